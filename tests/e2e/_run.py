"""Run a recipe in this process the way the resume tests need it: ``OMP_NUM_THREADS`` threads (1 unless set),
torch's default kernels (a run must repeat itself without ``torch.use_deterministic_algorithms``), and optionally
a SIGKILL of the process itself right after optimizer step ``--kill-at`` (before that step's checkpoint, so the
run must go back to the previous one) or in the middle of writing checkpoint file number ``--kill-in-write``.

    python tests/e2e/_run.py sft [--kill-at K] [--kill-in-write N] -- <recipe arguments>
"""

import argparse
import os
import signal
import sys

import torch

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

from lightning.pytorch.callbacks import Callback  # noqa: E402

import align.cli.lightning_cli  # noqa: E402
import align.cli.recipes  # noqa: E402
from align.trainer.checkpointing import AtomicCheckpointIO  # noqa: E402


class KillAtStep(Callback):
    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # Lightning runs checkpoint callbacks after every other callback: the checkpoint of this step is not written.
        # (Classic-RL iterations take several optimizer steps: the kill comes at the first batch that reaches it.)
        if trainer.global_step >= self.step:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def kill_in_write(n: int) -> None:
    """SIGKILL in the middle of writing the n-th checkpoint file (half of its bytes are on disk)."""
    original = AtomicCheckpointIO._write
    count = {"writes": 0}

    def write(self, checkpoint, f):
        count["writes"] += 1
        if count["writes"] < n:
            return original(self, checkpoint, f)
        import io

        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    AtomicCheckpointIO._write = write


def main() -> None:
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("algorithm")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--kill-in-write", type=int, default=None)
    ns = parser.parse_args(argv[:split])
    recipe_args = argv[split + 1 :]
    if ns.kill_in_write:
        kill_in_write(ns.kill_in_write)
    if ns.kill_at is not None:
        original = align.cli.lightning_cli.AlignCLI._instantiate_trainer

        def instantiate(self, config, callbacks):
            return original(self, config, [*callbacks, KillAtStep(ns.kill_at)])

        align.cli.lightning_cli.AlignCLI._instantiate_trainer = instantiate
    from align.data.preference import PreferenceDataModule
    from align.data.prompts import PromptDataModule
    from align.data.sft import SFTDataModule
    from align.gym import ClassicRLModule
    from align.modules.distill import DistillModule
    from align.modules.dpo import DPOModule
    from align.modules.grpo import GRPOModule
    from align.modules.sft import SFTModule

    if ns.algorithm == "gym":
        align.cli.recipes.run_recipe(
            "gym", ClassicRLModule, None, args=recipe_args, default_config="ppo-cartpole.yaml", layered=False
        )
        return
    classes = {
        "sft": (SFTModule, SFTDataModule),
        "dpo": (DPOModule, PreferenceDataModule),
        "grpo": (GRPOModule, PromptDataModule),
        "distill": (DistillModule, PromptDataModule),
    }
    align.cli.recipes.run_recipe(ns.algorithm, *classes[ns.algorithm], args=recipe_args)


if __name__ == "__main__":
    main()
