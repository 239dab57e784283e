"""The base of the on-policy RL modules (``align.modules.rl``), without a trainer: the sampler's checks of rewards,
overlong shaping and environment against each other, the reward ``val/accuracy`` counts, the counters and KL
controller a checkpoint carries, and the stop after training batches in a row without an update."""

import pytest
from _helpers import length_reward

from align.errors import AlignConfigError, NoLearningSignalError
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.modules.options import Evaluation, KLPenalty, OverlongPenalty
from align.modules.ppo import PPOModule
from align.modules.rl import NO_UPDATE_LIMIT
from align.rollout.engine import SamplingConfig
from align.rollout.envs.chat import EnvironmentSpec, EnvStep
from align.rollout.rewards import RewardSpec


class Rounds:
    """Two rounds; reward 1 for a reply of two or more words, on the turn it answers."""

    def reset(self, row):
        self.turn = 0
        return row["messages"]

    def step(self, message):
        self.turn += 1
        reward = float(len(message["content"].split()) >= 2)
        if self.turn == 2:
            return EnvStep([], reward, True, {"rounds": 1})
        return EnvStep([{"role": "user", "content": "sort: e b"}], reward, False, {"rounds": 1})


SPEC = EnvironmentSpec(Rounds, max_turns=2, max_tokens=40)
COMMON = dict(environment=SPEC, sampling=SamplingConfig(max_new_tokens=8), log_entropy=False)


def test_environment_and_reward_names_and_budget():
    with pytest.raises(AlignConfigError, match="the name 'env' is the env reward part's"):
        GRPOModule(
            policy=PolicyModel("tiny-sort"),
            group_size=2,
            rewards=[RewardSpec("align.rewards.sort_format", name="env")],
            **COMMON,
        )
    module = GRPOModule(policy=PolicyModel("tiny-sort"), group_size=2, **COMMON)
    assert module.accuracy_reward == "env" and module.sampler.max_response_tokens == 40
    assert GRPOModule(policy=PolicyModel("tiny-sort"), group_size=2).sampler.max_response_tokens == 32
    with pytest.raises(AlignConfigError, match="model.overlong: the overlong penalty is per completion"):
        GRPOModule(policy=PolicyModel("tiny-sort"), group_size=2, overlong=OverlongPenalty(buffer=4), **COMMON)
    with pytest.raises(AlignConfigError, match="set reward_model, rewards or environment"):
        PPOModule(
            policy=PolicyModel("tiny-sort", critic=CriticSettings()), rewards=[], reward_model=None, eval_rewards=[]
        )


def exact_format(prompts, completions, **kw):
    return [0.0] * len(completions)


def grpo(**kw):
    return GRPOModule(**{"policy": PolicyModel("tiny", seed=2), "rewards": [length_reward], "group_size": 2, **kw})


def test_accuracy_counts_the_named_reward_else_the_first_eval_reward_else_the_first_reward():
    assert grpo().accuracy_reward == "length_reward"
    assert grpo(eval_rewards=[exact_format]).accuracy_reward == "exact_format"
    named = grpo(eval_rewards=[exact_format], evaluation=Evaluation(accuracy_reward="length_reward"))
    assert named.accuracy_reward == "length_reward"
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.evaluation\.accuracy_reward: 'nope' is not one of the rewards \['length_reward'\]; name one "
        r"of them, or null for the first$",
    ):
        grpo(evaluation=Evaluation(accuracy_reward="nope"))


def test_the_overlong_part_keeps_its_name_and_a_group_needs_a_member():
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.rewards: the name 'overlong' is the overlong reward part's; rename that reward$",
    ):
        grpo(rewards=[RewardSpec("align.rewards.sort_format", name="overlong")], overlong=OverlongPenalty(buffer=4))
    with pytest.raises(AlignConfigError, match=r"^model\.group_size: expected >= 1, got 0$"):
        PPOModule(policy=PolicyModel("tiny", seed=2, critic=CriticSettings()), rewards=[length_reward], group_size=0)


def test_a_checkpoint_carries_the_counters_and_the_kl_controller():
    adaptive = KLPenalty(coef=0.1, target=0.5)
    module = grpo(kl=adaptive)
    assert module.needs_reference and not grpo().needs_reference  # the KL penalty loads the reference, 0 does not
    module.sampler.rollouts, module.learner.steps = 4, 7
    module.kl_controller.update(2.0, 8)  # KL above the target: the coefficient grows
    checkpoint = {}
    module.on_save_checkpoint(checkpoint)
    saved = checkpoint["align"]["rl"]
    assert (saved["rollouts"], saved["updates"]) == (4, 7) and saved["kl_controller"]["value"] > 0.1
    assert "rollout_source" not in checkpoint["align"]  # the inline source keeps nothing between steps
    fresh = grpo(kl=adaptive)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.rl_counters == {"rollouts": 4, "updates": 7}
    assert fresh.kl_controller.value == module.kl_controller.value


def test_a_run_stops_after_the_limit_of_batches_in_a_row_without_an_update():
    module = grpo()
    assert module.max_batches_without_update == NO_UPDATE_LIMIT
    module.max_batches_without_update = 3
    module.no_update("the rewards tied")
    module.no_update("the rewards tied")
    module._updated()  # an update starts the count again
    module.no_update("the rewards tied")
    module.no_update("the rewards tied")
    with pytest.raises(
        NoLearningSignalError,
        match=r"^the rewards tied in 3 training batches in a row, so no update was taken and trainer\.max_steps "
        r"\(which counts updates\) cannot be reached: check that the rewards can tell",
    ):
        module.no_update("the rewards tied")
