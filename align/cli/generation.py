"""``align generate``, ``align evaluate`` and ``align chat``: argparse entry points over :mod:`align.rollout.generation`
and :mod:`align.rollout.evaluation` (docs/generation.md). Errors are one line on stderr (``error: ...``, exit status
2), as for every align command.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from align.cli.config_errors import guarded
from align.errors import AlignConfigError


def _model_arguments(parser) -> None:
    parser.add_argument(
        "--model",
        "--ckpt_path",
        dest="model",
        required=True,
        metavar="MODEL",
        help="What to load: an align checkpoint (.ckpt from any run), an exported Hugging Face folder "
        "(align export), or a model id (tiny-sort, smollm2-135m-instruct, a .gguf file, a hub "
        "id). --ckpt_path is the same setting.",
    )
    parser.add_argument("--device", default=None, help="Device to run on (cuda, cuda:1, mps); default cpu.")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="Weight dtype; default: the run's for a checkpoint, float32 otherwise.",
    )


def _sampling_arguments(parser, max_new_tokens: int, several: bool = True) -> None:
    parser.add_argument(
        "--max_new_tokens",
        type=int,
        default=max_new_tokens,
        help=f"Longest completion in tokens (default {max_new_tokens}).",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="0 is greedy. Default: greedy for one sample per prompt, 1.0 for several (--n > 1)."
        if several
        else "0 is greedy (the default).",
    )
    parser.add_argument("--top_p", type=float, default=1.0, help="Nucleus sampling (1: off).")
    parser.add_argument("--top_k", type=int, default=0, help="Sample from the k most likely tokens only (0: off).")
    parser.add_argument(
        "--seed", type=int, default=0, help="Seed of the sampler (default 0): the same seed gives the same output."
    )
    if several:
        parser.add_argument("--n", type=int, default=1, help="Completions sampled per prompt (default 1).")


def _prompt_arguments(parser) -> None:
    parser.add_argument(
        "--prompts",
        required=True,
        help='Prompt data as training reads it ({"prompt", ...} or '
        '{"messages", ...} rows in jsonl/json/parquet/csv, align:..., a hub dataset); the '
        "tokenizer's chat template is applied as in training.",
    )
    parser.add_argument(
        "--prompt_field",
        default=None,
        help="The prompt column; default 'prompt', or 'messages' for rows without 'prompt'.",
    )
    parser.add_argument("--system_prompt", default=None, help="A system message added to prompts that have none.")
    parser.add_argument(
        "--split",
        default=None,
        help="Split to read; default 'train' for a file (its only one), "
        "'validation' for a hub dataset. Slices work: 'train[:20]'.",
    )
    parser.add_argument(
        "--batch_size", type=int, default=8, help="Prompts per generation batch (default 8); each is sampled --n times."
    )


def _prompts_command(prog: str, description: str):
    """The argparse parser of a command that runs a model over a prompt file (generate, evaluate)."""
    import argparse

    parser = argparse.ArgumentParser(prog=prog, description=description)
    _model_arguments(parser)
    _prompt_arguments(parser)
    return parser


def generate_main(args: list[str]) -> None:
    """``align generate``: completions of a prompt file, one JSON line per completion."""
    parser = _prompts_command(
        "align generate",
        "Sample completions of a prompt file with a trained policy (the "
        "training rollout engine) and write them as JSON lines: each input row with every "
        "column kept and its completion added.",
    )
    parser.add_argument("--output", required=True, help="JSON lines file to write (one line per completion).")
    parser.add_argument(
        "--completion_field", default="completion", help="Output column of the completion (default completion)."
    )
    _sampling_arguments(parser, max_new_tokens=64)
    ns = parser.parse_args(args)
    guarded(lambda: _generate(ns))


def _generate(ns) -> None:
    from align.rollout.generation import (
        check_completion_field,
        completion_rows,
        generate_batches,
        load_policy,
        read_prompts,
        sampling_config,
    )

    sampling = sampling_config(ns.max_new_tokens, ns.temperature, ns.top_p, ns.top_k, ns.n)
    policy = load_policy(ns.model, ns.device, ns.dtype)
    prompts = read_prompts(ns.prompts, policy.tokenizer, ns.prompt_field, ns.system_prompt, ns.split)
    check_completion_field(prompts, ns.completion_field)
    output = Path(ns.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(f".{output.name}.partial")
    rows, tokens, seconds, start = 0, 0.0, 0.0, 0
    with open(partial, "w", encoding="utf-8") as fh:
        for batch, rollout in generate_batches(policy, prompts.examples, sampling, ns.n, ns.batch_size, ns.seed):
            for row in completion_rows(prompts, start, rollout, ns.completion_field):
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            start, rows = start + len(batch), rows + len(rollout)
            tokens += rollout.metrics["rollout/completion_tokens"]
            seconds += rollout.generation_seconds
            _progress(start, len(prompts.examples))
    os.replace(partial, output)  # a file named --output is complete
    print(
        f"generated {rows} completions of {len(prompts.examples)} prompts: {int(tokens)} tokens, "
        f"{tokens / max(seconds, 1e-9):.0f} tokens/s ({_sampling_words(sampling)}) -> {output}"
    )


def _progress(done: int, total: int) -> None:
    if sys.stderr.isatty():
        print(f"\r{done}/{total} prompts", end="\n" if done >= total else "", file=sys.stderr, flush=True)


def _sampling_words(sampling) -> str:
    how = "greedy" if sampling.temperature == 0 else f"temperature {sampling.temperature:g}"
    if sampling.temperature and sampling.top_p < 1:
        how += f", top_p {sampling.top_p:g}"
    if sampling.temperature and sampling.top_k:
        how += f", top_k {sampling.top_k}"
    return f"{how}, at most {sampling.max_new_tokens} new tokens"


def evaluate_main(args: list[str]) -> None:
    """``align evaluate``: mean rewards, accuracy and pass@k of a policy on a prompt file."""
    parser = _prompts_command(
        "align evaluate",
        "Score a policy's completions of a prompt file with reward "
        "functions: each reward's mean, the accuracy (as val/accuracy in training) and pass@k; "
        "against a --baseline, the win rate and the KL.",
    )
    parser.add_argument(
        "--rewards",
        nargs="+",
        required=True,
        metavar="PATH[=WEIGHT]",
        help="Rewards named as in a config: align.rewards.math_answer, my_rewards.py:fn, with an "
        "optional weight (align.rewards.sort_format=0.5). reward_mean is the weighted total.",
    )
    parser.add_argument(
        "--accuracy_reward",
        default=None,
        help="The reward that decides accuracy and pass@k (its function name); default the first.",
    )
    parser.add_argument(
        "--accuracy_threshold",
        type=float,
        default=1.0,
        help="A completion is correct when the accuracy reward is at least this.",
    )
    parser.add_argument(
        "--k", type=int, nargs="+", default=None, help="pass@k for each k (each <= --n); default 1 and n when --n > 1."
    )
    parser.add_argument(
        "--baseline",
        default=None,
        help="Compare with another model (a checkpoint, folder or id), "
        "or 'reference': the model the checkpoint's run started from. Adds the win rate and the KL.",
    )
    parser.add_argument(
        "--reward_model",
        default=None,
        help="Judge the win rate with this reward model (an export "
        "folder, a reward-model .ckpt or tiny-sort-rm) instead of the rewards.",
    )
    parser.add_argument("--output", default=None, help="Also write the report to this JSON file.")
    _sampling_arguments(parser, max_new_tokens=64)
    ns = parser.parse_args(args)
    guarded(lambda: _evaluate(ns))


def _evaluate(ns) -> None:
    from align.rollout.evaluation import evaluate, parse_reward
    from align.rollout.generation import REFERENCE, load_policy, read_prompts, reference_policy, sampling_config

    sampling = sampling_config(ns.max_new_tokens, ns.temperature, ns.top_p, ns.top_k, ns.n)
    ks = ns.k if ns.k is not None else sorted({1, ns.n}) if ns.n > 1 else []
    rewards = [parse_reward(r) for r in ns.rewards]
    if ns.reward_model and not ns.baseline:
        raise AlignConfigError("--reward_model judges the win rate against a --baseline; give --baseline too")
    policy = load_policy(ns.model, ns.device, ns.dtype)
    prompts = read_prompts(ns.prompts, policy.tokenizer, ns.prompt_field, ns.system_prompt, ns.split)
    baseline = None
    if ns.baseline == REFERENCE:
        baseline = reference_policy(ns.model, ns.device, ns.dtype)
    elif ns.baseline:
        baseline = load_policy(ns.baseline, ns.device, ns.dtype, what="--baseline")
    # The baseline reads the prompts through its own tokenizer and chat template.
    baseline_prompts = (
        read_prompts(ns.prompts, baseline.tokenizer, ns.prompt_field, ns.system_prompt, ns.split)
        if baseline is not None
        else None
    )
    report = evaluate(
        policy,
        prompts,
        rewards,
        sampling,
        n=ns.n,
        ks=ks,
        batch_size=ns.batch_size,
        seed=ns.seed,
        accuracy_reward=ns.accuracy_reward,
        accuracy_threshold=ns.accuracy_threshold,
        baseline=baseline,
        reward_model=ns.reward_model,
        baseline_prompts=baseline_prompts,
        model_name=ns.model,
        on_batch=_progress,
    )
    print(_report_table(report, ns.baseline, sampling))
    if ns.output:
        Path(ns.output).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.output).write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"report: {ns.output}")


def _report_table(report, baseline_name: str | None, sampling) -> str:
    """The report as two aligned columns."""
    samples = f"{report.samples_per_prompt} sample" + ("s" if report.samples_per_prompt > 1 else "")
    lines = [
        ("model", report.model),
        ("prompts", f"{report.prompts} ({report.num_prompts} prompts x {samples}, {_sampling_words(sampling)})"),
        ("reward_mean", f"{report.reward_mean:.4f}"),
    ]
    lines += [(f"reward/{name}", f"{value:.4f}") for name, value in report.rewards.items()]
    accuracy = f"{report.accuracy:.4f} ({report.accuracy_reward} >= {report.accuracy_threshold:g})"
    highest = report.accuracy_reward_highest
    if highest is not None and highest < report.accuracy_threshold:  # 0 by construction: say so, and what to read
        accuracy = (
            f"{report.accuracy:.4f} (no completion reached {report.accuracy_reward} >= "
            f"{report.accuracy_threshold:g}, highest {highest:.4f}: read reward/{report.accuracy_reward}, "
            "its mean; --accuracy_threshold sets the bar)"
        )
    lines.append(("accuracy", accuracy))
    lines += [(f"pass@{k}", f"{value:.4f}") for k, value in report.pass_at_k.items()]
    lines.append(
        (
            "response_length",
            f"{report.response_length:.2f} tokens ({report.truncated_frac:.1%} truncated, "
            f"{report.tokens_per_s:.0f} tokens/s)",
        )
    )
    if report.baseline is not None:
        b = report.baseline
        judge = "the reward model" if b["judge"] == "reward_model" else "reward_mean"
        lines.append(
            (
                f"vs {baseline_name}",
                f"win rate {b['win_rate']:.4f} (wins {b['wins']:.1%}, ties {b['ties']:.1%}, "
                f"losses {b['losses']:.1%}; judged by {judge})",
            )
        )
        lines.append(("baseline reward_mean", f"{b['reward_mean']:.4f}"))
        if "rm_score" in b:
            lines.append(("reward model score", f"{b['rm_score']:.4f} (baseline {b['baseline_rm_score']:.4f})"))
        if b["kl"] is None:
            lines.append(("kl to baseline", "n/a (different tokenizers)"))
        elif b["kl_estimator"].startswith("k1"):
            lines.append(("kl to baseline", f"{b['kl']:.4f} nats per completion (k1, sequence-level)"))
        else:  # greedy or tempered completions: their log-ratio is no estimate of the KL
            lines.append(
                (
                    "log-ratio to baseline",
                    f"{b['kl']:.4f} nats per completion (not a KL: sample with --temperature 1 for one)",
                )
            )
    width = max(len(name) for name, _ in lines)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in lines)


def chat_main(args: list[str], stdin=None) -> None:
    """``align chat``: talk to a policy in the terminal, with the model's chat template and the whole history."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="align chat",
        description="Chat with a trained policy in the terminal. "
        "/reset clears the history; /exit or end of input (Ctrl-D) quits.",
    )
    _model_arguments(parser)
    parser.add_argument("--system_prompt", default=None, help="A system message at the start of the conversation.")
    _sampling_arguments(parser, max_new_tokens=256, several=False)
    ns = parser.parse_args(args)
    try:
        guarded(lambda: _chat(ns, stdin or sys.stdin))
    except KeyboardInterrupt:  # Ctrl-C ends a chat as /exit does
        print()


def _chat(ns, stdin) -> None:
    from align.data.chat import ChatEncoder
    from align.rollout.engine import make_engine
    from align.rollout.generation import chat_reply, load_policy, sampling_config, seeded_generator

    engine = make_engine(sampling_config(ns.max_new_tokens, ns.temperature, ns.top_p, ns.top_k))
    policy = load_policy(ns.model, ns.device, ns.dtype)
    if not getattr(policy.tokenizer, "chat_template", None):
        raise AlignConfigError(f"--model: the tokenizer of '{ns.model}' has no chat template; chat needs one")
    encoder = ChatEncoder(policy.tokenizer, use_chat_template=True)
    generator = seeded_generator(ns.seed, policy)
    start = [{"role": "system", "content": ns.system_prompt}] if ns.system_prompt else []
    history = list(start)
    interactive = stdin.isatty()
    print(
        f"chatting with {ns.model}; /reset clears the history, /exit or Ctrl-D quits",
        file=sys.stdout if interactive else sys.stderr,
    )
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = stdin.readline()
        if not line:  # end of input
            if interactive:
                print()
            return
        text = line.strip()
        if text == "/exit":
            return
        if text == "/reset":
            history = list(start)
            print("(history cleared)")
            continue
        if not text:
            continue
        history.append({"role": "user", "content": text})
        reply, _ = chat_reply(policy, encoder, history, engine, generator)
        history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
