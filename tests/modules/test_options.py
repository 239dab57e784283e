"""The RL modules' option groups: checks that name their YAML key, and nested blocks that change only the fields
they name, on top of each module's own defaults."""

import pytest
from jsonargparse import ArgumentParser

from align.errors import AlignConfigError
from align.modules.grpo import GRPOModule
from align.modules.options import (
    GAE,
    ClipRange,
    GroupAdvantages,
    KLPenalty,
    OverlongPenalty,
    PolicyLoss,
    ScoreShaping,
    TrustRegion,
    Updates,
    ValueTraining,
)
from align.modules.ppo import PPOModule
from align.modules.trpo import TRPOModule


@pytest.mark.parametrize(
    "build, key",
    [
        (lambda: KLPenalty(coef=-0.1), "kl.coef"),
        (lambda: KLPenalty(estimator="k4"), "kl.estimator"),
        (lambda: KLPenalty(placement="logits"), "kl.placement"),
        (lambda: KLPenalty(coef=0.1, target=0.0), "kl.target"),
        (lambda: KLPenalty(coef=0.1, horizon=0), "kl.horizon"),
        (lambda: ClipRange(low=-0.2), "clip.low"),
        (lambda: ClipRange(high=-1.0), "clip.high"),
        (lambda: Updates(epochs=0), "updates.epochs"),
        (lambda: Updates(minibatches=0), "updates.minibatches"),
        (lambda: Updates(micro_batch_size=0), "updates.micro_batch_size"),
        (lambda: Updates(max_tokens_per_microbatch=0), "updates.max_tokens_per_microbatch"),
        (lambda: Updates(max_grad_norm=0.0), "updates.max_grad_norm"),
        (lambda: Updates(loss_aggregation="sum"), "updates.loss_aggregation"),
        (lambda: GroupAdvantages(std_scale="rank"), "advantages.std_scale"),
        (lambda: GroupAdvantages(estimator="ppo"), "advantages.estimator"),
        (lambda: GroupAdvantages(estimator="rloo", std_scale="group"), "advantages.std_scale"),
        (lambda: GroupAdvantages(estimator="reinforce_pp", std_scale="batch"), "advantages.std_scale"),
        (lambda: GroupAdvantages(estimator="gae"), "advantages.estimator"),
        (lambda: PolicyLoss(name="sentence"), "policy_loss.name"),
        (lambda: GAE(gamma=1.5), "gae.gamma"),
        (lambda: GAE(lam=-0.1), "gae.lam"),
        (lambda: ScoreShaping(clip=0.0), "scores.clip"),
        (lambda: ValueTraining(coef=-1.0), "value.coef"),
        (lambda: ValueTraining(clip=0.0), "value.clip"),
        (lambda: ValueTraining(lr_scale=0.0), "value.lr_scale"),
        (lambda: ValueTraining(warmup_rollouts=-1), "value.warmup_rollouts"),
        (lambda: TrustRegion(max_kl=0.0), "trust_region.max_kl"),
        (lambda: TrustRegion(backtrack_ratio=1.0), "trust_region.backtrack_ratio"),
        (lambda: TrustRegion(cg_iters=0), "trust_region.cg_iters"),
        (lambda: TrustRegion(damping=-1.0), "trust_region.damping"),
        (lambda: TrustRegion(fisher_fraction=1.5), "trust_region.fisher_fraction"),
        (lambda: OverlongPenalty(buffer=-1), "overlong.buffer"),
        (lambda: OverlongPenalty(buffer=8, max_length=4), "overlong.buffer"),
        (lambda: OverlongPenalty(max_length=0), "overlong.max_length"),
        (lambda: OverlongPenalty(coef=-1.0), "overlong.coef"),
        (lambda: OverlongPenalty(buffer=20).resolve(16), "overlong.buffer"),
    ],
)
def test_a_bad_value_fails_on_one_line_naming_its_key(build, key):
    with pytest.raises(AlignConfigError) as err:
        build()
    message = str(err.value)
    assert message.startswith(f"model.{key}: expected ") and "\n" not in message, message


def test_ppo_refuses_a_sequence_level_policy_loss_on_one_line():
    with pytest.raises(AlignConfigError, match=r"^model\.policy_loss\.name: 'gspo' takes one advantage per sequence"):
        PPOModule(policy_loss=PolicyLoss(name="gspo"))


@pytest.mark.parametrize(
    "name, clip, bounds",
    [
        ("clip", ClipRange(), (0.2, None)),
        ("gspo", ClipRange(low=3e-4, high=4e-4), (3e-4, 4e-4)),
        ("cispo", ClipRange(), (1.0, 4.0)),
        ("cispo", ClipRange(low=0.2), (0.2, 4.0)),
        ("gmpo", ClipRange(), (0.4, None)),
    ],
)
def test_a_null_clip_takes_the_losses_own_range(name, clip, bounds):
    assert PolicyLoss(name=name).clip_bounds(clip) == bounds


def test_the_2025_losses_parse_from_the_command_line_and_sapo_refuses_a_clip_range():
    grpo = parse(GRPOModule, "--model.policy_loss.name", "sapo", "--model.policy_loss.tau_neg", "2.0")
    assert (grpo.policy_loss.name, grpo.policy_loss.tau_pos, grpo.policy_loss.tau_neg) == ("sapo", 1.0, 2.0)
    ppo = parse(PPOModule, "--model.policy_loss.name", "cispo", "--model.clip.high", "1.0")
    assert bounds(ppo) == (1.0, 1.0)
    with pytest.raises(AlignConfigError, match=r"^model\.clip: policy_loss\.name sapo has no clip range"):
        GRPOModule(policy_loss=PolicyLoss(name="sapo"), clip=ClipRange(low=0.1))
    with pytest.raises(AlignConfigError, match=r"^model\.policy_loss\.tau_pos: expected > 0"):
        PolicyLoss(name="sapo", tau_pos=0.0)


def test_an_adaptive_controller_needs_a_positive_start():
    with pytest.raises(AlignConfigError, match=r"^model\.kl\.coef: the adaptive controller \(kl\.target 0\.5\)"):
        KLPenalty(coef=0.0, target=0.5)


def test_kl_estimator_defaults_follow_the_placement():
    assert KLPenalty().kind == "k3" and KLPenalty(placement="reward").kind == "k1"
    assert KLPenalty(estimator="k2", placement="reward").kind == "k2"
    assert not KLPenalty().enabled and KLPenalty(coef=0.1).enabled
    assert Updates().on_policy and not Updates(epochs=2).on_policy and not Updates(minibatches=2).on_policy


def parse(module_class, *args):
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(module_class, "model")
    return parser.parse_args(list(args)).model


def bounds(model):
    """The clip bounds of a parsed ``model`` namespace."""
    return PolicyLoss(**vars(model.policy_loss)).clip_bounds(ClipRange(**vars(model.clip)))


def test_a_nested_block_changes_only_the_fields_it_names_on_the_modules_own_defaults():
    ppo = parse(PPOModule, "--model.kl.target", "6")
    assert (ppo.kl.coef, ppo.kl.placement, ppo.kl.target) == (0.05, "reward", 6.0)  # PPO's defaults kept
    assert ppo.updates.epochs == 4 and ppo.group_size == 1
    grpo = parse(GRPOModule, "--model.kl", '{"coef": 0.04}', "--model.clip.high", "0.28")
    assert (grpo.kl.coef, grpo.kl.placement, grpo.clip.low, grpo.clip.high) == (0.04, "loss", None, 0.28)
    assert bounds(grpo) == (0.2, 0.28)  # null low: the clip row's 0.2
    assert grpo.updates.epochs == 1 and grpo.group_size == 8
    trpo = parse(TRPOModule, "--model.trust_region.max_kl", "0.05")
    assert trpo.trust_region.max_kl == 0.05 and trpo.trust_region.cg_iters == 10 and trpo.value.clip is None


def test_every_rl_module_takes_the_shared_blocks_and_only_its_own_extras():
    shared = {
        "policy",
        "rewards",
        "reward_model",
        "eval_rewards",
        "group_size",
        "sampling",
        "source",
        "evaluation",
        "updates",
        "kl",
        "overlong",
        "log_entropy",
        "optimizer",
        "scheduler",
        "disable_dropout",
        "environment",
    }
    keys = {cls: set(vars(parse(cls))) for cls in (GRPOModule, PPOModule, TRPOModule)}
    assert keys[GRPOModule] == shared | {"clip", "policy_loss", "advantages"}
    assert keys[PPOModule] == shared | {"clip", "policy_loss", "gae", "scores", "value", "entropy_coef"}
    assert keys[TRPOModule] == shared | {"gae", "scores", "value", "trust_region"}  # no clip, no entropy bonus
    evaluation = parse(GRPOModule, "--model.evaluation.accuracy_threshold", "0.5").evaluation
    assert (evaluation.sampling, evaluation.accuracy_reward, evaluation.accuracy_threshold) == (None, None, 0.5)


def test_advantage_estimators_keep_grpo_as_the_default_and_parse_from_the_command_line():
    assert (GroupAdvantages().estimator, GroupAdvantages().scale) == ("grpo", "group")
    assert GroupAdvantages(std_scale="none").scale == "none"
    grpo = parse(GRPOModule, "--model.advantages.estimator", "rloo", "--model.policy_loss.name", "gspo")
    assert (grpo.advantages.estimator, grpo.advantages.std_scale, grpo.policy_loss.name, grpo.clip.low) == (
        "rloo",
        None,
        "gspo",
        None,
    )
