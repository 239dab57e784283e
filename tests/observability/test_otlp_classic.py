"""Classic RL over OTLP: each iteration's collection is a ``rollout`` span under its step span, carrying the
episodes it finished as ``rl.*`` attributes, and the episode metrics arrive as OTLP metrics."""

from functools import partial

import torch

from align.gym import A2CGymModule
from align.gym.make import EnvSpec
from align.observability import OTelTracingCallback, OTLPLogger

from ._toy import toy_trainer


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
