import functools
import sys
from fractions import Fraction

import pytest

from align.errors import AlignConfigError
from align.rollout.rewards import (
    CombinedReward,
    RewardError,
    RewardFunction,
    RewardModelSpec,
    RewardSpec,
    extract_final_number,
    math_answer,
    math_verify,
    resolve_import,
    resolve_reward,
    sort_exact_match,
    sort_format,
    sort_position_match,
)
from align.rollout.rewards.combine import training_rewards


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


def test_resolve_by_dotted_path_and_file(tmp_path, monkeypatch):
    assert resolve_reward("align.rewards.sort_format") is sort_format
    assert resolve_reward("align.rollout.rewards:sort_format") is sort_format
    (tmp_path / "my_rewards.py").write_text(
        "def brevity(prompts, completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    fn = resolve_reward("my_rewards.py:brevity")
    assert fn(["p"], ["abc"]) == [0.25]


@pytest.mark.parametrize(
    "path, message",
    [
        ("no_such_pkg.fn", "cannot import module 'no_such_pkg'"),
        ("align.rewards.no_such_fn", "has no attribute 'no_such_fn'"),
        ("missing.py:fn", "file 'missing.py' does not exist"),
        ("align.rollout.rewards.__doc__", "not a callable"),
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


def test_the_rewards_of_a_run_are_named_by_their_list_and_index():
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.eval_rewards\[1\]\.concurrency: expected an integer >= 1, "
        r"got 0$",
    ):
        training_rewards(
            ["align.rewards.sort_format"],
            None,
            ["align.rewards.sort_position_match", RewardSpec("align.rewards.sort_format", concurrency=0)],
        )
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.rewards: expected unique metric names across reward_model "
        r"\('rm'\), rewards and eval_rewards, got \['sort_format', "
        r"'sort_format'\]; set 'name' on the duplicates$",
    ):
        training_rewards(["align.rewards.sort_format"], None, ["align.rewards.sort_format"])
    with pytest.raises(AlignConfigError, match=r"^model\.reward_model\.weight: expected a finite number, got nan$"):
        RewardModelSpec("tiny-sort-rm", weight=float("nan"))
    with pytest.raises(AlignConfigError, match=r"^model\.reward_model\.batch_size: expected an integer >= 1, got 0$"):
        RewardModelSpec("tiny-sort-rm", batch_size=0)
    with pytest.raises(AlignConfigError, match=r"^rewards: expected at least one reward function, got none$"):
        CombinedReward([])


def test_dotted_path_imports_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_a1.py").write_text(
        "def brevity(completions, **kw):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    fn = RewardFunction(RewardSpec("cwd_rewards_a1.brevity"))
    assert fn(["p"], ["abc"]) == [0.25]
    assert sys.path[-1] == str(tmp_path)  # searched last: never shadows an installed package


def test_a_file_path_imports_the_modules_beside_it_and_in_the_working_directory(tmp_path, monkeypatch):
    """``my_envs.py:Game`` (in the working directory) and ``envs/game.py:Game`` (in a folder) import their sibling
    modules, as the dotted form can, from a script whose own folder is first on sys.path (python recipes/grpo.py)."""
    (tmp_path / "sibling_helpers_c3.py").write_text("BONUS = 2.0\n")
    (tmp_path / "my_envs_c3.py").write_text("from sibling_helpers_c3 import BONUS\nclass Game:\n    bonus = BONUS\n")
    (tmp_path / "envs").mkdir()
    (tmp_path / "envs" / "nested_helpers_c3.py").write_text("VALUE = 3\n")
    (tmp_path / "envs" / "game_c3.py").write_text(
        "from nested_helpers_c3 import VALUE\n"
        "from sibling_helpers_c3 import BONUS\n"
        "class Game:\n    value = VALUE * BONUS\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for name in ("sibling_helpers_c3", "nested_helpers_c3"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert resolve_import("my_envs_c3.py:Game", what="environment").bonus == 2.0
    assert resolve_import("envs/game_c3.py:Game", what="environment").value == 6.0
    assert sys.path[-2:] == [str(tmp_path), str(tmp_path / "envs")]  # searched last


def test_a_module_that_fails_to_import_names_the_error_and_line(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_b2.py").write_text("import math\n\nVALUE = 1 / 0\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        AlignConfigError,
        match=r"importing module 'cwd_rewards_b2' failed: ZeroDivisionError: "
        r"division by zero at cwd_rewards_b2.py, line 3",
    ):
        resolve_reward("cwd_rewards_b2.fn")


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
        f".<locals>.exact) raised ZeroDivisionError: empty completion at tests/rollout/test_rewards.py, "
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
        "tests/rollout/test_rewards.py, line "
    )
    assert message.endswith("in __call__(); every sample passes on its own, the batch of 3 fails as a whole")


def test_a_built_in_reward_that_raises_points_at_its_own_file():
    with pytest.raises(
        RewardError,
        match=r"reward 'math_answer' \(align.rewards.math_answer\) raised ValueError: "
        r"math_answer needs an 'answer' column .* at .*align/rollout/rewards/builtin.py, "
        r"line \d+ in math_answer\(\); first failing sample 0 of 1: prompt 'q'",
    ):
        RewardFunction(RewardSpec("align.rewards.math_answer"))(["q"], ["1"])


def test_a_non_number_names_the_sample():
    with pytest.raises(RewardError, match=r"must return a list of numbers, got \[1.0, 'high'\] \(sample 1: 'high'\)"):
        RewardFunction(lambda completions, **kw: [1.0, "high"])(["p0", "p1"], ["c0", "c1"])
