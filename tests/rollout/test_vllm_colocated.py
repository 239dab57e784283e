"""The process's colocated vLLM engines (align.rollout.vllm_colocated) on the tiny model: vLLM imported or named as
the package to install, the adapters and LoRA ranks it cannot serve refused on one line, a model its kernels refuse
failing at start, and an engine started without changing the process's environment.

The tests of this file close the process's engines at the end, as tests/rollout/test_vllm_engine.py does."""

import os
import sys

import pytest
import torch

from align.errors import AlignConfigError
from align.models import LoraSettings, PolicyModel
from align.rollout.engine import SamplingConfig, make_engine

pytest.importorskip("vllm", exc_type=ImportError)
vllm_engine = pytest.importorskip("align.rollout.vllm_engine")
from align.rollout import vllm_colocated  # noqa: E402

pytestmark = pytest.mark.slow  # vLLM: its import and an engine start take seconds per test

PROMPTS = ["c a b", "d b a c", "b a", "e d c b a"]
PRELOAD_AT_IMPORT = os.environ.get("LD_PRELOAD")  # before any engine of this file (vLLM's platform sets it)


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    vllm_engine.close_engines()


def prompt_ids(policy, texts=PROMPTS):
    from align.data.chat import ChatEncoder

    encoder = ChatEncoder(policy.tokenizer)
    return [encoder.prompt_ids([{"role": "user", "content": t}]) for t in texts]


def greedy(engine="vllm", max_new_tokens=10, **kw):
    return make_engine(SamplingConfig(engine=engine, temperature=0.0, max_new_tokens=max_new_tokens, **kw))


def test_a_quantized_base_or_dora_adapter_is_refused_on_one_line():
    policy = PolicyModel("tiny-sort", lora=LoraSettings(r=8, use_dora=True))
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.policy\.lora: expected a plain LoRA adapter with the vllm "
        r"engine \(no use_dora, modules_to_save or bias\)",
    ):
        greedy().generate(policy, prompt_ids(policy)[:1], 1)


def test_a_missing_or_broken_vllm_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(AlignConfigError, match=r"^model\.sampling\.engine: vllm is not installed; pip install"):
        vllm_colocated.import_vllm()


def test_a_lora_rank_vllm_cannot_serve_fails_naming_the_setting():
    assert vllm_colocated._lora_rank(20) == 32
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.policy\.lora\.r: expected <= 512 with the vllm engine \(the "
        r"largest rank vLLM serves\), got 600$",
    ):
        vllm_colocated._lora_rank(600)


def test_a_model_the_engines_kernels_refuse_fails_on_one_line_at_start(tmp_path):
    from align.hub.tiny import build_tiny_model

    model = build_tiny_model(
        hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
    )  # head_dim 16: no CPU attention kernel for it
    model.save_pretrained(tmp_path / "m")
    PolicyModel("tiny-sort").tokenizer.save_pretrained(tmp_path / "m")
    policy = PolicyModel(str(tmp_path / "m"))
    if torch.cuda.is_available():
        pytest.skip("the CPU kernels' limit")
    with pytest.raises(AlignConfigError, match=r"^model\.sampling\.engine: vllm cannot run this model here \(.*\); "):
        greedy().generate(policy, prompt_ids(policy)[:1], 1)


def test_starting_an_engine_leaves_the_process_environment_as_it_was():
    before = PRELOAD_AT_IMPORT
    vllm_engine.close_engines()
    policy = PolicyModel("tiny-sort")
    greedy().generate(policy, prompt_ids(policy)[:1], 1)
    assert os.environ.get("LD_PRELOAD") == before
