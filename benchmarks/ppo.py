"""PPO-RLHF step throughput and memory: ``align`` against TRL's ``PPOTrainer``, same model, prompts and settings.

Usage::

    python benchmarks/ppo.py                                     # align only (TRL 1.16 has no PPO trainer)
    pip install --no-deps --target /tmp/trl-1.12 trl==1.12.0     # the last TRL release with a PPO trainer
    python benchmarks/ppo.py --trl-path /tmp/trl-1.12 --trials 3 --json ppo-bench.json
    python benchmarks/ppo.py --hidden-size 256 --layers 4 --prompts 32
    python benchmarks/ppo.py --model smollm2-135m-instruct --prompts 8 --max-new-tokens 32 --threads 2

TRL removed ``trl.experimental.ppo`` in 1.13.0; the installed TRL (1.16) has no PPO trainer at all. With
``--trl-path DIR`` the TRL child imports ``trl`` from ``DIR`` first (the rest of the environment, transformers
and accelerate included, is shared), so TRL's last PPO trainer runs side by side.

What happens:

1. A tiny random Llama (``align.hub.tiny.build_tiny_model`` with the size flags) and the shipped tokenizer are
   saved to a temporary Hugging Face directory. With ``--model`` (a local Hugging Face folder, a ``.gguf`` file or a
   packaged id such as ``smollm2-135m-instruct``) the size flags are ignored and both frameworks load that model and
   its tokenizer from the one folder it resolves to. The reward model is the same backbone with a random scalar
   head: an ``align`` reward-model export for align, ``AutoModelForSequenceClassification`` (one label; for a Llama,
   ``LlamaForSequenceClassification``) for TRL. Both load in float32; both start the critic (a separate model) from
   the reward model.
2. Prompts: the first ``--prompts`` bundled sort prompts, one user message each, with the chat template applied.
3. Trials run in fresh subprocesses, alternating ``align, trl, align, trl, ...``. Each trial runs ``--steps`` full
   PPO steps (generation, scoring: reward model, reference and values, then the update: ``--ppo-epochs`` x
   ``--minibatches`` optimizer steps); the first ``--warmup`` are excluded.
4. Reported per framework: completion tokens per second of full steps (valid completion tokens / wall time of the
   step), the shares of the step spent generating, scoring and updating, and the process's peak RSS (``ru_maxrss``;
   no GPU). Then the align/TRL ratios. TRL's split comes from wrapping its module-level ``batch_generation`` (the
   generation) and ``get_reward`` (reward model and critic); its reference and policy log-prob passes over the
   rollout fall in "update". align's split: the logged ``time/generation_s``, ``time/scoring_s`` (reward model,
   reference and values) and the rest; its completion tokens: the logged ``rollout/completion_tokens``.

Settings that are the same on both sides: model and weights, prompts, one completion per prompt, new-token limit
(``response_length``), temperature 1, no top-k/top-p, stop at EOS, k1 KL shaped into the rewards with coefficient
0.05, GAE with gamma 1 and lambda 0.95, whitened advantages, clip 0.2, value clip 0.2, vf_coef 0.1, no reward
whitening, no EOS penalty, ``--ppo-epochs`` epochs x ``--minibatches`` minibatches per rollout, one micro-batch per
minibatch, AdamW (torch's fused form, TRL's default) with a constant learning rate, gradient clipping at 1.0, fp32,
``--threads`` torch threads, no checkpoints, no evaluation. TRL keeps ``transformers.generate``; align its own
KV-cache sampler. TRL's tokenizer pads on the left (as TRL's PPO examples load it) with a pad token other than EOS
(:func:`distinct_pad_token`): TRL's PPO tells padding by the pad id alone.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness as h

KL_COEF, LR = 0.05, 1e-5
PHASES = ("generation", "scoring")


# ---------------------------------------------------------------------------------------------------------------
# children


def build_module(spec: dict):
    """The PPO module of an align trial: every setting the comparison fixes, in one place."""
    import torch

    from align.models import CriticSettings, PolicyModel
    from align.modules.options import GAE, ClipRange, KLPenalty, Updates, ValueTraining
    from align.modules.ppo import PPOModule
    from align.rollout.engine import SamplingConfig
    from align.rollout.rewards import RewardModelSpec

    return PPOModule(
        policy=PolicyModel(spec["model_dir"], critic=CriticSettings(kind="separate", model=spec["rm_dir"])),
        reward_model=RewardModelSpec(spec["rm_dir"], batch_size=spec["prompts"]),
        eval_rewards=[],
        sampling=SamplingConfig(max_new_tokens=spec["max_new_tokens"], temperature=1.0),
        kl=KLPenalty(coef=KL_COEF, estimator="k1", placement="reward"),
        gae=GAE(gamma=1.0, lam=0.95),
        clip=ClipRange(low=0.2),
        value=ValueTraining(coef=0.1, clip=0.2),
        updates=Updates(epochs=spec["ppo_epochs"], minibatches=spec["minibatches"], max_grad_norm=1.0),
        log_entropy=True,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True),
    )


def run_align(spec: dict) -> dict:
    h.set_threads(spec["threads"])
    # A rollout takes ppo_epochs x minibatches optimizer steps.
    return h.rl_align_trial(
        spec, build_module(spec), PHASES, max_steps=spec["steps"] * spec["ppo_epochs"] * spec["minibatches"]
    )


def run_trl(spec: dict) -> dict:
    if spec.get("trl_path"):
        sys.path.insert(0, spec["trl_path"])
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    try:
        import trl.experimental.ppo.ppo_trainer as ppo_module
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError as err:
        raise SystemExit(
            f"TRL {trl.__version__} ({trl.__file__}) has no PPO trainer ({err}); TRL removed "
            "trl.experimental.ppo in 1.13.0. Pass --trl-path with TRL 1.12.0 installed there."
        ) from err
    h.set_threads(spec["threads"])
    # Left padding, as TRL's PPO examples load it: TRL generates from the padded queries, and a right-padded prompt
    # would be continued after its padding.
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], padding_side="left")
    from align.data.chat import ChatEncoder  # the same prompt ids as align's prompt data

    encoder = ChatEncoder(tokenizer)
    rows = [
        {"input_ids": encoder.prompt_ids([{"role": "user", "content": p}])} for p in h.sort_prompts(spec["prompts"])
    ]
    tokenizer.pad_token = distinct_pad_token(tokenizer, rows)
    dataset = Dataset.from_list(rows * (spec["steps"] + 1))
    n = spec["prompts"]
    config = PPOConfig(
        # TRL 1.12's rollout is per_device_train_batch_size x gradient_accumulation_steps prompts, split into
        # num_mini_batches minibatches: n prompts per step, as align's, in minibatches of n / minibatches rows.
        output_dir=str(Path(spec["workdir"]) / "trl"),
        per_device_train_batch_size=n,
        gradient_accumulation_steps=1,
        num_mini_batches=spec["minibatches"],
        num_ppo_epochs=spec["ppo_epochs"],
        total_episodes=n * spec["steps"],
        local_rollout_forward_batch_size=n,
        response_length=spec["max_new_tokens"],
        temperature=1.0,
        stop_token="eos",
        missing_eos_penalty=None,
        kl_coef=KL_COEF,
        kl_estimator="k1",
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        whiten_rewards=False,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        optim="adamw_torch_fused",
        max_grad_norm=1.0,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        **h.trl_device(spec),
        seed=0,
        num_sample_generations=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,  # as align (TRL's own default is on)
    )
    policy = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(spec["trl_rm_dir"], num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(spec["trl_rm_dir"], num_labels=1, dtype=torch.float32)
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
    )
    if (config.local_batch_size, config.local_mini_batch_size) != (n, n // spec["minibatches"]):
        raise SystemExit(
            f"TRL's PPO derived a rollout of {config.local_batch_size} prompts in minibatches of "
            f"{config.local_mini_batch_size}; the comparison needs {n} in minibatches of "
            f"{n // spec['minibatches']}"
        )
    meter = h.StepMeter(spec["warmup"], sync=h.device_sync(spec))

    def timed(fn, phase):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            meter.add(**{f"{phase}_s": time.perf_counter() - start})
            if phase == "generation":  # (query_responses, logits): count valid completion tokens up to the first EOS
                responses = out[0][:, args[1].shape[1] :]
                is_eos = responses == tokenizer.eos_token_id
                valid = (torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0
                meter.add(tokens=int(valid.sum()))
            return out

        return wrapper

    ppo_module.batch_generation = timed(ppo_module.batch_generation, "generation")
    ppo_module.get_reward = timed(ppo_module.get_reward, "scoring")
    trainer.add_callback(h.trl_meter(meter))
    trainer.train()
    return h.rl_step_summary(meter, PHASES, h.device_memory(spec))


def distinct_pad_token(tokenizer, rows: list[dict]) -> str:
    """A pad token for TRL that is not EOS and occurs in no prompt. TRL's PPO finds padding by the pad id alone
    (``query_responses != pad_token_id`` as the attention mask, the first pad as a completion's end), so with
    ``pad == EOS`` (SmolLM2's tokenizer) it masks the prompt's own end-of-turn token out of every forward pass
    and ends a completion's scoring at its first EOS. align pads by attention mask and is unaffected."""
    from align.models.reward_export import (
        scoring_pad_token,  # the reward-model export's choice of a pad that is not EOS
    )

    pad = scoring_pad_token(tokenizer)
    if pad is None or tokenizer.convert_tokens_to_ids(pad) in {i for row in rows for i in row["input_ids"]}:
        raise SystemExit(
            f"TRL's PPO needs a pad token that is neither EOS nor in a prompt; this tokenizer offers {pad!r}"
        )
    return pad


CHILDREN = {"align": run_align, "trl": run_trl}

# ---------------------------------------------------------------------------------------------------------------
# parent


def _trl_has_ppo(trl_path: str | None) -> str | None:
    """None when TRL's PPO trainer imports (from ``trl_path`` when given), else the reason it does not."""
    code = (
        "import sys; p = sys.argv[1]; sys.path.insert(0, p) if p else None; import trl; "
        "print(trl.__version__); from trl.experimental.ppo import PPOTrainer"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, trl_path or ""],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        check=False,
    )
    if proc.returncode == 0:
        return None
    version = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "?"
    return (
        f"TRL {version} has no PPO trainer (trl.experimental.ppo does not import: "
        f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'unknown error'}); TRL removed it "
        "in 1.13.0. Install 1.12.0 with `pip install --no-deps --target DIR trl==1.12.0` and pass --trl-path DIR."
    )


def save_reward_models(model_dir: str, rm_dir: Path, trl_rm_dir: Path) -> None:
    """One random value head on the policy's backbone, saved as align's reward-model checkpoint and as the same
    weights in TRL's sequence-classifier form (which also serves as TRL's critic)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from align.models import CriticSettings, PolicyModel
    from align.models.reward_export import save_reward_model

    rm = PolicyModel(model_dir, critic=CriticSettings())
    torch.nn.init.normal_(rm.critic.head.proj.weight, std=0.05)
    save_reward_model(rm, rm_dir)
    trl_rm = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    with torch.no_grad():
        trl_rm.score.weight.copy_(rm.critic.head.proj.weight)
    trl_rm.config.pad_token_id = rm.tokenizer.pad_token_id
    trl_rm.save_pretrained(trl_rm_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="Prompts (= completions) per rollout.")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--ppo-epochs", type=int, default=2)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    h.add_model_args(parser, tiny_defaults=h.RL_TINY_DEFAULTS)
    parser.add_argument("--trl-path", default=None, help="A directory holding a TRL release with a PPO trainer.")
    parser.add_argument("--json", type=Path, default=None)
    h.add_child_args(parser, CHILDREN)
    ns = parser.parse_args(argv)
    if h.run_if_child(ns, CHILDREN):
        return
    if ns.prompts % ns.minibatches:
        parser.error("--prompts must be a multiple of --minibatches")

    trl_missing = _trl_has_ppo(ns.trl_path)
    if trl_missing:
        print(f"TRL not run: {trl_missing}", flush=True)
    frameworks = ("align",) if trl_missing else ("align", "trl")
    with tempfile.TemporaryDirectory() as tmp:
        rm_dir, trl_rm_dir = Path(tmp) / "rm", Path(tmp) / "trl-rm"
        model_dir, model_name, n_params = h.rl_model(ns, tmp)
        print(f"model: {model_name}, {n_params / 1e6:.2f}M parameters, from {model_dir}", flush=True)
        save_reward_models(model_dir, rm_dir, trl_rm_dir)
        spec = {
            "model_dir": model_dir,
            "rm_dir": str(rm_dir),
            "trl_rm_dir": str(trl_rm_dir),
            "workdir": tmp,
            "prompts": ns.prompts,
            "max_new_tokens": ns.max_new_tokens,
            "steps": ns.steps + ns.warmup,
            "warmup": ns.warmup,
            "threads": ns.threads,
            "ppo_epochs": ns.ppo_epochs,
            "minibatches": ns.minibatches,
            "trl_path": ns.trl_path,
        }
        results = h.Trials(__file__, spec, Path(tmp), threads=ns.threads).alternate(
            frameworks, ns.trials, lambda trial, kind, res: h.print_rl_trial(trial, kind, res, PHASES)
        )

    h.rl_report(
        ns,
        f"\nPPO full step, {model_name} ({n_params / 1e6:.2f}M parameters), {ns.prompts} prompts x 1 "
        f"completion, {ns.max_new_tokens} new tokens, {ns.ppo_epochs} epochs x {ns.minibatches} "
        f"minibatches, {ns.threads} threads, medians of {ns.trials} trials:",
        results,
        model_dir,
        n_params,
        PHASES,
        trl_not_run=trl_missing,
    )


if __name__ == "__main__":
    main()
