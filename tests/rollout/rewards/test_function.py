"""One reward's call and checks (align.rollout.rewards.function): what each signature style receives by keyword,
its settings checked naming their place in the config, and the one-line error of a reward that raises or returns
something that is not one finite number per completion."""

import functools

import pytest

from align.errors import AlignConfigError
from align.rollout.rewards import CombinedReward, RewardError, RewardFunction, RewardSpec, sort_format


def test_spec_kwargs_are_passed():
    def scaled(prompts, completions, scale=1.0, **kw):
        return [scale] * len(completions)

    fn = RewardFunction(RewardSpec("align.rewards.sort_format"))
    fn.fn, fn.kwargs = scaled, {"scale": 3.0}
    assert fn(["p"], ["c"]) == [3.0]


@pytest.mark.parametrize(
    "returned, message",
    [
        ([1.0, float("nan")], r"returned nan for sample 1 \(prompt 'p1', completion 'c1'\)"),
        ([float("inf"), 0.0], r"returned inf for sample 0 \(prompt 'p0', completion 'c0'\)"),
        ([1.0], "returned 1 values for 2 completions"),
        (None, "must return a list of numbers"),
    ],
)
def test_bad_reward_values_name_the_function_and_sample(returned, message):
    def bad_reward(prompts, completions, **kw):
        return returned

    with pytest.raises(RewardError, match=message) as info:
        RewardFunction(bad_reward)(["p0", "p1"], ["c0", "c1"])
    assert "bad_reward" in str(info.value)


INPUTS = {
    "prompt_messages": [[{"role": "user", "content": "p0"}], [{"role": "user", "content": "p1"}]],
    "completion_ids": [[5, 2], [6]],
    "completion_truncated": [False, True],
}


def test_each_signature_style_receives_what_it_names_by_keyword():
    """align's documented names, TRL's ``(completions, **kwargs)``, a strict signature, a class and a partial."""
    seen = {}

    def align_style(prompts, completions, **columns):
        seen["align_style"] = {"prompts": prompts, "completions": completions, **columns}
        return [1.0, 2.0]

    def trl_style(completions, **kwargs):
        seen["trl_style"] = {"completions": completions, **kwargs}
        return [float(len(c)) for c in completions]

    def strict(completions, answer):  # no **kwargs: only the names it lists
        seen["strict"] = {"completions": completions, "answer": answer}
        return [float(c == a) for c, a in zip(completions, answer)]

    class Scorer:
        def __init__(self, bonus):
            self.bonus = bonus

        def __call__(self, completions, completion_truncated):
            return [self.bonus * (not t) for t in completion_truncated]

    def scaled(prompts, completions, scale, level):
        return [scale * lv for lv in level]

    combined = CombinedReward([align_style, trl_style, strict, Scorer(3.0), functools.partial(scaled, scale=0.5)])
    total, parts = combined(prompts=["p0", "p1"], completions=["ab", "c"], answer=["ab", "x"], level=[2, 4], **INPUTS)
    assert parts == {
        "align_style": [1.0, 2.0],
        "trl_style": [2.0, 1.0],
        "strict": [1.0, 0.0],
        "Scorer": [3.0, 0.0],
        "scaled": [1.0, 2.0],
    }
    assert total == [8.0, 5.0]
    everything = {"prompts": ["p0", "p1"], "completions": ["ab", "c"], "answer": ["ab", "x"], "level": [2, 4], **INPUTS}
    assert seen["align_style"] == everything and seen["trl_style"] == everything
    assert seen["strict"] == {"completions": ["ab", "c"], "answer": ["ab", "x"]}


def test_positional_only_parameters_are_filled_by_name():
    def positional(prompts, completions, /, answer=None):
        return [float(c == a) for c, a in zip(completions, answer)]

    assert RewardFunction(positional)(["p"], ["a"], answer=["a"], level=[1]) == [1.0]


def test_a_required_argument_that_nothing_provides_fails_before_any_rollout():
    def needs_solution(completions, solution, tolerance=0.0):
        return [0.0] * len(completions)

    combined = CombinedReward([RewardSpec(needs_solution, name="exact")])
    with pytest.raises(AlignConfigError) as info:
        combined.check_inputs(["answer", "level"])
    message = str(info.value)
    assert "\n" not in message
    assert "reward 'exact' (" in message and ".needs_solution) requires 'solution', which no data column" in message
    assert (
        "available: prompts, completions, prompt_messages, completion_ids, completion_truncated, conversation, "
        "answer, level" in message
    )
    assert "data columns: answer, level" in message
    combined.check_inputs(["solution"])  # provided by a column: fine
    RewardFunction(RewardSpec(needs_solution, kwargs={"solution": "42"})).check_inputs([])  # or by kwargs


def test_kwargs_must_be_parameters_and_columns_must_not_shadow_inputs():
    def strict(completions, answer):
        return [1.0] * len(completions)

    with pytest.raises(
        AlignConfigError,
        match=r"^reward 'strict' \(.*strict\): kwargs: expected parameters of the "
        r"function, which takes \['answer', 'completions'\] \(add \*\*kwargs to "
        r"take any\), got \['tolerance'\]$",
    ):
        RewardFunction(RewardSpec(strict, kwargs={"tolerance": 0.1}))
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.rewards\[1\]\.kwargs: expected parameters of reward "
        r"'strict' \(.*strict\), which takes \['answer', 'completions'\] \(add "
        r"\*\*kwargs to take any\), got \['tolerance'\]$",
    ):
        RewardFunction(RewardSpec(strict, kwargs={"tolerance": 0.1}), setting="model.rewards[1]")
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.rewards\[0\]\.kwargs: expected names other than the inputs "
        r"every reward receives, got \['completions'\]; rename them$",
    ):
        RewardFunction(RewardSpec(sort_format, kwargs={"completions": []}), setting="model.rewards[0]")
    with pytest.raises(AlignConfigError, match=r"data column\(s\) \['prompts'\] have the name of a reward input"):
        RewardFunction(sort_format).check_inputs(["prompts"])


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            RewardSpec("align.rewards.sort_format", weight=float("inf")),
            r"^model\.rewards\[0\]\.weight: expected a finite number, got inf$",
        ),
        (
            RewardSpec("align.rewards.sort_format", init_kwargs={"a": 1}),
            r"^model\.rewards\[0\]\.init_kwargs: expected null for a function \(init_kwargs build a class; pass "
            r"per-call "
            r"arguments in kwargs\), got \{'a': 1\}$",
        ),
        (
            RewardSpec("align.rewards.RewardModelScorer", init_kwargs={"path": "tiny-sort-rm", "bacth_size": 2}),
            r"^model\.rewards\[0\]\.init_kwargs: expected arguments align\.rewards\.RewardModelScorer takes, got "
            r"\{'path': 'tiny-sort-rm', 'bacth_size': 2\} \(TypeError: .*unexpected keyword argument 'bacth_size'\)$",
        ),
        (
            RewardSpec("align.rewards.RewardModelScorer", init_kwargs={"path": "tiny-sort-rm", "batch_size": 0}),
            r"^model\.rewards\[0\]\.init_kwargs\.batch_size: expected an integer >= 1, got 0$",
        ),
        (
            RewardSpec("align.rewards.RewardModelScorer", init_kwargs={"path": "tiny-sort-rm", "dtype": "fp64"}),
            r"^model\.rewards\[0\]\.init_kwargs\.dtype: expected auto, float32, bfloat16 or float16, got 'fp64'$",
        ),
        (
            RewardSpec("align.rewards.math_verify", kwargs={"timeout": 0}),
            r"^model\.rewards\[0\]\.kwargs\.timeout: expected a number of seconds > 0, got 0$",
        ),
        (
            RewardSpec("align.rewards.math_verify", kwargs={"gold_column": ""}),
            r"^model\.rewards\[0\]\.kwargs\.gold_column: expected the name of a data column, got ''$",
        ),
    ],
)
def test_a_bad_reward_setting_fails_naming_its_place_in_the_config(spec, message):
    with pytest.raises(AlignConfigError, match=message):
        RewardFunction(spec, setting="model.rewards[0]")


def _score(completion, answer):
    if not completion:
        raise ZeroDivisionError("empty completion")
    return float(completion == answer)


def test_a_raising_reward_names_itself_the_users_line_and_the_first_failing_sample():
    def exact(prompts, completions, answer, **kw):
        return [_score(c, a) for c, a in zip(completions, answer)]

    with pytest.raises(RewardError) as info:
        RewardFunction(RewardSpec(exact, name="exact"))(
            ["p0", "p1", "p2"], ["a", "", ""], answer=["a", "b", "c"], **{k: v + v[:1] for k, v in INPUTS.items()}
        )
    message = str(info.value)
    line = _score.__code__.co_firstlineno + 2
    assert message == (
        f"reward 'exact' (test_a_raising_reward_names_itself_the_users_line_and_the_first_failing_sample"
        f".<locals>.exact) raised ZeroDivisionError: empty completion at tests/rollout/rewards/test_function.py, "
        f"line {line} in _score(); first failing sample 1 of 3: prompt 'p1', completion '', answer='b'"
    )


def test_a_class_reward_is_named_by_its_call_and_a_batch_only_failure_says_so():
    class AtMostTwo:
        def __call__(self, completions, **kw):
            if len(completions) > 2:
                raise ValueError(f"at most 2 completions, got {len(completions)}")
            return [0.0] * len(completions)

    with pytest.raises(RewardError) as info:
        RewardFunction(RewardSpec(AtMostTwo(), name="four"))(["p"] * 3, ["a", "b", "c"])
    message = str(info.value)
    assert message.startswith(
        "reward 'four' (test_a_class_reward_is_named_by_its_call_and_a_batch_only_failure_says_so"
        ".<locals>.AtMostTwo.__call__) raised ValueError: at most 2 completions, got 3 at "
        "tests/rollout/rewards/test_function.py, line "
    )
    assert message.endswith("in __call__(); every sample passes on its own, the batch of 3 fails as a whole")


def test_a_non_number_names_the_sample():
    with pytest.raises(RewardError, match=r"must return a list of numbers, got \[1.0, 'high'\] \(sample 1: 'high'\)"):
        RewardFunction(lambda completions, **kw: [1.0, "high"])(["p0", "p1"], ["c0", "c1"])


def test_spec_settings_are_checked():
    for settings, message in (
        ({"concurrency": 0}, r"concurrency: expected an integer >= 1, got 0$"),
        ({"concurrency": 1.5}, r"concurrency: expected an integer >= 1, got 1\.5$"),
        ({"timeout": 0}, r"timeout: expected a number of seconds > 0 or null, got 0$"),
        ({"timeout": float("inf")}, r"timeout: expected a number of seconds > 0 or null, got inf$"),
    ):
        with pytest.raises(AlignConfigError, match=r"^model\.rewards\[2\]\." + message):
            RewardFunction(RewardSpec("align.rewards.sort_format", **settings), setting="model.rewards[2]")
        with pytest.raises(
            AlignConfigError, match=r"^reward 'sort_format' \(align\.rewards\.sort_format\): " + message
        ):
            RewardFunction(RewardSpec("align.rewards.sort_format", **settings))
