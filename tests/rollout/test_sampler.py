"""The sampler without a trainer (align.rollout.sampler): a sampled rollout scored, timed, counted and versioned, and
a reward failing on one rank stopping every rank on the same line."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from align.models.policy import PolicyModel
from align.rollout.engine import SamplingConfig
from align.rollout.rewards import training_rewards
from align.rollout.sampler import Sampler

sys.path.insert(0, str(Path(__file__).parents[1] / "modules"))
from _helpers import PROMPTS, length_reward, prompt_batch  # noqa: E402

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
