"""The P/D prefill hop's Handoff: one result once the prompt is computed and every chunk job has
answered, counting only the stored prefix (jobs answer in order on one export thread)."""
from __future__ import annotations

from fake_clock import FakeClock
from kvmesh.services.engine.kv_transfer import Handoff, HandoffResult


def handoff(clock: FakeClock) -> tuple[Handoff, list[HandoffResult]]:
    results: list[HandoffResult] = []
    return Handoff(results.append, clock=clock), results


def test_the_result_comes_once_sealed_and_every_job_answered():
    clock = FakeClock()
    h, results = handoff(clock)
    h.hold(64)                      # chunks the service held at lookup
    (done1, stored1), (done2, stored2) = h.job(32), h.job(32)
    done1(True)
    stored1(1000)
    assert not results              # not sealed: later chunks may still come
    h.seal()
    clock.advance(0.25)
    assert not results              # a job is still out
    stored2(900)
    done2(True)
    assert results == [HandoffResult(ok=True, tokens=128, bytes=1900, wait_s=0.25)]
    h.seal()
    assert len(results) == 1        # sealing again reports nothing more


def test_a_failed_job_stops_the_count_at_the_stored_prefix():
    h, results = handoff(FakeClock())
    jobs = [h.job(32) for _ in range(3)]
    h.seal()
    jobs[0][0](True)
    jobs[1][0](False)               # the service went away: this chunk and the next are lost
    jobs[2][0](True)
    assert results == [HandoffResult(ok=False, tokens=32, bytes=0, wait_s=0.0)]


def test_nothing_to_export_reports_at_seal_and_fail_reports_at_once():
    h, results = handoff(FakeClock())
    h.hold(256)
    h.seal()
    assert results == [HandoffResult(True, 256, 0, 0.0)]
    h2, results2 = handoff(FakeClock())
    h2.fail()                       # no KV service, or the request ended before its prompt was computed
    assert results2 == [HandoffResult(False, 0, 0, 0.0)]
