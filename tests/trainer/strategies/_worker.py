"""One rank of a 2-process CPU job (see ``_launch.py``): SFT, DPO and GRPO under one strategy (and PPO under
ZeRO-3), each trained for two steps, checkpointed, and resumed for a third; then, under ``ddp`` and ``zero2``,
the programs with known answers (``_programs.py``). Writes ``<out>/rank<r>.json``; rank 0 also writes the
parameters the tests compare.

    python -m torch.distributed.run --standalone --nproc_per_node 2 _worker.py STRATEGY OUT_DIR
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import _programs as P  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy  # noqa: E402

from align.trainer.strategies import DeepSpeedZeROStrategy, FSDP2Strategy  # noqa: E402


def make_strategy(name: str):
    if name == "ddp":
        return DDPStrategy()
    if name == "fsdp2":
        return FSDP2Strategy()
    stage = int(name[-1])
    # Threshold 0: every parameter of the tiny model is really partitioned under ZeRO-3 (by default DeepSpeed keeps
    # parameters under 1e5 elements whole on every rank, which would be all of them).
    return DeepSpeedZeROStrategy(stage=stage, param_persistence_threshold=0)


class Record(L.Callback):
    """The logged ``train/loss`` after every training batch."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        value = trainer.callback_metrics.get("train/loss")
        if value is not None:
            self.losses.append(float(value))


def trainer(name: str, out: Path, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=2,
        strategy=make_strategy(name),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=1,
        default_root_dir=str(out),
        log_every_n_steps=1,
    )  # Record reads every step's loss (AlignModule.logs_this_step)
    return L.Trainer(**{**defaults, **kwargs})


def train_save_resume(name: str, algo: str, out: Path) -> dict:
    started = time.perf_counter()
    module, data = P.SETUPS[algo]()
    first = Record()
    t = trainer(name, out, max_steps=2, callbacks=[first])
    if algo in P.RL:  # as the CLI does: validate (sampling from the sharded policy), then fit on the same trainer
        result_before = float(t.validate(module, data, verbose=False)[0]["val/reward_mean"])
    t.fit(module, data)
    ckpt = out / f"{algo}.ckpt"
    t.save_checkpoint(ckpt)
    result = {"losses": first.losses, "checkpoint": ckpt.exists()}
    if algo not in P.RL:  # the restored weights give the same held-out loss as the saved ones
        result["val_loss_saved"] = float(t.validate(module, data, verbose=False)[0]["val/loss"])
        module, data = P.SETUPS[algo]()
        t = trainer(name, out, max_steps=2)
        t.fit(module, data, ckpt_path=ckpt)  # restores, then stops: max_steps is already reached
        result["val_loss_restored"] = float(t.validate(module, data, verbose=False)[0]["val/loss"])
    module, data = P.SETUPS[algo]()
    resumed = Record()
    t = trainer(name, out, max_steps=3, callbacks=[resumed])
    t.fit(module, data, ckpt_path=ckpt)
    result.update(resumed_losses=resumed.losses, global_step=t.global_step)
    if algo in P.RL:  # held-out generation from the resumed (sharded) policy, reduced over ranks
        metrics = t.validate(module, data, verbose=False)[0]
        result["val_reward_mean"] = float(metrics["val/reward_mean"])
        result["val_reward_mean_before"] = result_before
    result["seconds"] = time.perf_counter() - started
    return result


def main() -> None:
    name, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    results: dict = {"strategy": name}
    algos = () if "--equivalence-only" in sys.argv else P.algorithms(name)
    for algo in algos:
        results[algo] = train_save_resume(name, algo, out)
    rank = int(os.environ.get("RANK", "0"))
    if name in ("ddp", "zero2"):
        # SFT: per-rank batch 2 (ddp) or 2 micro-batches of 1 (zero2, where DeepSpeed accumulates) = 4 rows.
        record = Record()
        accumulate, batch = (1, 2) if name == "ddp" else (2, 1)
        t = trainer(name, out, max_steps=1, accumulate_grad_batches=accumulate, callbacks=[record])
        module = P.sft_equivalence_run(t, batch_size=batch)
        results["sft_equivalence_loss"] = record.losses[-1]
        if rank == 0:
            torch.save(P.flat_params(module), out / "sft_equivalence.pt")
        # GRPO: the loss normaliser over fixed rows; micro-batches of one row under zero2.
        t = trainer(name, out, max_steps=1)
        module = P.grpo_equivalence_run(t, micro_batch_size=None if name == "ddp" else 1)
        results["kl_seen"] = module.kl_seen
        results["whitened"] = module.whitened
        results["batch_scaled"] = module.batch_scaled
        if rank == 0:
            torch.save(P.flat_params(module), out / "grpo_equivalence.pt")
    assert all(math.isfinite(v) for algo in algos for v in results[algo]["losses"])
    (out / f"rank{rank}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
