"""verifiers environments (classic API) as align environments (align.rollout.envs.verifiers): a MultiTurnEnv and a
ToolEnv written here against verifiers' classes, driven by scripted turns through align's reset/step; the rubric
scores the finished rollout."""

import logging

import pytest

pytest.importorskip(
    "verifiers",
    reason="verifiers is not in align[dev] (it cannot install beside TRL 1.x and vLLM "
    "0.32, see pyproject.toml); pip install 'align[verifiers]' to run these",
)

from align.errors import AlignConfigError  # noqa: E402
from align.rollout.envs.chat import EnvironmentPool, EnvironmentSpec  # noqa: E402
from align.rollout.envs.verifiers import VerifiersEnvironment, classic_verifiers, tools_prompt  # noqa: E402

vf = classic_verifiers()


def _examples():
    from datasets import Dataset

    return Dataset.from_list([{"prompt": [{"role": "user", "content": "Guess."}], "answer": "0"}])


class GuessEnv(vf.MultiTurnEnv):
    """'higher' or 'lower' after each guess; stops when the last guess is the answer."""

    async def env_response(self, messages, state, **kwargs):
        guess = int(messages[-1].content.strip())
        return [vf.UserMessage(content="higher" if guess < int(state["answer"]) else "lower")]

    @vf.stop
    async def guessed(self, state) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and trajectory[-1]["completion"][-1].content.strip() == state["answer"]


def found(completion, answer) -> float:
    """1 / guesses when the last guess is the answer, else 0."""
    guesses = [m.content.strip() for m in completion if m.role == "assistant"]
    return 1.0 / len(guesses) if guesses and guesses[-1] == answer else 0.0


def load_guess(max_turns: int = 4):
    return GuessEnv(
        dataset=_examples, rubric=vf.Rubric(funcs=[found]), max_turns=max_turns, system_prompt="Reply with one number."
    )


def add(a: int, b: int) -> int:
    """Adds two integers."""
    return a + b


def correct(completion, answer) -> float:
    return float(completion[-1].content.strip() == answer)


def load_calculator():
    return vf.ToolEnv(tools=[add], max_turns=3, dataset=_examples, rubric=vf.Rubric(funcs=[correct]))


def pairs(scores):
    return sorted((k, v) for k, v in scores.items())


def row(answer, content="Guess a number from 0 to 9.", **columns):
    return {"prompt": content, "answer": answer, "messages": [{"role": "user", "content": content}], **columns}


def say(text):
    return {"role": "assistant", "content": text}


def test_a_multi_turn_rollout_is_played_turn_by_turn_and_its_rubric_scores_the_end():
    env = VerifiersEnvironment(path=f"{__name__}.load_guess")
    assert env.reset(row(3)) == [
        {"role": "system", "content": "Reply with one number."},
        {"role": "user", "content": "Guess a number from 0 to 9."},
    ]
    assert env.step(say("5")) == ([{"role": "user", "content": "lower"}], 0.0, False, {})
    assert env.step(say("1")) == ([{"role": "user", "content": "higher"}], 0.0, False, {})
    last = env.step(say("3"))
    assert (last.messages, last.reward, last.done) == ([], pytest.approx(1 / 3), True)
    assert pairs(last.info) == [("vf_errors", 0.0), ("vf_found", pytest.approx(1 / 3)), ("vf_num_turns", 3.0)]
    # the row's own system message wins over the environment's; the next episode starts afresh
    system = {"role": "system", "content": "Be quick."}
    assert env.reset({**row(7), "messages": [system, {"role": "user", "content": "Go."}]}) == [
        system,
        {"role": "user", "content": "Go."},
    ]
    assert env.step(say("7"))[1:3] == (1.0, True)
    # the environment's max_turns ends an episode: four wrong guesses score 0
    env.reset(row(9))
    assert [env.step(say(str(g))).done for g in (1, 2, 3, 4)] == [False, False, False, True]
    with pytest.raises(RuntimeError, match="step without a running rollout"):
        env.step(say("9"))


def test_a_tool_env_runs_the_calls_written_in_align_format_and_scores_the_answer():
    env = VerifiersEnvironment(path=f"{__name__}.load_calculator", roles={"tool": "user"})
    first = env.reset(row("5", "What is 2 + 3?"))
    assert first[0] == {"role": "system", "content": tools_prompt(env.env.tool_defs)}
    assert "- add(a: integer, b: integer): Adds two integers." in first[0]["content"]
    assert first[1:] == [{"role": "user", "content": "What is 2 + 3?"}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    assert env.step(say(call)) == ([{"role": "user", "content": "5"}], 0.0, False, {})
    # a parsed tool call (a tokenizer's response template) works too, and a failing call is the tool's error reply
    parsed = {**say(""), "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 2, "b": "x"}'}}]}
    reply = env.step(parsed)
    assert reply.messages[0]["role"] == "user" and not reply.done
    last = env.step(say("5"))
    assert (last.reward, last.done) == (1.0, True)
    assert pairs(last.info) == [
        ("vf_add_calls", 2.0),
        ("vf_correct", 1.0),
        ("vf_errors", 0.0),
        ("vf_num_turns", 3.0),
        ("vf_total_tool_calls", 2.0),
    ]


def test_info_columns_the_pool_and_a_cut_episode(caplog):
    spec = EnvironmentSpec(
        VerifiersEnvironment,
        init_kwargs={"path": "align.rollout.envs.verifiers_tasks.load_environment", "info_columns": ["rounds"]},
        workers=2,
    )
    pool = EnvironmentPool(spec)
    rows = [row("", "sort: d a c", rounds=["sort: b a"]), row("", "sort: c b", rounds=["sort: e d"])]
    labels = ["episode 0", "episode 1"]
    assert pool.reset(rows, labels) == [
        [{"role": "user", "content": "sort: d a c"}],
        [{"role": "user", "content": "sort: c b"}],
    ]
    steps, _ = pool.step([0, 1], [say("a c d"), say("c b")], labels, 1)
    assert [s.messages for s in steps] == [
        [{"role": "user", "content": "sort: b a"}],
        [{"role": "user", "content": "sort: e d"}],
    ]
    steps, _ = pool.step([0, 1], [say("a b"), say("d e")], labels, 2)
    assert [(s.reward, s.done) for s in steps] == [(1.0, True), (0.5, True)]
    assert pool.instances[0].env is pool.instances[1].env  # one verifiers environment, one rollout per episode
    # align cuts an episode the environment has not ended: the next reset abandons it, unscored, and says so once
    pool.reset(rows, labels)
    with caplog.at_level(logging.WARNING, logger="align.rollout.envs.verifiers"):
        pool.reset(rows, labels)
    assert sum("its rubric did not score it" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(KeyError, match=r"info_columns \['rounds'\] are not columns of the row"):
        pool.instances[0].reset(row(""))


async def group_reward(completions, answers) -> list[float]:
    return [0.0] * len(completions)


def load_grouped():
    return GuessEnv(dataset=_examples, rubric=vf.Rubric(funcs=[group_reward]))


def load_not_an_env():
    return object()


def test_settings_that_cannot_work_fail_on_one_line():
    cases = [
        (
            dict(),
            r"^init_kwargs: expected exactly one of path \(an import path of the environment's loader\) "
            r"and env_id \(an installed environment\), got path=None, env_id=None$",
        ),
        (dict(path="x.y", env_id="z"), "^init_kwargs: expected exactly one of path"),
        (dict(path=f"{__name__}.load_grouped"), "its rubric has group reward functions"),
        (dict(path=f"{__name__}.load_not_an_env"), "expected a verifiers MultiTurnEnv .* got object"),
        (
            dict(path=f"{__name__}.load_guess", env_args={"turns": 2}),
            r"cannot build it from env_args \{'turns': 2\}: TypeError",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(AlignConfigError, match=message):
            VerifiersEnvironment(**kwargs)
