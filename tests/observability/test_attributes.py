"""Metric names, redaction, attribute values and batch attributes (align.observability.attributes): pure functions,
no exporter involved."""

from types import SimpleNamespace

import pytest
import torch

from align.observability.attributes import (
    MAX_VALUE_CHARS,
    REDACTED,
    algorithm_of,
    attribute_value,
    batch_attributes,
    flatten,
    hparam_attributes,
    is_secret_key,
    matches_any,
    metric_name,
    model_name_of,
)


@pytest.mark.parametrize(
    "name, expected",
    [
        ("train/kl", "align.train.kl"),
        ("rollout/reward_mean", "align.rollout.reward_mean"),
        ("val/reward_mean", "align.val.reward_mean"),
        ("epoch", "align.epoch"),
        ("train/loss step", "align.train.loss_step"),
        ("dpo/rewards_chosen", "align.dpo.rewards_chosen"),
    ],
)
def test_metric_names_follow_the_documented_scheme(name, expected):
    assert metric_name(name) == expected


def test_metric_name_without_prefix_still_starts_with_a_letter():
    assert metric_name("train/kl", prefix="") == "train.kl"
    assert metric_name("0/x", prefix="") == "m_0.x"


@pytest.mark.parametrize(
    "key",
    [
        "hf_token",
        "api_key",
        "wandb.api_key",
        "OPENAI_API_KEY",
        "password",
        "db.passwd",
        "Authorization",
        "client_secret",
        "apiKey",
        "headers.authorization",
        "token",
    ],
)
def test_secret_keys_are_recognised(key):
    assert is_secret_key(key)


@pytest.mark.parametrize(
    "key", ["max_new_tokens", "tokenizer", "num_tokens", "model", "lr", "monkey", "kl_coef", "keys_total", "capital"]
)
def test_ordinary_keys_are_not_secrets(key):
    assert not is_secret_key(key)


def test_hparams_are_flattened_and_redacted():
    params = {
        "model": {
            "class_path": "align.modules.GRPOModule",
            "init_args": {"beta": 0.04, "max_new_tokens": 32, "hf_token": "hf_abc", "api": {"key": "k"}},
        },
        "reward": {"auth_header": "Bearer abc.def"},
        "note": "Bearer xyz",
        "lr": 1e-3,
        "_private": 1,
        "tags": ["a", "b"],
        "obj": object(),
    }
    attrs = hparam_attributes(params)
    assert attrs["hparam.model.class_path"] == "align.modules.GRPOModule"
    assert attrs["hparam.model.init_args.beta"] == 0.04
    assert attrs["hparam.model.init_args.max_new_tokens"] == 32
    assert attrs["hparam.model.init_args.hf_token"] == REDACTED
    assert attrs["hparam.model.init_args.api.key"] == REDACTED
    assert attrs["hparam.reward.auth_header"] == REDACTED
    assert attrs["hparam.note"] == REDACTED  # a bearer credential under an innocent key
    assert attrs["hparam.tags"] == ["a", "b"]
    assert isinstance(attrs["hparam.obj"], str)
    assert not any("_private" in k for k in attrs)


def test_flatten_handles_empty_and_scalar_values():
    assert flatten({}) == {}
    assert flatten({"a": {}, "b": 1}) == {"a": {}, "b": 1}


def test_algorithm_names():
    class SFTModule: ...

    class GRPOModule: ...

    assert algorithm_of(SFTModule()) == "sft" and algorithm_of(GRPOModule()) == "grpo" and algorithm_of(None) is None


def test_attribute_values_are_otel_types():
    assert [attribute_value(v) for v in (True, 3, 0.5, "x")] == [True, 3, 0.5, "x"]
    assert attribute_value("a" * 600) == "a" * MAX_VALUE_CHARS
    assert attribute_value([1, 2]) == [1, 2] and attribute_value(("a", "b")) == ["a", "b"]
    assert attribute_value([1, "a"]) == "[1, 'a']"  # mixed kinds: one string
    assert attribute_value([]) == "[]" and attribute_value(list(range(65))) == str(list(range(65)))
    assert attribute_value(torch.tensor(0.25)) == 0.25 and attribute_value(torch.tensor([1, 2])) == "tensor([1, 2])"
    assert attribute_value({"lr": 1e-3}) == "{'lr': 0.001}" and attribute_value(None) == "None"


def test_model_names_and_patterns():
    assert model_name_of(SimpleNamespace(policy=SimpleNamespace(spec={"model": "tiny-sort"}))) == "tiny-sort"
    assert model_name_of(SimpleNamespace(policy=None)) is None and model_name_of(None) is None
    assert matches_any("rollout/reward/judge", ["train/*", "rollout/reward/*"])
    assert not matches_any("Rollout/reward", ["rollout/*"])  # case matters
    assert not matches_any("train/loss", [])


def test_batch_attributes_count_without_a_device_sync():
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert batch_attributes({"input_ids": ids, "attention_mask": mask}) == {
        "align.batch.size": 2,
        "align.batch.padded_tokens": 10,
        "align.batch.tokens": 8,
    }
    assert batch_attributes({"input_ids": ids, "attention_mask": mask, "num_tokens": 7})["align.batch.tokens"] == 7
    assert batch_attributes({"input_ids": ids, "attention_mask": mask.to("meta")}) == {
        "align.batch.size": 2,
        "align.batch.padded_tokens": 10,
    }  # a mask off the CPU is not summed
    prompts = SimpleNamespace(prompt_ids=[[1, 2, 3], [4]])
    assert batch_attributes(prompts) == {"align.batch.size": 2, "align.batch.prompt_tokens": 4}
    assert batch_attributes([torch.zeros(3, 4)]) == {"align.batch.size": 3}  # a tensor tuple: its first dimension
    assert batch_attributes(["a", "b", "c", "d"]) == {"align.batch.size": 4}
