"""The rollout layer's seams without a trainer: the sampler, the rollout sources and the generation-engine table.

A scripted engine stands in for a second engine (it answers every prompt with the same tokens) to show that the
sampler, the episodes and an RL module's training step use whatever ``sampling.engine`` names."""

import os
import socket
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from align.errors import AlignConfigError
from align.models.critic import CriticSettings
from align.models.policy import PolicyModel
from align.modules.grpo import GRPOModule
from align.modules.online_dpo import OnlineDPOModule
from align.modules.ppo import PPOModule
from align.rollout.engine import GenerationEngine, HeldOutSampling, SamplingConfig, make_engine
from align.rollout.filter import concat_rollouts
from align.rollout.rewards import training_rewards
from align.rollout.sampler import Sampler
from align.rollout.sampling import SampleOutput
from align.rollout.source import FilteredSource, InlineSource

sys.path.insert(0, str(Path(__file__).parents[1] / "modules"))
from _helpers import PROMPTS, length_reward, prompt_batch, standalone  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def policy():
    return PolicyModel("tiny-sort")


def sampler_of(policy, group_size=2, **kw) -> Sampler:
    reward, _ = training_rewards([length_reward], None, None)
    return Sampler(policy, reward, group_size, SamplingConfig(max_new_tokens=6), **kw)


def test_a_sampled_rollout_is_scored_timed_counted_and_versioned(policy):
    sampler = sampler_of(policy)
    scored = sampler.sample(prompt_batch(policy, PROMPTS[:3]), version=7)
    assert len(scored.rollout) == 6 and scored.rewards.shape == (6,) and set(scored.parts) == {"length_reward"}
    assert set(scored.timings) == {"time/generation_s", "time/scoring_s"}
    assert scored.rollout.policy_version == 7 and sampler.rollouts == 1
    expected = torch.tensor([float(len(t) % 3) for t in scored.rollout.texts])
    assert torch.equal(scored.rewards, expected)
    assert not hasattr(sampler, "reference_logprobs") and not hasattr(sampler, "token_logprobs")  # the scorer's


def test_joined_rollouts_keep_the_oldest_policy_version(policy):
    sampler = sampler_of(policy)
    batch = prompt_batch(policy, PROMPTS[:2])
    first = sampler.rollout(batch)
    second = sampler.rollout(batch, version=3)
    joined = concat_rollouts([second, first], policy.tokenizer.pad_token_id)
    assert (first.policy_version, second.policy_version, joined.policy_version) == (0, 3, 0)


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


def test_the_inline_source_samples_every_step(policy):
    sampler = sampler_of(policy)
    source = InlineSource()
    source.bind(sampler)
    assert len(source.next(prompt_batch(policy, PROMPTS[:2]), 0).rollout) == 4 and not source.pending
    assert source.state_dict() == {} and source.max_steps_without_update == 0


def test_the_filtered_source_refuses_what_it_cannot_filter(policy):
    with pytest.raises(AlignConfigError, match=r"^model\.source: FilteredSource .* model\.group_size >= 2, got 1$"):
        FilteredSource().bind(sampler_of(policy, group_size=1))
    with pytest.raises(AlignConfigError, match=r"^model\.source\.reward: expected one of the rewards"):
        FilteredSource(reward="accuracy").bind(sampler_of(policy))


def half_reward(prompts, completions, **kw):
    """Differs within the group of the first prompt only: one informative group per batch of two prompts."""
    return [float(i % 2) if p == PROMPTS[0] else 1.0 for i, p in enumerate(prompts)]


@pytest.mark.parametrize(
    "make",
    [
        lambda policy, source: OnlineDPOModule(
            policy=policy,
            rewards=[half_reward],
            group_size=2,
            source=source,
            log_entropy=False,
            sampling=SamplingConfig(max_new_tokens=6),
        ),
        lambda policy, source: PPOModule(
            policy=PolicyModel("tiny-sort", critic=CriticSettings(kind="shared")),
            rewards=[half_reward],
            group_size=2,
            source=source,
            log_entropy=False,
            sampling=SamplingConfig(max_new_tokens=6),
        ),
    ],
    ids=["online_dpo", "ppo"],
)
def test_dynamic_sampling_serves_every_rl_module(policy, make):
    # Two prompts per batch, one informative group each: the first step buffers one group, the second fills the
    # update of two groups.
    module = make(policy, FilteredSource(max_batches=3))
    optimizer = standalone(module)
    batch = prompt_batch(policy, PROMPTS[:2])
    module.setup("fit")
    torch.manual_seed(0)
    module.training_step(batch, 0)
    assert optimizer.steps == 0 and module.source.pending and module.batches_without_update == 1
    module.training_step(batch, 1)
    assert optimizer.steps > 0 and not module.source.pending
    m = module.last_metrics
    assert m["rollout/sampling_batches"] == 2 and m["rollout/kept_groups"] == 2 and m["rollout/kept_frac"] == 0.5
    assert module.rl_counters["rollouts"] == 2


RANKS_CHILD = """
import os, sys
import torch.distributed as dist
from align.rollout.rewards import CombinedReward, RewardError
from align.rollout.sampler import stop_together
from align.core.stats import Ranks

rank = int(sys.argv[1])
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{sys.argv[2]}")
ranks = Ranks(rank, 2, lambda t: (dist.all_reduce(t), t)[1])


def fussy(completions, **kw):
    if rank == 1 and "b" in completions:
        raise ValueError("rank 1 cannot score this")
    return [1.0] * len(completions)


reward = CombinedReward([fussy])
for batch in (["a"], ["b"]):
    error = None
    try:
        reward(["p"], batch)
    except Exception as err:
        error = err
    try:
        stop_together(error, ranks)
        print("scored", batch, flush=True)
    except RewardError as err:
        print("stopped:", err, flush=True)
        break
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_a_reward_failing_on_one_rank_stops_every_rank_with_the_same_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANKS_CHILD, str(rank), str(port)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    lines = [out.strip().splitlines() for out, _ in outs]
    assert lines[0][0] == lines[1][0] == "scored ['a']"
    assert lines[0][1] == lines[1][1]
    assert lines[0][1].startswith("stopped: reward 'fussy'") and "rank 1 cannot score this" in lines[0][1]
    assert lines[0][1].endswith("[scoring failed on rank 1 of 2; every rank stops]")
