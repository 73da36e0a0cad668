"""Placement: the kv_aware score and the exact order each policy gives."""
from __future__ import annotations

import pytest

from kvmesh.services.router.placement import Candidate, Load, TierState, rank, score


def test_score_is_uncached_prompt_plus_queue_plus_weighted_load():
    load = Load(cached_tokens=96, running=2, waiting=1, pending_prefill_tokens=40)
    assert score(128, load, load_weight=10.0) == (128 - 96) + 40 + 10.0 * 3
    assert score(64, Load(cached_tokens=256), 10.0) == 0  # cached beyond the prompt is no bonus


def test_kv_aware_prefers_the_longest_cached_prefix():
    cands = [Candidate("a", probe=Load(cached_tokens=0)),
             Candidate("b", probe=Load(cached_tokens=192)),
             Candidate("c", probe=Load(cached_tokens=64))]
    choice = rank("kv_aware", cands, prompt_tokens=256, load_weight=64, cursor=0)
    assert choice.policy == "kv_aware"
    assert choice.order == ("b", "c", "a")
    assert [r.score for r in choice.ranked] == [64, 192, 256]
    assert [r.cached_tokens for r in choice.ranked] == [192, 64, 0]


def test_load_outweighs_a_cached_prefix_only_when_it_costs_more_than_it_saves():
    warm_busy = Load(cached_tokens=128, running=3)          # saves 128, costs 3 x 64 = 192
    cold_idle = Load(cached_tokens=0)
    cands = [Candidate("warm", probe=warm_busy), Candidate("cold", probe=cold_idle)]
    assert rank("kv_aware", cands, prompt_tokens=200, load_weight=64, cursor=0).order == \
        ("cold", "warm")                                     # 200 < 72 + 192
    assert rank("kv_aware", cands, prompt_tokens=200, load_weight=32, cursor=0).order == \
        ("warm", "cold")                                     # 72 + 96 < 200


def test_pending_prefill_counts_as_work_ahead():
    cands = [Candidate("a", probe=Load(cached_tokens=100, pending_prefill_tokens=500)),
             Candidate("b", probe=Load(cached_tokens=0, pending_prefill_tokens=0))]
    assert rank("kv_aware", cands, prompt_tokens=300, load_weight=0, cursor=0).order == ("b", "a")


@pytest.mark.parametrize("cursor, first", [(0, "a"), (1, "b"), (2, "c"), (3, "a")])
def test_kv_aware_ties_are_broken_round_robin(cursor, first):
    cands = [Candidate(r, probe=Load()) for r in "abc"]
    assert rank("kv_aware", cands, prompt_tokens=10, load_weight=1, cursor=cursor).order[0] == first


def test_unprobed_replicas_rank_after_probed_ones_by_in_flight():
    cands = [Candidate("oai1", in_flight=3), Candidate("eng", probe=Load(running=50)),
             Candidate("oai2", in_flight=1)]
    choice = rank("kv_aware", cands, prompt_tokens=10, load_weight=64, cursor=0)
    assert choice.order == ("eng", "oai2", "oai1") and choice.policy == "kv_aware"
    assert choice.ranked[1].score is None


def test_no_probe_answer_falls_back_to_least_loaded():
    cands = [Candidate("a", in_flight=2), Candidate("b", in_flight=0), Candidate("c", in_flight=1)]
    choice = rank("kv_aware", cands, prompt_tokens=10, load_weight=64, cursor=0)
    assert (choice.policy, choice.order) == ("least_loaded", ("b", "c", "a"))


def test_round_robin_rotates_and_ignores_probes():
    cands = [Candidate("a", probe=Load(cached_tokens=999)), Candidate("b"), Candidate("c")]
    orders = [rank("round_robin", cands, prompt_tokens=10, load_weight=1, cursor=i).order
              for i in range(4)]
    assert orders == [("a", "b", "c"), ("b", "c", "a"), ("c", "a", "b"), ("a", "b", "c")]


def test_least_loaded_ties_rotate():
    cands = [Candidate("a", in_flight=1), Candidate("b", in_flight=1), Candidate("c", in_flight=0)]
    assert rank("least_loaded", cands, prompt_tokens=1, load_weight=1, cursor=0).order == \
        ("c", "a", "b")
    assert rank("least_loaded", cands, prompt_tokens=1, load_weight=1, cursor=1).order == \
        ("c", "b", "a")


def test_tier_state_marks_down_for_the_back_off_then_recovers():
    now = [100.0]
    state = TierState(["a", "b"], backoff_s=5.0, clock=lambda: now[0])
    assert [state.next_cursor() for _ in range(3)] == [0, 1, 2]
    state.mark_down("a", "connection refused")
    assert state.healthy() == ["b"] and state.is_down("a")
    assert state.describe_down() == "a down for 5.0s more (connection refused)"
    now[0] = 104.9
    assert state.healthy() == ["b"]
    now[0] = 105.0
    assert state.healthy() == ["a", "b"] and state.describe_down() == ""
    state.begin("b")
    state.begin("b")
    state.end("b")
    assert state.in_flight == {"a": 0, "b": 1}


def test_a_sole_candidate_is_the_policy_s_pick():
    only = [Candidate("a", probe=Load(cached_tokens=32))]
    choice = rank("kv_aware", only, prompt_tokens=48, load_weight=1, cursor=7)
    assert (choice.policy, choice.ranked[0].cached_tokens, choice.ranked[0].score) == \
        ("kv_aware", 32, 16)
    assert rank("round_robin", [Candidate("a")], prompt_tokens=1, load_weight=1,
                cursor=0).policy == "round_robin"
