"""Helpers shared by the module tests (importable because pytest puts this folder on sys.path)."""

import json

import lightning as L


def cpu_trainer(**kwargs) -> L.Trainer:
    """A quiet single-process CPU trainer: no logger, checkpoints, progress bar or sanity check."""
    defaults = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, num_sanity_val_steps=0)
    return L.Trainer(**{**defaults, **kwargs})


def write_varied_pairs(path) -> str:
    """Preference pairs of very different lengths, so a mean of per-micro-batch means would differ from the
    per-pair mean; each row has a ``margin`` column."""
    letters = "abcdefghij"
    rows = []
    for i in range(8):
        n = 1 + (i * 5) % 7
        prompt = [letters[(i + k) % 10] for k in range(n)]
        rows.append({"prompt": "sort: " + " ".join(prompt), "chosen": " ".join(sorted(prompt)),
                     "rejected": " ".join(prompt[::-1] + prompt[: 1 + i % 3]), "margin": 0.25 * i})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
