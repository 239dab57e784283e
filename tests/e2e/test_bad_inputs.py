"""The bad-input table (docs/reliability.md): every bad input stops the command line with a non-zero exit
before any weights are written, and the message names the file, row or field and what was expected.

Rows of the table already covered elsewhere are listed in the docs with their test: SFT rows that are
malformed JSON, miss a field, hold an empty string or a wrong type or are too long, and an unknown YAML key
(tests/cli/test_main.py, tests/cli/test_config_errors.py); reader-level non-UTF-8 bytes and empty files
(tests/data/test_sft_data.py); rewards returning NaN, the wrong length or raising, in a real GRPO run
(tests/e2e/test_recipes_grpo.py), and the printed output of a raising reward through the recipe script (the
last test here).
This file covers the rest through the same command line, one table row per case.
"""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from align.cli.recipes import run_recipe
from align.data.preference import PreferenceDataModule, UnpairedDataModule
from align.data.prompts import PromptDataModule
from align.data.sft import SFTDataModule
from align.modules.dpo import DPOModule
from align.modules.grpo import GRPOModule
from align.modules.kto import KTOModule
from align.modules.sft import SFTModule
from align.rollout.rewards import CombinedReward, RewardError, RewardSpec

ROOT = Path(__file__).resolve().parents[2]
RECIPES = {
    "sft": (SFTModule, SFTDataModule),
    "dpo": (DPOModule, PreferenceDataModule),
    "grpo": (GRPOModule, PromptDataModule),
    "kto": (KTOModule, UnpairedDataModule),
}
QUICK = {
    "sft": ["--data.init_args.val_files", "null"],
    "dpo": ["--data.init_args.val_files", "null"],
    "kto": ["--data.init_args.val_files", "null"],
    "grpo": [
        "--data.init_args.val_files",
        "null",
        "--data.init_args.batch_size",
        "2",
        "--model.init_args.group_size",
        "2",
        "--model.init_args.sampling.max_new_tokens",
        "4",
    ],
}

PAIR = {"prompt": "sort: b a", "chosen": "a b", "rejected": "b a"}
SFT = {"prompt": "sort: b a", "completion": "a b"}
PROMPT = {"prompt": "sort: b a", "answer": "a b"}
U = {"role": "user", "content": "sort: b a"}


def _dataset_dict(path: Path) -> None:
    import datasets

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list([SFT]), "test": datasets.Dataset.from_list([SFT])}
    ).save_to_disk(str(path))


def jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


# id, recipe, {file name: content or bytes} (written to tmp; "{tmp}" in args is replaced), extra args, expected parts
CASES = [
    (
        "malformed-json-preference",
        "dpo",
        {
            "d.jsonl": jsonl(PAIR, '{"prompt": "x", "chosen": '),
        },
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "one JSON object per line"],
    ),
    (
        "missing-field-preference",
        "dpo",
        {"d.jsonl": jsonl(PAIR, {"prompt": "sort: b a", "chosen": "a b"})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "rejected"],
    ),
    (
        "empty-field-preference",
        "dpo",
        {"d.jsonl": jsonl(PAIR, {**PAIR, "chosen": ""})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "field 'chosen'", "non-empty"],
    ),
    (
        "wrong-type-preference",
        "dpo",
        {"d.jsonl": jsonl(PAIR, {**PAIR, "rejected": 7})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "field 'rejected'", "expected"],
    ),
    (
        "extra-field-sft",
        "sft",
        {"d.jsonl": jsonl(SFT, {**SFT, "messages": [{"role": "user", "content": "x"}]})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "expected"],
    ),
    (
        "non-utf8",
        "sft",
        {"d.jsonl": jsonl(SFT).encode() + b'{"prompt": "sort: \xff\xfe", "completion": "a"}\n'},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "UTF-8"],
    ),
    (
        "row-too-long-prompt",
        "grpo",
        {"p.jsonl": jsonl(PROMPT, {"prompt": "sort: " + "a " * 300, "answer": "a"})},
        ["--data.init_args.train_files", "{tmp}/p.jsonl", "--data.init_args.max_prompt_length", "64"],
        ["p.jsonl", "row 2", "field 'prompt'", "at most max_prompt_length=64"],
    ),
    (
        "empty-dataset",
        "dpo",
        {"d.jsonl": ""},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "at least one row"],
    ),
    (
        "empty-validation-split",
        "sft",
        {"d.jsonl": jsonl(SFT), "v.jsonl": "\n"},
        ["--data.init_args.train_files", "{tmp}/d.jsonl", "--data.init_args.val_files", "{tmp}/v.jsonl"],
        ["v.jsonl", "at least one row"],
    ),
    (
        "missing-file",
        "sft",
        {},
        ["--data.init_args.train_files", "{tmp}/nope.jsonl"],
        ["nope.jsonl", "an existing file"],
    ),
    (
        "prompt-column-absent-rl",
        "grpo",
        {"p.jsonl": jsonl(PROMPT, {"question": "sort: b a", "answer": "a b"})},
        ["--data.init_args.train_files", "{tmp}/p.jsonl"],
        ["p.jsonl", "row 2", "field 'prompt'", "question"],
    ),
    # row shapes beyond {prompt, completion} / {prompt, chosen, rejected} (docs/data.md)
    (
        "sharegpt-unknown-speaker",
        "sft",
        {
            "d.jsonl": jsonl(
                SFT, {"conversations": [{"from": "human", "value": "sort: b a"}, {"from": "bot", "value": "a b"}]}
            )
        },
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "field 'conversations[1].from'", "gpt"],
    ),
    (
        "implicit-prompt-not-shared",
        "dpo",
        {
            "d.jsonl": jsonl(
                PAIR,
                {
                    "chosen": [U, {"role": "assistant", "content": "a b"}],
                    "rejected": [{"role": "user", "content": "sort: c a"}, {"role": "assistant", "content": "a c"}],
                },
            )
        },
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "field 'rejected'", "shared prompt"],
    ),
    (
        "implicit-prompt-no-final-reply",
        "dpo",
        {"d.jsonl": jsonl(PAIR, {"chosen": [U], "rejected": [U, {"role": "assistant", "content": "b a"}]})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "field 'chosen'", "assistant"],
    ),
    (
        "hh-text-empty-turn",
        "dpo",
        {
            "d.jsonl": jsonl(
                PAIR,
                {"chosen": "\n\nHuman: sort: b a\n\nAssistant:", "rejected": "\n\nHuman: sort: b a\n\nAssistant: b a"},
            )
        },
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "field 'chosen'", "turn 2 is empty"],
    ),
    (
        "plain-text-pair-without-prompt",
        "dpo",
        {"d.jsonl": jsonl(PAIR, {"chosen": "a b", "rejected": "b a"})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "field 'prompt'"],
    ),
    (
        "ultrafeedback-conversation-other-prompt",
        "dpo",
        {
            "d.jsonl": jsonl(
                PAIR,
                {**PAIR, "chosen": [{"role": "user", "content": "sort: c a"}, {"role": "assistant", "content": "a c"}]},
            )
        },
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 2", "field 'chosen'", "the prompt's messages"],
    ),
    (
        "unpaired-kto-row",
        "dpo",
        {"d.jsonl": jsonl({"prompt": "sort: b a", "completion": "a b", "label": True})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl"],
        ["d.jsonl", "row 1", "field 'label'", "KTO"],
    ),
    (
        "kto-label-not-boolean",
        "kto",
        {"u.jsonl": jsonl({"prompt": "sort: b a", "completion": "a b", "label": "yes"})},
        ["--data.init_args.train_files", "{tmp}/u.jsonl"],
        ["u.jsonl", "row 1", "field 'label'", "true (a desirable"],
    ),
    (
        "kto-one-label-only",
        "kto",
        {"u.jsonl": jsonl(*[{"prompt": "sort: b a", "completion": "a b", "label": False}] * 2)},
        ["--data.init_args.train_files", "{tmp}/u.jsonl"],
        ["u.jsonl", "field 'label'", "both desirable (true) and"],
    ),
    (
        "unused-column-strict",
        "sft",
        {"d.jsonl": jsonl(SFT, {**SFT, "score": 1})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl", "--data.init_args.strict", "true"],
        ["d.jsonl", "row 2", "field 'score'", "data.strict"],
    ),
    (
        "unused-column-strict-prompt-pairs",
        "dpo",
        {"d.jsonl": jsonl({**PAIR, "id": 3})},
        ["--data.init_args.train_files", "{tmp}/d.jsonl", "--data.init_args.strict", "true"],
        ["d.jsonl", "row 1", "field 'id'", "data.strict"],
    ),
    # sources and splits
    (
        "local-file-other-split",
        "sft",
        {"d.jsonl": jsonl(SFT)},
        ["--data.init_args.train_files", "{tmp}/d.jsonl", "--data.init_args.split", "eval"],
        ["d.jsonl", "field 'data.split'", "the split 'train'", "'eval'"],
    ),
    (
        "local-val-file-other-split",
        "sft",
        {"d.jsonl": jsonl(SFT), "v.jsonl": jsonl(SFT)},
        [
            "--data.init_args.train_files",
            "{tmp}/d.jsonl",
            "--data.init_args.val_files",
            "{tmp}/v.jsonl",
            "--data.init_args.val_split",
            "validation",
        ],
        ["v.jsonl", "field 'data.val_split'", "'validation'"],
    ),
    (
        "bad-slice",
        "grpo",
        {"p.jsonl": jsonl(PROMPT)},
        ["--data.init_args.train_files", "{tmp}/p.jsonl", "--data.init_args.split", "train[one:]"],
        ["p.jsonl", "field 'data.split'", "train[:10]", "train[one:]"],
    ),
    (
        "save-to-disk-missing-split",
        "sft",
        {"ds": lambda path: _dataset_dict(path)},
        ["--data.init_args.train_files", "{tmp}/ds", "--data.init_args.split", "validation"],
        ["ds", "field 'data.split'", "one of the splits ['test', 'train']"],
    ),
    (
        "folder-not-a-dataset",
        "sft",
        {"folder/readme.txt": "notes"},
        ["--data.init_args.train_files", "{tmp}/folder"],
        ["folder", "save_to_disk"],
    ),
    (
        "held-out-larger-than-data",
        "sft",
        {"d.jsonl": jsonl(SFT, SFT)},
        [
            "--data.init_args.train_files",
            "{tmp}/d.jsonl",
            "--data.init_args.val_files",
            "auto",
            "--data.init_args.val_size",
            "2",
        ],
        ["d.jsonl", "data.val_size=2", "2 rows"],
    ),
    (
        "unknown-yaml-key",
        "sft",
        {"c.yaml": "model:\n  init_args:\n    learning_rate: 0.1\n"},
        ["--config", "{tmp}/c.yaml"],
        ["learning_rate"],
    ),
    (
        "yaml-syntax-error",
        "sft",
        {"c.yaml": "trainer:\n  max_steps: 3\n   bad: [\n"},
        ["--config", "{tmp}/c.yaml"],
        ["c.yaml', line 3, column 7: not valid YAML: mapping values are not allowed here"],
    ),
    (
        "wrong-type-yaml",
        "sft",
        {"c.yaml": "trainer:\n  max_steps: ten\n"},
        ["--config", "{tmp}/c.yaml"],
        ["max_steps", "ten"],
    ),
    # an environment path that does not import: the path and why
    (
        "misspelt-environment-path",
        "grpo",
        {},
        ["--model.init_args.environment", '{"path": "align.rollout.envs.tasks.SortRound"}'],
        [
            "error: environment 'align.rollout.envs.tasks.SortRound': module 'align.rollout.envs.tasks' has no "
            "attribute "
            "'SortRound'"
        ],
    ),
    # a class_path that does not import: the path, why, and the nearest importable one
    (
        "misspelt-module-class-path",
        "grpo",
        {},
        ["--model.class_path", "align.modules.grpo.GRPOModul"],
        ["error: --model: cannot import 'align.modules.grpo.GRPOModul'", "did you mean align.modules.grpo.GRPOModule?"],
    ),
    (
        "misspelt-data-class-path-yaml",
        "grpo",
        {"c.yaml": "data:\n  class_path: align.data.PromptDataModul\n"},
        ["--config", "{tmp}/c.yaml"],
        [
            "error: --data: cannot import 'align.data.PromptDataModul'",
            "did you mean align.data.prompts.PromptDataModule?",
        ],
    ),
    (
        "misspelt-policy-class-path",
        "sft",
        {},
        ["--model.policy.class_path", "align.models.PolicyModl"],
        ["error: --model.policy: cannot import 'align.models.PolicyModl'", "did you mean align.models.PolicyModel?"],
    ),
    (
        "misspelt-model-id",
        "sft",
        {},
        ["--model.init_args.policy.init_args.model", "smollm2-135m"],
        [
            "model: 'smollm2-135m' is not a local path or an id align ships",
            "HF_HUB_OFFLINE is set",
            "did you mean 'smollm2-135m-instruct'?",
            "align's own ids: smollm2-135m-instruct, tiny",
        ],
    ),
    (
        "run-folder-as-model",
        "sft",
        {"old/version_0/checkpoints/last.ckpt": "not read"},
        ["--model.init_args.policy.init_args.model", "{tmp}/old/version_0"],
        [
            "is an align run folder, not a model folder; its checkpoint is ",
            "old/version_0/checkpoints/last.ckpt",
            "align export --ckpt_path",
        ],
    ),
    (
        "nonexistent-model-path",
        "sft",
        {},
        ["--model.init_args.policy.init_args.model", "{tmp}/no_model"],
        ["no_model", "does not exist", "expected a local model directory"],
    ),
    (
        "reward-import-path-missing",
        "grpo",
        {},
        ["--model.init_args.rewards", '[{"fn": "align.rewards.no_such_reward"}]'],
        ["align.rewards.no_such_reward", "has no attribute 'no_such_reward'"],
    ),
    (
        "reward-module-missing",
        "grpo",
        {},
        ["--model.init_args.rewards", '[{"fn": "no_such_pkg.scores:fn"}]'],
        ["no_such_pkg.scores", "cannot import module"],
    ),
    # Reward modules below sit in the working directory and are named by dotted path: no PYTHONPATH needed.
    (
        "reward-raises",
        "grpo",
        {
            "p.jsonl": jsonl(PROMPT, PROMPT),
            "bad_reward_r1.py": "def flaky(completions, answer, **kw):\n    known = {}\n"
            "    return [known[a] for a in answer]\n",
        },
        [
            "--data.init_args.train_files",
            "{tmp}/p.jsonl",
            "--model.init_args.rewards",
            '[{"fn": "bad_reward_r1.flaky"}]',
        ],
        [
            "error: reward 'flaky' (bad_reward_r1.flaky) raised KeyError: 'a b' at bad_reward_r1.py, line 3 in "
            "flaky(); "
            "first failing sample 0 of 4: prompt 'sort: b a', completion ",
            "answer='a b'",
        ],
    ),
    (
        "reward-argument-no-column-provides",
        "grpo",
        {
            "p.jsonl": jsonl(PROMPT),
            "bad_reward_r2.py": "def exact(completions, solution):\n    return [0.0] * len(completions)\n",
        },
        [
            "--data.init_args.train_files",
            "{tmp}/p.jsonl",
            "--model.init_args.rewards",
            '[{"fn": "bad_reward_r2.exact"}]',
        ],
        [
            "reward 'exact' (bad_reward_r2.exact) requires 'solution', which no data column or input provides",
            "data columns: answer",
        ],
    ),
    (
        "reward-kwargs-not-a-parameter",
        "grpo",
        {"bad_reward_r3.py": "def exact(completions, answer):\n    return [0.0] * len(completions)\n"},
        ["--model.init_args.rewards", '[{"fn": "bad_reward_r3.exact", "kwargs": {"tolerance": 0.1}}]'],
        [
            "error: model.rewards[0].kwargs: expected parameters of reward 'exact' (bad_reward_r3.exact), which takes "
            "['answer', 'completions'] (add **kwargs to take any), got ['tolerance']"
        ],
    ),
    (
        "rloo-one-sample-per-prompt",
        "grpo",
        {},
        ["--model.init_args.advantages.estimator", "rloo", "--model.init_args.group_size", "1"],
        ["model.group_size: expected >= 2 for the group baseline of advantages.estimator rloo, got 1"],
    ),
    # multi-turn environments (docs/environments.md): modules in the working directory, named by dotted path
    (
        "environment-import-missing",
        "grpo",
        {},
        ["--model.init_args.environment", '{"path": "no_such_env_pkg.Game"}'],
        ["environment 'no_such_env_pkg.Game': cannot import module 'no_such_env_pkg'"],
    ),
    (
        "environment-step-raises",
        "grpo",
        {
            "bad_env_e1.py": "class Game:\n    def reset(self, row):\n        return row['messages']\n"
            "    def step(self, message):\n        raise KeyError('board')\n"
        },
        ["--model.init_args.environment", '{"path": "bad_env_e1.Game"}'],
        [
            "error: environment 'Game' (bad_env_e1.Game): episode 0 (prompt 0 of the batch, sample 0), turn 1: step "
            "raised "
            "KeyError: 'board' at bad_env_e1.py, line 5 in step()"
        ],
    ),
    (
        "environment-malformed-reply",
        "grpo",
        {
            "bad_env_e2.py": "class Game:\n    def reset(self, row):\n        return row['messages']\n"
            "    def step(self, message):\n        return {'reply': 'ok'}\n"
        },
        ["--model.init_args.environment", '{"path": "bad_env_e2.Game"}'],
        [
            "error: environment 'Game' (bad_env_e2.Game): episode 0 (prompt 0 of the batch, sample 0), turn 1: step "
            "must "
            "return EnvStep(messages, reward, done, info), got a dict with keys ['reply']"
        ],
    ),
    (
        "environment-never-answers",
        "grpo",
        {
            "bad_env_e3.py": "import time\nclass Game:\n    def reset(self, row):\n        return row['messages']\n"
            "    def step(self, message):\n        time.sleep(30)\n"
        },
        ["--model.init_args.environment", '{"path": "bad_env_e3.Game", "step_timeout": 0.5}'],
        [
            "error: environment 'Game' (bad_env_e3.Game): episode 0 (prompt 0 of the batch, sample 0), turn 1: step "
            "did not "
            "return within step_timeout=0.5 s"
        ],
    ),
    (
        "environment-bad-reset",
        "grpo",
        {
            "bad_env_e4.py": "class Game:\n    def reset(self, row):\n        return 'sort: b a'\n"
            "    def step(self, message):\n        return [], 0.0, True\n"
        },
        ["--model.init_args.environment", '{"path": "bad_env_e4.Game"}'],
        [
            "error: environment 'Game' (bad_env_e4.Game): episode 0 (prompt 0 of the batch, sample 0): reset's "
            "result must "
            "be a list of messages, got 'sort: b a'"
        ],
    ),
    (
        "environment-max-turns-zero",
        "grpo",
        {},
        ["--model.init_args.environment", '{"path": "align.rollout.envs.tasks.SortRounds", "max_turns": 0}'],
        ["model.environment.max_turns: expected an integer >= 1, got 0"],
    ),
    (
        "reward-column-shadows-an-input",
        "grpo",
        {"p.jsonl": jsonl({**PROMPT, "completions": "x"})},
        ["--data.init_args.train_files", "{tmp}/p.jsonl"],
        ["data column(s) ['completions'] have the name of a reward input"],
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, recipe, files, args, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_nonzero_naming_where_and_what_before_any_weights(
    tmp_path, monkeypatch, capsys, case, recipe, files, args, expected
):
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if callable(content):
            content(tmp_path / name)
        else:
            (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    root = tmp_path / "run"
    given = set(tmp_path.rglob("*.ckpt"))
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    with pytest.raises(SystemExit) as info:
        run_recipe(
            recipe,
            *RECIPES[recipe],
            args=[*QUICK[recipe], *argv, "--trainer.default_root_dir", str(root), "--trainer.max_steps", "1"],
        )
    assert info.value.code not in (0, None)
    err = capsys.readouterr().err
    for part in expected:
        assert part in err, f"{case}: {part!r} not in {err[-2000:]}"
    assert "Traceback" not in err
    assert not set(tmp_path.rglob("*.ckpt")) - given and not list(tmp_path.rglob("*.safetensors"))
    assert not list(root.glob("version_*"))  # no run folder holding only the config of a run that never stepped


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, line",
    [
        # a setting of a nested option group: these used to end in a traceback with a dump of every setting
        (
            ["--model.init_args.policy.init_args.lora", '{"r": 0}'],
            "error: model.policy.lora.r: expected an integer >= 1, got 0",
        ),
        (["--data.init_args.batch_size", "0"], "error: data.batch_size: expected an integer >= 1, got 0"),
        (
            ["--model.init_args.rewards", '[{"fn": "align.rewards.sort_format", "concurrency": 0}]'],
            "error: model.rewards[0].concurrency: expected an integer >= 1, got 0",
        ),
        # one class at two places in a config: its checks name the place
        (
            ["--model.init_args.sampling.temperature", "-1"],
            "error: model.sampling.temperature: expected >= 0 (0: greedy), got -1.0",
        ),
        (
            ["--model.init_args.evaluation.sampling.temperature", "-1"],
            "error: model.evaluation.sampling.temperature: expected >= 0 (0: greedy), got -1.0",
        ),
    ],
    ids=["lora-rank", "data-batch-size", "reward-concurrency", "sampling", "held-out-sampling"],
)
def test_a_bad_nested_setting_stops_the_cli_on_one_line_naming_its_full_path(tmp_path, monkeypatch, capsys, args, line):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as info:
        run_recipe(
            "grpo",
            *RECIPES["grpo"],
            args=[
                *QUICK["grpo"],
                *args,
                "--trainer.max_steps",
                "1",
                "--trainer.default_root_dir",
                str(tmp_path / "run"),
            ],
        )
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert [text for text in err.splitlines() if "error" in text.lower() or "Traceback" in text] == [line], err[-3000:]
    assert not list((tmp_path / "run").glob("version_*"))


@pytest.mark.slow
def test_a_raising_reward_prints_one_error_line_through_the_recipe_script(tmp_path):
    """End to end: ``python recipes/grpo.py`` from a folder holding the user's reward module (named by dotted
    path, no PYTHONPATH entry for it) exits 2 and prints the reward's error as one line, the last on stderr,
    with no traceback; the other lines are Lightning's and transformers' usual start-up lines."""
    (tmp_path / "my_rewards.py").write_text(
        "def exact(completions, answer, **kwargs):\n"
        "    return [grade(c, a) for c, a in zip(completions, answer)]\n"
        "\n\n"
        "def grade(completion, answer):\n"
        "    raise RuntimeError(f'grader offline for {answer!r}')\n"
    )
    (tmp_path / "p.jsonl").write_text(jsonl(PROMPT, {"prompt": "sort: c a", "answer": "a c"}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))  # align from this checkout; the reward from the cwd
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "recipes" / "grpo.py"),
            *QUICK["grpo"],
            "--data.init_args.train_files",
            "p.jsonl",
            "--model.init_args.rewards",
            '[{"fn": "my_rewards.exact"}]',
            "--trainer.max_steps",
            "1",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(
        "error: reward 'exact' (my_rewards.exact) raised RuntimeError: grader offline for "
        "'a b' at my_rewards.py, line 6 in grade(); first failing sample 0 of 4: prompt "
        "'sort: b a', completion "
    ), lines[-1]
    assert lines[-1].endswith(", answer='a b'")
    assert "Traceback" not in proc.stderr
    assert [line for line in lines if "grader offline" in line or "error:" in line] == lines[-1:]
    assert not list(tmp_path.rglob("*.ckpt"))


def test_an_environment_that_breaks_mid_run_stops_it_with_nothing_written_for_that_step(tmp_path, monkeypatch, capsys):
    """The environment works for the first training step and raises on the second: the run exits on one line, the
    first step's metrics row and checkpoint stay, and the failing step leaves no metrics row and no checkpoint."""
    (tmp_path / "late_env.py").write_text(
        "from align.rollout.envs.chat import EnvStep\n"
        "calls = {'n': 0}\n"
        "class Game:\n"
        "    def reset(self, row):\n"
        "        calls['n'] += 1\n"
        "        return row['messages']\n"
        "    def step(self, message):\n"
        "        if calls['n'] > 4:\n"
        "            raise RuntimeError('server gone')\n"
        "        return EnvStep([], 1.0, True)\n"
    )
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "run"
    with pytest.raises(SystemExit) as info:
        run_recipe(
            "grpo",
            *RECIPES["grpo"],
            args=[
                *QUICK["grpo"],
                "--model.init_args.environment",
                '{"path": "late_env.Game"}',
                "--trainer.max_steps",
                "3",
                "--trainer.default_root_dir",
                str(root),
                "--trainer.log_every_n_steps",
                "1",
                "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                "--trainer.callbacks.every_n_train_steps=1",
                "--trainer.callbacks.save_last=true",
            ],
        )
    assert info.value.code not in (0, None)
    err = capsys.readouterr().err
    assert "episode 0 (prompt 0 of the batch, sample 0), turn 1: step raised RuntimeError: server gone" in err
    assert "Traceback" not in err
    rows = [r for r in csv.DictReader(open(next(root.rglob("metrics.csv")))) if r.get("rollout/reward_mean")]
    assert [r["step"] for r in rows] == ["0"] and float(rows[0]["rollout/reward/env"]) == 1.0
    assert sorted(p.name for p in root.rglob("*.ckpt")) == ["epoch=0-step=1.ckpt", "last.ckpt"]


def scorer(values):
    return CombinedReward([RewardSpec(lambda prompts, completions, **kw: values, name="flaky")])


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1.0, float("inf")], "returned inf for sample 1"),
        ([float("-inf"), 0.0], "returned -inf for sample 0"),
        ([float("nan"), 0.0], "returned nan for sample 0"),
        ([1.0], "returned 1 values for 2 completions"),
        ([1.0, "high"], "list of numbers"),
    ],
)
def test_reward_values_that_are_not_finite_numbers_one_per_completion_are_refused(values, expected):
    with pytest.raises(RewardError, match=expected) as info:
        scorer(values)(["sort: b a", "sort: c a"], ["a b", "a c"])
    assert "flaky" in str(info.value)


def test_tokenizer_without_eos_is_refused_and_one_without_pad_uses_eos(tmp_path):
    from align.errors import AlignConfigError
    from align.hub import load_tokenizer
    from align.hub.tiny import load_tiny_tokenizer

    tok = load_tiny_tokenizer()
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "no_pad")
    loaded = load_tokenizer(str(tmp_path / "no_pad"))
    assert loaded.pad_token_id == loaded.eos_token_id == tok.eos_token_id
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "no_eos")
    config = json.loads((tmp_path / "no_eos" / "tokenizer_config.json").read_text())
    config.pop("eos_token", None)
    (tmp_path / "no_eos" / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(AlignConfigError, match="has no eos_token"):
        load_tokenizer(str(tmp_path / "no_eos"))


def test_remote_code_is_off_unless_asked_for():
    import inspect

    from align.hub import load_tokenizer
    from align.models.loading import load_causal_lm
    from align.models.policy import PolicyModel

    for fn in (load_causal_lm, load_tokenizer, PolicyModel.__init__):
        assert inspect.signature(fn).parameters["trust_remote_code"].default is False
