"""The draft service failing, slow, down, restarted or out of step: the engine decodes plainly
(same greedy output), counts the failures, backs off, and speculates again by itself.

No test races the wall clock: a late answer is scripted (DEADLINE_EXCEEDED, what the client sees
when its deadline passes) or held until after the deadline, and the back-off runs on a FakeClock
the test advances."""
import time

import grpc
import pytest

from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint, oracle_drafts, run_all
from fake_clock import FakeClock
from kvmesh.draft.v1 import draft_pb2
from kvmesh.services.engine.core import EngineRequest
from kvmesh.services.engine.speculation import SpecMode

PROMPTS = {f"r{i}": [(11 * i + 5 * j + 3) % 256 for j in range(24 + 6 * i)] for i in range(3)}
PARAMS = greedy(60, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def plain(tiny):
    return {rid: out["tokens"] for rid, out in run_all(make_core(tiny), PROMPTS, PARAMS).items()}


@pytest.fixture
def fake(plain):
    service = FakeDraftService(oracle_drafts(PROMPTS, plain))
    yield service
    service.stop()


LATE = grpc.StatusCode.DEADLINE_EXCEEDED


def _core(tiny, fake, **kw):
    """Requests draft at every step (n-gram mode, no SpecGate and no row budget in the way: the
    failure handling is under test); a deadline no answer misses unless the test says so; the
    back-off on a FakeClock (`draft_clock`) that only the test moves."""
    kw.setdefault("speculation", "ngram")
    kw.setdefault("spec_step_rows", 256)
    kw.setdefault("draft_timeout_s", 5.0)
    kw.setdefault("draft_retry_s", 1.0)
    kw.setdefault("draft_clock", FakeClock())
    return make_core(tiny, draft_address=fake.address, **kw)


class _Run:
    """Steps a core over PROMPTS by hand, so a test can change the service between steps."""

    def __init__(self, core):
        self.core = core
        self.tokens = {rid: [] for rid in PROMPTS}
        self.finals = {}
        for rid, ids in PROMPTS.items():
            core.add_request(EngineRequest(rid, ids, PARAMS, time.monotonic()))

    def steps(self, n):
        for _ in range(n):
            for out in self.core.step():
                self.tokens[out.request_id] += out.token_ids
                if out.finished:
                    self.finals[out.request_id] = out

    def finish(self):
        while self.core.has_work:
            self.steps(1)
        return self


def test_failing_service_means_plain_decoding_counted_and_backed_off(tiny, fake, plain):
    fake.fail = grpc.StatusCode.UNAVAILABLE
    core = _core(tiny, fake)
    got = run_all(core, PROMPTS, PARAMS)
    assert {rid: v["tokens"] for rid, v in got.items()} == plain
    assert core.drafts.stats.failures == 1 and len(fake.calls) == 1  # then it backed off
    assert core.spec_totals.steps == 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_an_answer_after_the_deadline_is_not_waited_for(tiny, fake, plain):
    """The real deadline: the service answers only once the test lets it, after the engine's
    0.05 s have passed, so every call misses it however loaded the machine is."""
    fake.hold_answers()
    core = _core(tiny, fake, draft_timeout_s=0.05)
    run = _Run(core)
    run.steps(4)
    # the first late call is forgiven (the next step calls again), the second backs off
    assert core.drafts.stats.failures == 2 and core.drafts.stats.calls == 2 and not core.drafts.available
    assert core.spec_totals.steps == 0
    fake.release_answers()
    assert run.finish().tokens == plain


def test_slow_service_misses_its_deadline_and_speculation_resumes(tiny, fake, plain):
    clock = FakeClock()
    fake.fail_next = [LATE] * 2
    core = _core(tiny, fake, draft_clock=clock)
    run = _Run(core)
    run.steps(4)
    assert core.drafts.stats.failures == 2 and core.spec_totals.steps == 0
    clock.advance(core.drafts.config.retry_s)
    run.finish()
    assert run.tokens == plain
    assert core.spec_totals.steps > 0
    assert sum(f.spec.accepted_tokens for f in run.finals.values()) == core.spec_totals.accepted_tokens


def test_killed_and_restarted_service_resyncs_and_speculation_resumes(tiny, fake, plain):
    clock = FakeClock()
    core = _core(tiny, fake, draft_clock=clock)
    run = _Run(core)
    run.steps(4)
    before = core.spec_totals.steps
    assert before > 0
    fake.stop()
    run.steps(4)  # down: plain decoding, one failure per retry period
    assert core.spec_totals.steps == before and core.drafts.stats.failures == 1
    fake.start()  # same port, no state: every sequence must be resent whole
    calls_before = len(fake.calls)
    # gRPC reconnects on its own back-off timer: wait for the connection, then for the retry period
    grpc.channel_ready_future(core.drafts._channel).result(timeout=20)
    clock.advance(core.drafts.config.retry_s)
    while core.spec_totals.steps == before and core.has_work:
        run.steps(1)
    assert core.spec_totals.steps > before, "speculation did not resume after the service came back"
    resyncs = [s for c in fake.calls[calls_before:] for s in c.sequences if s.resync]
    assert {s.sequence_id for s in resyncs} == {core.drafts.sequence_id(r) for r in PROMPTS}
    for s in resyncs:
        rid = s.sequence_id.split("/", 1)[1]
        assert list(s.resync) == (PROMPTS[rid] + plain[rid])[:s.committed_len] and not s.new_token_ids
    assert core.drafts.stats.resyncs == len(PROMPTS)
    run.finish()
    assert run.tokens == plain
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_lost_state_is_resynced(tiny, fake, plain):
    """The service forgets a sequence (TTL, eviction): it answers needs_resync, the engine sends
    the whole sequence at its next step, and drafts continue from there."""
    core = _core(tiny, fake)
    run = _Run(core)
    run.steps(3)
    sid = core.drafts.sequence_id("r1")
    del fake.histories[sid]
    n = len(fake.calls)
    run.steps(2)
    first, second = ([s for s in c.sequences if s.sequence_id == sid][0] for c in fake.calls[n:n + 2])
    assert first.new_token_ids and not first.resync                 # the engine did not know yet
    assert list(second.resync) == (PROMPTS["r1"] + plain["r1"])[:second.committed_len]
    assert core.drafts.stats.resyncs == 1
    run.finish()
    assert run.tokens == plain
    assert run.finals["r1"].spec.steps > 0


def test_a_drafter_the_service_does_not_offer_is_not_asked_for(tiny, fake, plain):
    fake.drafters = [draft_pb2.DRAFTER_NGRAM]
    core = _core(tiny, fake)
    core.drafts._info.result(timeout=5)  # GetInfo answered (it is asked without waiting)
    prompts = {"r0": PROMPTS["r0"], "r1": PROMPTS["r1"]}
    core.add_request(EngineRequest("r0", prompts["r0"], PARAMS, time.monotonic(), speculation=SpecMode.MODEL))
    core.add_request(EngineRequest("r1", prompts["r1"], PARAMS, time.monotonic(), speculation=SpecMode.NGRAM))
    finals, tokens = {}, {"r0": [], "r1": []}
    while core.has_work:
        for out in core.step():
            tokens[out.request_id] += out.token_ids
            if out.finished:
                finals[out.request_id] = out
    assert tokens == {"r0": plain["r0"], "r1": plain["r1"]}
    assert finals["r0"].spec.steps == 0 and finals["r1"].spec.steps > 0
    assert {s.drafter for c in fake.calls for s in c.sequences} == {draft_pb2.DRAFTER_NGRAM}
    assert core.drafts.stats.failures == 0


def test_one_late_answer_is_forgiven_two_in_a_row_back_off(tiny, fake, plain):
    fake.fail_next = [LATE]
    core = _core(tiny, fake)
    run = _Run(core)
    run.steps(3)
    assert core.drafts.stats.failures == 1 and core.drafts.available   # the next step called again
    assert core.spec_totals.steps > 0
    fake.fail = LATE
    run.steps(4)
    assert core.drafts.stats.failures == 3 and not core.drafts.available
    assert len(fake.calls) == core.drafts.stats.calls                  # no call while backing off
    calls_then = len(fake.calls)
    run.steps(2)
    assert len(fake.calls) == calls_then
    fake.fail = None
    assert run.finish().tokens == plain
