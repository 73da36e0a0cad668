"""N-gram drafter: exact proposals for hand-made sequences; the incremental index agrees with a
brute-force lookup at every point of a sequence fed in pieces."""
from __future__ import annotations

import random

import pytest

from draft_utils import ngram_reference
from kvmesh.services.draft.drafters import DraftJob
from kvmesh.services.draft.ngram import NgramDrafter, NgramIndex, continue_from
from kvmesh.services.draft.state import SequenceState


def lookup(tokens, k, n_min=2, n_max=4):
    index = NgramIndex(n_min, n_max)
    index.update(tokens)
    return index.lookup(tokens, k)


@pytest.mark.parametrize("tokens, k, expected", [
    ([1, 2, 3, 4, 1, 2, 3], 4, [4, 1, 2, 3]),               # "1 2 3" occurred at 0: continue it
    ([1, 2, 3, 4, 1, 2, 3], 6, [4, 1, 2, 3, 4, 1]),         # ... into the copy itself
    ([5, 6, 7, 5, 6, 8, 5, 6], 3, [8, 5, 6]),               # the latest earlier occurrence wins
    ([1, 2, 3, 9, 2, 3, 7, 1, 2, 3], 2, [9, 2]),            # the longest n-gram wins over recency
    ([7, 7, 7, 7], 5, [7, 7, 7, 7, 7]),                     # period 1: a full budget
    ([1, 2, 3, 4, 5], 3, []),                               # nothing repeats
    ([3, 1], 3, []),                                        # too short
    ([4, 9, 9, 1, 2, 4, 9], 1, [9]),
])
def test_hand_made_proposals(tokens, k, expected):
    assert lookup(tokens, k) == expected
    assert ngram_reference(tokens, 2, 4, k) == expected


def test_unigrams_only_match_when_allowed():
    tokens = [1, 2, 3, 1]
    assert lookup(tokens, 3, n_min=2) == []
    assert lookup(tokens, 3, n_min=1) == [2, 3, 1]


def test_n_max_bounds_the_match():
    tokens = [1, 2, 3, 5, 0, 2, 3, 6, 1, 2, 3]
    assert lookup(tokens, 1, n_max=3) == [5]  # "1 2 3" at 0
    assert lookup(tokens, 1, n_max=2) == [6]  # only "2 3": its latest occurrence is at 5


def test_continue_from_copies_with_overlap():
    assert continue_from([1, 2, 3], 1, 5) == [2, 3, 2, 3, 2]
    assert continue_from([1, 2, 3], 0, 0) == []


@pytest.mark.parametrize("seed", range(6))
def test_incremental_index_equals_brute_force(seed):
    rng = random.Random(seed)
    n_min, n_max = rng.choice([(1, 3), (2, 4), (2, 2), (3, 5)])
    alphabet = rng.choice([3, 5, 12])
    tokens: list[int] = []
    index = NgramIndex(n_min, n_max)
    while len(tokens) < 300:
        tokens += [rng.randrange(alphabet) for _ in range(rng.randint(0, 9))]
        index.update(tokens)
        k = rng.randint(1, 8)
        assert index.lookup(tokens, k) == ngram_reference(tokens, n_min, n_max, k), len(tokens)


def test_drafter_indexes_incrementally_and_rebuilds_after_a_rewrite():
    drafter = NgramDrafter(2, 4)
    state = SequenceState("s", [1, 2, 3, 4, 1, 2])
    assert drafter.propose([DraftJob(state, 3)])[0].token_ids == [3, 4, 1]
    index = state.slots["ngram"]
    state.append([5, 1, 2])
    assert drafter.propose([DraftJob(state, 2)])[0].token_ids == [5, 1]  # latest "1 2" -> 5
    assert state.slots["ngram"] is index and index.indexed == 9
    state.replace([9, 8, 9, 8, 9])  # diverges from the old history: a new epoch
    assert drafter.propose([DraftJob(state, 2)])[0].token_ids == [8, 9]
    assert state.slots["ngram"] is not index
    drafter.release(state)
    assert "ngram" not in state.slots


def test_bad_ranges_are_refused():
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)
    with pytest.raises(ValueError):
        NgramIndex(0, 2)
