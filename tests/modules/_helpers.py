"""Helpers shared by the module tests (importable as ``_helpers``: this folder's conftest.py puts it on sys.path)."""

import csv
import json
import os
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from align.data.preference import PreferenceDataModule
from align.models import PolicyModel
from align.modules.dpo import DPOModule


def cpu_trainer(**kwargs) -> L.Trainer:
    """A quiet single-process CPU trainer: no logger, checkpoints, progress bar or sanity check."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(**{**defaults, **kwargs})


def write_varied_pairs(path) -> str:
    """Preference pairs of very different lengths, so a mean of per-micro-batch means would differ from the
    per-pair mean; each row has a ``margin`` column."""
    letters = "abcdefghij"
    rows = []
    for i in range(8):
        n = 1 + (i * 5) % 7
        prompt = [letters[(i + k) % 10] for k in range(n)]
        rows.append(
            {
                "prompt": "sort: " + " ".join(prompt),
                "chosen": " ".join(sorted(prompt)),
                "rejected": " ".join(prompt[::-1] + prompt[: 1 + i % 3]),
                "margin": 0.25 * i,
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


PROMPTS = ["sort: d a c b", "sort: b a", "sort: c c a", "sort: j e f g"]


def length_reward(prompts, completions, **kw):
    return [float(len(c) % 3) for c in completions]


def prompt_batch(policy, prompts=PROMPTS):
    """A training batch of ``prompts`` as single user turns, encoded with the policy's chat template."""
    from align.data.chat import ChatEncoder
    from align.data.prompts import PromptBatch

    enc = ChatEncoder(policy.tokenizer)
    ids = [enc.prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    return PromptBatch(ids, list(prompts), {})


class CaptureOptimizer:
    """A plain SGD optimizer (``lr`` 0 by default: parameters stay put) that records the gradients of each step."""

    def __init__(self, module, lr=0.0):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.lr, self.steps, self.grads = lr, 0, []

    def step(self):
        import torch

        self.steps += 1
        self.grads.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in self.params])
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p -= self.lr * p.grad

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def standalone(module, optimizer=None, lr=0.0):
    """Run an RL module's update without a trainer (``RLModule.use_optimizer``); returns the optimizer."""
    optimizer = optimizer if optimizer is not None else CaptureOptimizer(module, lr)
    module.use_optimizer(optimizer)
    return optimizer


def nudged_trainables(module, scale: float = 0.05) -> list:
    """Add ``scale`` x Gaussian noise to every trainable parameter of ``module`` (away from its reference, and from
    LoRA's zero init, so log-ratios and gradients are not trivially zero); returns those parameters."""
    import torch

    params = [p for p in module.parameters() if p.requires_grad]
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn_like(p))
    return params


def first_eval_batch(datamodule, tokenizer):
    """The first held-out-order batch of ``datamodule``'s training set, tokenized with ``tokenizer``."""
    datamodule.set_tokenizer(tokenizer)
    datamodule.setup("fit")
    return next(iter(datamodule.eval_dataloader(datamodule.train_set)))


def fit_dpo(pairs, root, *, every_step=False, log_every=2, max_steps=5, **trainer_kwargs):
    """Fit DPO on ``pairs`` for ``max_steps`` with a CSV logger under ``root``; returns the train rows (without the
    timing column), the steps ``log_step`` was called at, and the trainer."""
    L.seed_everything(0)
    module = DPOModule(PolicyModel(), optimizer=partial(torch.optim.AdamW, lr=1e-3))
    logged_steps = []
    original = module.log_step

    def counting(metrics, prog_bar=()):
        logged_steps.append(module.trainer.global_step)
        original(metrics, prog_bar)

    module.log_step = counting
    if every_step:
        module.logs_this_step = lambda: True
    trainer = cpu_trainer(
        max_steps=max_steps,
        logger=CSVLogger(root, name="csv"),
        log_every_n_steps=log_every,
        limit_val_batches=0,
        **trainer_kwargs,
    )
    trainer.fit(module, PreferenceDataModule(train_files=pairs, val_files=None, batch_size=2, max_length=64))
    path = Path(trainer.logger.log_dir) / "metrics.csv"
    with open(path) if path.exists() else open(os.devnull) as f:  # nothing written when no step is a logging step
        rows = [{k: v for k, v in r.items() if v != "" and k != "train/pairs_per_s"} for r in csv.DictReader(f)]
    return [r for r in rows if "train/loss" in r], logged_steps, trainer
