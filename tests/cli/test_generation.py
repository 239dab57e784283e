"""``align generate``, ``align evaluate`` and ``align chat`` (align.cli.generation, over align.rollout.generation):
what each prints and writes, its one-line errors, and evaluation numbers equal to the ones training's validation logs
for the same data."""

import io
import json

import lightning as L
import pytest
import torch

from align.data.prompts import PromptDataModule
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.modules.options import Updates
from align.rollout.engine import SamplingConfig
from align.rollout.rewards import RewardSpec

from ._commands import ROWS, fails, read_jsonl, run, write_rows

VALIDATION = "align:sort/prompts/validation.jsonl"


@pytest.fixture
def prompts(tmp_path) -> str:
    return write_rows(tmp_path / "prompts.jsonl", ROWS)


def validate(module) -> dict[str, float]:
    """The module's held-out metrics on the bundled sort validation prompts, as a run logs them (one batch)."""
    data = PromptDataModule(val_batch_size=100)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return {k: float(v) for k, v in trainer.validate(module, datamodule=data, verbose=False)[0].items()}


def grpo_module() -> GRPOModule:
    return GRPOModule(
        policy=PolicyModel("tiny-sort"),
        rewards=[RewardSpec("align.rewards.sort_exact_match")],
        group_size=4,
        sampling=SamplingConfig(max_new_tokens=16, temperature=0.5),
        log_entropy=False,
        optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3),
        updates=Updates(max_grad_norm=None),
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint written by a two-step GRPO run of tiny-sort, with the held-out metrics its validation logged
    before and after training."""
    root = tmp_path_factory.mktemp("grpo")
    L.seed_everything(0)
    module = grpo_module()
    before = validate(module)
    data = PromptDataModule(batch_size=4, val_files=None)
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    after = validate(module)
    ckpt = root / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    return {"ckpt": str(ckpt), "before": before, "after": after}


def evaluate_report(capsys, tmp_path, model, *extra, prompts=VALIDATION) -> tuple[dict, str]:
    report = tmp_path / "report.json"
    out, _ = run(
        capsys,
        "evaluate",
        "--model",
        model,
        "--prompts",
        prompts,
        "--rewards",
        "align.rewards.sort_exact_match",
        "--max_new_tokens",
        "16",
        "--batch_size",
        "100",
        "--output",
        str(report),
        *extra,
    )
    return json.loads(report.read_text()), out


# ---------------------------------------------------------------------------- evaluate = training's validation
def as_validation(report: dict) -> dict[str, float]:
    """An ``align evaluate`` report under the names training's held-out pass logs (one evaluator makes both)."""
    shared = {f"val/{k}": report[k] for k in ("reward_mean", "accuracy", "response_length", "truncated_frac")}
    return {**shared, **{f"val/reward/{name}": value for name, value in report["rewards"].items()}}


def test_evaluate_equals_the_validation_of_training_before_and_after(trained, capsys, tmp_path):
    report, out = evaluate_report(capsys, tmp_path, "tiny-sort")
    before = as_validation(report)
    assert before == pytest.approx({k: trained["before"][k] for k in before}, abs=1e-6)
    assert any(
        line.split() == ["accuracy", f"{report['accuracy']:.4f}", "(sort_exact_match", ">=", "1)"]
        for line in out.splitlines()
    )
    report, _ = evaluate_report(capsys, tmp_path, trained["ckpt"])
    after = as_validation(report)
    assert after == pytest.approx({k: trained["after"][k] for k in after}, abs=1e-6)


def test_evaluate_prints_a_table_and_writes_the_report(capsys, tmp_path, prompts):
    report_path = tmp_path / "r" / "report.json"
    out, _ = run(
        capsys,
        "evaluate",
        "--ckpt_path",
        "tiny-sort",
        "--prompts",
        prompts,
        "--rewards",
        "align.rewards.sort_exact_match",
        "align.rewards.sort_format=0.5",
        "--max_new_tokens",
        "8",
        "--output",
        str(report_path),
    )
    report = json.loads(report_path.read_text())
    parts = report["rewards"]
    assert set(parts) == {"sort_exact_match", "sort_format"}
    assert report["reward_mean"] == pytest.approx(parts["sort_exact_match"] + 0.5 * parts["sort_format"])
    assert report["num_prompts"] == 4 and report["samples_per_prompt"] == 1 and report["pass_at_k"] == {}
    assert report["sampling"]["temperature"] == 0.0 and report["baseline"] is None
    lines = out.splitlines()
    assert lines[0].split() == ["model", "tiny-sort"]
    assert lines[1].startswith("prompts") and "(4 prompts x 1 sample, greedy, at most 8 new tokens)" in lines[1]
    assert any(line.split()[:2] == ["reward/sort_format", f"{parts['sort_format']:.4f}"] for line in lines)
    assert lines[-1] == f"report: {report_path}"


def test_sampled_evaluation_reports_unbiased_pass_at_k(capsys, tmp_path, prompts):
    report, out = evaluate_report(
        capsys, tmp_path, "tiny-sort", "--n", "6", "--k", "1", "3", "6", "--temperature", "0.5", prompts=prompts
    )
    assert report["samples_per_prompt"] == 6 and report["sampling"]["temperature"] == 0.5
    pass_k = report["pass_at_k"]
    assert set(pass_k) == {"1", "3", "6"}
    assert pass_k["1"] == pytest.approx(report["accuracy"])  # equally many samples per prompt
    assert pass_k["1"] <= pass_k["3"] <= pass_k["6"] <= 1
    assert "pass@3" in out
    default, _ = evaluate_report(capsys, tmp_path, "tiny-sort", "--n", "2", prompts=prompts)
    assert set(default["pass_at_k"]) == {"1", "2"} and default["sampling"]["temperature"] == 1.0


def test_baseline_win_rate_and_kl(trained, capsys, tmp_path):
    same, out = evaluate_report(capsys, tmp_path, trained["ckpt"], "--baseline", trained["ckpt"])
    # Against itself: identical completions, every comparison a tie, a log-ratio of exactly 0.
    assert same["baseline"]["win_rate"] == 0.5 and same["baseline"]["ties"] == 1.0
    assert same["baseline"]["kl"] == 0.0 and same["baseline"]["reward_mean"] == same["reward_mean"]
    report, out = evaluate_report(capsys, tmp_path, trained["ckpt"], "--baseline", "reference")
    b = report["baseline"]
    assert b["judge"] == "rewards" and b["kl_estimator"].startswith("log-ratio only")  # greedy completions
    assert b["reward_mean"] == pytest.approx(trained["before"]["val/reward_mean"], abs=1e-6)  # tiny-sort, greedy
    assert b["wins"] + b["ties"] + b["losses"] == pytest.approx(1.0)
    assert b["win_rate"] == pytest.approx(b["wins"] + 0.5 * b["ties"])
    assert b["kl"] != 0.0 and "log-ratio to baseline" in out and "vs reference" in out
    sampled, out = evaluate_report(
        capsys, tmp_path, trained["ckpt"], "--baseline", "reference", "--n", "2", "--batch_size", "50"
    )
    assert sampled["baseline"]["kl_estimator"] == "k1, sequence-level" and "kl to baseline" in out


def test_win_rate_judged_by_a_reward_model(capsys, tmp_path, prompts):
    report, _ = evaluate_report(
        capsys, tmp_path, "tiny-sort", "--baseline", "tiny", "--reward_model", "tiny-sort-rm", prompts=prompts
    )
    b = report["baseline"]
    assert b["judge"] == "reward_model" and 0 <= b["win_rate"] <= 1
    assert b["rm_score"] != b["baseline_rm_score"]


# ---------------------------------------------------------------------------- generate
def test_generate_writes_one_row_per_prompt_with_its_columns_and_prints_a_summary(capsys, tmp_path, prompts):
    output = tmp_path / "out" / "gen.jsonl"
    out, _ = run(
        capsys,
        "generate",
        "--model",
        "tiny-sort",
        "--prompts",
        prompts,
        "--output",
        str(output),
        "--max_new_tokens",
        "12",
    )
    rows = read_jsonl(output)
    assert [{k: v for k, v in r.items() if k != "completion"} for r in rows] == ROWS
    assert all(isinstance(r["completion"], str) for r in rows) and rows[0]["completion"] == "a b c d"
    line = out.strip()
    assert line.startswith("generated 4 completions of 4 prompts: ") and "tokens/s" in line
    assert line.endswith(f"(greedy, at most 12 new tokens) -> {output}")
    assert not list(output.parent.glob(".*partial"))


def test_generate_from_a_checkpoint_and_from_its_export_gives_the_same_completions(trained, capsys, tmp_path, prompts):
    export = tmp_path / "export"
    run(capsys, "export", "--ckpt_path", trained["ckpt"], "--output_dir", str(export))
    results = []
    for flag, model in (("--ckpt_path", trained["ckpt"]), ("--model", str(export))):
        path = tmp_path / f"{len(results)}.jsonl"
        run(capsys, "generate", flag, model, "--prompts", prompts, "--output", str(path), "--max_new_tokens", "12")
        results.append(read_jsonl(path))
    assert results[0] == results[1]


# ---------------------------------------------------------------------------- chat
def chat(monkeypatch, capsys, text: str, *args) -> tuple[list[str], list[list[dict]]]:
    """Run ``align chat`` on piped ``text``; returns its stdout lines and the history each reply was made from."""
    import align.rollout.generation as generation

    seen = []
    original = generation.chat_reply

    def spy(policy, encoder, history, *rest):
        seen.append([dict(m) for m in history])
        return original(policy, encoder, history, *rest)

    monkeypatch.setattr(generation, "chat_reply", spy)
    from align.cli.generation import chat_main

    chat_main(["--model", "tiny-sort", "--max_new_tokens", "8", *args], stdin=io.StringIO(text))
    return capsys.readouterr().out.splitlines(), seen


def test_chat_keeps_history_resets_and_exits(monkeypatch, capsys):
    out, seen = chat(monkeypatch, capsys, "sort: d a c b\nsort: b a\n/reset\n\nsort: c b a\n/exit\nsort: x y\n")
    assert len(seen) == 3 and len(out) == 4 and out[2] == "(history cleared)"
    assert out[0] == "a b c d"
    assert [m["role"] for m in seen[1]] == ["user", "assistant", "user"] and seen[1][1]["content"] == out[0]
    assert seen[2] == [{"role": "user", "content": "sort: c b a"}]  # after /reset; nothing read after /exit


def test_chat_ends_at_end_of_input_and_keeps_a_system_prompt(monkeypatch, capsys):
    out, seen = chat(monkeypatch, capsys, "sort: b a\n/reset\nsort: c a", "--system_prompt", "Sort letters.")
    assert len(seen) == 2 and len(out) == 3
    assert seen[1] == [{"role": "system", "content": "Sort letters."}, {"role": "user", "content": "sort: c a"}]


# ---------------------------------------------------------------------------- errors
def test_one_line_errors(capsys, tmp_path, prompts):
    out = str(tmp_path / "o.jsonl")
    assert (
        fails(capsys, "generate", "--ckpt_path", str(tmp_path / "missing.ckpt"), "--prompts", prompts, "--output", out)
        == f"error: --model: checkpoint '{tmp_path / 'missing.ckpt'}' does not exist"
    )
    bad = write_rows(tmp_path / "bad.jsonl", [{"prompt": "sort: b a"}, {"question": "sort: c a"}])
    assert fails(capsys, "generate", "--model", "tiny-sort", "--prompts", bad, "--output", out) == (
        f"error: {bad}: row 2: field 'prompt': expected a row with a 'prompt' field (a string or a list of "
        "messages), got \"fields ['question']\""
    )
    assert (
        fails(capsys, "evaluate", "--model", "tiny-sort", "--prompts", prompts, "--rewards", "align.rewards.no_such")
        == "error: reward 'align.rewards.no_such': module 'align.rewards' has no "
        "attribute 'no_such'"
    )
    assert "pass@4 needs at least 4 samples per prompt, but --n is 2" in fails(
        capsys,
        "evaluate",
        "--model",
        "tiny-sort",
        "--prompts",
        prompts,
        "--rewards",
        "align.rewards.sort_format",
        "--n",
        "2",
        "--k",
        "4",
    )
    assert "--temperature: expected >= 0 (0: greedy), got -1.0" in fails(
        capsys, "generate", "--model", "tiny-sort", "--prompts", prompts, "--output", out, "--temperature", "-1"
    )
    assert "only an align checkpoint records the model its run started from" in fails(
        capsys,
        "evaluate",
        "--model",
        "tiny-sort",
        "--prompts",
        prompts,
        "--rewards",
        "align.rewards.sort_format",
        "--baseline",
        "reference",
    )
    assert fails(
        capsys,
        "evaluate",
        "--model",
        "tiny-sort",
        "--prompts",
        prompts,
        "--rewards",
        "align.rewards.sort_format",
        "--reward_model",
        "tiny-sort-rm",
    ) == ("error: --reward_model judges the win rate against a --baseline; give --baseline too")
    done = write_rows(tmp_path / "done.jsonl", [{"prompt": "sort: b a", "completion": "a b"}])
    assert "field 'completion': expected no column with the name of the output's completion field" in fails(
        capsys, "generate", "--model", "tiny-sort", "--prompts", done, "--output", out
    )
    assert not (tmp_path / "o.jsonl").exists()


def test_the_report_says_when_no_completion_could_reach_the_accuracy_threshold():
    from align.cli.generation import _report_table
    from align.rollout.engine import SamplingConfig
    from align.rollout.evaluation import EvalReport

    report = EvalReport(
        model="m",
        prompts="p.jsonl",
        num_prompts=2,
        samples_per_prompt=1,
        sampling={},
        reward_mean=0.4,
        rewards={"half": 0.4},
        accuracy=0.0,
        accuracy_reward="half",
        accuracy_threshold=1.0,
        response_length=3.0,
        truncated_frac=0.0,
        accuracy_reward_highest=0.5,
    )
    table = _report_table(report, None, SamplingConfig())
    assert (
        "accuracy         0.0000 (no completion reached half >= 1, highest 0.5000: read reward/half, its mean; "
        "--accuracy_threshold sets the bar)"
    ) in table
    report.accuracy_reward_highest = 1.0
    assert "accuracy         0.0000 (half >= 1)" in _report_table(report, None, SamplingConfig())
