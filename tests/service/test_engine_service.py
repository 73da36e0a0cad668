"""The engine's gRPC API against a real server on port 0, on the real model."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_utils import ServedEngine, make_core, serve_engine
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
pytestmark = pytest.mark.slow


class Harness(ServedEngine):
    async def collect(self, req, timeout=120):
        return await super().collect(req, timeout=timeout)

    async def settle(self) -> None:
        """Runs a tiny request to completion: the engine's inbox is FIFO, so every abort posted
        before it has been applied once it finishes."""
        await self.collect(engine_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=[1, 2, 3]), sampling=engine_pb2.SamplingParams(max_tokens=1)))


@pytest.fixture
async def harness(bundled_model, request):
    overrides = getattr(request, "param", {})
    core = make_core(bundled_model, **overrides)
    async with serve_engine(core) as served:
        yield Harness(served.engine, served.stub, served.address)


def _text_req(text: str, **sampling) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(text=text, sampling=engine_pb2.SamplingParams(**sampling))


async def test_generate_streams_deltas_then_one_final(harness):
    msgs = await harness.collect(_text_req("The capital of France is", max_tokens=12, ignore_eos=True))
    finals = [m for m in msgs if m.HasField("final")]
    assert len(finals) == 1 and msgs[-1].HasField("final")
    tokens = [t for m in msgs for t in m.delta.token_ids]
    assert len(tokens) == 12
    final = finals[0].final
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    prompt_len = len(harness.engine.core.tokenizer.encode("The capital of France is"))
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (prompt_len, 12)
    text = "".join(m.delta.text for m in msgs)
    assert text == harness.engine.core.tokenizer.decode(tokens)
    assert 0 < final.ttft_s <= final.e2e_s


@pytest.mark.parametrize("req, fragment", [
    (engine_pb2.GenerateRequest(sampling=engine_pb2.SamplingParams(max_tokens=4)), "prompt"),
    (engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[])), "empty"),
    (_text_req("hi", temperature=5.0), "temperature"),
    (_text_req("hi", top_p=0.0), "top_p"),
    (_text_req("hi", max_tokens=9000), "context"),
    (_text_req("hi", logprobs=99), "logprobs"),
    (_text_req("hi", prompt_logprobs=21), "prompt_logprobs"),
    (engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[10**6])), "vocab"),
])
async def test_bad_input_is_invalid_argument_with_a_fix(harness, req, fragment):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.collect(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details().lower()
    # and the engine still serves
    msgs = await harness.collect(_text_req("Hello", max_tokens=2, ignore_eos=True))
    assert msgs[-1].final.usage.completion_tokens == 2


async def test_unknown_fields_are_rejected(harness):
    raw = _text_req("hi", max_tokens=2).SerializeToString() + bytes([0xF8, 0x06, 0x01])  # field 111 varint
    multi = grpc.aio.insecure_channel(harness.address)
    try:
        generate = multi.unary_stream(f"/{SERVICE}/Generate", request_serializer=lambda b: b,
                                      response_deserializer=engine_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            [m async for m in generate(raw, timeout=30)]
    finally:
        await multi.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown field" in err.value.details()


async def test_client_cancel_frees_blocks(harness):
    core = harness.engine.core
    total = core.block_manager.num_free_blocks
    call = harness.stub.Generate(_text_req("Tell me a long story.", max_tokens=500, ignore_eos=True), timeout=120)
    got = 0
    async for msg in call:
        got += len(msg.delta.token_ids)
        if got >= 3:
            break
    call.cancel()
    await harness.settle()
    assert core.block_manager.num_free_blocks == total
    assert core.request_ids() == []


async def test_deadline_frees_blocks(harness):
    core = harness.engine.core
    total = core.block_manager.num_free_blocks
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await harness.collect(_text_req("Count to a thousand.", max_tokens=2000, ignore_eos=True), timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await harness.settle()
    assert core.block_manager.num_free_blocks == total


async def test_abort_by_id_ends_the_stream(harness):
    call = harness.stub.Generate(engine_pb2.GenerateRequest(
        request_id="abort-me", text="Write an essay.",
        sampling=engine_pb2.SamplingParams(max_tokens=1000, ignore_eos=True)), timeout=120)
    msgs = []
    async for msg in call:
        msgs.append(msg)
        if len(msgs) == 2:
            resp = await harness.stub.Abort(engine_pb2.AbortRequest(request_id="abort-me"), timeout=10)
            assert resp.aborted
    assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert msgs[-1].final.usage.completion_tokens < 1000
    again = await harness.stub.Abort(engine_pb2.AbortRequest(request_id="abort-me"), timeout=10)
    assert not again.aborted


@pytest.mark.parametrize("harness", [{"max_num_seqs": 1, "max_waiting": 1}], indirect=True)
async def test_full_queue_is_resource_exhausted(harness):
    long = dict(max_tokens=200, ignore_eos=True)
    first = harness.stub.Generate(_text_req("one", **long), timeout=120)
    await first.read()   # admitted and running; the one queue slot is left

    async def outcome(call) -> grpc.StatusCode:
        try:
            await call.read()
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            return e.code()

    # Two more arrive together: whichever the engine sees second finds the queue full (their
    # handlers may start in either order). The queued one cannot produce a token while `first`
    # runs, so the first outcome to arrive is the refusal.
    calls = [harness.stub.Generate(_text_req(t, **long), timeout=120) for t in ("two", "three")]
    tasks = [asyncio.create_task(outcome(c)) for c in calls]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    assert [t.result() for t in done] == [grpc.StatusCode.RESOURCE_EXHAUSTED]
    for c in [first, *calls]:
        c.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def test_get_model_info(harness, bundled_model):
    info = await harness.stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
    assert info.weights_digest == bundled_model.weights_digest and len(info.weights_digest) >= 32
    assert info.max_model_len == 8192 and info.vocab_size == 49152
    assert (info.kv_namespace.layout.num_layers, info.kv_namespace.layout.num_kv_heads, info.kv_namespace.layout.head_dim) == (30, 3, 64)
    assert list(info.eos_token_ids) == [2]


async def test_same_seed_same_output(harness):
    req = _text_req("Once upon a time", max_tokens=16, temperature=0.9, seed=1234, ignore_eos=True)
    runs = []
    for _ in range(2):
        msgs = await harness.collect(req)
        runs.append([t for m in msgs for t in m.delta.token_ids])
    other = await harness.collect(_text_req("Once upon a time", max_tokens=16, temperature=0.9,
                                            seed=99, ignore_eos=True))
    assert runs[0] == runs[1]
    assert [t for m in other for t in m.delta.token_ids] != runs[0]


async def test_stop_string_cuts_the_text(harness):
    base = await harness.collect(_text_req("List the days of the week:", max_tokens=40, ignore_eos=True))
    text = "".join(m.delta.text for m in base)
    stop = text[len(text) // 2: len(text) // 2 + 4]
    assert stop.strip(), f"need a non-blank stop string from {text!r}"
    msgs = await harness.collect(_text_req("List the days of the week:", max_tokens=40, ignore_eos=True,
                                           stop=[stop]))
    cut = "".join(m.delta.text for m in msgs)
    assert cut == text[: text.index(stop)]
    assert msgs[-1].final.finish_reason == common_pb2.FINISH_REASON_STOP_STRING
    assert msgs[-1].final.stop_reason == stop


async def test_logprobs(harness):
    msgs = await harness.collect(_text_req("2 + 2 =", max_tokens=4, logprobs=3, ignore_eos=True))
    entries = [lp for m in msgs for lp in m.delta.logprobs]
    tokens = [t for m in msgs for t in m.delta.token_ids]
    assert len(entries) == len(tokens) == 4
    for lp, tok in zip(entries, tokens):
        assert lp.chosen.token_id == tok and lp.chosen.logprob <= 0
        assert len(lp.top) == 3
        values = [t.logprob for t in lp.top]
        assert values == sorted(values, reverse=True)
        assert lp.top[0].token_id == tok   # greedy: the chosen token is the most likely
