"""The reward model scored at a sequence's last token (``align.models.reward``): which token the score is read at,
whatever the padding, with or without it; its head and the one-line error of a policy without one."""

import pytest
import torch

from align.errors import AlignConfigError
from align.models import CriticSettings, PolicyModel
from align.models.reward import RewardModel, init_reward_head, last_scored_index, score_head, sequence_scores


def test_scored_token_is_the_last_real_one_that_is_not_the_models_pad():
    ids = torch.tensor([[1, 5, 2, 2, 2], [0, 1, 5, 6, 2], [2, 2, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
    assert last_scored_index(ids, mask).tolist() == [2, 4, 1]  # align's rule: the mask's last token
    assert last_scored_index(ids, mask, skip_token_id=2).tolist() == [1, 3, 1]  # transformers' with pad id 2


def test_head_reads_the_last_real_token_whatever_the_padding():
    policy = PolicyModel(critic=CriticSettings()).eval()
    torch.nn.init.normal_(policy.critic.head.proj.weight)
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    with torch.no_grad():
        alone = sequence_scores(policy, ids, torch.ones_like(ids))
        right = sequence_scores(policy, torch.tensor([[1, 5, 6, 7, 2, 0, 0]]), torch.tensor([[1] * 5 + [0] * 2]))
        left = sequence_scores(policy, torch.tensor([[0, 0, 1, 5, 6, 7, 2]]), torch.tensor([[0] * 2 + [1] * 5]))
        shorter = sequence_scores(policy, ids[:, :4], torch.ones_like(ids[:, :4]))
    torch.testing.assert_close(right, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(left, alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(shorter, alone)


def test_a_policy_without_a_shared_critic_has_no_score_head():
    ids = torch.tensor([[1, 5, 2]])
    for critic in (None, CriticSettings(kind="separate")):
        with pytest.raises(
            AlignConfigError,
            match=r"^reward model: the policy needs a shared critic \(critic: \{kind: shared\}, the scalar head\)$",
        ):
            sequence_scores(PolicyModel(critic=critic), ids, torch.ones_like(ids))
    with pytest.raises(AlignConfigError, match=r"^reward checkpoint: the policy needs a shared critic"):
        score_head(PolicyModel(), what="reward checkpoint")


def test_the_initial_head_is_seeded_with_a_zero_bias():
    first, second = PolicyModel(critic=CriticSettings()), PolicyModel(critic=CriticSettings())
    first.critic.head.proj.bias.data.fill_(3.0)
    init_reward_head(first, torch.Generator().manual_seed(5))
    init_reward_head(second, torch.Generator().manual_seed(5))
    head = first.critic.head.proj
    assert torch.equal(head.weight, second.critic.head.proj.weight) and head.weight.abs().sum() > 0
    assert not head.bias.any()  # a sequence classifier's score has no bias


def test_a_reward_model_of_a_policy_scores_as_the_policy_padded_or_padding_free():
    policy = PolicyModel(critic=CriticSettings()).eval()
    init_reward_head(policy, torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 0, 1, 5, 6, 2], [1, 5, 6, 7, 8, 2], [1, 9, 2, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        padded = sequence_scores(policy, ids, mask)
        torch.testing.assert_close(RewardModel.from_policy(policy)(ids, mask), padded)
        torch.testing.assert_close(sequence_scores(policy, ids, mask, padding_free=True), padded, atol=1e-5, rtol=1e-5)
        alone = torch.cat([sequence_scores(policy, i[m.bool()][None], m[m.bool()][None]) for i, m in zip(ids, mask)])
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="a row has no real token"):
        last_scored_index(ids, torch.zeros_like(mask))
