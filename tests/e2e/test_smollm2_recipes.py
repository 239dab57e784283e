"""Each algorithm's SmolLM2 config runs a few steps through the CLI, as a user would start it."""

import csv
import math
from pathlib import Path

import pytest

from align.cli.recipes import run_recipe
from align.data import SFTDataModule
from align.data.preference import PreferenceDataModule
from align.data.prompts import PromptDataModule
from align.modules import SFTModule
from align.modules.dpo import DPOModule
from align.modules.grpo import GRPOModule
from align.modules.ppo import PPOModule
from align.modules.reward import RewardModule

pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FEW = ["--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.log_every_n_steps", "1"]
PAIRS = ["--data.init_args.batch_size", "2", "--data.init_args.val_batch_size", "4"]
ROLLOUTS = [
    "--data.init_args.batch_size",
    "2",
    "--data.init_args.val_batch_size",
    "4",
    "--model.init_args.sampling.max_new_tokens",
    "8",
]


def run(algorithm, module, data, config, root, *extra):
    run_recipe(
        algorithm,
        module,
        data,
        args=["--config", str(CONFIGS / config), *FEW, "--trainer.default_root_dir", str(root), *extra],
    )
    files = list(Path(root).rglob("metrics.csv"))
    assert len(files) == 1, files
    return list(csv.DictReader(open(files[0])))


def finite(rows, name):
    values = [float(r[name]) for r in rows if r.get(name)]
    assert values and all(math.isfinite(v) for v in values), name
    return values


def held_out(out: str, name: str) -> tuple[float, float]:
    line = next(line for line in out.splitlines() if line.startswith(f"held-out {name}:"))
    before, after = (float(x) for x in line.split(":", 1)[1].split("->"))
    return before, after


@pytest.mark.parametrize("config", ["sft/smollm2.yaml", "sft/smollm2-lora.yaml"])
def test_sft(config, tmp_path, capsys):
    rows = run("sft", SFTModule, SFTDataModule, config, tmp_path, *PAIRS)
    finite(rows, "train/loss")
    held_out(capsys.readouterr().out, "val/loss")


@pytest.fixture(scope="module")
def reward_model_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("rm")
    rows = run("rm", RewardModule, PreferenceDataModule, "rm/smollm2.yaml", root, *PAIRS)
    finite(rows, "train/loss")
    export = next(root.rglob("export"))
    assert (export / "config.json").is_file() and (export / "reward_model.json").is_file()
    return export


def test_reward_model(reward_model_export):
    """The export is a standard sequence classifier: transformers loads its head and scores as align does, on
    SmolLM2, whose pad token is its EOS (the export pads with another token, so the EOS is the scored one)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from align.rollout.rewards import RewardModelScorer

    model = AutoModelForSequenceClassification.from_pretrained(reward_model_export).eval()
    scorer = RewardModelScorer(str(reward_model_export), device="cpu")
    assert model.config.num_labels == 1 and model.config.pad_token_id != scorer.tokenizer.eos_token_id
    prompts, completions = ["What is 2 + 3? Reply with just the number.", "What is 7 + 9?"], ["5", "The answer is 16."]
    rows = [sum(scorer.encode(p, c), []) for p, c in zip(prompts, completions)]
    T = max(map(len, rows))
    pad = model.config.pad_token_id
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])
    with torch.no_grad():
        hf = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
    torch.testing.assert_close(hf, torch.tensor(scorer(prompts, completions)), atol=1e-4, rtol=1e-4)


def test_dpo(tmp_path, capsys):
    rows = run(
        "dpo",
        DPOModule,
        PreferenceDataModule,
        "dpo/smollm2.yaml",
        tmp_path,
        *PAIRS,
        "--model.init_args.precompute_reference",
        "false",
    )
    finite(rows, "train/loss")
    held_out(capsys.readouterr().out, "val/dpo_accuracy")


def test_grpo(tmp_path, capsys):
    rows = run(
        "grpo",
        GRPOModule,
        PromptDataModule,
        "grpo/smollm2-arith.yaml",
        tmp_path,
        *ROLLOUTS,
        "--model.init_args.group_size",
        "2",
    )
    finite(rows, "rollout/reward_mean")
    before, after = held_out(capsys.readouterr().out, "val/accuracy")
    assert 0 <= before <= 1 and 0 <= after <= 1


def test_grpo_with_a_calculator_tool(tmp_path, capsys):
    rows = run(
        "grpo",
        GRPOModule,
        PromptDataModule,
        "grpo/smollm2-calculator.yaml",
        tmp_path,
        "--data.init_args.batch_size",
        "2",
        "--data.init_args.val_batch_size",
        "4",
        "--model.init_args.group_size",
        "2",
    )
    finite(rows, "rollout/reward_mean")
    turns = finite(rows, "rollout/turns")
    assert all(1.0 <= t <= 3.0 for t in turns)
    finite(rows, "rollout/tool_calls")
    finite(rows, "rollout/environment_tokens")
    before, after = held_out(capsys.readouterr().out, "val/accuracy")
    assert 0 <= before <= 1 and 0 <= after <= 1


def test_ppo_on_the_trained_reward_model(reward_model_export, tmp_path, capsys):
    rows = run(
        "ppo",
        PPOModule,
        PromptDataModule,
        "ppo/smollm2.yaml",
        tmp_path,
        *ROLLOUTS,
        "--model.init_args.reward_model",
        str(reward_model_export),
        "--model.init_args.group_size",
        "2",
        "--model.init_args.value.warmup_rollouts",
        "1",
    )
    finite(rows, "rollout/reward_mean")
    out = capsys.readouterr().out
    held_out(out, "val/reward/math_verify")
    held_out(out, "val/kl")
