"""The kvmesh.gateway.v1 gRPC API: same semantics, limits, auth and errors as the HTTP API."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway_utils import MAX_MODEL_LEN, MODEL, WORDS
from kvmesh.common.v1 import common_pb2
from kvmesh.gateway.v1 import gateway_pb2 as pb
from kvmesh.gateway.v1 import gateway_pb2_grpc

HI = [pb.ChatMessage(role=pb.ROLE_USER, content="hi")]


@pytest.fixture
async def stub(gateway):
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


async def _collect(call) -> list[pb.CompletionChunk]:
    return [chunk async for chunk in call]


async def test_list_models(stub):
    r = await stub.ListModels(pb.ListModelsRequest())
    assert [(m.id, m.owned_by, m.root, m.max_model_len) for m in r.models][0] == (
        MODEL, "kvmesh", "tiny-root", MAX_MODEL_LEN)


async def test_chat_complete_streams_deltas_then_usage(stub, gateway):
    gateway.state.cached_tokens = 5
    chunks = await _collect(stub.ChatComplete(pb.ChatCompleteRequest(
        model=MODEL, messages=HI, options=pb.GenerationOptions(temperature=0))))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].role == pb.ROLE_ASSISTANT and not any(d.HasField("role") for d in deltas[1:])
    assert "".join(d.text for d in deltas) == "".join(WORDS)
    assert [t for d in deltas for t in d.token_ids] == [2000 + i for i in range(len(WORDS))]
    assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert not any(d.HasField("finish_reason") for d in deltas[:-1])
    last = chunks[-1]
    assert not last.choices and last.HasField("usage")
    assert (last.usage.completion_tokens, last.usage.cached_tokens) == (len(WORDS), 5)
    assert last.usage.total_tokens == last.usage.prompt_tokens + len(WORDS)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert gateway.state.calls[0].request.request.sampling.temperature == 0


async def test_complete_with_n_stop_logprobs_and_echo(stub, gateway):
    chunks = await _collect(stub.Complete(pb.CompleteRequest(
        model=MODEL, text="ab", echo=True,
        options=pb.GenerationOptions(n=2, seed=7, stop=[" the"], logprobs=1))))
    by_index: dict[int, list[pb.ChoiceDelta]] = {}
    for c in chunks:
        for d in c.choices:
            by_index.setdefault(d.index, []).append(d)
    assert sorted(by_index) == [0, 1]
    for i, deltas in by_index.items():
        assert deltas[0].echo.text == "ab" and list(deltas[0].echo.token_ids) == [97, 98]
        assert [e.chosen.text for e in deltas[0].echo.logprobs] == ["b"]  # from the 2nd token
        assert "".join(d.text for d in deltas) == f" Seed{7 + i} from"
        assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_STOP
        lps = [e for d in deltas for e in d.logprobs]
        assert lps[0].chosen.logprob == -0.25 and len(lps[0].top) == 1
    assert chunks[-1].usage.prompt_tokens == 2


async def test_token_id_prompt_and_length(stub, gateway):
    chunks = await _collect(stub.Complete(pb.CompleteRequest(
        model=MODEL, token_ids=common_pb2.TokenIds(ids=[104, 105]),
        options=pb.GenerationOptions(max_tokens=2))))
    assert chunks[-2].choices[0].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert gateway.state.calls[0].request.prompt_text == "hi"


@pytest.mark.parametrize("request_, code, words", [
    (pb.ChatCompleteRequest(model="nope", messages=HI), grpc.StatusCode.NOT_FOUND, "nope"),
    (pb.ChatCompleteRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, "messages"),
    (pb.ChatCompleteRequest(model=MODEL, messages=[pb.ChatMessage(content="hi")]),
     grpc.StatusCode.INVALID_ARGUMENT, "messages[0].role must be one of ROLE_SYSTEM"),
    (pb.ChatCompleteRequest(model=MODEL, messages=HI, options=pb.GenerationOptions(temperature=5)),
     grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    (pb.ChatCompleteRequest(model=MODEL, messages=HI, options=pb.GenerationOptions(max_tokens=999)),
     grpc.StatusCode.INVALID_ARGUMENT, "maximum context length is 256"),
])
async def test_errors_are_status_codes(stub, request_, code, words):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _collect(stub.ChatComplete(request_))
    assert e.value.code() == code and words in e.value.details()


async def test_a_string_field_that_is_not_utf8_is_invalid_argument_naming_it(gateway):
    """Bytes protobuf cannot parse (a lone surrogate encoded as UTF-8 in messages[1].content) get
    INVALID_ARGUMENT with the field's path, not grpc's INTERNAL; the server goes on serving."""
    req = pb.ChatCompleteRequest(model=MODEL, messages=[HI[0], pb.ChatMessage(role=pb.ROLE_USER, content="XYZ")])
    raw = req.SerializeToString()
    assert raw.count(b"XYZ") == 1
    raw = raw.replace(b"XYZ", "\ud800".encode("utf-8", "surrogatepass"))  # 3 bytes for 3: lengths hold
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        call = channel.unary_stream("/kvmesh.gateway.v1.GatewayService/ChatComplete",
                                    request_serializer=lambda b: b,
                                    response_deserializer=pb.CompletionChunk.FromString)(raw)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _collect(call)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "'messages[1].content'" in e.value.details() and "UTF-8" in e.value.details()
        garbage = channel.unary_unary("/kvmesh.gateway.v1.GatewayService/ListModels",
                                      request_serializer=lambda b: b,
                                      response_deserializer=pb.ListModelsResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await garbage(b"\x0a\xff")  # a length past the end: not protobuf at all
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid kvmesh.gateway.v1.ListModelsRequest" in e.value.details()
        ok = await gateway_pb2_grpc.GatewayServiceStub(channel).ListModels(pb.ListModelsRequest())
        assert ok.models
    assert gateway.state.calls == []


async def test_an_error_quoting_a_huge_input_keeps_its_status(stub, gateway):
    """Found by tests/fuzz: NOT_FOUND quoting a 1 MiB model name outgrew the trailer size a grpc
    client accepts, which then reported RESOURCE_EXHAUSTED ("metadata size exceeds hard limit")
    instead; the shared interceptor cuts the message, so the status and its start arrive."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _collect(stub.ChatComplete(pb.ChatCompleteRequest(model="m" * (1 << 20), messages=HI)))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert e.value.details().startswith("The model `mmm") and "more bytes cut" in e.value.details()
    assert gateway.state.calls == []


async def test_upstream_overload_is_resource_exhausted_with_retry_after(stub, gateway):
    gateway.state.fail = (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full", 0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _collect(stub.ChatComplete(pb.ChatCompleteRequest(model=MODEL, messages=HI)))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after", "1") in tuple(e.value.trailing_metadata() or ())


async def test_gateway_full_is_resource_exhausted(small_gateway):
    h = small_gateway
    h.state.gate = h.call(asyncio.Event)
    async with grpc.aio.insecure_channel(h.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        held = asyncio.ensure_future(_collect(stub.ChatComplete(pb.ChatCompleteRequest(
            model=MODEL, messages=HI, options=pb.GenerationOptions(n=2)))))
        assert await asyncio.to_thread(h.state.received.wait, 5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _collect(stub.ChatComplete(pb.ChatCompleteRequest(model=MODEL, messages=HI)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        h.call(h.state.gate.set)
        assert (await held)[-1].usage.completion_tokens == 2 * len(WORDS)


async def test_cancelling_the_call_cancels_upstream(stub, gateway):
    gateway.state.hang = True
    call = stub.Complete(pb.CompleteRequest(model=MODEL, text="x"))
    async for chunk in call:
        if any(d.text for d in chunk.choices):
            break
    call.cancel()
    # the fake hangs until cancelled: its cancellation can only come from this call's
    assert await asyncio.to_thread(gateway.state.cancelled.wait, 5)
    await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        gateway.gateway.admission.wait_idle(), gateway.loop)), 2)


async def test_keys_apply_to_grpc(keyed_gateway, keys_and_file):
    keys, _ = keys_and_file
    async with grpc.aio.insecure_channel(keyed_gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer sk-kvmesh-nope"),)):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.ListModels(pb.ListModelsRequest(), metadata=metadata)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await _collect(stub.ChatComplete(pb.ChatCompleteRequest(model=MODEL, messages=HI),
                                                 metadata=metadata))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {keys['acme']}"),)
        chunks = await _collect(stub.ChatComplete(
            pb.ChatCompleteRequest(model=MODEL, messages=HI), metadata=good))
        assert chunks[-1].usage.completion_tokens == len(WORDS)
    sent = keyed_gateway.state.calls[-1].request
    assert (sent.tenant, sent.request.cache_salt) == ("acme", "tenant:acme")
