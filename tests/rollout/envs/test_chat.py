"""The language-model environment interface: building instances by import path, the checked and time-limited
reset/step calls, and one-line errors that name the environment, the episode and the turn.

The environments below are loaded through the import path of this very file (``/abs/path/...py:Name``), the way a
user names their own class."""

import re
import time
from pathlib import Path

import pytest

from align.errors import AlignConfigError, AlignEnvError
from align.rollout.envs.chat import Environment, EnvironmentPool, EnvironmentSpec, EnvStep, check_messages

THIS = str(Path(__file__).resolve())


class Counter(Environment):
    """Replies ``turn N`` until ``turns`` turns were played; reward = the turn number."""

    def __init__(self, turns: int = 2):
        self.turns = turns

    def reset(self, row):
        self.n = 0
        return row["messages"]

    def step(self, message):
        self.n += 1
        return EnvStep(
            [] if self.n >= self.turns else [{"role": "user", "content": f"turn {self.n}"}],
            reward=float(self.n),
            done=self.n >= self.turns,
            info={"seen": len(message["content"])},
        )


class Raises(Counter):
    def step(self, message):
        raise ValueError("the board is on fire")


class Sleeps(Counter):
    def step(self, message):
        time.sleep(3.0)
        return EnvStep([], 0.0, True)


class Tuple(Counter):
    def step(self, message):
        return [{"role": "user", "content": "ok"}], 1, False


def pool(name: str, **kw) -> EnvironmentPool:
    return EnvironmentPool(EnvironmentSpec(f"{THIS}:{name}", **kw))


def rows(n: int) -> list[dict]:
    return [{"prompt": f"p{i}", "messages": [{"role": "user", "content": f"p{i}"}]} for i in range(n)]


def labels(n: int) -> list[str]:
    return [f"episode {i}" for i in range(n)]


def test_instances_are_built_by_import_path_with_init_kwargs_and_reused():
    envs = pool("Counter", init_kwargs={"turns": 3})
    assert envs.name == "Counter" and envs.where == f"environment 'Counter' ({THIS}:Counter)"
    first = envs.reset(rows(2), labels(2))
    assert first == [[{"role": "user", "content": "p0"}], [{"role": "user", "content": "p1"}]]
    assert [e.turns for e in envs.instances] == [3, 3]
    instance = envs.instance(1)
    envs.reset(rows(2), labels(2))
    assert envs.instance(1) is instance  # reused across rollouts: reset must clear the state


def test_step_results_are_checked_and_recorded_in_order():
    envs = pool("Counter", init_kwargs={"turns": 2}, workers=3)
    envs.reset(rows(3), labels(3))
    message = {"role": "assistant", "content": "abc"}
    steps, records = envs.step([0, 1, 2], [message] * 3, labels(3), turn=1)
    assert [s.messages for s in steps] == [[{"role": "user", "content": "turn 1"}]] * 3
    assert [(s.reward, s.done, s.info) for s in steps] == [(1.0, False, {"seen": 3})] * 3
    assert [(r.episode, r.turn) for r in records] == [(0, 1), (1, 1), (2, 1)]
    assert all(r.end_ns >= r.start_ns > 0 for r in records)
    steps, _ = envs.step([0], [message], labels(1), turn=2)
    assert steps[0] == EnvStep([], 2.0, True, {"seen": 3})


def test_a_plain_tuple_is_a_step():
    envs = pool("Tuple")
    envs.reset(rows(1), labels(1))
    steps, _ = envs.step([0], [{"role": "assistant", "content": "x"}], labels(1), 1)
    assert steps[0] == EnvStep([{"role": "user", "content": "ok"}], 1.0, False, {})


def test_a_step_that_raises_stops_with_one_line_naming_environment_episode_turn_and_user_code():
    envs = pool("Raises")
    envs.reset(rows(2), labels(2))
    with pytest.raises(AlignEnvError) as err:
        envs.step([0, 1], [{"role": "assistant", "content": "x"}] * 2, labels(2), turn=3)
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(
        f"environment 'Raises' ({THIS}:Raises): episode 0, turn 3: step raised ValueError: the board is on fire"
    )
    assert re.search(r"test_chat\.py, line \d+ in step\(\)", text)


def test_a_step_that_never_returns_is_stopped_at_the_timeout():
    envs = pool("Sleeps", step_timeout=0.3)
    envs.reset(rows(1), labels(1))
    started = time.monotonic()
    with pytest.raises(AlignEnvError, match=r"episode 0, turn 1: step did not return within step_timeout=0.3 s"):
        envs.step([0], [{"role": "assistant", "content": "x"}], labels(1), turn=1)
    assert time.monotonic() - started < 2.5  # not held for the full sleep


@pytest.mark.parametrize(
    "reply, why",
    [
        ("done", "step must return EnvStep"),
        ({"text": "x"}, "got a dict with keys"),
        (([{"role": "user"}], 0.0, False), r"step's messages\[0\] must be a \{'role': str, 'content': str\} dict"),
        (([], float("nan"), True), "step's reward must be finite"),
        (([], "1", True), "step's reward must be a number"),
        (([], 1.0, "yes"), "step's done must be True or False"),
        (([], 1.0, False), "messages are empty but done is False"),
        (([], 1.0, True, ["x"]), "step's info must be a dict"),
    ],
)
def test_a_malformed_reply_is_one_line_naming_what_is_wrong(reply, why):
    class Bad(Counter):
        def step(self, message):
            return reply

    envs = EnvironmentPool(EnvironmentSpec(Bad))
    envs.reset(rows(1), labels(1))
    with pytest.raises(AlignEnvError, match=why) as err:
        envs.step([0], [{"role": "assistant", "content": "x"}], labels(1), turn=2)
    assert "\n" not in str(err.value) and "episode 0, turn 2" in str(err.value)


def test_reset_results_are_checked():
    class EndsWithAssistant(Counter):
        def reset(self, row):
            return [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]

    envs = EnvironmentPool(EnvironmentSpec(EndsWithAssistant))
    with pytest.raises(AlignEnvError, match="must not end with an assistant message"):
        envs.reset(rows(1), labels(1))
    with pytest.raises(ValueError, match="must hold at least one message"):
        check_messages([], "reset's result")


def test_config_errors_name_the_setting():
    with pytest.raises(AlignConfigError, match=r"model.environment.max_turns: expected an integer >= 1, got 0"):
        EnvironmentSpec("x.Y", max_turns=0)
    with pytest.raises(AlignConfigError, match="step_timeout"):
        EnvironmentSpec("x.Y", step_timeout=0)
    with pytest.raises(AlignConfigError, match="environment 'no_such_module.Env': cannot import module"):
        EnvironmentPool("no_such_module.Env")
    with pytest.raises(AlignConfigError, match=r"cannot build it from init_kwargs \{'bad': 1\}: TypeError"):
        pool("Counter", init_kwargs={"bad": 1}).instance(0)
    with pytest.raises(
        AlignConfigError, match="needs reset.row. and step.message. methods; it has no reset and no step"
    ):
        EnvironmentPool(EnvironmentSpec("builtins.dict")).instance(0)
