"""The math-verify reward (align.rollout.rewards.mathverify): answers compared by value in LaTeX, fractions,
decimals and GSM8K form, arithmetic left to compute refused unless asked, the gold read from another column, and
its own alarms that neither clear an outer timer nor fail off the main thread."""

import pytest

from align.rollout.rewards import CombinedReward, RewardError, RewardFunction, RewardSpec, math_verify


@pytest.mark.parametrize(
    "completion, gold, score",
    [
        ("so the answer is \\boxed{\\frac{3}{4}}.", "3/4", 1.0),  # boxed LaTeX against a plain fraction
        ("The answer is 0.75", "\\frac{3}{4}", 1.0),  # a decimal against a LaTeX fraction
        ("$\\frac{1}{2}$", "0.5", 1.0),
        ("2", "\\sqrt{4}", 1.0),  # LaTeX without $ delimiters in the gold
        ("They sold 1,234 clips.", "1234", 1.0),  # thousands separators
        ("\\boxed{1{,}000}", "1000", 1.0),
        ("48 + 24 = 72\n#### 72", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0),  # GSM8K on both sides
        ("3 boxes of 250 and 250 more: 3 * 250 + 250 = 1,000\n#### 1,000", "#### 1000", 1.0),
        ("7 + 12 = 19", "19", 1.0),  # the arithmetic task's worked equation
        ("To compute 4 * 7 + 8, we need to add", "36", 0.0),  # the question restated is arithmetic left to compute
        ("$\\frac{1}{2} + \\frac{1}{3}$", "5/6", 0.0),
        ("Let's break the equation: 8 * 7 + 6.", "62", 0.0),  # "6." reads as a decimal: still arithmetic
        ("$\\frac{5}{6}$", "5/6", 1.0),
        ("-3/4", "-0.75", 1.0),
        ("$2\\sqrt{2}$", "\\sqrt{8}", 1.0),  # irrational forms compare symbolically
        ("The total is 71.", "72", 0.0),  # a wrong answer
        ("I do not know.", "72", 0.0),  # nothing to parse
        ("", "72", 0.0),
    ],
)
def test_math_verify(completion, gold, score):
    assert math_verify(["q"], [completion], answer=[gold]) == [score]


def test_math_verify_keeps_an_alarm_set_before_it():
    import signal

    before = signal.signal(signal.SIGALRM, signal.SIG_IGN)
    try:
        signal.setitimer(signal.ITIMER_REAL, 60.0)
        assert math_verify(["q"], ["\\boxed{2}"], answer=["2"]) == [1.0]  # its own alarms cancel the timer...
        assert 0 < signal.getitimer(signal.ITIMER_REAL)[0] <= 60.0  # ...which is set again for the time it had left
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def test_math_verify_can_compare_uncomputed_arithmetic_by_value():
    assert math_verify(["q"] * 2, ["4 * 7 + 8", "$10^{3}$"], answer=["36", "1000"], require_computed=False) == [
        1.0,
        1.0,
    ]
    assert math_verify(["q"] * 2, ["4 * 7 + 8", "$10^{3}$"], answer=["36", "1000"]) == [0.0, 0.0]


def test_math_verify_reads_another_column_and_refuses_a_gold_it_cannot_parse():
    assert math_verify(["q"] * 2, ["2", "3"], gold_column="solution", solution=["#### 2", "$\\sqrt{9}$"]) == [1.0, 1.0]
    with pytest.raises(
        ValueError,
        match=r"column 'answer', which the prompt data does not have \(its columns: "
        r"\['solution'\]\); set kwargs.gold_column",
    ):
        math_verify(["q"], ["2"], solution=["2"])
    with pytest.raises(
        RewardError,
        match=r"the gold answer 'no answer here' holds no number .* first failing "
        r"sample 1 of 2",
    ):
        RewardFunction(RewardSpec("align.rewards.math_verify"))(["q"] * 2, ["1", "2"], answer=["1", "no answer here"])


def test_math_verify_runs_off_the_main_thread():
    # math-verify's own timeouts use signal.alarm, which raises off the main thread; the reward turns them off there.
    combined = CombinedReward([RewardSpec("align.rewards.math_verify", concurrency=2)])
    total, _ = combined(["q"] * 4, ["\\boxed{3/4}", "0.75", "1", "x"], answer=["\\frac{3}{4}"] * 4)
    assert total == [1.0, 1.0, 0.0, 0.0]
