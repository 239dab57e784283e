"""The device both frameworks of a benchmark train on: ``--device cpu`` (the default) or ``cuda``, and
``--precision`` (``32-true`` on a CPU, ``bf16-mixed`` on CUDA by default), the same on both sides: Lightning's
accelerator and precision for align, ``use_cpu`` and ``bf16`` for TRL. On CUDA the step clocks wait for the
device's queued work, and each trial reports its peak of allocated CUDA memory and the GPU's name. Re-exported by
``_harness``."""

from __future__ import annotations

from collections.abc import Callable


def add_device_args(parser) -> None:
    """``--device`` and ``--precision``, the same for both frameworks (see :func:`device_spec`)."""
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where both frameworks train (cuda: the first GPU)"
    )
    parser.add_argument(
        "--precision",
        choices=("32-true", "bf16-mixed"),
        default=None,
        help="both sides: fp32, or fp32 weights under bf16 autocast (default: 32-true on cpu, bf16-mixed on cuda)",
    )


def device_spec(ns) -> dict:
    """The trial spec's ``device`` and ``precision`` from the flags of :func:`add_device_args`."""
    return {"device": ns.device, "precision": ns.precision or ("bf16-mixed" if ns.device == "cuda" else "32-true")}


def lightning_device(spec: dict) -> dict:
    """Lightning ``Trainer`` arguments for the spec's device and precision."""
    return {
        "accelerator": "gpu" if spec.get("device") == "cuda" else "cpu",
        "devices": 1,
        "precision": spec.get("precision", "32-true"),
    }


def trl_device(spec: dict) -> dict:
    """TRL config arguments for the spec's device and precision."""
    return {"use_cpu": spec.get("device", "cpu") == "cpu", "bf16": spec.get("precision") == "bf16-mixed", "fp16": False}


def device_sync(spec: dict) -> Callable[[], None] | None:
    """What waits for the device's queued work before a clock is read (CUDA), or None."""
    if spec.get("device") != "cuda":
        return None
    import torch

    return torch.cuda.synchronize


def device_memory(spec: dict) -> dict:
    """On CUDA: the trial's peak of allocated CUDA memory (``cuda_peak_mb``) and the GPU's name; else nothing."""
    if spec.get("device") != "cuda":
        return {}
    import torch

    return {"cuda_peak_mb": torch.cuda.max_memory_allocated() / 2**20, "gpu": torch.cuda.get_device_name()}
