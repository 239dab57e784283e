import json
import random
import re

import pytest

from align.data.arith_task import (
    ANSWER_FORMAT,
    CHATTER_SHARE,
    DATA_DIR,
    PHRASINGS,
    evaluate,
    expression,
    preference_pair,
    sample_problem,
    wrong_number,
)
from align.rollout.rewards import math_answer

KINDS = ("sft", "preference", "prompts")
FIELDS = {
    "sft": {"prompt", "completion"},
    "preference": {"prompt", "chosen", "rejected"},
    "prompts": {"prompt", "answer"},
}
EXPRESSION = re.compile(r"-?\d+(?: [-+*] -?\d+)+")


def read(kind, split):
    with (DATA_DIR / kind / f"{split}.jsonl").open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def expression_of(prompt: str) -> str:
    return EXPRESSION.search(prompt).group(0)


@pytest.mark.parametrize(
    "expr, value",
    [
        ("7 + 12", 19),
        ("15 - 4", 11),
        ("4 - 9", -5),
        ("6 * 7", 42),
        ("3 + 4 * 2", 11),
        ("4 * 5 + 7", 27),
        ("9 - 3 - 2", 4),
        ("2 - 5 + 8", 5),
    ],
)
def test_evaluate_follows_precedence_and_left_to_right_order(expr, value):
    assert evaluate(expr) == value


@pytest.mark.parametrize("bad", ["", "3 +", "3 / 4", "a + 1", "3 4"])
def test_evaluate_rejects_malformed_expressions(bad):
    with pytest.raises(ValueError, match="malformed expression"):
        evaluate(bad)


def test_expressions_stay_small_and_problems_are_deterministic():
    rng = random.Random(0)
    for _ in range(2000):
        expr = expression(rng)
        operands = [int(t) for t in expr.split()[::2]]
        assert 2 <= len(operands) <= 3 and all(2 <= x <= 20 for x in operands), expr
    assert [sample_problem(random.Random(5)) for _ in range(3)] == [sample_problem(random.Random(5)) for _ in range(3)]


def test_wrong_answers_are_never_right():
    rng = random.Random(1)
    for _ in range(2000):
        expr = expression(rng)
        assert wrong_number(rng, expr) != evaluate(expr)


def test_a_pair_differs_either_in_the_number_alone_or_in_format_alone():
    rng = random.Random(3)
    pairs = [(expr, *preference_pair(rng, expr)) for expr in (expression(rng) for _ in range(2000))]
    chatter = 0
    for expr, chosen, rejected in pairs:
        right = str(evaluate(expr))
        assert chosen == f"{expr} = {right}" == ANSWER_FORMAT.format(e=expr, n=right)
        if rejected.startswith(("Sure", "Great", "Okay")):
            chatter += 1
            assert right in rejected
            continue
        wrong = rejected.removeprefix(f"{expr} = ")
        assert wrong != rejected and wrong != right and wrong.lstrip("-").isdigit()
    assert abs(chatter / len(pairs) - CHATTER_SHARE) < 0.03


@pytest.mark.parametrize("kind", KINDS)
def test_rows_have_exact_fields_and_right_answers(kind):
    for split in ("train", "validation"):
        rows = read(kind, split)
        assert rows and all(set(r) == FIELDS[kind] for r in rows)
        for row in rows:
            assert any(row["prompt"] == p.format(e=expression_of(row["prompt"])) for p in PHRASINGS)
            expr = expression_of(row["prompt"])
            right = str(evaluate(expr))
            if kind == "preference":
                assert row["chosen"] == ANSWER_FORMAT.format(e=expr, n=right)
            else:
                assert row.get("answer", row.get("completion")) == right


def test_the_task_reward_scores_chosen_answers_right_and_wrong_numbers_wrong():
    rows = read("preference", "validation")
    prompts = [r["prompt"] for r in rows]
    answers = [str(evaluate(expression_of(p))) for p in prompts]
    assert math_answer(prompts, [r["chosen"] for r in rows], answer=answers) == [1.0] * len(rows)
    rejected = math_answer(prompts, [r["rejected"] for r in rows], answer=answers)
    chatter = [r["rejected"].startswith(("Sure", "Great", "Okay")) for r in rows]
    assert all(score == float(c) for score, c in zip(rejected, chatter)), "only chatter keeps the right number"
    assert 0.05 < sum(chatter) / len(rows) < 0.3


def test_held_out_expressions_never_appear_in_any_training_split():
    held = {expression_of(r["prompt"]) for kind in KINDS for r in read(kind, "validation")}
    for kind in KINDS:
        assert not held & {expression_of(r["prompt"]) for r in read(kind, "train")}, kind
        validation = [expression_of(r["prompt"]) for r in read(kind, "validation")]
        assert len(validation) == len(set(validation)), "held-out expressions are unique within a file"


def test_generator_reproduces_the_committed_files(tmp_path, load_script):
    script = load_script("make_arith_data")
    for path in script.write_splits(tmp_path, script.build()):
        relative = path.relative_to(tmp_path)
        assert path.read_bytes() == (DATA_DIR / relative).read_bytes(), relative


def test_the_calculator_task_is_beyond_small_arithmetic_and_its_generator_reproduces_it(tmp_path, load_script):
    from align.data.arith_task import tool_expression

    rng = random.Random(0)
    for _ in range(200):
        numbers = [int(t) for t in tool_expression(rng).split()[::2]]
        assert max(numbers) > 100 and all(n > 10 for n in numbers)
    rows = {split: read("tools", split) for split in ("train", "validation")}
    assert len(rows["train"]) == 2000 and len(rows["validation"]) == 200
    for row in rows["train"] + rows["validation"]:
        assert set(row) == {"prompt", "answer"} and row["answer"] == str(evaluate(expression_of(row["prompt"])))
    held = {expression_of(r["prompt"]) for r in rows["validation"]}
    assert len(held) == 200 and not held & {expression_of(r["prompt"]) for r in rows["train"]}
    script = load_script("make_arith_tools")
    for path in script.write_splits(tmp_path, script.build()):
        assert path.read_bytes() == (DATA_DIR / path.relative_to(tmp_path)).read_bytes()
