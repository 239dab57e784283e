"""The critic: its settings, its values, and the policy rebuilt from a checkpoint with or without its head."""

import pytest
import torch

from align.errors import AlignConfigError
from align.models import CriticSettings, PolicyModel

from ._tiny_batches import batch


@pytest.mark.parametrize("kind", ["shared", "separate"])
def test_values_shapes_and_gradients(kind):
    policy = PolicyModel(critic=CriticSettings(kind=kind))
    ids, mask = batch(policy)
    out = policy.token_logprobs(ids, mask, response_length=3, return_values=True)
    assert out.values.shape == (2, 3)
    out.values.sum().backward()
    head = policy.critic.head
    assert head.proj.weight.grad is not None


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            lambda: CriticSettings(kind="both"),
            r"^model\.policy\.critic\.kind: expected 'shared' or 'separate', got 'both'$",
        ),
        (
            lambda: CriticSettings(model="tiny-sort-rm"),
            r"^model\.policy\.critic\.model: expected null for a shared critic \(a head on the policy's backbone\), "
            r"got "
            r"'tiny-sort-rm'; set model\.policy\.critic\.kind: separate to give the critic a backbone of its own$",
        ),
        (
            lambda: CriticSettings(kind="separate", model=3),
            r"^model\.policy\.critic\.model: expected a model path or id, got 3$",
        ),
        (
            lambda: CriticSettings(kind="separate", head_from_reward_model="yes"),
            r"^model\.policy\.critic\.head_from_reward_model: expected true or false, got 'yes'$",
        ),
        (lambda: PolicyModel(critic="shared"), r"^model\.policy\.critic: expected a block such as \{kind: shared\}"),
        (
            lambda: PolicyModel(critic={"kind": "separate", "critic_model": "x"}),
            r"^model\.policy\.critic\.critic_model: not a setting of the critic; expected kind, model or "
            r"head_from_reward_model$",
        ),
        (
            lambda: PolicyModel(critic=CriticSettings(kind="separate", model="/nonexistent/rm")),
            r"^model\.policy\.critic\.model: .*does not exist",
        ),
    ],
)
def test_critic_settings_are_checked_on_one_line_naming_the_setting(settings, message):
    with pytest.raises(AlignConfigError, match=message) as err:
        settings()
    assert "\n" not in str(err.value)


def test_a_separate_critic_has_its_own_backbone_and_its_parameters_are_the_value_parameters():
    shared = PolicyModel(critic=CriticSettings())
    separate = PolicyModel(critic=CriticSettings(kind="separate"))
    assert not shared.critic.separate and shared.critic.backbone is None
    assert separate.critic.separate and separate.critic.backbone is not None
    assert [n for n, _ in shared.critic.named_parameters()] == ["head.proj.weight", "head.proj.bias"]
    # The order of the optimizer's parameters: the language model, the critic's backbone, its head.
    parts = [".".join(n.split(".")[:2]) if n.startswith("critic.") else "model" for n, _ in separate.named_parameters()]
    assert list(dict.fromkeys(parts)) == ["model", "critic.backbone", "critic.head"]
    assert shared.spec["critic"] == {"kind": "shared", "model": None, "head_from_reward_model": True}
    assert PolicyModel().critic is None and PolicyModel().spec["critic"] is None
    ids, mask = batch(shared)
    with pytest.raises(RuntimeError, match="no critic; set policy.critic"):
        PolicyModel().values(ids, mask, response_length=2)


@pytest.mark.parametrize("reward", [False, True])
def test_a_checkpoint_rebuilds_its_policy(reward, tmp_path):
    # What `align export`, `align generate` and a RewardModelScorer read: the spec and the weights of a checkpoint;
    # a reward model's score head (critic.head.*) is loaded too.
    from align.models.checkpoints import policy_from_checkpoint

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
