"""``--model`` for the benchmarks (``grpo.py``, ``ppo.py``, ``dpo.py``, ``sft.py``): a real model instead of the
synthetic tiny Llama they build from their size flags.

``--model`` takes a local Hugging Face model folder, a path to a ``.gguf`` file or a packaged model id such as
``smollm2-135m-instruct``; :func:`resolve_model_dir` turns each into one local Hugging Face folder (a GGUF is
converted once into a cache folder), from which both frameworks' trial processes load the model and its tokenizer.
"""

from __future__ import annotations

from pathlib import Path

MODEL_HELP = ("a real model instead of the synthetic tiny Llama: a local Hugging Face model folder, a .gguf file or "
              "a packaged model id such as smollm2-135m-instruct; both frameworks load the model and its tokenizer "
              "from the same resolved folder (the tiny-model size flags are then ignored)")


def resolve_model_dir(name: str) -> str:
    """The local Hugging Face folder ``--model name`` names (:func:`align.hub.check_model_source`)."""
    from align.errors import AlignConfigError
    from align.hub import check_model_source

    try:
        folder = Path(check_model_source(name, what="--model"))
    except AlignConfigError as err:
        raise SystemExit(str(err)) from None
    if not (folder / "config.json").is_file():
        raise SystemExit(f"--model {name!r} resolved to {str(folder)!r}, which is not a local Hugging Face model "
                         "folder (no config.json); pass a local folder, a .gguf file or a packaged model id such as "
                         "smollm2-135m-instruct (leave --model out for the tiny model)")
    return str(folder.resolve())


def model_config_and_parameters(folder: str):
    """``(config, parameter count)`` of the causal LM in ``folder``, counted on the meta device (no weights
    loaded; tied weights counted once, as ``sum(p.numel() for p in model.parameters())`` does)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return config, sum(p.numel() for p in model.parameters())
