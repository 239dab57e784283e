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
   rollout fall in "update". align's split: ``time/generation_s``, ``time/scoring_s`` (reward model, reference
   and values) and ``time/update_s``.

Settings that are the same on both sides: model and weights, prompts, one completion per prompt, new-token limit
(``response_length``), temperature 1, no top-k/top-p, stop at EOS, k1 KL shaped into the rewards with coefficient
0.05, GAE with gamma 1 and lambda 0.95, whitened advantages, clip 0.2, value clip 0.2, vf_coef 0.1, no reward
whitening, no EOS penalty, ``--ppo-epochs`` epochs x ``--minibatches`` minibatches per rollout, one micro-batch
per minibatch, AdamW with a constant learning rate, gradient clipping at 1.0, fp32, ``--threads`` torch threads,
no checkpoints, no evaluation. TRL keeps ``transformers.generate``; align its own KV-cache sampler.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _rl_harness import add_model_args, prepare_model, run_child, sort_prompts, step_summary

KL_COEF, LR = 0.05, 1e-5


# ---------------------------------------------------------------------------------------------------------------
# children


def run_align(spec: dict) -> dict:
    import lightning as L
    import torch

    from align.data.prompts import PromptDataModule
    from align.models.policy import PolicyModel
    from align.modules.ppo import PPOModule
    from align.rollout import SamplingConfig

    torch.set_num_threads(spec["threads"])
    workdir = Path(spec["workdir"])
    data_file = workdir / "prompts.jsonl"
    data_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in sort_prompts(spec["prompts"])))
    module = PPOModule(
        policy=PolicyModel(spec["model_dir"], value_head="separate", critic_model=spec["rm_dir"]),
        reward_model=spec["rm_dir"], reward_model_batch_size=spec["prompts"], eval_rewards=[],
        sampling=SamplingConfig(max_new_tokens=spec["max_new_tokens"], temperature=1.0),
        kl_coef=KL_COEF, kl_estimator="k1", gamma=1.0, lam=0.95, clip_range=0.2, value_clip=0.2, vf_coef=0.1,
        ppo_epochs=spec["ppo_epochs"], num_minibatches=spec["minibatches"], max_grad_norm=1.0, log_entropy=True,
        optimizer=lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.0),
    )
    data = PromptDataModule(train_files=str(data_file), val_files=None, batch_size=spec["prompts"], shuffle=False)
    steps, gens, scores, tokens = [], [], [], []

    class Meter(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append(time.perf_counter() - self.t)
            gens.append(pl_module.timings["time/generation_s"])
            scores.append(pl_module.timings["time/scoring_s"])
            tokens.append(pl_module._last_tokens)

    original = module.rollout

    def counting_rollout(batch, group_size=1, engine=None):
        rollout = original(batch, group_size, engine)
        module._last_tokens = int(rollout.response_mask.sum())
        return rollout

    module.rollout = counting_rollout
    trainer = L.Trainer(max_steps=spec["steps"] * spec["ppo_epochs"] * spec["minibatches"], accelerator="cpu",
                        devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Meter()], max_epochs=-1)
    trainer.fit(module, datamodule=data)
    return step_summary(steps, tokens, spec["warmup"], generation=gens, scoring=scores)


def run_trl(spec: dict) -> dict:
    if spec.get("trl_path"):
        sys.path.insert(0, spec["trl_path"])
    import torch
    import trl
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )

    try:
        import trl.experimental.ppo.ppo_trainer as ppo_module
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError as err:
        raise SystemExit(f"TRL {trl.__version__} ({trl.__file__}) has no PPO trainer ({err}); TRL removed "
                         "trl.experimental.ppo in 1.13.0. Pass --trl-path with TRL 1.12.0 installed there.")
    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    from align.data.chat import (
        ChatEncoder,  # the same prompt ids as align's prompt data
    )

    encoder = ChatEncoder(tokenizer)
    rows = [{"input_ids": encoder.prompt_ids([{"role": "user", "content": p}])} for p in sort_prompts(spec["prompts"])]
    dataset = Dataset.from_list(rows * (spec["steps"] + 1))
    n = spec["prompts"]
    config = PPOConfig(
        output_dir=str(Path(spec["workdir"]) / "trl"), per_device_train_batch_size=n // spec["minibatches"],
        gradient_accumulation_steps=1, num_mini_batches=spec["minibatches"], num_ppo_epochs=spec["ppo_epochs"],
        total_episodes=n * spec["steps"], local_rollout_forward_batch_size=n, response_length=spec["max_new_tokens"],
        temperature=1.0, stop_token="eos", missing_eos_penalty=None, kl_coef=KL_COEF, kl_estimator="k1",
        cliprange=0.2, cliprange_value=0.2, vf_coef=0.1, gamma=1.0, lam=0.95, whiten_rewards=False,
        learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, logging_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0, num_sample_generations=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    policy = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(spec["trl_rm_dir"], num_labels=1, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(spec["trl_rm_dir"], num_labels=1, dtype=torch.float32)
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=dataset)
    steps, gens, scores, tokens = [], [], [], []
    clock = {"gen": 0.0, "score": 0.0}

    def timed(fn, key):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            clock[key] += time.perf_counter() - start
            if key == "gen":  # (query_responses, logits): count valid completion tokens up to the first EOS
                responses = out[0][:, args[1].shape[1]:]
                is_eos = responses == tokenizer.eos_token_id
                valid = (torch.cumsum(is_eos.long(), 1) - is_eos.long()) == 0
                clock["tokens"] = clock.get("tokens", 0) + int(valid.sum())
            return out
        return wrapper

    ppo_module.batch_generation = timed(ppo_module.batch_generation, "gen")
    ppo_module.get_reward = timed(ppo_module.get_reward, "score")

    class Meter(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            steps.append(now - self.t)
            gens.append(clock["gen"])
            scores.append(clock["score"])
            tokens.append(clock.get("tokens", 0))
            clock.update(gen=0.0, score=0.0, tokens=0)
            self.t = now

    trainer.add_callback(Meter())
    trainer.train()
    return step_summary(steps, tokens, spec["warmup"], generation=gens, scoring=scores)


# ---------------------------------------------------------------------------------------------------------------
# parent


def _trl_has_ppo(trl_path: str | None) -> str | None:
    """None when TRL's PPO trainer imports (from ``trl_path`` when given), else the reason it does not."""
    code = ("import sys; p = sys.argv[1]; sys.path.insert(0, p) if p else None; import trl; "
            "print(trl.__version__); from trl.experimental.ppo import PPOTrainer")
    proc = subprocess.run([sys.executable, "-c", code, trl_path or ""], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONWARNINGS="ignore"), check=False)
    if proc.returncode == 0:
        return None
    version = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else "?"
    return (f"TRL {version} has no PPO trainer (trl.experimental.ppo does not import: "
            f"{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else 'unknown error'}); TRL removed it "
            "in 1.13.0. Install 1.12.0 with `pip install --no-deps --target DIR trl==1.12.0` and pass --trl-path DIR.")


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
    add_model_args(parser)
    parser.add_argument("--trl-path", default=None, help="A directory holding a TRL release with a PPO trainer.")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--child", choices=["align", "trl"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)

    if ns.child:
        spec = json.loads(ns.spec)
        result = run_align(spec) if ns.child == "align" else run_trl(spec)
        print(json.dumps(result))
        return
    if ns.prompts % ns.minibatches:
        parser.error("--prompts must be a multiple of --minibatches")

    import torch
    from transformers import AutoModelForSequenceClassification

    from align.models.policy import PolicyModel
    from align.models.reward import save_reward_model

    trl_missing = _trl_has_ppo(ns.trl_path)
    if trl_missing:
        print(f"TRL not run: {trl_missing}", flush=True)
    frameworks = ("align",) if trl_missing else ("align", "trl")
    with tempfile.TemporaryDirectory() as tmp:
        rm_dir, trl_rm_dir = Path(tmp) / "rm", Path(tmp) / "trl-rm"
        model_dir, model_name, n_params = prepare_model(ns, tmp)
        print(f"model: {model_name}, {n_params / 1e6:.2f}M parameters, from {model_dir}", flush=True)
        rm = PolicyModel(str(model_dir), value_head="shared")
        torch.nn.init.normal_(rm.value_head.proj.weight, std=0.05)
        save_reward_model(rm, rm_dir)
        trl_rm = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        with torch.no_grad():
            trl_rm.score.weight.copy_(rm.value_head.proj.weight)
        trl_rm.config.pad_token_id = rm.tokenizer.pad_token_id
        trl_rm.save_pretrained(trl_rm_dir)
        spec = {"model_dir": str(model_dir), "rm_dir": str(rm_dir), "trl_rm_dir": str(trl_rm_dir), "workdir": tmp,
                "prompts": ns.prompts, "max_new_tokens": ns.max_new_tokens, "steps": ns.steps + ns.warmup,
                "warmup": ns.warmup, "threads": ns.threads, "ppo_epochs": ns.ppo_epochs,
                "minibatches": ns.minibatches, "trl_path": ns.trl_path}
        results: dict[str, list[dict]] = {fw: [] for fw in frameworks}
        for trial in range(ns.trials):
            for framework in frameworks:
                res = run_child(__file__, framework, spec)
                res["load"] = os.getloadavg()[0]
                results[framework].append(res)
                print(f"trial {trial + 1} {framework:5s}: {res['tokens_per_s']:8.1f} completion tok/s, step "
                      f"{res['step_s']:.2f} s (generation {res['generation_share']:.0%}, scoring "
                      f"{res['scoring_share']:.0%}, update {res['update_share']:.0%}), peak RSS "
                      f"{res['peak_rss_mb']:.0f} MB, load {res['load']:.1f}", flush=True)

    med = {fw: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for fw, rs in results.items()}
    print(f"\nPPO full step, {model_name} ({n_params / 1e6:.2f}M parameters), {ns.prompts} prompts x 1 completion, "
          f"{ns.max_new_tokens} new tokens, {ns.ppo_epochs} epochs x {ns.minibatches} minibatches, {ns.threads} "
          f"threads, medians of {ns.trials} trials:")
    print(f"{'':8s}{'tok/s':>10s}{'step s':>9s}{'gen %':>8s}{'score %':>9s}{'update %':>10s}{'peak RSS MB':>13s}")
    for fw in frameworks:
        m = med[fw]
        print(f"{fw:8s}{m['tokens_per_s']:10.1f}{m['step_s']:9.2f}{m['generation_share']:8.0%}"
              f"{m['scoring_share']:9.0%}{m['update_share']:10.0%}{m['peak_rss_mb']:13.0f}")
    ratios = {}
    if "trl" in med:
        ratios = {"throughput_align_over_trl": med["align"]["tokens_per_s"] / med["trl"]["tokens_per_s"],
                  "peak_rss_align_over_trl": med["align"]["peak_rss_mb"] / med["trl"]["peak_rss_mb"]}
        print(f"throughput ratio align/TRL: {ratios['throughput_align_over_trl']:.2f}x; "
              f"peak memory ratio align/TRL: {ratios['peak_rss_align_over_trl']:.2f}")
    if ns.json:
        ns.json.write_text(json.dumps({"model": ns.model or "tiny", "model_dir": str(model_dir) if ns.model else None,
                                       "parameters": n_params,
                                       "settings": vars(ns) | {"json": str(ns.json)}, "trials": results,
                                       "medians": med, "ratios": ratios, "trl_not_run": trl_missing},
                                      indent=2, default=str))


if __name__ == "__main__":
    main()
