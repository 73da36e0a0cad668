"""Model drafter on the tiny random-weight model: its drafts equal a direct greedy decode of the
same model from the same context — batched, after partial acceptance (rollback), after a
resync, with chunked catch-up and under KV-pool pressure. One slow test on the bundled model."""
from __future__ import annotations

import random

import pytest

from draft_utils import greedy_reference
from engine_utils import load_tiny, make_tiny_checkpoint
from kvmesh.services.draft.drafters import DraftJob
from kvmesh.services.draft.model_drafter import ModelDrafter, describe_model
from kvmesh.services.draft.state import SequenceState


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def context(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def drafter(loaded, num_blocks=64, block_size=4, catch_up_tokens=4096) -> ModelDrafter:
    return ModelDrafter(loaded, num_blocks=num_blocks, block_size=block_size, catch_up_tokens=catch_up_tokens)


def check(loaded, proposal, history, k):
    tokens, logprobs = greedy_reference(loaded, history, k)
    assert proposal.token_ids == tokens
    assert proposal.logprobs == pytest.approx(logprobs, abs=1e-4)


def test_a_batch_drafts_like_separate_greedy_decodes(tiny):
    d = drafter(tiny)
    states = [SequenceState(f"s{i}", context(i, n)) for i, n in enumerate((1, 7, 23))]
    budgets = (4, 1, 6)
    proposals = d.propose([DraftJob(s, k) for s, k in zip(states, budgets)])
    for state, k, proposal in zip(states, budgets, proposals):
        check(tiny, proposal, state.tokens, k)
        assert d.pool.blocks_for(len(state.tokens) + k - 1) == len(state.slots["model"].blocks)
    # the slot holds the history and the drafts it fed back (all but the last)
    assert states[2].slots["model"].tokens == states[2].tokens + proposals[2].token_ids[:5]


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_after_partial_acceptance_and_a_different_committed_token(tiny, accepted):
    d = drafter(tiny)
    state = SequenceState("s", context(3, 30))
    first = d.propose([DraftJob(state, 4)])[0].token_ids
    bonus = (first[accepted] + 1) % 256 if accepted < 4 else 17  # the engine's own next token
    state.append(first[:accepted] + [bonus])
    slot = state.slots["model"]
    second = d.propose([DraftJob(state, 5)])[0]
    check(tiny, second, state.tokens, 5)
    assert slot.tokens[:len(state.tokens)] == state.tokens


def test_many_rounds_of_speculation_stay_exact(tiny):
    rng = random.Random(7)
    d = drafter(tiny, num_blocks=128)
    states = [SequenceState(f"s{i}", context(10 + i, rng.randint(1, 40))) for i in range(3)]
    for _ in range(6):
        budgets = [rng.randint(1, 5) for _ in states]
        proposals = d.propose([DraftJob(s, k) for s, k in zip(states, budgets)])
        for state, k, proposal in zip(states, budgets, proposals):
            check(tiny, proposal, state.tokens, k)
            accepted = rng.randint(0, k)
            state.append(proposal.token_ids[:accepted] + [rng.randrange(256)])


def test_resync_keeps_the_common_prefix_and_recomputes_the_rest(tiny):
    d = drafter(tiny)
    state = SequenceState("s", context(4, 20))
    d.propose([DraftJob(state, 3)])
    state.replace(state.tokens[:12] + context(5, 9))  # diverges at 12: a new epoch
    check(tiny, d.propose([DraftJob(state, 3)])[0], state.tokens, 3)


def test_catch_up_is_rationed_per_call_shortest_first(tiny):
    d = drafter(tiny, catch_up_tokens=6)
    long, short = SequenceState("long", context(6, 14)), SequenceState("short", context(7, 4))
    computed = []
    for _ in range(3):
        proposal, drafted = d.propose([DraftJob(long, 3), DraftJob(short, 3)])
        check(tiny, drafted, short.tokens, 3)  # first: its 4 tokens, later: its last one again
        assert proposal.token_ids == []
        computed.append(len(long.slots["model"].tokens))
    assert computed == [2, 7, 12]  # what the short one left of the 6 tokens per call
    check(tiny, d.propose([DraftJob(long, 3), DraftJob(short, 3)])[0], long.tokens, 3)


def test_pool_pressure_evicts_idle_sequences_and_skips_what_cannot_fit(tiny):
    d = drafter(tiny, num_blocks=6, block_size=4)  # 24 token slots
    a, b = SequenceState("a", context(8, 10)), SequenceState("b", context(9, 10))
    d.propose([DraftJob(a, 2)])                    # 11 positions: 3 blocks
    check(tiny, d.propose([DraftJob(b, 4)])[0], b.tokens, 4)  # 13 positions: 4 blocks, a evicted
    assert a.slots["model"].blocks == [] and d.pool.evictions == 1
    check(tiny, d.propose([DraftJob(a, 2)])[0], a.tokens, 2)  # recomputed from scratch
    big = SequenceState("big", context(10, 30))
    assert d.propose([DraftJob(big, 2)])[0].token_ids == []   # 31 positions never fit
    assert big.slots["model"].blocks == []


def test_release_returns_the_blocks_and_the_context_limit_caps_drafts(tiny):
    d = drafter(tiny, num_blocks=600, block_size=4)
    state = SequenceState("s", context(11, 2046))     # the tiny model's context is 2048
    assert len(d.propose([DraftJob(state, 5)])[0].token_ids) == 2
    d.release(state)
    assert "model" not in state.slots and d.pool.free_blocks == 600
    assert describe_model(tiny).endswith("fp32, 3 layers")


@pytest.mark.slow
def test_bundled_int4_drafts_are_its_own_greedy_continuation():
    """The engine serving the same int4 model accepts every draft and adds its own next token:
    three rounds of 4 drafts continue one greedy decode of the model. (Only equal up to float
    rounding: the int4 kernels round differently for one row and for several, so a token the
    model itself finds a near-tie could flip; these prompts have none.)"""
    import torch

    from kvmesh.model.loader import load_model

    torch.set_num_threads(2)
    lm = load_model("bundled", weights="int4", progress=False)
    tok = lm.tokenizer
    d = ModelDrafter(lm, num_blocks=64, block_size=16)
    for prompt in ["The capital of France is", "def fibonacci(n):\n    if n <"]:
        own, _ = greedy_reference(lm, tok.encode(prompt), 14)
        state = SequenceState(prompt, tok.encode(prompt))
        for start in (0, 5, 10):  # one sequence per call: the model's single-sequence path
            assert d.propose([DraftJob(state, 4)])[0].token_ids == own[start:start + 4], prompt
            state.append(own[start:start + 5])
    assert describe_model(lm) == "bundled int4, 30 layers"
