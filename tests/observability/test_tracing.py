"""The tracing callback (align.observability.tracing) against an in-process OTLP receiver: the fit -> epoch -> step
span tree with the step's metrics, a GRPO step's section spans, a multi-turn rollout's environment calls, checkpoint
saves and validation, exceptions as span events, timed sections from other threads under their step, and classic
RL's rollout spans carrying the episodes they finished."""

import threading
from functools import partial

import pytest
import torch

from align.gym import A2CGymModule
from align.gym.make import EnvSpec
from align.observability import OTelTracingCallback, OTLPLogger, Timer, timing
from align.observability.attributes import REDACTED

from ._toy import ToyRLModule, toy_trainer

PROTOCOLS = ["grpc", "http/protobuf"]


def by_name(points):
    out = {}
    for p in points:
        out.setdefault(p.metric, []).append(p)
    return out


def span_tree(spans):
    by_id = {s.span_id: s for s in spans}
    return by_id, (lambda s: by_id.get(s.parent_span_id))


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_training_exports_the_span_tree_and_metrics(receiver, protocol, tmp_path):
    endpoint = receiver.endpoint(protocol)
    logger = OTLPLogger(endpoint=endpoint, protocol=protocol, export_interval=60)
    callback = OTelTracingCallback(endpoint=endpoint, protocol=protocol, export_interval=60)
    trainer = toy_trainer(tmp_path, logger=logger, callbacks=[callback], max_steps=3)
    module = ToyRLModule()
    trainer.fit(module)
    assert timing._active is None  # torn down after fit
    assert set(module.timings) == {"time/generation_s", "time/scoring_s", "time/update_s"}

    spans = receiver.spans()
    by_id, parent = span_tree(spans)
    names = [s.name for s in spans]
    assert names.count("fit") == 1 and names.count("epoch") == 1 and names.count("step") == 3
    fit = next(s for s in spans if s.name == "fit")
    assert fit.parent_span_id == "" and fit.attributes["align.algorithm"] == "toyrl"
    assert fit.resource["align.run_id"] == logger.run_id == callback.run_id  # one run id for both signals
    assert fit.resource["service.instance.id"] == f"{logger.run_id}-rank0"
    assert fit.attributes["hparam.beta"] == 0.04 and fit.attributes["hparam.hf_token"] == REDACTED
    assert "hf_0123456789abcdefghij" not in repr(receiver.trace_requests) + repr(receiver.metric_requests)
    info = next(p for p in receiver.points() if p.metric == "align.run.info").attributes
    assert info["hparam.hf_token"] == REDACTED and info["hparam.beta"] == 0.04
    for s in spans:
        assert s.trace_id == fit.trace_id
    steps = [s for s in spans if s.name == "step"]
    for step in steps:
        assert parent(step).name == "epoch" and parent(parent(step)).name == "fit"
        assert step.attributes["align.batch.size"] == 4
        assert step.attributes["align.train.kl"] == 0.25
        assert step.attributes["align.rollout.reward_mean"] == 0.75
        children = sorted((s for s in spans if s.parent_span_id == step.span_id), key=lambda s: s.start)
        assert [c.name for c in children] == ["generation", "scoring", "update"]  # the module's Timer sections
        assert step.start <= children[0].start and all(c.end <= step.end for c in children)
    assert [s.attributes["align.step"] for s in steps] == [0, 1, 2]

    points = by_name(receiver.points())
    assert points["align.train.kl"][-1].value == 0.25
    assert points["align.train.kl"][-1].attributes["align.algorithm"] == "toyrl"


def test_a_grpo_step_has_the_documented_section_spans(receiver, tmp_path):
    """A real GRPO step on the tiny model: its Timer sections are spans named as docs/observability.md says, children
    of the step span, and the same blocks still give the time/* metrics."""
    from torch.utils.data import DataLoader

    from align.data.chat import ChatEncoder
    from align.data.prompts import PromptBatch
    from align.models.policy import PolicyModel
    from align.modules.grpo import GRPOModule
    from align.rollout.engine import SamplingConfig

    policy = PolicyModel("tiny", seed=2)
    prompt = "sort: b a"
    batch = PromptBatch([ChatEncoder(policy.tokenizer).prompt_ids([{"role": "user", "content": prompt}])], [prompt], {})
    module = GRPOModule(
        policy=policy,
        rewards=[lambda prompts, completions, **kw: [1.0] * len(completions)],
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=4),
    )
    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    toy_trainer(tmp_path, logger=False, callbacks=[callback], max_steps=1).fit(
        module, train_dataloaders=DataLoader([batch], batch_size=None)
    )
    spans = receiver.spans()
    step = next(s for s in spans if s.name == "step")
    children = sorted((s for s in spans if s.parent_span_id == step.span_id), key=lambda s: s.start)
    assert [c.name for c in children] == ["generation", "scoring", "update"]
    assert set(module.timings) == {"time/generation_s", "time/scoring_s", "time/update_s"}


class TwoTurns:
    """Replies once, then ends: reward 0.5 a turn."""

    def reset(self, row):
        self.turn = 0
        return row["messages"]

    def step(self, message):
        self.turn += 1
        from align.rollout.envs.chat import EnvStep

        return EnvStep([] if self.turn == 2 else [{"role": "user", "content": "sort: c a"}], 0.5, self.turn == 2)


def test_every_environment_call_of_a_multi_turn_rollout_is_a_span_under_generation(receiver, tmp_path):
    from torch.utils.data import DataLoader

    from align.data.chat import ChatEncoder
    from align.data.prompts import PromptBatch
    from align.models.policy import PolicyModel
    from align.modules.grpo import GRPOModule
    from align.rollout.engine import SamplingConfig
    from align.rollout.envs.chat import EnvironmentSpec

    policy = PolicyModel("tiny", seed=2)
    messages = [[{"role": "user", "content": p}] for p in ("sort: b a", "sort: d c")]
    encode = ChatEncoder(policy.tokenizer).prompt_ids
    batch = PromptBatch([encode(m) for m in messages], ["sort: b a", "sort: d c"], {}, messages)
    module = GRPOModule(
        policy=policy,
        environment=EnvironmentSpec(TwoTurns, max_tokens=40),
        group_size=2,
        sampling=SamplingConfig(max_new_tokens=4),
    )
    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    logger = OTLPLogger(endpoint=receiver.endpoint("grpc"), export_interval=60)
    toy_trainer(tmp_path, logger=logger, callbacks=[callback], max_steps=1).fit(
        module, train_dataloaders=DataLoader([batch], batch_size=None)
    )
    names = {p.metric for p in receiver.points()}
    assert {
        "align.rollout.turns",
        "align.rollout.environment_tokens",
        "align.rollout.truncated_frac",
        "align.rollout.reward.env",
        "align.time.env_s",
    } <= names
    spans = receiver.spans()
    generation = next(s for s in spans if s.name == "generation")
    calls = [s for s in spans if s.name == "env_step"]
    episodes = module.last_metrics["rollout/turns"] * 4
    assert len(calls) == episodes > 0
    assert all(s.parent_span_id == generation.span_id for s in calls)
    assert all(generation.start <= s.start <= s.end <= generation.end for s in calls)
    assert {s.attributes["align.env.name"] for s in calls} == {"TwoTurns"}
    assert sorted((s.attributes["align.env.episode"], s.attributes["align.env.turn"]) for s in calls)[0] == (0, 1)
    assert all(s.attributes["align.env.reward"] == 0.5 for s in calls)
    assert {s.attributes["align.env.done"] for s in calls} <= {True, False}


def test_checkpoint_saves_and_validation_are_spans(receiver, tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    class WithVal(ToyRLModule):
        def validation_step(self, batch, batch_idx):
            self.log("val/reward_mean", 1.0)

        def val_dataloader(self):
            return self.train_dataloader()

    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    trainer = toy_trainer(
        tmp_path,
        logger=False,
        max_steps=2,
        limit_val_batches=1,
        val_check_interval=2,
        enable_checkpointing=True,
        callbacks=[callback, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)],
    )
    trainer.fit(WithVal())
    spans = receiver.spans()
    by_id, parent = span_tree(spans)
    saves = [s for s in spans if s.name == "checkpoint_save"]
    assert len(saves) >= 2
    assert all(parent(s).name in ("epoch", "validation") for s in saves)
    assert all(s.attributes["align.checkpoint.path"].endswith(".ckpt") for s in saves)
    # without an OTLPLogger the callback reads Lightning's metrics on logging steps (every step here)
    assert all(s.attributes["align.train.kl"] == 0.25 for s in spans if s.name == "step")
    val = [s for s in spans if s.name == "validation"]
    assert len(val) == 1 and parent(val[0]).name == "epoch"


def test_exceptions_are_recorded_as_span_events(receiver, tmp_path):
    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    trainer = toy_trainer(tmp_path, logger=False, callbacks=[callback], max_steps=5)
    with pytest.raises(RuntimeError, match="exploded"):
        trainer.fit(ToyRLModule(fail_at_step=1))
    spans = receiver.spans()
    failed = [s for s in spans if s.events]
    assert [s.name for s in failed] == ["generation", "step"]  # the Timer section, then the step around it
    for s in failed:
        name, attrs = s.events[0]
        assert name == "exception" and attrs["exception.type"] == "RuntimeError"
        assert "exploded" in attrs["exception.message"]
        assert s.status_code == 2  # STATUS_CODE_ERROR
    assert next(s for s in spans if s.name == "fit").status_code == 2


def test_timer_sections_from_other_threads_nest_under_the_step(receiver, tmp_path):
    class Threaded(ToyRLModule):
        def training_step(self, batch, batch_idx):
            timings = {}

            def generate():  # a worker thread has no current span: its section nests under the step
                with Timer(timings, "time/generation_s"):
                    pass

            with Timer(timings, "time/update_s"):
                t = threading.Thread(target=generate)
                t.start()
                t.join()
            return self.layer(batch[0]).sum()

    callback = OTelTracingCallback(endpoint=receiver.endpoint("grpc"), export_interval=60)
    toy_trainer(tmp_path, logger=False, callbacks=[callback], max_steps=1).fit(Threaded())
    spans = receiver.spans()
    _, parent = span_tree(spans)
    gen = next(s for s in spans if s.name == "generation")
    assert parent(gen).name == "step"


def test_rollout_spans_carry_the_finished_episodes(receiver, tmp_path):
    endpoint = receiver.endpoint("grpc")
    logger = OTLPLogger(endpoint=endpoint, export_interval=60)
    tracing = OTelTracingCallback(endpoint=endpoint, export_interval=60)
    torch.manual_seed(0)
    module = A2CGymModule(
        env=EnvSpec(num_envs=4), total_steps=400, steps_per_iteration=5, optimizer=partial(torch.optim.Adam, lr=1e-3)
    )
    finished = []
    original = module.runner.pop_episodes
    module.runner.pop_episodes = lambda: finished.append(original()) or finished[-1]
    trainer = toy_trainer(tmp_path, logger=logger, callbacks=[tracing], max_steps=-1, max_epochs=1, log_every_n_steps=1)
    trainer.fit(module)

    spans = receiver.spans()
    steps = {s.span_id: s for s in spans if s.name == "step"}
    rollouts = [s for s in spans if s.name == "rollout"]
    assert len(rollouts) == len(steps) == 20  # 400 steps / (4 environments x 5)
    assert all(s.parent_span_id in steps for s in rollouts)
    annotated = [s for s in rollouts if "rl.episodes" in s.attributes]
    with_episodes = [batch for batch in finished if batch]
    assert len(annotated) == len(with_episodes) > 0  # a span for each batch of finished episodes
    for span, batch in zip(sorted(annotated, key=lambda s: s.start), with_episodes):
        assert span.attributes["rl.algorithm"] == "a2c"
        assert span.attributes["rl.episodes"] == len(batch)
        assert span.attributes["rl.episode"] == batch[-1].index
        assert span.attributes["rl.total_reward"] == sum(e.reward for e in batch) / len(batch)
        assert span.attributes["rl.episode_length"] == sum(e.length for e in batch) / len(batch)

    names = {p.metric for p in receiver.points()}
    assert {
        "align.rollout.episode_reward",
        "align.rollout.episode_length",
        "align.rollout.env_steps",
        "align.train.policy_loss",
        "align.train.value_loss",
        "align.train.entropy",
        "align.train.lr",
    } <= names
