import csv

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from align.advantages import gae
from align.data.chat import ChatEncoder
from align.data.prompts import PromptBatch, PromptDataModule
from align.kl import AdaptiveKLController
from align.logprobs import masked_mean, response_mask, truncated
from align.models.policy import PolicyModel
from align.modules.ppo import PPOBatch, PPOModule
from align.rewards import RewardSpec
from align.rollout import Rollout, SamplingConfig

PROMPTS = ["sort: d a c b", "sort: b a", "sort: c c a", "sort: j e f g"]


def length_reward(prompts, completions, **kw):
    return [float(len(c) % 3) for c in completions]


def row_reward(prompts, completions, **kw):
    """Scores 3, 5, 7, ... by row: each row's terminal reward is recognisable."""
    return [3.0 + 2 * i for i in range(len(completions))]


def make_module(policy=None, **kw):
    defaults = {"policy": policy or PolicyModel("tiny", seed=2, value_head="shared"), "rewards": [length_reward],
                "sampling": SamplingConfig(max_new_tokens=6), "samples_per_prompt": 2, "max_grad_norm": None,
                "log_entropy": False, "ppo_epochs": 1}
    return PPOModule(**{**defaults, **kw})


class CaptureOptimizer:
    """Stands in for Lightning's optimizer: applies plain SGD steps and counts them."""

    def __init__(self, module, lr=0.0):
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.lr, self.steps, self.grads = lr, 0, []

    def step(self):
        self.steps += 1
        self.grads.append([None if p.grad is None else p.grad.clone() for p in self.params])
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p -= self.lr * p.grad

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def detach_from_trainer(module, lr=0.0):
    opt = CaptureOptimizer(module, lr)
    module.optimizers = lambda: opt
    module.lr_schedulers = lambda: None
    module.manual_backward = lambda loss: loss.backward()
    module.logged = []
    module.log_metrics = module.logged.append
    return opt


def prompt_batch(policy, prompts=PROMPTS):
    enc = ChatEncoder(policy.tokenizer)
    ids = [enc.prompt_ids([{"role": "user", "content": p}]) for p in prompts]
    return PromptBatch(ids, list(prompts), {})


def hand_rollout(policy, responses, max_new_tokens):
    """A rollout of the given response ids (already padded) for the first len(responses) prompts."""
    tok = policy.tokenizer
    enc = ChatEncoder(tok)
    prompts = [enc.prompt_ids([{"role": "user", "content": p}]) for p in PROMPTS[: len(responses)]]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    response_ids = torch.tensor(responses)
    mask = response_mask(response_ids, tok.eos_token_id)
    is_truncated = truncated(response_ids, tok.eos_token_id) & (response_ids.shape[1] >= max_new_tokens)
    logprobs = policy.score(torch.cat([prompt_ids, response_ids], 1), torch.cat([prompt_mask, mask.long()], 1),
                            response_length=response_ids.shape[1]).logprobs.detach()
    logprobs = torch.where(mask, logprobs, torch.zeros_like(logprobs))
    texts = tok.batch_decode(torch.where(mask, response_ids, tok.pad_token_id).tolist(), skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, response_ids, mask, logprobs, is_truncated, texts,
                   torch.arange(len(responses)), 1, 0.0, {})


def test_terminal_reward_on_eos_when_pad_equals_eos_and_on_last_token_when_truncated():
    policy = PolicyModel("tiny", seed=2, value_head="shared", pad_equals_eos=True)
    eos = policy.tokenizer.eos_token_id
    assert policy.tokenizer.pad_token_id == eos
    # Row 0 stops at its EOS (index 2), then padding that is also EOS; row 1 never stops (truncated at 5).
    responses = [[40, 41, eos, eos, eos], [40, 41, 42, 43, 44]]
    module = make_module(policy, rewards=[row_reward], kl_coef=0.0, samples_per_prompt=1,
                         sampling=SamplingConfig(max_new_tokens=5))
    module.rollout = lambda batch, group_size=1, engine=None: hand_rollout(policy, responses, 5)
    data = module.make_batch(prompt_batch(policy, PROMPTS[:2]))
    assert data.response_mask.tolist() == [[True, True, True, False, False], [True] * 5]
    expected = torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5.0]])
    torch.testing.assert_close(data.rewards, expected)
    assert data.scores.tolist() == [3.0, 5.0]
    assert data.metrics["rollout/truncated_frac"] == 0.5


def test_make_batch_shapes_returns_and_whitened_advantages():
    module = make_module(kl_coef=0.1)
    module.setup("fit")
    torch.manual_seed(0)
    with torch.no_grad():
        module.policy.value_head.proj.bias.fill_(0.5)
    data = module.make_batch(prompt_batch(module.policy))
    assert isinstance(data, PPOBatch)
    n, r = len(data), data.response_length
    assert n == 8 and data.input_ids.shape[1] == data.attention_mask.shape[1] > r
    for name in ("old_logprobs", "advantages", "ref_logprobs", "values", "returns", "rewards", "kl"):
        assert getattr(data, name).shape == (n, r), name
        assert (getattr(data, name)[~data.response_mask] == 0).all(), name
    # returns are the unwhitened GAE advantages plus the values; only the advantages are whitened
    raw, returns = gae(data.rewards, data.values, data.response_mask, module.gamma, module.lam)
    torch.testing.assert_close(data.returns, returns)
    torch.testing.assert_close(data.returns - data.values, torch.where(data.response_mask, raw, 0.0))
    assert abs(float(masked_mean(data.advantages, data.response_mask))) < 1e-5
    # KL shaping: per-token -kl_coef * kl on response tokens, k1 by default
    kl = torch.where(data.response_mask, data.old_logprobs - data.ref_logprobs, 0.0)
    torch.testing.assert_close(data.kl, kl)
    sub = data.select(torch.tensor([1, 3]))
    assert isinstance(sub, PPOBatch) and len(sub) == 2 and sub.values.shape == sub.response_mask.shape


def test_explained_variance_rises_during_critic_warmup_on_a_fixed_rollout():
    policy = PolicyModel("tiny", seed=2, value_head="separate")
    module = make_module(policy, rewards=[row_reward], kl_coef=0.0, critic_warmup_steps=25, ppo_epochs=2, value_clip=None,
                         samples_per_prompt=1)
    torch.manual_seed(0)
    fixed = module.rollout(prompt_batch(policy), 1)
    module.rollout = lambda batch, group_size=1, engine=None: fixed
    detach_from_trainer(module)
    adam = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=3e-3)
    module.optimizers = lambda: adam
    lm_before = [p.detach().clone() for p in policy.model.parameters()]
    batch = prompt_batch(policy)
    for step in range(25):
        module.training_step(batch, step)
    ev = [m["train/explained_variance"] for m in module.logged]
    assert all(m["train/critic_warmup"] == 1.0 for m in module.logged)
    assert "train/policy_loss" not in module.logged[-1] and "train/value_loss" in module.logged[-1]
    assert ev[0] < 0.1 and ev[-1] > 0.5 and ev[-1] > ev[0] + 0.4, ev
    assert all(torch.equal(a, b) for a, b in zip(lm_before, policy.model.parameters()))  # the policy stays put
    assert module.rollouts_done == 25 and not module.warming_up  # the next rollout trains the policy


def test_critic_warmup_with_a_shared_head_trains_the_head_alone():
    module = make_module(critic_warmup_steps=1, kl_coef=0.0)
    detach_from_trainer(module)
    adam = torch.optim.Adam([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    module.optimizers = lambda: adam
    backbone = [p.detach().clone() for p in module.policy.model.parameters()]
    head = [p.detach().clone() for p in module.policy.value_head.parameters()]
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    assert all(torch.equal(a, b) for a, b in zip(backbone, module.policy.model.parameters()))
    assert any(not torch.equal(a, b) for a, b in zip(head, module.policy.value_head.parameters()))
    assert not module.warming_up


def test_joint_update_steps_and_accumulation_matches_one_micro_batch():
    module = make_module(num_minibatches=2, ppo_epochs=2, kl_coef=0.05)
    module.setup("fit")
    torch.manual_seed(0)
    data = module.make_batch(prompt_batch(module.policy))
    opt = detach_from_trainer(module)
    stats = module.update_policy(data)
    assert opt.steps == 4
    for name in ("train/loss", "train/policy_loss", "train/value_loss", "train/clipfrac", "train/approx_kl"):
        assert name in stats, name
    grads = {}
    for micro in (None, 1):
        module.micro_batch_size, module.num_minibatches, module.ppo_epochs = micro, 1, 1
        opt = detach_from_trainer(module)
        module.update_policy(data)
        grads[micro] = [g for g in opt.grads[0] if g is not None]
    assert any(g.abs().sum() > 0 for g in grads[None])
    for full, accumulated in zip(grads[None], grads[1]):
        torch.testing.assert_close(full, accumulated, atol=1e-6, rtol=1e-4)


def test_score_options_penalty_whitening_scaling_clipping():
    module = make_module(missing_eos_penalty=1.0, whiten_scores=True, score_scale=2.0, score_clip=1.5)
    rollout = type("R", (), {"truncated": torch.tensor([True, False, False, False])})()
    out = module.transform_scores(torch.tensor([1.0, 0.0, 2.0, 4.0]), rollout)
    x = torch.tensor([0.0, 0.0, 2.0, 4.0])
    expected = ((x - x.mean()) / x.std() * 2.0).clamp(-1.5, 1.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(make_module().transform_scores(torch.tensor([7.0, -9.0]), rollout), torch.tensor([7.0, -9.0]))


def test_no_value_model_is_an_error_naming_the_setting():
    with pytest.raises(Exception, match="value_head"):
        make_module(PolicyModel("tiny", seed=2))


def test_an_adaptive_kl_controller_must_start_above_zero():
    from align.errors import AlignConfigError

    with pytest.raises(AlignConfigError, match=r"^model.kl_coef: the adaptive controller .* must start > 0"):
        make_module(kl_coef=0.0, kl_target=0.5)


METRICS = ["train/loss", "train/policy_loss", "train/value_loss", "train/entropy", "train/kl", "train/kl_coef",
           "train/clipfrac", "train/approx_kl", "train/explained_variance", "train/returns_mean",
           "rollout/reward_mean", "rollout/reward_std", "rollout/response_length", "rollout/tokens_per_s",
           "rollout/reward/sort_format", "rollout/reward/length_reward", "time/generation_s", "time/scoring_s",
           "time/update_s"]


def test_trains_a_few_steps_with_lightning_logs_metrics_and_checkpoints_the_kl_controller(tmp_path):
    module = PPOModule(policy=PolicyModel("tiny", seed=2, value_head="shared"),
                       rewards=[RewardSpec("align.rewards.sort_format")],
                       eval_rewards=[length_reward],
                       samples_per_prompt=2, sampling=SamplingConfig(max_new_tokens=6), kl_coef=0.1, kl_target=0.5,
                       kl_horizon=100, num_minibatches=2, micro_batch_size=2, ppo_epochs=1, critic_warmup_steps=1)
    assert module.accuracy_reward == "length_reward"
    data = PromptDataModule(batch_size=2, val_batch_size=4)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name=""),
                        log_every_n_steps=1, limit_val_batches=1, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    before = [p.detach().clone() for p in module.policy.model.parameters()]
    trainer.validate(module, datamodule=data, verbose=False)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 6 and module.rollouts_done == 3  # 1 warm-up + 2 PPO rollouts, 2 steps each
    assert any((a != b).any() for a, b in zip(before, module.policy.model.parameters()))
    assert isinstance(module.kl_controller, AdaptiveKLController) and module.kl_controller.value != 0.1
    with open(next(tmp_path.rglob("metrics.csv"))) as f:
        rows = list(csv.DictReader(f))
    for name in METRICS + ["val/reward_mean", "val/accuracy", "val/kl", "val/reward/sort_format",
                           "val/reward/length_reward"]:
        assert any(r.get(name) for r in rows), name
    # rewards logged with weight 0 never enter the training total
    row = next(r for r in rows if r.get("rollout/reward_mean"))
    assert float(row["rollout/reward_mean"]) == pytest.approx(float(row["rollout/reward/sort_format"]))

    ckpt = tmp_path / "ppo.ckpt"
    trainer.save_checkpoint(ckpt)
    fresh = PPOModule(policy=PolicyModel("tiny", seed=2, value_head="shared"),
                      rewards=[RewardSpec("align.rewards.sort_format")], kl_coef=0.1, kl_target=0.5)
    fresh.on_load_checkpoint(torch.load(ckpt, weights_only=False))
    assert fresh.kl_controller.value == pytest.approx(module.kl_controller.value)
    assert fresh.rollouts_done == 3


def test_value_lr_scale_gives_the_value_parameters_their_own_learning_rate():
    from functools import partial

    module = make_module(PolicyModel("tiny", seed=2, value_head="separate"), value_lr_scale=10.0,
                         optimizer=partial(torch.optim.AdamW, lr=1e-3))
    optimizer = module.configure_optimizers()
    value_ids = {id(p) for p in [*module.policy.critic.parameters(), *module.policy.critic_head.parameters()]}
    seen = set()
    for group in optimizer.param_groups:
        ids = {id(p) for p in group["params"]}
        seen |= ids
        assert ids <= value_ids if group["value_params"] else not ids & value_ids
        assert group["lr"] == pytest.approx(1e-2 if group["value_params"] else 1e-3)
    assert seen == {id(p) for p in module.parameters() if p.requires_grad}


@pytest.mark.parametrize("from_rm", [True, False])
def test_critic_head_starts_from_the_shipped_reward_models_head(from_rm):
    """The default critic's backbone is ``tiny-sort-rm`` (a sequence-classification export): its head starts as the
    reward model's ``score`` (bias 0), or at zero when ``critic_head_from_reward_model`` is off."""
    from safetensors.torch import load_file

    from align.models.tiny import TINY_SORT_RM_DIR

    module = PPOModule(critic_head_from_reward_model=from_rm)
    head = module.policy.critic_head.proj
    score = load_file(str(TINY_SORT_RM_DIR / "model.safetensors"))["score.weight"]
    if from_rm:
        torch.testing.assert_close(head.weight.detach(), score)
    else:
        assert not head.weight.any()
    assert not head.bias.any()
