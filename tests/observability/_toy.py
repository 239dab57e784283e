"""A stand-in RL module and a quiet trainer for the observability tests (and for the DDP test's script, which
imports this file with its folder on sys.path)."""

import lightning as L
import torch

from align.observability import Timer


class ToyRLModule(L.LightningModule):
    """A stand-in for an RL module: a GRPO/PPO step's timed sections and metrics, on a linear model."""

    def __init__(self, fail_at_step: int | None = None, hf_token: str = "hf_0123456789abcdefghij", beta: float = 0.04):
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at_step = fail_at_step
        self.timings: dict[str, float] = {}

    def training_step(self, batch, batch_idx):
        self.timings = {}
        x = batch[0]
        with Timer(self.timings, "time/generation_s"):
            if self.fail_at_step is not None and self.global_step == self.fail_at_step:
                raise RuntimeError("reward function exploded")
        with Timer(self.timings, "time/scoring_s"):
            rewards = torch.arange(x.shape[0], dtype=torch.float32) / 2  # 0, 0.5, 1.0, ...
        with Timer(self.timings, "time/update_s"):
            loss = self.layer(x).pow(2).mean()
        self.log("train/loss", loss, on_step=True)
        self.log("train/kl", 0.25, on_step=True)
        self.log("rollout/reward_mean", rewards.mean(), on_step=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(24, 4))
        return torch.utils.data.DataLoader(data, batch_size=4)


def toy_trainer(tmp_path, **kwargs):
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
        default_root_dir=str(tmp_path),
        enable_checkpointing=False,
    )
    return L.Trainer(**{**defaults, **kwargs})
