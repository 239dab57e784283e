"""Reading align's training checkpoints (``align.models.checkpoints``): the policy rebuilt from the spec and weights a
checkpoint holds, and the one-line errors of a checkpoint that is missing, foreign or does not match its spec."""

import re

import pytest
import torch

from align.errors import AlignConfigError
from align.models import CriticSettings, LoraSettings, PolicyModel
from align.models.checkpoints import is_reward_checkpoint, load_checkpoint, policy_from_checkpoint, policy_settings


@pytest.mark.parametrize("reward", [False, True])
def test_a_checkpoint_rebuilds_its_policy(reward, tmp_path):
    # What `align export`, `align generate` and a RewardModelScorer read: the spec and the weights of a checkpoint;
    # a reward model's score head (critic.head.*) is loaded too.
    trained = PolicyModel(critic=CriticSettings(kind="shared" if reward else "separate"), seed=1)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    meta = {
        "policy": trained.spec,
        "module": "RewardModule" if reward else "PPOModule",
        **({"reward": {}} if reward else {}),
    }
    state = {f"policy.{k}": v for k, v in trained.state_dict().items()}
    torch.save({"align": meta, "state_dict": state}, tmp_path / "run.ckpt")
    policy = policy_from_checkpoint(tmp_path / "run.ckpt", reward_head=reward)
    for name, p in policy.model.state_dict().items():
        torch.testing.assert_close(p, trained.model.state_dict()[name], rtol=0, atol=0, msg=name)
    if reward:
        torch.testing.assert_close(policy.critic.head.proj.weight, trained.critic.head.proj.weight, rtol=0, atol=0)
    else:
        assert policy.critic is None  # a separate critic is not exported


def save(path, policy, state=None, **meta):
    """A checkpoint of ``policy`` as an align module writes it: its spec under ``align`` and its weights."""
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()} if state is None else state
    torch.save({"align": {"policy": policy.spec, **meta}, "state_dict": state}, path)
    return path


def test_a_missing_or_foreign_checkpoint_fails_on_one_line_naming_it(tmp_path):
    missing = tmp_path / "nope.ckpt"
    with pytest.raises(AlignConfigError, match=rf"^ckpt_path: '{re.escape(str(missing))}' does not exist$"):
        load_checkpoint(missing)
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {}}, foreign)
    with pytest.raises(
        AlignConfigError,
        match=rf"^ckpt_path: '{re.escape(str(foreign))}' was not written by an align module \(no 'align' metadata\)$",
    ):
        policy_from_checkpoint(foreign)


def test_weights_that_do_not_match_the_spec_are_refused(tmp_path):
    policy = PolicyModel(seed=1)
    state = {f"policy.{k}": v for k, v in policy.state_dict().items()}
    extra = save(tmp_path / "extra.ckpt", policy, {**state, "policy.model.extra.weight": torch.zeros(1)})
    with pytest.raises(AlignConfigError, match=r"does not match its policy spec \(missing \[\], unexpected \[") as err:
        policy_from_checkpoint(extra)
    assert "'model.extra.weight'" in str(err.value)
    some = next(k for k in state if k.startswith("policy.model."))
    short = save(tmp_path / "short.ckpt", policy, {k: v for k, v in state.items() if k != some})
    with pytest.raises(AlignConfigError, match=rf"missing \['{re.escape(some[len('policy.') :])}'\], unexpected \[\]"):
        policy_from_checkpoint(short)


def test_a_reward_checkpoint_is_told_by_its_metadata():
    assert is_reward_checkpoint({"align": {"policy": {}, "reward": {}}})
    assert not is_reward_checkpoint({"align": {"policy": {}}})
    assert not is_reward_checkpoint({"state_dict": {}})  # not written by align at all


def test_a_saved_spec_gives_the_policys_settings_back():
    policy = PolicyModel(lora=LoraSettings(r=4, alpha=8), critic=CriticSettings(kind="separate"))
    settings = policy_settings(policy.spec)
    assert settings["lora"] == LoraSettings(r=4, alpha=8) and settings["critic"] == CriticSettings(kind="separate")
    assert policy_settings(PolicyModel().spec)["critic"] is None
    assert {k: v for k, v in settings.items() if k not in ("lora", "critic")} == {
        k: v for k, v in policy.spec.items() if k not in ("lora", "critic")
    }


def test_a_checkpoint_loads_at_the_dtype_asked_for_and_without_its_reference(tmp_path):
    trained = PolicyModel(seed=1, reference_model="tiny")
    path = save(tmp_path / "run.ckpt", trained)
    policy = policy_from_checkpoint(path, dtype="bfloat16")
    assert policy.spec["dtype"] == "bfloat16" and {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    assert policy.spec["reference_model"] is None
