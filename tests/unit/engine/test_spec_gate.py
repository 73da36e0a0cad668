"""SpecGate: ADAPTIVE requests draft only while drafting steps are measured faster (exact)."""
from __future__ import annotations

import pytest

from kvmesh.services.engine.spec_gate import SpecGate


def run(gate: SpecGate, batch: int, steps: int, spec_rate: float, plain_rate: float) -> list[bool]:
    """Drives the gate with steps whose throughput depends only on its decision."""
    decisions = []
    for _ in range(steps):
        allowed = gate.allow(batch)
        decisions.append(allowed)
        gate.record(batch, allowed, tokens=10, seconds=10 / (spec_rate if allowed else plain_rate))
    return decisions


def test_warm_up_alternates_then_the_faster_side_wins_with_exploration():
    gate = SpecGate(explore_every=8, min_steps=3)
    slow_spec = run(gate, batch=8, steps=64, spec_rate=80.0, plain_rate=100.0)
    assert slow_spec[:6] == [True, False, True, False, True, False]
    after = slow_spec[6:]
    assert sum(after) == sum(1 for i in range(7, 65) if i % 8 == 0)   # only the exploration steps
    assert gate.rates(8) == (pytest.approx(80.0), pytest.approx(100.0))
    fast_spec = run(SpecGate(explore_every=8, min_steps=3), batch=1, steps=64, spec_rate=120.0, plain_rate=100.0)
    assert fast_spec[6:].count(False) == sum(1 for i in range(7, 65) if i % 8 == 0)


def test_batch_sizes_are_measured_apart_and_the_gate_follows_a_change():
    gate = SpecGate(explore_every=4, min_steps=2)
    assert [SpecGate.bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]
    run(gate, batch=1, steps=40, spec_rate=150.0, plain_rate=100.0)
    run(gate, batch=8, steps=40, spec_rate=50.0, plain_rate=100.0)
    assert gate.allow(1) or gate.allow(1)            # batch 1 keeps drafting (one may explore)
    later = run(gate, batch=8, steps=200, spec_rate=300.0, plain_rate=100.0)   # drafting got cheaper
    assert sum(later[-20:]) == 15                    # spec won back: only 1 in 4 explores plain


def test_the_engine_leaves_adaptive_requests_out_of_propose_when_the_gate_says_so(tmp_path):
    import time

    from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint
    from kvmesh.services.engine.core import EngineRequest
    from kvmesh.services.engine.speculation import SpecMode

    tiny = load_tiny(make_tiny_checkpoint(tmp_path))
    fake = FakeDraftService(propose=lambda rid, history, k: history[-k:])
    try:
        core = make_core(tiny, draft_address=fake.address, speculation="ngram", spec_max_draft_tokens=4,
                             spec_step_rows=256)
        decisions = []

        def allow(batch):
            decisions.append(len(decisions) % 2 == 0)   # every other step: adaptive may draft
            return decisions[-1]

        core.speculator.gate.allow = allow
        core.add_request(EngineRequest("a", [5, 6, 7, 8], greedy(12), time.monotonic(), speculation=SpecMode.ADAPTIVE))
        core.add_request(EngineRequest("n", [9, 8, 7, 6], greedy(12), time.monotonic(), speculation=SpecMode.NGRAM))
        while core.has_work:
            core.step()
        core.drafts.close()
    finally:
        fake.stop()
    asked = [{s.sequence_id.split("/")[-1] for s in c.sequences} for c in fake.calls]
    assert decisions and any("a" in ids for ids in asked)          # allowed steps include it
    assert sum("a" in ids for ids in asked) <= decisions.count(True)
    assert all("n" in ids for ids in asked if ids)                  # NGRAM requests are not gated
    assert sum("n" in ids for ids in asked) > sum("a" in ids for ids in asked)
