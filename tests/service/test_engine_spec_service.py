"""Speculative decoding through EngineService.Generate (real server on port 0, tiny model, fake
draft service): the per-request override, Final's counters, and a draft service that dies and
comes back in the middle of a stream."""
import asyncio

import grpc
import pytest

from engine_utils import (FakeDraftService, StepGate, greedy, load_tiny, make_core, make_tiny_checkpoint,
                          oracle_drafts, run_all, serve_engine)
from fake_clock import FakeClock
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2

PROMPTS = {"a": [(3 * j + 1) % 256 for j in range(30)], "b": [(5 * j + 2) % 256 for j in range(41)]}
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def plain(tiny):
    got = run_all(make_core(tiny), PROMPTS, greedy(MAX_TOKENS, ignore_eos=True))
    return {rid: v["tokens"] for rid, v in got.items()}


@pytest.fixture
def fake(plain):
    service = FakeDraftService(oracle_drafts(PROMPTS, plain, wrong_at={2}))
    yield service
    service.stop()


def _request(rid, max_tokens=MAX_TOKENS, speculation=engine_pb2.SPECULATION_UNSPECIFIED):
    return engine_pb2.GenerateRequest(
        request_id=rid, token_ids=common_pb2.TokenIds(ids=PROMPTS[rid]), speculation=speculation,
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _tokens(msgs):
    return [t for m in msgs for t in m.delta.token_ids]


async def test_request_override_and_final_counters(tiny, fake, plain):
    core = make_core(tiny, draft_address=fake.address, draft_timeout_s=5.0, speculation="ngram")
    async with serve_engine(core) as served:
        on, off = await asyncio.gather(
            served.collect(_request("a")),
            served.collect(_request("b", speculation=engine_pb2.SPECULATION_OFF)))
    assert _tokens(on) == plain["a"] and _tokens(off) == plain["b"]
    final = on[-1].final
    assert final.spec_steps > 0 and final.accepted_draft_tokens > 0
    assert final.accepted_draft_tokens < final.draft_tokens       # every third draft is wrong
    assert final.usage.completion_tokens == MAX_TOKENS
    assert (off[-1].final.spec_steps, off[-1].final.draft_tokens) == (0, 0)
    assert any(len(m.delta.token_ids) > 1 for m in on)                  # runs arrive as one message
    assert {s.drafter for c in fake.calls for s in c.sequences} == {1}  # DRAFTER_NGRAM


async def test_unknown_speculation_value_is_invalid_argument(tiny, fake):
    core = make_core(tiny, draft_address=fake.address)
    async with serve_engine(core) as served:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.collect(_request("a", speculation=99))
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_draft_service_dies_and_returns_mid_stream(tiny, fake):
    """The step loop moves only when the test lets it (one message per step), so the stream
    outlasts the kill and the restart whatever the machine's speed; the back-off runs on a
    FakeClock."""
    prompt = {"a": PROMPTS["a"]}
    want = run_all(make_core(tiny), prompt, greedy(120, ignore_eos=True))["a"]["tokens"]
    fake.propose = oracle_drafts(prompt, {"a": want})
    clock = FakeClock()
    core = make_core(tiny, draft_address=fake.address, draft_timeout_s=5.0, speculation="ngram",
                     draft_clock=clock)
    gate = StepGate(core)
    async with serve_engine(core) as served:
        try:
            call = served.stub.Generate(_request("a", max_tokens=120), timeout=60)
            gate.allow(3)                                         # the prefill, then two drafting steps
            msgs = [await call.read() for _ in range(3)]
            assert core.spec_totals.steps > 0
            fake.stop()
            gate.allow(1)
            msgs.append(await call.read())                        # that step's call failed: no drafts
            assert core.drafts.stats.failures == 1 and not msgs[-1].HasField("final")
            steps_while_down = core.spec_totals.steps
            fake.start()
            # gRPC reconnects on its own back-off timer: wait for the connection, not for a time
            await asyncio.to_thread(grpc.channel_ready_future(core.drafts._channel).result, 20)
            clock.advance(core.drafts.config.retry_s)
            gate.open()
            while not msgs[-1].HasField("final"):
                msgs.append(await call.read())
        finally:
            gate.open()
    assert _tokens(msgs) == want
    assert core.spec_totals.steps > steps_while_down, "speculation did not resume"
    assert core.drafts.stats.resyncs == 1                         # the new service knew nothing
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
