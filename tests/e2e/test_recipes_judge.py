"""The GRPO recipe trained on a judge reward: align.rewards.Judge pointed, through the config, at an
OpenAI-compatible server the test starts on loopback, whose "judge" says yes to exactly sorted letters (the rule of
the tiny sort task's own reward). The judge is asked for every completion, scores them as sort_exact_match does, its
metrics reach the CSV, and the held-out reward it gives rises."""

import csv
import re

import pytest
from _loopback import Loopback, user_message

from align.cli.recipes import run_recipe
from align.data import sort_task
from align.data.prompts import PromptDataModule
from align.modules.grpo import GRPOModule

TEMPLATE = "Task: {prompt}\nAnswer: {completion}\nIs the answer the task's letters, sorted? Reply yes or no."


def sort_judge(request) -> str:
    match = re.fullmatch(r"Task: (.*)\nAnswer: (.*)\nIs the answer .*", user_message(request), re.S)
    task, answer = match.groups()
    return "Yes." if sort_task.is_correct(answer, sort_task.solve(task)) else "No."


def judge_config(tmp_path, server) -> str:
    path = tmp_path / "judge.yaml"
    path.write_text(
        "model:\n  init_args:\n    rewards:\n"
        "      - fn: align.rewards.Judge\n        name: judge\n"
        f"        init_kwargs: {{model: sort-judge, base_url: '{server.base_url}', parser: yes_no, timeout: 30,\n"
        f"                      template: {TEMPLATE!r}}}\n"
        "    eval_rewards:\n      - fn: align.rewards.sort_exact_match\n"
    )
    return str(path)


@pytest.mark.slow
@pytest.mark.timeout(900)  # about a minute on 2 cores shared with other jobs
def test_grpo_trains_on_a_judge_served_on_loopback(tmp_path, capsys):
    root = tmp_path / "run"
    with Loopback(sort_judge) as server:
        run_recipe(
            "grpo",
            GRPOModule,
            PromptDataModule,
            args=[
                "--config",
                judge_config(tmp_path, server),
                "--trainer.default_root_dir",
                str(root),
                "--trainer.max_steps",
                "40",
                "--data.init_args.batch_size",
                "16",
                "--data.init_args.val_batch_size",
                "50",
                "--trainer.limit_val_batches",
                "1",
                "--trainer.enable_checkpointing",
                "false",
                "--trainer.callbacks",
                "[]",
                "--model.init_args.scheduler.init_args.warmup_steps",
                "5",
            ],
        )
    # 40 steps of 16 prompts x 8 completions, and two held-out passes of 50: one request per completion
    assert len(server.requests) == 40 * 16 * 8 + 2 * 50
    (metrics,) = root.rglob("metrics.csv")
    rows = [r for r in csv.DictReader(open(metrics)) if r.get("rollout/reward/judge")]
    assert len(rows) == 40
    for row in rows:  # the judge's rule is the task's: its scores are sort_exact_match's, and no call failed
        assert float(row["rollout/reward/judge"]) == float(row["rollout/reward/sort_exact_match"])
        assert float(row["rollout/reward_errors/judge"]) == 0.0 and float(row["rollout/reward_na/judge"]) == 0.0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("held-out val/reward_mean:"))
    before, after = (float(x) for x in line.split(":")[1].split("->"))
    assert after - before >= 0.1, line  # measured 0.30 -> 0.46 (seed 0, one thread)
