import importlib.resources
import json
import random

import pytest

from align.data import sort_task
from align.data.sort_task import (
    LETTERS,
    data_file,
    is_correct,
    is_well_formed,
    make_prompt,
    parse_answer,
    prompt_letters,
    sample_problem,
    solve,
)

KINDS = ("sft", "preference", "prompts")
FIELDS = {
    "sft": {"prompt", "completion"},
    "preference": {"prompt", "chosen", "rejected"},
    "prompts": {"prompt", "answer"},
}


def read(kind, split):
    with data_file(kind, split).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# --- the task -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, answer",
    [
        ("sort: d a c b", "a b c d"),
        ("sort: b a b", "a b b"),
        ("sort: j j j", "j j j"),
        ("sort: a", "a"),
        ("  sort: c b a\n", "a b c"),
    ],
)
def test_solve(prompt, answer):
    assert solve(prompt) == answer


@pytest.mark.parametrize(
    "prompt",
    ["", "sort:", "sort: ", "sort d a", "sort: A b", "sort: k a", "sort: ab c", "sort:  a b", "sort: a,b", "sort a"],
)
def test_solve_rejects_malformed_prompt(prompt):
    with pytest.raises(ValueError, match="sort prompt"):
        solve(prompt)


def test_make_prompt_round_trips_and_validates():
    assert make_prompt(["d", "a", "c"]) == "sort: d a c"
    assert solve(make_prompt(list("jihgfedcba"))) == " ".join(LETTERS)
    with pytest.raises(ValueError):
        make_prompt([])
    with pytest.raises(ValueError, match="letters must come from"):
        make_prompt(["a", "z"])


def test_sample_problem_is_deterministic_and_in_range():
    a = [sample_problem(random.Random(7)) for _ in range(3)]
    b = [sample_problem(random.Random(7)) for _ in range(3)]
    assert a == b
    rng = random.Random(0)
    lengths = set()
    for _ in range(500):
        problem = sample_problem(rng, min_len=2, max_len=4)
        assert problem["answer"] == solve(problem["prompt"])
        lengths.add(len(problem["answer"].split()))
    assert lengths == {2, 3, 4}
    with pytest.raises(ValueError):
        sample_problem(rng, min_len=5, max_len=4)


@pytest.mark.parametrize(
    "completion, letters",
    [
        ("a b c", ["a", "b", "c"]),
        ("  a b c \n", ["a", "b", "c"]),
        ("z", ["z"]),  # outside the alphabet still parses; is_well_formed rejects it
        ("", None),
        ("   ", None),
        ("a  b", None),
        ("ab c", None),
        ("a,b,c", None),
        ("A b", None),
        ("a\nb", None),
        ("a b c<|eos|>", None),
    ],
)
def test_parse_answer(completion, letters):
    assert parse_answer(completion) == letters


def test_is_correct():
    assert is_correct("a b c", "a b c")
    assert is_correct(" a b c\n", "a b c")
    assert is_correct("a b c", ["a", "b", "c"])
    assert not is_correct("a c b", "a b c")
    assert not is_correct("a b", "a b c")
    assert not is_correct("a b c c", "a b c")
    assert not is_correct("abc", "a b c")
    assert not is_correct("", "a b c")


def test_is_well_formed():
    prompt = "sort: c a b"
    assert is_well_formed("a b c", prompt)
    assert is_well_formed("c b a", prompt)  # wrong but well-formed
    assert is_well_formed("a a a", prompt)
    assert not is_well_formed("a b", prompt)
    assert not is_well_formed("a b c d", prompt)
    assert not is_well_formed("a b z", prompt)
    assert not is_well_formed("a, b, c", prompt)
    with pytest.raises(ValueError):
        is_well_formed("a b c", "sort c a b")


def test_data_file_validates_names():
    assert data_file("sft", "train").name == "train.jsonl"
    with pytest.raises(ValueError, match="kind"):
        data_file("dpo", "train")
    with pytest.raises(ValueError, match="split"):
        data_file("sft", "test")


# --- the bundled files ----------------------------------------------------------------------


def test_files_are_package_data():
    root = importlib.resources.files("align.data") / "assets" / "sort"
    for kind in KINDS:
        for split in ("train", "validation"):
            assert (root / kind / f"{split}.jsonl").is_file()
    assert sort_task.DATA_DIR.is_dir()


@pytest.mark.parametrize("kind", KINDS)
def test_rows_have_exact_fields_and_correct_answers(kind):
    for split in ("train", "validation"):
        rows = read(kind, split)
        assert len(rows) >= 100
        for i, row in enumerate(rows):
            assert set(row) == FIELDS[kind], (kind, split, i)
            assert all(isinstance(v, str) and v for v in row.values())
            answer = solve(row["prompt"])
            n = len(answer.split())
            assert 3 <= n <= 6
            if kind == "sft":
                assert row["completion"] == answer
            elif kind == "prompts":
                assert row["answer"] == answer
            else:
                assert row["chosen"] == answer
                assert row["rejected"] != row["chosen"]
                assert not is_correct(row["rejected"], answer)
                assert parse_answer(row["rejected"]) is not None


def test_rejected_answers_follow_the_documented_mix():
    """edit 65% (sorted, wrong letters), swap 25% (right letters, one adjacent pair swapped), echo 10% (the input)."""
    from collections import Counter

    rows = read("preference", "train")
    kinds = Counter()
    for row in rows:
        chosen, rejected = row["chosen"].split(), row["rejected"].split()
        if sorted(rejected) == chosen:
            if rejected == prompt_letters(row["prompt"]):
                kinds["echo"] += 1
                continue
            diff = [i for i, (c, r) in enumerate(zip(chosen, rejected)) if c != r]
            assert len(diff) == 2 and diff[1] == diff[0] + 1, row
            kinds["swap"] += 1
        else:
            assert rejected == sorted(rejected), row  # an edit keeps the answer sorted
            assert abs(len(rejected) - len(chosen)) <= 3, row
            kinds["edit"] += 1
    shares = {k: v / len(rows) for k, v in kinds.items()}
    # Sorted inputs cannot be echoed (they fall through to edit) and some swaps are echoes too: wide bounds.
    assert 0.6 < shares["edit"] < 0.75 and 0.2 < shares["swap"] < 0.3 and 0.05 < shares["echo"] < 0.12, shares


def test_held_out_prompts_never_appear_in_train():
    train_prompts = {row["prompt"] for kind in KINDS for row in read(kind, "train")}
    for kind in KINDS:
        val_prompts = [row["prompt"] for row in read(kind, "validation")]
        assert len(set(val_prompts)) == len(val_prompts), f"{kind} validation repeats a prompt"
        assert not set(val_prompts) & train_prompts, f"{kind} validation leaks into a train split"


@pytest.mark.parametrize("kind", KINDS)
def test_files_load_with_datasets_offline(kind, tmp_path):
    datasets = pytest.importorskip("datasets")
    files = {split: str(data_file(kind, split)) for split in ("train", "validation")}
    ds = datasets.load_dataset("json", data_files=files, cache_dir=str(tmp_path))
    assert set(ds["train"].column_names) == FIELDS[kind]
    assert ds["train"].num_rows == len(read(kind, "train"))
    assert ds["validation"].num_rows == len(read(kind, "validation"))


def test_generator_reproduces_the_committed_files(tmp_path, load_script):
    load_script("make_bundled_data").write(tmp_path)
    for kind in KINDS:
        for split in ("train", "validation"):
            fresh = (tmp_path / kind / f"{split}.jsonl").read_bytes()
            assert fresh == data_file(kind, split).read_bytes(), f"{kind}/{split}.jsonl is stale; rerun the script"


def test_the_multi_turn_rounds_are_well_formed_held_out_and_reproduced(tmp_path, load_script):
    """align:sort/rounds: two sort prompts per row (the first in 'prompt', the second in 'rounds'), answers
    matching, no held-out episode in the train split; scripts/make_sort_rounds.py writes the same bytes."""
    folder = sort_task.DATA_DIR / "rounds"
    rows = {
        split: [json.loads(line) for line in (folder / f"{split}.jsonl").open()] for split in ("train", "validation")
    }
    assert len(rows["train"]) == 2000 and len(rows["validation"]) == 100
    for row in rows["train"] + rows["validation"]:
        prompts = [row["prompt"], *row["rounds"]]
        assert len(prompts) == 2 and all(2 <= len(sort_task.prompt_letters(p)) <= 4 for p in prompts)
        assert row["answer"] == " | ".join(sort_task.solve(p) for p in prompts)

    def key(r):
        return (r["prompt"], *r["rounds"])

    assert not {key(r) for r in rows["validation"]} & {key(r) for r in rows["train"]}
    script = load_script("make_sort_rounds")
    for path in script.write_splits(tmp_path, script.build()):
        assert path.read_bytes() == (sort_task.DATA_DIR / path.relative_to(tmp_path)).read_bytes()
