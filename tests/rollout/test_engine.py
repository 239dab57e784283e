"""Generation engines as classes (align.rollout.engine): a third engine from outside the package, named in YAML by its
class path with its own settings, trains, answers the held-out passes and generates for the asynchronous source; a
scripted engine named by its path serves an RL module's sampler; the short names still work and an unknown one fails
naming the setting; the training and held-out engines are one object with two sampling settings."""

import csv
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml

from align.errors import AlignConfigError
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.rollout.engine import (
    GenerationEngine,
    HeldOutCorrection,
    HeldOutSampling,
    NativeEngine,
    SamplingConfig,
    engine_class,
    make_engine,
)
from align.rollout.rewards import training_rewards
from align.rollout.sampler import Sampler
from align.rollout.sampling import SampleOutput

sys.path.insert(0, str(Path(__file__).parents[1] / "modules"))
from _helpers import PROMPTS, length_reward, prompt_batch, standalone  # noqa: E402

ENGINE = f"{__name__}.EchoEngine"


@pytest.fixture(scope="module")
def policy():
    return PolicyModel("tiny-sort")


class EchoEngine(GenerationEngine):
    """Answers every context with ``text`` and a stop token, each token at log-prob ``logprob``: an engine whose
    log-probs are not the trainer's (so the sampler corrects its rollouts)."""

    exact_logprobs = False

    def __init__(self, text: str = "a b", logprob: float = -1.0):
        """
        Args:
            text: What every completion says.
            logprob: The log-prob recorded for each token.
        """
        super().__init__()
        self.text, self.logprob = text, logprob

    @contextmanager
    def decoding(self, policy, capacity):
        tokens = policy.tokenizer.encode(self.text, add_special_tokens=False) + [policy.tokenizer.eos_token_id]

        def decode(
            input_ids,
            attention_mask,
            *,
            max_new_tokens,
            min_new_tokens=0,
            generator=None,
            sync_stop=None,
            shared_prefix=1,
        ):
            row = torch.tensor(tokens[:max_new_tokens], device=input_ids.device)
            ids = row.expand(input_ids.shape[0], -1).clone()
            return SampleOutput(ids, torch.full(ids.shape, self.logprob, device=ids.device), ids.shape[1])

        yield decode


def test_short_names_and_class_paths_name_engines():
    assert engine_class("native") is NativeEngine and engine_class(ENGINE) is EchoEngine
    assert engine_class("vllm").__name__ == "VLLMEngine"
    engine = make_engine(SamplingConfig(engine=ENGINE, temperature=0.5))
    assert isinstance(engine, EchoEngine) and engine.sampling.temperature == 0.5 and engine.text == "a b"
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.sampling\.engine: expected native, vllm or the import path of "
        r"a GenerationEngine subclass, got 'sglang'$",
    ):
        SamplingConfig(engine="sglang")
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.evaluation\.sampling\.engine: 'torch\.nn\.Linear' is not a "
        r"subclass of align\.rollout\.engine\.GenerationEngine$",
    ):
        HeldOutSampling(engine="torch.nn.Linear")


def test_the_same_checks_name_the_training_or_the_held_out_settings():
    for sampling, where in ((SamplingConfig, "model.sampling"), (HeldOutSampling, "model.evaluation.sampling")):
        with pytest.raises(
            AlignConfigError,
            match=rf"^{re.escape(where)}\.temperature: expected >= 0 \(0: greedy\), "
            r"got -1\.0$",
        ):
            sampling(temperature=-1.0)
        with pytest.raises(
            AlignConfigError,
            match=rf"^{re.escape(where)}\.top_p: expected a value in \(0, 1\], "
            r"got 0$",
        ):
            sampling(top_p=0)
        correction = sampling.__dataclass_fields__["correction"].default_factory
        with pytest.raises(AlignConfigError, match=rf"^{re.escape(where)}\.correction\.cap: expected >= 1, got 0\.5$"):
            correction(cap=0.5)
    assert isinstance(HeldOutSampling().correction, HeldOutCorrection)


def test_the_held_out_engine_is_the_training_engine_with_its_own_sampling():

    policy = PolicyModel("tiny-sort")
    reward, _ = training_rewards(["align.rewards.sort_exact_match"], None, None)
    echo = EchoEngine(text="b a")
    sampler = Sampler(policy, reward, 2, SamplingConfig(max_new_tokens=5, temperature=0.7, engine=echo))
    train, held_out = sampler.engine, sampler.eval_engine
    assert isinstance(train, EchoEngine) and isinstance(held_out, EchoEngine) and held_out.text == "b a"
    assert (train.sampling.temperature, held_out.sampling.temperature) == (0.7, 0.0)
    assert held_out.sampling.max_new_tokens == 5
    named = Sampler(policy, reward, 2, SamplingConfig(engine=echo), HeldOutSampling(engine="native"))
    assert isinstance(named.eval_engine, NativeEngine)


def run_dir(tmp_path, config: dict, *args: str):
    from align.cli.recipes import run_recipe
    from align.data.prompts import PromptDataModule
    from align.modules.grpo import GRPOModule

    path = tmp_path / "engine.yaml"
    path.write_text(yaml.safe_dump(config))
    return run_recipe(
        "grpo",
        GRPOModule,
        PromptDataModule,
        args=[
            "--config",
            str(path),
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
            "--trainer.enable_progress_bar",
            "false",
            *args,
        ],
    )


def test_an_engine_from_outside_the_package_trains_and_answers_the_held_out_passes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [sys.argv[0]])
    config = {
        "model": {
            "init_args": {
                "group_size": 2,
                "sampling": {
                    "max_new_tokens": 6,
                    "engine": {"class_path": ENGINE, "init_args": {"text": "b a", "logprob": -0.5}},
                },
            }
        },
        "trainer": {"max_steps": 2, "log_every_n_steps": 1},
    }
    cli = run_dir(tmp_path, config)
    sampler = cli.model.sampler
    assert isinstance(sampler.engine, EchoEngine) and (sampler.engine.text, sampler.engine.logprob) == ("b a", -0.5)
    assert sampler.eval_engine.text == "b a" and sampler.eval_engine.sampling.temperature == 0
    rows = list(csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")))
    trained = [r for r in rows if r.get("train/loss")]
    held_out = [r for r in rows if r.get("val/reward_mean")]
    assert len(trained) == 2 and len(held_out) >= 1
    tokens = len(cli.model.tokenizer.encode("b a", add_special_tokens=False)) + 1
    # Every completion, trained on or held out, is the engine's; its log-probs are not the trainer's, so the
    # rollouts were corrected (rollout/engine_kl) and scored at its temperature.
    assert all(float(r["rollout/response_length"]) == tokens for r in trained)
    assert all(float(r["val/response_length"]) == tokens for r in held_out)
    assert all(r.get("rollout/engine_kl") not in (None, "") for r in trained)


@pytest.mark.slow
def test_an_engine_from_outside_the_package_generates_for_the_asynchronous_source():
    ray = pytest.importorskip("ray")
    from ray import cloudpickle

    from align.modules.grpo import GRPOModule
    from align.modules.options import Updates
    from align.rollout.async_source import AsyncSource

    # The generator runs in a Ray actor: a class from a module the actor cannot import travels by value.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        torch.manual_seed(0)
        module = GRPOModule(
            policy=PolicyModel("tiny-sort"),
            rewards=[length_reward],
            group_size=2,
            log_entropy=False,
            updates=Updates(max_grad_norm=None),
            sampling=SamplingConfig(max_new_tokens=6, engine=EchoEngine(text="a b")),
            source=AsyncSource(max_staleness=1),
        )
        module.use_optimizer(torch.optim.SGD([p for p in module.parameters() if p.requires_grad], lr=0.1))
        steps = []
        for i in range(3):
            module.last_metrics = {}
            module.training_step(prompt_batch(module.policy, PROMPTS[:2]), i)
            steps.append(dict(module.last_metrics))
        module.source.close()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()
    tokens = len(module.tokenizer.encode("a b", add_special_tokens=False)) + 1
    assert steps[0] == {}  # the pipeline fills: no update on the first step
    assert [s["rollout/response_length"] for s in steps[1:]] == [tokens, tokens]
    assert [s["rollout/staleness"] for s in steps[1:]] == [0, 1]  # the first update's batch: none before it


class ScriptedEngine(GenerationEngine):
    """Answers every context with the same tokens (the pad id after the first stop token), log-prob -1 each."""

    tokens: list[int] = []

    @contextmanager
    def decoding(self, policy, capacity):
        def decode(
            input_ids,
            attention_mask,
            *,
            max_new_tokens,
            min_new_tokens=0,
            generator=None,
            sync_stop=None,
            shared_prefix=1,
        ):
            row = torch.tensor(self.tokens[:max_new_tokens])
            ids = row.expand(input_ids.shape[0], -1).clone()
            return SampleOutput(ids, torch.full(ids.shape, -1.0), ids.shape[1])

        yield decode


def test_a_new_engine_is_a_class_named_by_its_path(policy):
    eos = policy.tokenizer.eos_token_id
    ScriptedEngine.tokens = policy.tokenizer.encode("a b", add_special_tokens=False) + [eos]
    path = f"{ScriptedEngine.__module__}.ScriptedEngine"
    assert isinstance(make_engine(SamplingConfig(engine=path)), ScriptedEngine)
    module = GRPOModule(
        policy=policy,
        rewards=[length_reward],
        group_size=2,
        log_entropy=False,
        sampling=SamplingConfig(max_new_tokens=6, engine=ScriptedEngine()),
    )
    assert isinstance(module.sampler.engine, ScriptedEngine)
    assert isinstance(module.sampler.eval_engine, ScriptedEngine)  # held out: the training engine, greedy
    assert module.sampler.eval_engine.sampling.temperature == 0
    standalone(module)
    module.training_step(prompt_batch(policy, PROMPTS[:2]), 0)
    # Every completion is the scripted one, so every reward ties and the group advantages are 0.
    assert module.last_metrics["rollout/zero_std_frac"] == 1.0 and module.rl_counters == {"rollouts": 1, "updates": 1}
    rollout = module.sampler.rollout(prompt_batch(policy, PROMPTS[:1]))
    assert rollout.texts == ["a b", "a b"] and rollout.response_mask.sum() == 2 * len(ScriptedEngine.tokens)


def test_an_unknown_engine_fails_naming_the_setting():
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.sampling\.engine: expected native, vllm or the import path of "
        r"a GenerationEngine subclass, got 'sglang'$",
    ):
        SamplingConfig(engine="sglang")
    with pytest.raises(
        AlignConfigError, match=r"^model\.evaluation\.sampling\.engine: 'torch\.nn\.Linear' is not a subclass"
    ):
        HeldOutSampling(engine="torch.nn.Linear")
