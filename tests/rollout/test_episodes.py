"""Multi-turn rollouts (align.rollout.episodes) on the tiny model: environment tokens are in the context but carry no
loss and no KL, the trained log-probs are the sampled ones on every assistant token of every turn, a sampled turn is
never re-tokenized, episodes batched together equal each played alone, and every way an episode ends.

The environments are loaded through the import path of this file, as a user names their own class."""

from pathlib import Path

import pytest
import torch

import align.rollout.engine as engine_module
from align.data.chat import ChatEncoder
from align.data.prompts import PromptBatch
from align.errors import AlignEnvError
from align.models.policy import PolicyModel, TokenLogprobs
from align.modules.grpo import GRPOModule
from align.modules.options import KLPenalty, Updates
from align.rollout.engine import SamplingConfig
from align.rollout.envs.chat import EnvironmentSpec, EnvStep

THIS = str(Path(__file__).resolve())
PROMPTS = ["sort: d a c", "sort: b a", "sort: c c a b", "sort: j e"]


class Rounds:
    """``turns`` rounds (a row's ``turns`` column, else 2); each reply is a new sort prompt; reward 1 per
    well-formed answer at the turn it is given, plus 10 on the last turn."""

    def reset(self, row):
        self.turn, self.turns = 0, int(row.get("turns") or 2)
        return row["messages"]

    def step(self, message):
        self.turn += 1
        reward = float(len(message["content"].split()) > 1) + (10.0 if self.turn == self.turns else 0.0)
        if self.turn == self.turns:
            return EnvStep([], reward, True, {"rounds": 1})
        return EnvStep(
            [{"role": "user", "content": f"sort: {'abcdefghij'[self.turn]} a"}], reward, False, {"rounds": 1}
        )


class DoneAtOnce(Rounds):
    """Says done after every turn, with an info entry named like a built-in metric."""

    def step(self, message):
        return EnvStep([], 1.0, True, {"turns": 7, "answers": 1})


class ToolRole(Rounds):
    def step(self, message):
        return EnvStep([{"role": "tool", "content": "42"}], 0.0, False)


@pytest.fixture(scope="module")
def policy():
    return PolicyModel("tiny-sort")


def module(policy, env="Rounds", group_size=2, temperature=1.0, max_new_tokens=12, max_turns=3, max_tokens=96, **kw):
    spec = EnvironmentSpec(f"{THIS}:{env}", max_turns=max_turns, max_tokens=max_tokens)
    return GRPOModule(
        policy=policy,
        environment=spec,
        group_size=group_size,
        log_entropy=False,
        sampling=SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature),
        **kw,
    )


def batch(policy, prompts=PROMPTS, turns=None) -> PromptBatch:
    enc = ChatEncoder(policy.tokenizer)
    messages = [[{"role": "user", "content": p}] for p in prompts]
    columns = {"turns": list(turns)} if turns is not None else {}
    return PromptBatch([enc.prompt_ids(m) for m in messages], list(prompts), columns, messages)


def segments(mask_row: torch.Tensor, context_row: torch.Tensor) -> list[tuple[bool, int, int]]:
    """Runs of ``(assistant?, start, end)`` over the used part of a response row."""
    used = int(context_row.sum())
    out, start = [], 0
    for j in range(1, used + 1):
        if j == used or bool(mask_row[j]) != bool(mask_row[start]):
            out.append((bool(mask_row[start]), start, j))
            start = j
    return out


def test_environment_tokens_are_context_without_loss_or_kl_and_trained_logprobs_equal_sampled(policy):
    torch.manual_seed(0)
    m = module(policy, kl=KLPenalty(coef=0.1), updates=Updates(epochs=2, max_grad_norm=None))
    m.setup("fit")
    rollout = m.sampler.rollout(batch(policy))
    assert len(rollout) == 8 and rollout.episodes is not None
    environment = rollout.context_mask.bool() & ~rollout.response_mask
    assert environment.any(), "a second turn follows an environment reply"
    assert (rollout.old_logprobs[environment] == 0).all()
    # The attention mask covers the whole conversation, the response mask only the policy's tokens.
    width = rollout.prompt_ids.shape[1]
    assert torch.equal(rollout.attention_mask[:, width:], rollout.context_mask)
    # Trained log-probs (one forward pass over the whole conversation) equal the sampled ones, every turn.
    trained = m.scorer.logprobs(rollout).logprobs.detach()
    mask = rollout.response_mask
    torch.testing.assert_close(trained[mask], rollout.old_logprobs[mask], atol=2e-5, rtol=0)
    # The loss (clipped surrogate + k3 KL in the loss) has no gradient on environment tokens.
    from align.modules.learner import RLBatch

    ref = m.scorer.reference_logprobs(rollout)
    data = RLBatch.from_rollout(rollout, torch.linspace(-1, 1, len(rollout)), ref)
    leaf = (trained + 0.05 * torch.randn_like(trained)).requires_grad_()  # off-policy: ratios away from 1
    m.scorer.logprobs = lambda micro, **kw: TokenLogprobs(leaf[: len(micro), : micro.response_length], None, None)
    loss, stats = m._loss(data.select(torch.arange(len(data))), torch.tensor(float(mask.sum())))
    loss.backward()
    assert stats["train/kl"] > 0
    assert (leaf.grad[:, : data.response_length][environment[:, : data.response_length]] == 0).all()
    assert (leaf.grad[mask] != 0).any()


def test_each_assistant_turn_keeps_the_ids_it_was_sampled_as(policy, monkeypatch):
    sampled = []
    real = engine_module.sample

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        sampled.append(out.response_ids.tolist())
        return out

    monkeypatch.setattr(engine_module, "sample", recording)
    torch.manual_seed(1)
    m = module(policy, temperature=1.5)
    rollout = m.sampler.rollout(batch(policy, PROMPTS[:2], turns=[3, 3]), 1)
    stop = policy.tokenizer.eos_token_id
    enc = ChatEncoder(policy.tokenizer)
    retokenized_differs = False
    for row in range(len(rollout)):
        turns = [s for s in segments(rollout.response_mask[row], rollout.context_mask[row]) if s[0]]
        assert len(turns) == rollout.episodes[row]["turns"]
        for k, (_, start, end) in enumerate(turns):
            ids = rollout.response_ids[row, start:end].tolist()
            active = [r for r in range(len(rollout)) if rollout.episodes[r]["turns"] > k]  # finished ones left
            drawn = sampled[k][active.index(row)][: len(ids)]
            assert ids == drawn  # the policy is trained on exactly the tokens it produced
            assert ids[-1] == stop or end == int(rollout.context_mask[row].sum())
            text = policy.tokenizer.decode(ids, skip_special_tokens=True)
            retokenized_differs |= enc._ids(text) != [t for t in ids if t != stop]
    # At temperature 1.5 the tiny model writes token sequences that the tokenizer would merge differently: the
    # check above would fail for a loop that re-encoded the conversation.
    assert retokenized_differs


def test_episodes_batched_together_equal_each_played_alone(policy):
    turns = [1, 3, 2, 3]
    m = module(policy, temperature=0.0)
    together = m.sampler.rollout(batch(policy, turns=turns), 1, m.sampler.eval_engine)
    assert sorted(e["turns"] for e in together.episodes) == [1, 2, 3, 3]
    for i, prompt in enumerate(PROMPTS):
        alone = m.sampler.rollout(batch(policy, [prompt], turns=[turns[i]]), 1, m.sampler.eval_engine)
        width = alone.response_ids.shape[1]
        assert int(together.context_mask[i].sum()) == width
        assert torch.equal(together.response_ids[i, :width], alone.response_ids[0])
        assert torch.equal(together.response_mask[i, :width], alone.response_mask[0])
        torch.testing.assert_close(together.old_logprobs[i, :width], alone.old_logprobs[0], atol=1e-5, rtol=0)
        assert torch.equal(together.token_rewards[i, :width], alone.token_rewards[0])
        assert together.episodes[i]["messages"] == alone.episodes[0]["messages"]
        assert together.texts[i] == alone.texts[0]


def test_rewards_sit_on_each_turns_last_token_and_sum_to_the_env_part(policy):
    torch.manual_seed(2)
    m = module(policy)
    b = batch(policy, turns=[2, 2, 3, 1])
    rollout = m.sampler.rollout(b)
    total, parts = m.sampler.score(b, rollout)
    torch.testing.assert_close(parts["env"], rollout.token_rewards.sum(dim=1))
    torch.testing.assert_close(total, parts["env"])
    for row, episode in enumerate(rollout.episodes):
        ends = [end - 1 for a, _, end in segments(rollout.response_mask[row], rollout.context_mask[row]) if a]
        nonzero = rollout.token_rewards[row].nonzero().flatten().tolist()
        assert set(nonzero) <= set(ends) and ends[-1] in nonzero  # the last turn carries at least the +10
        assert episode["end"] == "done" and not rollout.truncated[row]
    assert rollout.metrics["rollout/turns"] == pytest.approx(sum(e["turns"] for e in rollout.episodes) / 8)
    assert rollout.metrics["rollout/rounds"] == rollout.metrics["rollout/turns"]


@pytest.mark.parametrize(
    "limits, end",
    [
        (dict(max_turns=2), "max_turns"),
        (dict(max_new_tokens=1), "turn_length"),
        (dict(max_tokens=8, max_new_tokens=12), "max_tokens"),
    ],
)
def test_every_limit_ends_episodes_as_truncated(policy, limits, end):
    torch.manual_seed(3)
    m = module(policy, temperature=0.0, **limits)
    rollout = m.sampler.rollout(batch(policy, turns=[5, 5, 5, 5]), 1, m.sampler.eval_engine)
    assert {e["end"] for e in rollout.episodes} == {end}
    assert rollout.truncated.all() and rollout.metrics["rollout/truncated_frac"] == 1.0
    if end == "max_tokens":
        assert int(rollout.context_mask.sum(dim=1).max()) <= 8
    if end == "max_turns":
        assert all(e["turns"] == 2 for e in rollout.episodes)


def test_a_cut_turn_ends_its_episode_as_truncated_even_when_the_environment_says_done(policy):
    m = module(policy, env="DoneAtOnce", temperature=0.0)
    cut = m.sampler.rollout(batch(policy), 1, m.sampler.eval_engine)  # greedy tiny-sort answers stop within 12 tokens
    assert {e["end"] for e in cut.episodes} == {"done"} and not cut.truncated.any()
    m = module(policy, env="DoneAtOnce", temperature=0.0, max_new_tokens=1)
    cut = m.sampler.rollout(batch(policy), 1, m.sampler.eval_engine)
    assert {e["end"] for e in cut.episodes} == {"turn_length"} and cut.truncated.all()
    assert [e["env_reward"] for e in cut.episodes] == [1.0] * 4  # the environment still scored the cut turn
    # An info entry named like a built-in metric is logged beside it, not over it.
    assert cut.metrics["rollout/turns"] == 1.0 and cut.metrics["rollout/info/turns"] == 7.0
    assert cut.metrics["rollout/answers"] == 1.0


def test_a_reply_the_template_cannot_render_is_one_line_naming_the_roles(policy):
    m = module(policy, env="ToolRole")
    with pytest.raises(
        AlignEnvError,
        match=r"environment 'ToolRole' .*: episode 0 \(prompt 0 of the batch, sample 0\), "
        r"turn 1: the chat template cannot render the reply \(roles \['tool'\]\)",
    ):
        m.sampler.rollout(batch(policy))


def test_rewards_score_the_last_turn_and_receive_the_conversation(policy):
    seen = {}

    def last_turn(prompts, completions, conversation, prompt_messages, completion_ids, **kw):
        seen.update(conversation=conversation, completions=completions, prompt_messages=prompt_messages)
        return [float(len(c)) for c in completions]

    torch.manual_seed(4)
    m = module(policy, rewards=[last_turn])
    b = batch(policy, turns=[2, 2, 2, 2])
    rollout = m.sampler.rollout(b)
    total, parts = m.sampler.score(b, rollout)
    assert set(parts) == {"last_turn", "env"}
    torch.testing.assert_close(total, parts["last_turn"] + parts["env"])
    for i, conversation in enumerate(seen["conversation"]):
        assert conversation == rollout.episodes[i]["messages"]
        assert conversation[-1] == {"role": "assistant", "content": seen["completions"][i]}
        assert seen["prompt_messages"][i] == [{"role": "user", "content": PROMPTS[i // 2]}]


def test_a_response_template_parses_the_turn_into_the_message_the_environment_sees(policy, monkeypatch):
    received = []

    class Seen(Rounds):
        def step(self, message):
            received.append(message)
            return EnvStep([], 0.0, True)

    monkeypatch.setattr(policy.tokenizer, "response_template", {"stand-in": True}, raising=False)
    monkeypatch.setattr(
        policy.tokenizer,
        "parse_response",
        lambda ids, prefix=None: {"content": "parsed", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]},
        raising=False,
    )
    from align.rollout.envs.chat import EnvironmentPool

    m = module(policy)
    m.sampler.environment = EnvironmentPool(EnvironmentSpec(Seen))
    m.sampler.rollout(batch(policy, PROMPTS[:1]), 1)
    assert received == [
        {"role": "assistant", "content": "parsed", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
    ]


def test_dynamic_sampling_buffers_and_joins_multi_turn_groups(policy):
    from align.rollout.filter import concat_rollouts, select_groups

    torch.manual_seed(5)
    m = module(policy)
    first, second = (
        m.sampler.rollout(batch(policy, PROMPTS[:2], turns=[1, 3])),
        m.sampler.rollout(batch(policy, PROMPTS[2:], turns=[3, 1])),
    )
    joined = concat_rollouts([first, second], policy.tokenizer.pad_token_id)
    assert len(joined) == 8 and len(joined.episodes) == 8
    width = joined.response_ids.shape[1]
    for source, rows in ((first, range(4)), (second, range(4, 8))):
        w = source.response_ids.shape[1]
        assert torch.equal(joined.context_mask[list(rows), :w], source.context_mask)
        assert (joined.context_mask[list(rows), w:width] == 0).all()
        assert torch.equal(joined.token_rewards[list(rows), :w], source.token_rewards)
    picked = select_groups(joined, torch.tensor([3]))
    assert picked.episodes == joined.episodes[6:] and torch.equal(picked.context_mask, joined.context_mask[6:])
    assert picked.prompt_index.tolist() == [0, 0]
