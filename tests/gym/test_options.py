"""The classic-RL modules' option groups: the language-model modules' names where the meaning is the same, checks
that name their YAML key, and nested blocks that change only the fields they name on each module's own defaults."""

import pytest
import torch
from jsonargparse import ArgumentParser

from align.errors import AlignConfigError
from align.gym import (
    A2CGymModule,
    DQNGymModule,
    EpisodeEvaluation,
    Exploration,
    GymClipRange,
    GymGAE,
    GymUpdates,
    GymValueTraining,
    PPOGymModule,
    QLearningGymModule,
    REINFORCEGymModule,
    ReplayUpdates,
)


@pytest.mark.parametrize(
    "build, key",
    [
        (lambda: GymGAE(gamma=1.5), "gae.gamma"),
        (lambda: GymGAE(lam=-0.1), "gae.lam"),
        (lambda: GymClipRange(low=0.0), "clip.low"),
        (lambda: GymClipRange(high=-0.1), "clip.high"),
        (lambda: GymClipRange(schedule="cosine"), "clip.schedule"),
        (lambda: GymValueTraining(coef=-1.0), "value.coef"),
        (lambda: GymValueTraining(clip=0.0), "value.clip"),
        (lambda: GymUpdates(epochs=0), "updates.epochs"),
        (lambda: GymUpdates(minibatch_size=0), "updates.minibatch_size"),
        (lambda: GymUpdates(max_grad_norm=0.0), "updates.max_grad_norm"),
        (lambda: GymUpdates(target_kl=0.0), "updates.target_kl"),
        (lambda: ReplayUpdates(gradient_steps=-1), "updates.gradient_steps"),
        (lambda: ReplayUpdates(minibatch_size=0), "updates.minibatch_size"),
        (lambda: ReplayUpdates(max_grad_norm=-1.0), "updates.max_grad_norm"),
        (lambda: EpisodeEvaluation(episodes=0), "evaluation.episodes"),
        (lambda: Exploration(final=1.5), "exploration.final"),
        (lambda: A2CGymModule(updates=GymUpdates(epochs=4)), "updates.epochs"),
        (lambda: A2CGymModule(updates=GymUpdates(minibatch_size=64)), "updates.minibatch_size"),
        (lambda: A2CGymModule(value=GymValueTraining(clip=0.2)), "value.clip"),
        (lambda: REINFORCEGymModule(updates=GymUpdates(target_kl=0.01)), "updates.target_kl"),
        (lambda: REINFORCEGymModule(gae=GymGAE(lam=0.95)), "gae.lam"),
        (lambda: PPOGymModule(entropy_coef=-0.01), "entropy_coef"),
        (lambda: PPOGymModule(steps_per_iteration=0), "steps_per_iteration"),
        (lambda: DQNGymModule(steps_per_iteration=0), "steps_per_iteration"),
    ],
)
def test_a_bad_value_fails_on_one_line_naming_its_key(build, key):
    with pytest.raises(AlignConfigError) as err:
        build()
    message = str(err.value)
    assert message.startswith(f"model.{key}: expected ") and "\n" not in message, message


def parse(module_class, *args):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(module_class, "model")
    return parser.parse_args(list(args)).model


def test_a_nested_block_changes_only_the_fields_it_names_on_the_modules_own_defaults():
    a2c = parse(A2CGymModule, "--model.gae.gamma", "0.9")
    assert (a2c.gae.gamma, a2c.gae.lam, a2c.gae.whiten_advantages) == (0.9, 1.0, False)  # A2C's defaults kept
    ppo = parse(PPOGymModule, "--model.updates.max_grad_norm", "1.0", "--model.clip", '{"schedule": "linear"}')
    assert (ppo.updates.epochs, ppo.updates.minibatch_size, ppo.updates.max_grad_norm) == (10, 64, 1.0)
    assert (ppo.clip.low, ppo.clip.high, ppo.clip.schedule) == (0.2, None, "linear")
    reinforce = parse(REINFORCEGymModule, "--model.gae.gamma", "0.98")
    assert (reinforce.gae.gamma, reinforce.gae.lam) == (0.98, 1.0)
    dqn = parse(DQNGymModule, "--model.updates.gradient_steps", "4")
    assert (dqn.updates.gradient_steps, dqn.updates.minibatch_size, dqn.updates.max_grad_norm) == (4, 64, 10.0)


def test_the_on_policy_modules_take_the_shared_blocks_and_only_their_own_extras():
    shared = {
        "env",
        "total_steps",
        "steps_per_iteration",
        "gae",
        "entropy_coef",
        "value",
        "updates",
        "normalize_observations",
        "normalize_rewards",
        "network",
        "evaluation",
        "optimizer",
        "lr_schedule",
    }
    assert set(vars(parse(PPOGymModule))) == shared | {"clip"}
    assert set(vars(parse(A2CGymModule))) == shared
    assert set(vars(parse(REINFORCEGymModule))) == shared - {"steps_per_iteration"} | {"baseline"}  # one episode
    dqn, qlearning = set(vars(parse(DQNGymModule))), set(vars(parse(QLearningGymModule)))
    assert {"steps_per_iteration", "updates", "gamma", "exploration", "evaluation"} <= dqn
    assert {"steps_per_iteration", "gamma", "exploration", "evaluation"} <= qlearning


def test_an_upper_clip_range_of_null_is_the_lower_one_and_both_follow_the_schedule():
    torch.manual_seed(0)
    module = PPOGymModule(clip=GymClipRange(low=0.1, high=0.3, schedule="linear"), total_steps=1000)
    assert module.clip_ranges() == (0.1, 0.3)
    module.runner.steps = 500
    assert module.clip_ranges() == pytest.approx((0.05, 0.15))
    obs, actions = torch.randn(6, 4), torch.tensor([0, 1, 1, 0, 1, 0])
    old_logprobs = module.network.evaluate(obs, actions)[0].detach() + torch.linspace(-0.5, 0.5, 6)
    advantages, zeros = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0, 0.25]), torch.zeros(6)
    symmetric = module.loss(obs, actions, old_logprobs, advantages, zeros, zeros, 0.2, None)[0]
    explicit = module.loss(obs, actions, old_logprobs, advantages, zeros, zeros, 0.2, 0.2)[0]
    wider = module.loss(obs, actions, old_logprobs, advantages, zeros, zeros, 0.2, 0.6)[0]
    assert torch.equal(symmetric, explicit) and not torch.equal(symmetric, wider)
