"""scripts/gpu_check.py: its verdicts (recipe thresholds, the gpu tests' report), its MFU arithmetic by hand, its time
boxes, and one cheap run of its CPU-safe part (``--device cpu --quick``, the SFT recipe only)."""

import json
import sys
import time

import pytest


@pytest.fixture(scope="module")
def check(load_script):
    return load_script("gpu_check")


def test_a_recipe_is_held_to_its_threshold(check):
    out = "held-out pass after training ...\nheld-out val/reward_mean: 0.2400 -> 0.5600\n"
    verdict = check.judge_recipe("grpo", out, 0, quick=False)
    assert verdict["status"] == "ok" and (verdict["before"], verdict["after"]) == (0.24, 0.56)
    low = check.judge_recipe("grpo", out.replace("0.5600", "0.4000"), 0, quick=False)
    assert low["status"] == "failed" and "0.24 -> 0.4: not after - before >= 0.2" in low["why"]
    assert check.judge_recipe("grpo", out, 1, quick=False)["why"] == "exit 1"
    assert check.judge_recipe("sft", out, 0, quick=False)["why"] == "no 'held-out val/loss' line"
    sft = "held-out val/loss: 6.2946 -> 5.7270\n"  # 2 steps: learning, but not 1 nat lower (quick) nor <= 0.5
    assert check.judge_recipe("sft", sft, 0, quick=True)["status"] == "failed"
    assert check.judge_recipe("sft", "held-out val/loss: 6.2946 -> 2.1\n", 0, quick=True)["status"] == "ok"
    dpo = "held-out val/dpo_accuracy: 0.5000 -> 0.8600\n"
    assert check.judge_recipe("dpo", dpo, 0, quick=False)["status"] == "ok"
    assert check.judge_recipe("dpo", dpo.replace("0.5000", "0.3000"), 0, quick=False)["status"] == "failed"


def test_the_gpu_tests_pass_only_when_they_ran_and_none_failed_or_skipped(check, tmp_path):
    junit = tmp_path / "r.xml"
    case = '<testcase classname="tests.gpu.test_x" name="{}">{}</testcase>'
    junit.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="0">'
        + case.format("test_a", "")
        + case.format("test_b", '<failure message="no"/>')
        + case.format("test_c", "")
        + "</testsuite></testsuites>"
    )
    verdict = check.judge_tests(junit, 1)
    assert verdict["status"] == "failed" and verdict["failed"] == ["tests.gpu.test_x::test_b"]
    junit.write_text('<testsuites><testsuite tests="2" failures="0" errors="0" skipped="2"></testsuite></testsuites>')
    assert check.judge_tests(junit, 0)["status"] == "failed"  # skipped: the device was not there
    junit.write_text('<testsuites><testsuite tests="2" failures="0" errors="0" skipped="0"></testsuite></testsuites>')
    assert check.judge_tests(junit, 0)["status"] == "ok"
    assert check.judge_tests(tmp_path / "missing.xml", 4)["why"] == "pytest exit 4, no report"


# hidden 2, 1 layer, 1 head of 2, 1 KV head, intermediate 3, vocabulary 10: block linears 2*2*2 (q, o) + 2*2*2 (k, v)
# + 3*2*3 (MLP) = 34 weights; LM head 20; attention 12 * 1 * 2 = 24 FLOPs per key attended.
CONFIG = dict(
    hidden_size=2, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, intermediate_size=3, vocab_size=10
)
PEAK = 1_382_400.0


def test_mfu_of_each_benchmark_by_hand(check):
    # GRPO: 2 prompts x 2 = 4 rows, 200 update tokens of which 100 completions: loss fraction 0.5, mean context
    # 200 / (2 * 4) = 25, so 6 * 34 + 6 * 20 * 0.5 + 24 * 25 = 864 FLOPs per token; the update takes 2 s * 0.25.
    # 864 * 200 / 0.5 = 345,600 FLOP/s = 25% of the peak.
    grpo = {
        "settings": {"prompts": 2, "group": 2},
        "ratios": {"throughput_align_over_trl": 2.0},
        "medians": {
            kind: {
                "tokens_per_s": 50.0 * speed,
                "step_s": 2.0 / speed,
                "generation_share": 0.75,
                "update_share": 0.25,
                "completion_tokens_per_step": 100,
                "update_tokens_per_step": 200,
                "peak_rss_mb": 700.0,
                "cuda_peak_mb": 300.0,
            }
            for kind, speed in (("align", 2), ("trl", 1))
        },
    }
    align, trl = check.benchmark_rows("grpo", grpo, CONFIG, PEAK)
    assert align["mfu"] == pytest.approx(0.5) and trl["mfu"] == pytest.approx(0.25)
    assert (align["align_over_trl"], trl["align_over_trl"], align["memory_mb"]) == (2.0, None, 300.0)
    assert align["throughput"] == 100.0 and align["generation_share"] == 0.75
    # DPO: 10 pairs/s x 20 tokens = 200 tokens/s at 8 x (34 + 20) = 432 FLOPs per token: 86,400 / PEAK = 6.25%.
    dpo = {
        "summary": {
            "align": {"pairs_per_s": 10.0, "tokens_per_pair": 20.0, "step_s": 0.4, "peak_rss_mb": 500.0},
            "ratio_align_over_trl": {"pairs_per_s": 1.5},
        }
    }
    (row,) = check.benchmark_rows("dpo", dpo, CONFIG, PEAK)
    assert row["throughput"] == 200.0 and row["mfu"] == pytest.approx(0.0625) and row["align_over_trl"] == 1.5
    assert row["memory_mb"] == 500.0  # no CUDA: the peak RSS
    sft = {
        "summary": {
            "align": {"tokens_per_s": 900.0, "step_s": 0.1, "fraction_of_matmul_peak": 0.3, "peak_rss_mb": 600.0}
        }
    }
    (row,) = check.benchmark_rows("sft", sft, CONFIG, None)
    assert row["mfu"] == 0.3 and row["align_over_trl"] is None
    text = check.table({"device": "cpu", "environment": {}, "steps": [], "benchmarks": [align, trl, row]})
    assert "grpo       align        100.0 completion tok/s     1.00    75%  50.0%           300      2.00x" in text
    # Rollouts one step ahead: the same rows under their own name; an overlapped step has no update time to measure.
    ahead = {**grpo, "medians": {"align": {**grpo["medians"]["align"], "update_share": -0.5}}}
    (row,) = check.benchmark_rows("grpo-async", ahead, CONFIG, PEAK)
    assert row["benchmark"] == "grpo-async" and row["mfu"] is None


def test_a_step_past_its_box_is_stopped_and_one_past_the_deadline_never_starts(check, tmp_path):
    seen = []
    slow = check.Step("slow", [sys.executable, "-c", "import time; time.sleep(60)"], box=1.0)
    late = check.Step("late", [sys.executable, "-c", "pass"], box=10.0)
    started = time.monotonic()
    check.run_steps([slow], 1, started + 30, tmp_path, lambda step, rc, out: seen.append((step.name, rc)))
    assert seen == [("slow", None)] and time.monotonic() - started < 20
    check.run_steps([late], 1, time.monotonic() + 1, tmp_path, lambda step, rc, out: seen.append((step.name, rc, out)))
    assert seen[1] == ("late", None, "not started: out of time")


@pytest.mark.slow
def test_the_cpu_quick_run_of_the_sft_recipe(check, tmp_path, capsys):
    out = tmp_path / "check.json"
    rc = check.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--phases",
            "recipes",
            "--recipes",
            "sft",
            "--out",
            str(out),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    report = json.loads(out.read_text())
    assert [s["name"] for s in report["steps"]] == ["environment", "recipe/sft"], report
    sft = report["steps"][1]
    assert rc == 0 and sft["status"] == "ok", sft
    assert sft["metric"] == "val/loss" and sft["after"] <= sft["before"] - 1
    assert report["environment"]["torch"] and "recipe/sft" in capsys.readouterr().out
