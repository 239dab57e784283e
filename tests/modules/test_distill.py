"""On-policy distillation (align.modules.distill): the reverse-KL and GKD steps against their math, the mixed-data
draw, and the settings that fail early."""

import pytest
import torch
from _helpers import length_reward, prompt_batch, standalone

from align.core.distillation import generalized_jsd
from align.core.masks import masked_mean
from align.data.prompts import PromptBatch
from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.distill import DistillModule
from align.modules.options import KLPenalty, Updates
from align.rollout.engine import SamplingConfig


def make_module(**kw):
    # The student is the random tiny model, the teacher the SFT-warmed one: they share the tokenizer.
    defaults = dict(
        policy=PolicyModel("tiny", seed=2),
        teacher="tiny-sort",
        rewards=[length_reward],
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=6),
        log_entropy=False,
        updates=Updates(max_grad_norm=None),
    )
    module = DistillModule(**{**defaults, **kw})
    module.setup("fit")
    return module


def with_answers(module):
    batch = prompt_batch(module.policy)
    return PromptBatch(batch.prompt_ids, batch.prompts, {"answer": ["a b c d", "a b", "a c c", "e f g j"]})


def test_the_teacher_is_the_frozen_reference_and_a_reverse_kl_step_charges_each_token_its_estimate():
    module = make_module()
    assert module.policy.ref_model is not None and not any(
        p.requires_grad for p in module.policy.ref_model.parameters()
    )
    optimizer = standalone(module)
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    metrics = module.last_metrics
    assert optimizer.steps == 1 and metrics["distill/on_policy"] == 1.0
    # Replay the step's rollout: the logged reverse KL is the mean of log pi_S - log pi_T over the sampled tokens.
    torch.manual_seed(0)
    rollout = module.sampler.rollout(prompt_batch(module.policy))
    student = module.scorer.logprobs(rollout).logprobs
    teacher = module.scorer.reference_logprobs(rollout)
    expected = masked_mean(student - teacher, rollout.response_mask)
    assert metrics["distill/reverse_kl"] == pytest.approx(float(expected.detach()), rel=1e-5)
    assert metrics["distill/reverse_kl"] > 0  # a random student is far from the teacher


def test_the_reverse_kl_gradient_raises_the_tokens_the_teacher_prefers():
    # One on-policy step's gradient is that of -mean_t (log pi_T(y_t) - log pi_S(y_t)) * log pi_S(y_t), the
    # advantage detached: descending it raises the student's log-prob where the teacher's is higher.
    module = make_module()
    optimizer = standalone(module)
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    torch.manual_seed(0)
    rollout = module.sampler.rollout(prompt_batch(module.policy))
    mask = rollout.response_mask
    student = module.scorer.logprobs(rollout).logprobs
    with torch.no_grad():
        advantages = module.scorer.reference_logprobs(rollout) - student
    surrogate = -(advantages * student)[mask].sum() / mask.sum()
    expected = torch.autograd.grad(surrogate, optimizer.params)
    for got, want in zip(optimizer.grads[0], expected):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


def test_a_gkd_step_minimises_the_generalized_jsd_of_its_rows():
    module = make_module(objective="gkd", beta=0.3)
    standalone(module)  # lr 0: the logged value is the JSD of the sampled rows under the current weights
    torch.manual_seed(0)
    module.training_step(prompt_batch(module.policy), 0)
    torch.manual_seed(0)
    rollout = module.sampler.rollout(prompt_batch(module.policy))
    R = rollout.response_mask.shape[1]
    with torch.no_grad():
        student = module.policy.response_logits(rollout.input_ids, rollout.attention_mask, response_length=R)
        teacher = module.policy.response_logits(
            rollout.input_ids, rollout.attention_mask, response_length=R, reference=True
        )
    expected = masked_mean(generalized_jsd(student, teacher, 0.3), rollout.response_mask)
    assert module.last_metrics["distill/jsd"] == pytest.approx(float(expected), rel=1e-5)
    assert module.last_metrics["train/loss"] == pytest.approx(float(expected), rel=1e-5)


def test_response_logits_give_the_log_probs_the_scorer_gives():
    module = make_module()
    torch.manual_seed(0)
    rollout = module.sampler.rollout(prompt_batch(module.policy))
    R = rollout.response_mask.shape[1]
    for reference in (False, True):
        logits = module.policy.response_logits(
            rollout.input_ids, rollout.attention_mask, response_length=R, reference=reference
        )
        picked = torch.log_softmax(logits.float(), -1).gather(-1, rollout.response_ids[..., None])[..., 0]
        scored = module.scorer.reference_logprobs(rollout) if reference else module.scorer.logprobs(rollout).logprobs
        torch.testing.assert_close(picked * rollout.response_mask, scored * rollout.response_mask, atol=1e-5, rtol=1e-5)


def test_gkd_mixes_the_datas_completions_in_by_a_draw_seeded_by_the_step():
    module = make_module(objective="gkd", lmbda=0.5)
    draws = []
    for step in range(40):
        module.learner.steps = step
        draws.append(module.on_student_samples())
    again = make_module(objective="gkd", lmbda=0.5)
    for step, drawn in enumerate(draws):
        again.learner.steps = step
        assert again.on_student_samples() == drawn
    assert 8 < sum(draws) < 32  # about half
    module.learner.steps = draws.index(False)
    standalone(module)
    module.training_step(with_answers(module), 0)
    assert module.last_metrics["distill/on_policy"] == 0.0 and "rollout/reward_mean" not in module.last_metrics


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(objective="forward"), r"^model\.objective: expected reverse_kl or gkd"),
        (dict(objective="gkd", beta=1.5), r"^model\.beta: expected a value in \[0, 1\]"),
        (dict(lmbda=0.5), r"^model\.lmbda: the reverse_kl objective trains on the student's samples only"),
        (dict(kl=KLPenalty(coef=0.1)), r"^model\.kl\.coef: distillation pulls the student toward the teacher"),
        (
            dict(policy=PolicyModel("tiny", seed=2, reference_model="tiny")),
            r"^model\.policy\.reference_model: the teacher is loaded as the reference",
        ),
    ],
)
def test_settings_that_cannot_work_fail_on_one_line(kw, message):
    with pytest.raises(AlignConfigError, match=message):
        DistillModule(**{**dict(policy=PolicyModel("tiny", seed=2), teacher="tiny-sort"), **kw})


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from align.hub.tiny import load_tiny_tokenizer

    config = LlamaConfig(
        vocab_size=600,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    load_tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(AlignConfigError, match=r"^model\.teacher: .* has a vocabulary of 600 tokens and the student"):
        make_module(teacher=str(tmp_path))
