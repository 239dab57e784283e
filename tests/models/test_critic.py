"""The critic: its settings, its values, and its head started from a reward model's."""

import pytest
import torch

from align.errors import AlignConfigError
from align.models import CriticSettings, PolicyModel
from align.models.reward import init_reward_head
from align.models.reward_export import save_reward_model
from align.rollout.rewards import RewardModelScorer

from ._tiny_batches import batch

EOS = 2


def reward_policy(seed=0, **kwargs):
    policy = PolicyModel(critic=CriticSettings(), seed=seed, **kwargs).eval()
    init_reward_head(policy, torch.Generator().manual_seed(seed))
    return policy


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


def test_a_separate_critic_starts_from_the_reward_model(tmp_path):
    """Critic backbone and head from an export: its value of a sequence's end state is the reward model's score."""
    export = save_reward_model(reward_policy(seed=4), tmp_path / "rm")
    # The head is loaded at build.
    policy = PolicyModel(critic=CriticSettings(kind="separate", model=str(export))).eval()
    assert policy.critic.head.proj.weight.any() and policy.critic.init_head_from_reward_model()
    scorer = RewardModelScorer(str(export))
    prompt_ids, response_ids = scorer.encode("sort: b a", "a b")
    ids = torch.tensor([prompt_ids + response_ids + [EOS]])  # the value at the last token sees everything before it
    with torch.no_grad():
        value = policy.values(ids, torch.ones_like(ids), response_length=1)  # (1, 1)
    assert value.item() == pytest.approx(scorer(["sort: b a"], ["a b"])[0], abs=1e-5)
    # A plain causal LM as the critic backbone has no reward head: the critic head stays at zero.
    plain = PolicyModel(critic=CriticSettings(kind="separate"))
    assert not plain.critic.init_head_from_reward_model() and not plain.critic.head.proj.weight.any()
