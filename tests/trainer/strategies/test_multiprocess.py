"""SFT, DPO and GRPO on 2 CPU processes (gloo) under DDP, FSDP2, ZeRO-2 and ZeRO-3 (PPO too under ZeRO-3, multi-turn
GRPO and online DPO under DDP and ZeRO-3); equivalence with 1 process.

One ``torchrun`` job per strategy runs every algorithm in sequence (see ``_worker.py``) and writes what each rank
saw; the tests read it. The 1-process references run here, in the test process.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from . import _programs as P
from ._launch import launch

pytestmark = pytest.mark.slow

STRATEGIES = ["ddp", "fsdp2", "zero2", "zero3"]
_jobs: dict[str, tuple] = {}


def job(strategy: str, tmp_path_factory):
    if strategy not in _jobs:
        out = tmp_path_factory.mktemp(f"job-{strategy}")
        _jobs[strategy] = (out, launch(strategy, out))
    return _jobs[strategy]


def one_process_trainer(**kwargs) -> L.Trainer:
    return L.Trainer(
        **{
            **dict(
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                max_steps=1,
            ),
            **kwargs,
        }
    )


def assert_same_params(actual: dict, expected: dict, atol: float) -> None:
    assert actual.keys() == expected.keys()
    moved = max(float((expected[n] - P.flat_params_init()[n]).abs().max()) for n in expected)
    assert moved > 10 * atol, "the step must move the parameters well beyond the tolerance"
    worst = max(float((actual[n] - expected[n]).abs().max()) for n in expected)
    assert worst < atol, worst


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_algorithm_trains_saves_and_resumes(strategy, tmp_path_factory):
    out, ranks = job(strategy, tmp_path_factory)
    algos = P.algorithms(strategy)
    for algo in algos:
        for rank in ranks:
            r = rank[algo]
            steps_with_a_loss = 1 if algo == "ppo" else 2  # PPO's first rollout trains its critic alone
            assert len(r["losses"]) == steps_with_a_loss and all(math.isfinite(v) for v in r["losses"]), (algo, r)
            assert r["checkpoint"] and (out / f"{algo}.ckpt").exists()
            assert r["global_step"] == 3 and len(r["resumed_losses"]) == 1, (algo, r)
            assert math.isfinite(r["resumed_losses"][0])
            if algo not in P.RL:
                assert r["val_loss_restored"] == pytest.approx(r["val_loss_saved"], rel=1e-6), (algo, r)
        # Logged values are reduced over ranks: every rank logs the same loss.
        assert ranks[0][algo]["losses"] == pytest.approx(ranks[1][algo]["losses"], rel=1e-5), algo
    # Held-out reward after resuming, reduced over both ranks' prompts.
    for algo in set(algos) & set(P.RL):
        for key in ("val_reward_mean_before", "val_reward_mean"):
            assert ranks[0][algo][key] == ranks[1][algo][key], algo


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_sft_step_on_two_ranks_equals_one_process_with_the_whole_batch(strategy, tmp_path_factory):
    """2 ranks x batch 2 (DDP), or 2 ranks x 2 micro-batches of 1 (ZeRO-2, DeepSpeed's own accumulation), give
    the parameters and the logged loss of 1 process x batch 4."""
    out, ranks = job(strategy, tmp_path_factory)
    record = []

    class Loss(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            record.append(float(trainer.callback_metrics["train/loss"]))

    rows = P.first_distributed_rows(out / "first_rows.jsonl")
    module = P.sft_equivalence_run(one_process_trainer(callbacks=[Loss()]), batch_size=4, train_files=rows)
    assert_same_params(torch.load(out / "sft_equivalence.pt"), P.flat_params(module), atol=1e-5)
    assert ranks[0]["sft_equivalence_loss"] == pytest.approx(record[-1], rel=1e-5)


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_grpo_loss_normaliser_is_global(strategy, tmp_path_factory):
    """Rows with 1-7 response tokens split between ranks: the token-mean normaliser covers both ranks, so the
    step equals 1 process on all rows (under ZeRO-2 with one micro-batch per row)."""
    out, _ = job(strategy, tmp_path_factory)
    module = P.grpo_equivalence_run(one_process_trainer())
    assert_same_params(torch.load(out / "grpo_equivalence.pt"), P.flat_params(module), atol=1e-5)


def test_kl_controller_gets_the_same_all_reduced_value_on_every_rank(tmp_path_factory):
    _, ranks = job("ddp", tmp_path_factory)
    """Each rank's tokens have a different KL; the controllers (a plain AdaptiveKLController fed the mean of
    ``align.core.stats.mean_var`` over the ranks, and PPO's own ``update_kl_controller``) end equal on both ranks
    and equal to one process seeing every row."""
    (kl0, coef0, ppo0), (kl1, coef1, ppo1) = ranks[0]["kl_seen"], ranks[1]["kl_seen"]
    assert kl0 == kl1 == pytest.approx(P.pooled_kl(), rel=1e-6)
    assert coef0 == coef1 and ppo0 == ppo1
    assert coef0 != 0.1 and ppo0 != 0.1  # the controllers moved
    one = P.grpo_equivalence_run(one_process_trainer())
    assert one.kl_seen == pytest.approx([kl0, coef0, ppo0], rel=1e-6)


def test_advantage_whitening_uses_every_ranks_tokens(tmp_path_factory):
    """``align.core.stats.whiten`` on 2 ranks (with the strategy's all-reduce) equals ``masked_whiten`` over all rows
    on one process."""
    _, ranks = job("ddp", tmp_path_factory)
    expected = P.pooled_whitened()
    for rank, r in enumerate(ranks):
        got = torch.tensor(r["whitened"])
        torch.testing.assert_close(got, expected[rank::2][:, : got.shape[1]], atol=1e-5, rtol=1e-5)


def test_grpo_batch_std_scale_uses_every_ranks_rewards(tmp_path_factory):
    """``advantages.std_scale: batch`` on 2 ranks equals one process's advantages over all the rewards."""
    from align.core.advantages import group_advantages

    _, ranks = job("ddp", tmp_path_factory)
    expected = group_advantages(P.BATCH_REWARDS, 2, "batch").view(2, -1)
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(r["batch_scaled"]), expected[rank])
