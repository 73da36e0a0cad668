"""State store: TTL (on read and by sweep), Release, the LRU cap, drop hooks, resync semantics."""
from __future__ import annotations

import pytest

from fake_clock import FakeClock
from kvmesh.services.draft.state import SequenceState, StateStore


def make_store(ttl_s=60.0, max_sequences=8):
    clock, dropped = FakeClock(), []
    store = StateStore(ttl_s=ttl_s, max_sequences=max_sequences,
                       on_drop=lambda s: dropped.append(s.sequence_id), clock=clock)
    return store, clock, dropped


def test_ttl_counts_from_the_last_call_and_expired_states_are_gone_at_once():
    store, clock, dropped = make_store(ttl_s=10)
    store.create("a", [1, 2])
    store.create("b", [3])
    clock.advance(8)
    assert store.get("a").tokens == [1, 2]  # refreshes a
    clock.advance(3)                          # b idle 11 s, a idle 3 s
    assert store.get("b") is None and dropped == ["b"]
    assert "a" in store and len(store) == 1
    assert store.expired == 1


def test_sweep_drops_only_the_idle_ones():
    store, clock, dropped = make_store(ttl_s=10)
    for sid in "abc":
        store.create(sid, [])
        clock.advance(4)
    assert store.sweep() == 1 and dropped == ["a"]  # idle 12, 8 and 4 s
    clock.advance(4)
    assert store.sweep() == 1 and dropped == ["a", "b"]
    assert store.peek("c") is not None and store.sweep() == 0


def test_release_drops_at_once_and_is_idempotent():
    store, _, dropped = make_store()
    store.create("a", [1])
    store.create("b", [2])
    assert store.release(["a", "zzz", "a"]) == 1
    assert dropped == ["a"] and store.release(["a"]) == 0
    assert store.get("a") is None and store.get("b") is not None


def test_lru_cap_evicts_the_least_recently_used():
    store, _, dropped = make_store(max_sequences=3)
    for sid in "abc":
        store.create(sid, [])
    store.get("a")                      # b is now the least recently used
    store.create("d", [])
    assert dropped == ["b"] and store.evicted == 1
    store.peek("c")                     # peeking does not refresh
    store.create("e", [])
    assert dropped == ["b", "c"]
    assert [sid for sid in "abcde" if sid in store] == ["a", "d", "e"]


def test_create_replaces_an_existing_state():
    store, _, dropped = make_store()
    old = store.create("a", [1])
    new = store.create("a", [2])
    assert dropped == ["a"] and store.get("a") is new is not old


def test_replace_extends_or_starts_a_new_epoch():
    state = SequenceState("s", [1, 2, 3])
    assert state.replace([1, 2, 3, 4]) == 3 and state.epoch == 0 and state.tokens == [1, 2, 3, 4]
    assert state.replace([1, 2, 9]) == 2 and state.epoch == 1 and state.tokens == [1, 2, 9]
    assert state.replace([1]) == 1 and state.epoch == 2 and state.tokens == [1]


def test_bad_limits_are_refused():
    with pytest.raises(ValueError):
        StateStore(ttl_s=0, max_sequences=1)
    with pytest.raises(ValueError):
        StateStore(ttl_s=1, max_sequences=0)
