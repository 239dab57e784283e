"""The built-in rewards (align.rollout.rewards.builtin): the sort task's exact, format and position matches, the
final number of a GSM8K-style answer, and math_answer's numeric comparison."""

from fractions import Fraction

import pytest

from align.rollout.rewards import extract_final_number, math_answer, sort_exact_match, sort_format, sort_position_match


def test_sort_rewards():
    prompts = ["sort: c a b", "sort: c a b", "sort: b a", "sort: b a"]
    completions = ["a b c", "a c b", " a b ", "a b c"]
    assert sort_exact_match(prompts, completions) == [1.0, 0.0, 1.0, 0.0]
    assert sort_exact_match(prompts, completions, answer=["a b c", "a c b", "x", "a b c"]) == [1.0, 1.0, 0.0, 1.0]
    assert sort_format(prompts, completions) == [1.0, 1.0, 1.0, 0.0]
    # a b c: 3 of 3; a c b: a right of 3; a b: 2 of 2; a b c for "a b": 2 hits over the longer length 3
    assert sort_position_match(prompts, completions) == [1.0, 1 / 3, 1.0, 2 / 3]
    assert sort_position_match(["sort: b a"] * 3, ["ab", "", "b a"], answer=["a b"] * 3) == [0.0, 0.0, 0.0]


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
