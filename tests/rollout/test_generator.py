"""The generator of the asynchronous source (align.rollout.generator): a policy rebuilt from the trainer's settings
that loads its weights and samples as the trainer would with the same random stream, and the one-line errors of a
generator that cannot start or fails inside its Ray actor."""

import sys
from pathlib import Path

import pytest
import torch

from align.errors import AlignConfigError
from align.rollout.async_source import AsyncSource
from align.rollout.engine import SamplingConfig
from align.rollout.generator import Generator, GeneratorPlacement, trainable_weights

sys.path.insert(0, str(Path(__file__).parents[1] / "modules"))
from _helpers import prompt_batch  # noqa: E402

ray = pytest.importorskip("ray")

from .test_async_source import batches, module  # noqa: E402  (after the skip without Ray)


@pytest.fixture(scope="module", autouse=True)
def _ray():
    yield
    ray.shutdown()


def test_the_generator_tracks_the_trainers_weights():
    m = module()
    g = Generator(m.policy.spec, m.sampler.engine.sampling)
    with torch.no_grad():
        for p in m.policy.parameters():
            p.add_(0.01)
    g.load(3, trainable_weights(m.policy))
    for (name, p), q in zip(m.policy.model.named_parameters(), g.policy.model.parameters()):
        assert torch.equal(p, q), name
    prompts = prompt_batch(m.policy).prompt_ids
    out = g.generate(prompts, 2, seed=5)
    assert out["version"] == 3 and len(out["rollout"]) == 8 and out["rng"] is None
    assert torch.equal(out["rollout"].response_ids, g.generate(prompts, 2, seed=5)["rollout"].response_ids)
    # The trainer's stream handed over: the same draws as sampling here, and the state after them handed back.
    torch.manual_seed(7)
    here = m.sampler.engine.generate(m.policy, prompts, 2)
    after = torch.get_rng_state()
    torch.manual_seed(7)
    there = g.generate(prompts, 2, rng=torch.get_rng_state())
    assert torch.equal(here.response_ids, there["rollout"].response_ids) and torch.equal(there["rng"], after)


@pytest.mark.slow
def test_a_generator_that_cannot_start_in_time_fails_on_one_line():
    m = module(AsyncSource(generator=GeneratorPlacement(timeout_s=0.001)))
    with pytest.raises(
        AlignConfigError,
        match=r"^model\.source\.generator: Ray did not start a generator with 1 CPUs "
        r"and 0 GPUs within timeout_s=0\.001 s; .* raise generator\.timeout_s",
    ):
        m.training_step(batches(m, 1)[0], 0)


@pytest.mark.slow
def test_errors_inside_the_generator_reach_the_trainer_on_one_line():
    from align.errors import AlignError
    from align.rollout.generator import connect, generator_error, start_generator

    m = module()
    connect(None, 1)
    with pytest.raises(
        AlignError,
        match=r"^generator: could not be started on its Ray node: .*AlignConfigError: "
        r"model: '/nowhere' does not exist",
    ):
        start_generator(GeneratorPlacement(), {**m.policy.spec, "model": "/nowhere"}, SamplingConfig(), 1, "bad")
    actor, _ = start_generator(GeneratorPlacement(), m.policy.spec, SamplingConfig(), 1, "good")
    try:
        with pytest.raises(ray.exceptions.RayTaskError) as caught:
            ray.get(actor.load.remote(1, {"nope.weight": torch.zeros(2)}))
        error = generator_error(caught.value)
        assert type(error) is AlignConfigError and "\n" not in str(error)
        assert str(error).startswith("generator: the policy rebuilt from its settings has no weights ['nope.weight']")
    finally:
        ray.kill(actor)
