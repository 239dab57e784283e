"""Helpers shared by the module tests (importable as ``_helpers``: this folder's conftest.py puts it on sys.path)."""

import json

import lightning as L


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
