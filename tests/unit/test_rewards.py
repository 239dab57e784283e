from fractions import Fraction

import pytest

from align.errors import AlignConfigError
from align.rewards import (
    CombinedReward,
    RewardError,
    RewardFunction,
    RewardSpec,
    extract_final_number,
    math_answer,
    resolve_reward,
    sort_exact_match,
    sort_format,
)


def test_sort_rewards():
    prompts = ["sort: c a b", "sort: c a b", "sort: b a", "sort: b a"]
    completions = ["a b c", "a c b", " a b ", "a b c"]
    assert sort_exact_match(prompts, completions) == [1.0, 0.0, 1.0, 0.0]
    assert sort_exact_match(prompts, completions, answer=["a b c", "a c b", "x", "a b c"]) == [1.0, 1.0, 0.0, 1.0]
    assert sort_format(prompts, completions) == [1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "text, value",
    [
        ("Natalia sold 48/2 = 24 clips.\n#### 72", 72),
        ("#### 1,234", 1234),
        ("so the answer is \\boxed{3/4}.", Fraction(3, 4)),
        ("first 3 then 5, the answer is -2.5.", Fraction(-5, 2)),
        ("no number here", None),
        ("#### 7 and later 9", 7),
    ],
)
def test_extract_final_number(text, value):
    assert extract_final_number(text) == value


def test_math_answer_compares_numerically():
    completions = ["The total is 72.", "I think 72.0", "#### 71", "nothing"]
    assert math_answer(["q"] * 4, completions, answer=["blah\n#### 72"] * 4) == [1.0, 1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="answer"):
        math_answer(["q"], ["1"])


def test_resolve_by_dotted_path_and_file(tmp_path, monkeypatch):
    assert resolve_reward("align.rewards.sort_format") is sort_format
    assert resolve_reward("align.rewards:sort_format") is sort_format
    (tmp_path / "my_rewards.py").write_text("def brevity(prompts, completions, **kw):\n"
                                            "    return [1.0 / (1 + len(c)) for c in completions]\n")
    monkeypatch.chdir(tmp_path)
    fn = resolve_reward("my_rewards.py:brevity")
    assert fn(["p"], ["abc"]) == [0.25]


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_pkg.fn", "cannot import module 'no_such_pkg'"),
        ("align.rewards.no_such_fn", "has no attribute 'no_such_fn'"),
        ("missing.py:fn", "file 'missing.py' does not exist"),
        ("align.rewards.__doc__", "not a callable"),
        ("justaname", "expected an import path"),
    ],
)
def test_bad_import_paths_fail_clearly(path, message):
    with pytest.raises(AlignConfigError, match=message.replace("(", r"\(")):
        RewardFunction(RewardSpec(path))


def test_combined_weights_names_and_columns():
    seen = {}

    def spy(prompts, completions, answer, level, **kw):
        seen.update(answer=answer, level=level, kw=kw)
        return [0.5] * len(completions)

    combined = CombinedReward([RewardSpec("align.rewards.sort_exact_match", weight=2.0), spy])
    total, parts = combined(["sort: b a", "sort: b a"], ["a b", "b a"], answer=["a b", "a b"], level=[1, 2])
    assert parts == {"sort_exact_match": [1.0, 0.0], "spy": [0.5, 0.5]}
    assert total == [2.5, 0.5]
    assert seen["answer"] == ["a b", "a b"] and seen["level"] == [1, 2]
    with pytest.raises(AlignConfigError, match="unique"):
        CombinedReward([sort_format, sort_format])


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


def test_raising_reward_names_the_function():
    def exploding(prompts, completions, **kw):
        raise KeyError("answer")

    with pytest.raises(RewardError, match=r"reward 'exploding'.*raised KeyError.*first prompt 'p0'"):
        RewardFunction(exploding)(["p0"], ["c0"])
