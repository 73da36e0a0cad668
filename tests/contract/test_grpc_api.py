"""The kvmesh.gateway.v1 gRPC API: same semantics, limits, auth and errors as the HTTP API."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import pytest

from gateway_utils import MAX_MODEL_LEN, MODEL, WORDS
from kvmesh.common.v1 import common_pb2
from kvmesh.gateway.v1 import gateway_pb2 as pb
from kvmesh.gateway.v1 import gateway_pb2_grpc
from kvmesh.router.v1 import router_pb2

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


async def test_grpc_requests_are_counted_under_their_model(stub, gateway):
    await _collect(stub.ChatComplete(pb.ChatCompleteRequest(model=MODEL, messages=HI)))
    with pytest.raises(grpc.aio.AioRpcError):
        await _collect(stub.ChatComplete(pb.ChatCompleteRequest(model="no-such-model", messages=HI)))
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"{gateway.base_url.removesuffix('/v1')}/metrics")).text
    assert ('kvmesh_gateway_requests_total{endpoint="grpc:ChatComplete",'
            f'model_name="{MODEL}",status="200",tenant="default"}}') in text
    # a model nobody serves is counted under "*", never as a series of its own
    assert 'model_name="no-such-model"' not in text
    assert 'kvmesh_gateway_requests_total{endpoint="grpc:ChatComplete",model_name="*",status="404"' in text


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


# --- parity with the HTTP API: the sampling set, structured output, tools, errors ---------------

USER = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS_HTTP = [{"type": "function", "function": {"name": "f", "description": "Does f.", "parameters": SCHEMA}},
              {"type": "function", "function": {"name": "g"}}]
TOOLS = [pb.Tool(name="f", description="Does f.", parameters=json.dumps(SCHEMA)), pb.Tool(name="g")]


def _upstream(gateway) -> router_pb2.RouteRequest:
    [call] = gateway.state.calls
    return call.request


def _http(gateway, body: dict) -> httpx.Response:
    return httpx.post(gateway.base_url + "/chat/completions", json={"model": MODEL, **body}, timeout=30)


async def _both(gateway, stub, body: dict, request: pb.ChatCompleteRequest) -> tuple[router_pb2.RouteRequest, ...]:
    """What the engine is asked for by the same request over HTTP and over gRPC."""
    r = _http(gateway, {"messages": USER, **body})
    assert r.status_code == 200, r.text
    http = _upstream(gateway)
    gateway.reset()
    chunks = await _collect(stub.ChatComplete(request))
    assert chunks[-1].HasField("usage")
    return http, _upstream(gateway)


async def test_every_sampling_field_reaches_the_engine_as_over_http(stub, gateway):
    http, grpc_ = await _both(gateway, stub, {
        "presence_penalty": 0.5, "frequency_penalty": -0.25, "repetition_penalty": 1.2,
        "logit_bias": {"7": 3.5, "11": -100}, "top_k": 5, "min_p": 0.1, "ignore_eos": True,
        "stop_token_ids": [3, 4], "min_tokens": 2, "temperature": 0.7, "top_p": 0.9, "seed": 3,
        "stop": ["x"], "max_tokens": 9}, pb.ChatCompleteRequest(model=MODEL, messages=HI, options=pb.GenerationOptions(
            presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.2, logit_bias={7: 3.5, 11: -100},
            top_k=5, min_p=0.1, ignore_eos=True, stop_token_ids=[3, 4], min_tokens=2, temperature=0.7,
            top_p=0.9, seed=3, stop=["x"], max_tokens=9)))
    sp = grpc_.request.sampling
    assert sp == http.request.sampling
    assert (sp.presence_penalty, sp.frequency_penalty, dict(sp.logit_bias)) == (0.5, -0.25, {7: 3.5, 11: -100.0})
    assert (sp.top_k, sp.min_tokens, list(sp.stop_token_ids), sp.ignore_eos) == (5, 2, [3, 4], True)
    assert sp.min_p == pytest.approx(0.1) and sp.repetition_penalty == pytest.approx(1.2)


async def test_unset_fields_keep_the_engines_defaults(stub, gateway):
    await _collect(stub.Complete(pb.CompleteRequest(model=MODEL, text="x", options=pb.GenerationOptions(top_k=-1))))
    sp = _upstream(gateway).request.sampling
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "top_k",
                 "structured_output"):
        assert not sp.HasField(name), name
    assert not sp.logit_bias and not sp.stop_token_ids and not sp.ignore_eos


@pytest.mark.parametrize("body, options", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
     pb.GenerationOptions(response_format=pb.ResponseFormat(
         type=pb.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
         json_schema=pb.JsonSchema(name="s", schema=json.dumps(SCHEMA), strict=True)))),
    ({"response_format": {"type": "json_object"}},
     pb.GenerationOptions(response_format=pb.ResponseFormat(type=pb.RESPONSE_FORMAT_TYPE_JSON_OBJECT))),
    ({"response_format": {"type": "text"}},
     pb.GenerationOptions(response_format=pb.ResponseFormat(type=pb.RESPONSE_FORMAT_TYPE_TEXT))),
    ({"guided_regex": "[ab]+"}, pb.GenerationOptions(guided_regex="[ab]+")),
    ({"guided_choice": ["yes", "no"]}, pb.GenerationOptions(guided_choice=["yes", "no"])),
    ({"guided_grammar": 'start: "x" | "y"'}, pb.GenerationOptions(guided_grammar='start: "x" | "y"')),
], ids=["json_schema", "json_object", "text", "regex", "choice", "grammar"])
async def test_structured_output_reaches_the_engine_as_over_http(stub, gateway, body, options):
    http, grpc_ = await _both(gateway, stub, body, pb.ChatCompleteRequest(model=MODEL, messages=HI, options=options))
    assert grpc_.request.sampling == http.request.sampling
    assert grpc_.request.sampling.HasField("structured_output") == (body != {"response_format": {"type": "text"}})


@pytest.mark.parametrize("http_choice, choice, parallel", [
    ("required", pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), False),
    ({"type": "function", "function": {"name": "f"}}, pb.ToolChoice(function="f"), None),
    ("none", pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE), None),
])
async def test_tools_reach_the_engine_and_the_prompt_as_over_http(stub, gateway, http_choice, choice, parallel):
    body = {"tools": TOOLS_HTTP, "tool_choice": http_choice}
    request = pb.ChatCompleteRequest(model=MODEL, messages=HI, tools=TOOLS, tool_choice=choice)
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
        request.parallel_tool_calls = parallel
    http, grpc_ = await _both(gateway, stub, body, request)
    assert grpc_.request.sampling == http.request.sampling and grpc_.prompt_text == http.prompt_text


def _deltas(chunks: list[pb.CompletionChunk]) -> list[pb.ChoiceDelta]:
    return [d for c in chunks for d in c.choices]


async def test_a_required_tool_call_comes_back_as_a_tool_call(stub, gateway):
    gateway.state.words = ('[{"name": "f", ', '"parameters": {"a": 1}}]')
    deltas = _deltas(await _collect(stub.ChatComplete(pb.ChatCompleteRequest(
        model=MODEL, messages=HI, tools=TOOLS, tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)))))
    assert deltas[0].role == pb.ROLE_ASSISTANT and not any(d.text for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == [2000, 2001]  # ids still stream
    [call] = deltas[-1].tool_calls
    assert call.name == "f" and json.loads(call.arguments) == {"a": 1} and call.id.startswith("call_")
    assert deltas[-1].finish_reason == common_pb2.FINISH_REASON_TOOL_CALLS
    assert not any(d.tool_calls or d.HasField("finish_reason") for d in deltas[:-1])


async def test_a_named_tool_call_and_an_output_cut_short(stub, gateway):
    gateway.state.words = ('{"a": ', '2}')
    named = pb.ChatCompleteRequest(model=MODEL, messages=HI, tools=TOOLS, tool_choice=pb.ToolChoice(function="f"))
    [call] = _deltas(await _collect(stub.ChatComplete(named)))[-1].tool_calls
    assert (call.name, json.loads(call.arguments)) == ("f", {"a": 2})
    named.options.max_tokens = 1  # cut by max_tokens: no call, the text with its own reason
    last = _deltas(await _collect(stub.ChatComplete(named)))[-1]
    assert (last.text, list(last.tool_calls), last.finish_reason) == ('{"a": ', [], common_pb2.FINISH_REASON_LENGTH)


async def test_a_conversation_with_tool_calls_replays_as_over_http(stub, gateway):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [*USER, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    http, grpc_ = await _both(gateway, stub, {"messages": messages, "tools": TOOLS_HTTP, "tool_choice": "none"},
                              pb.ChatCompleteRequest(model=MODEL, tools=TOOLS, messages=[
                                  *HI, pb.ChatMessage(role=pb.ROLE_ASSISTANT, tool_calls=[pb.ToolCall(
                                      id="call_1", name="f", arguments='{"a": 1}')]),
                                  pb.ChatMessage(role=pb.ROLE_TOOL, content="42", tool_call_id="call_1")],
                                  tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)))
    assert grpc_.prompt_text == http.prompt_text


@pytest.mark.parametrize("body, request_", [
    ({"repetition_penalty": -0.5}, dict(options=pb.GenerationOptions(repetition_penalty=-0.5))),
    ({"min_p": 1.5}, dict(options=pb.GenerationOptions(min_p=1.5))),
    ({"top_k": -2}, dict(options=pb.GenerationOptions(top_k=-2))),
    ({"presence_penalty": 2.5}, dict(options=pb.GenerationOptions(presence_penalty=2.5))),
    ({"logit_bias": {"5": 150.5}}, dict(options=pb.GenerationOptions(logit_bias={5: 150.5}))),
    ({"min_tokens": 5, "max_tokens": 2}, dict(options=pb.GenerationOptions(min_tokens=5, max_tokens=2))),
    ({"tools": TOOLS_HTTP}, dict(tools=TOOLS)),
    ({"tools": TOOLS_HTTP, "tool_choice": {"type": "function", "function": {"name": "h"}}},
     dict(tools=TOOLS, tool_choice=pb.ToolChoice(function="h"))),
    ({"tool_choice": "required"}, dict(tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED))),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     dict(options=pb.GenerationOptions(response_format=pb.ResponseFormat(
         type=pb.RESPONSE_FORMAT_TYPE_JSON_SCHEMA, json_schema=pb.JsonSchema(name="s"))))),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
     dict(options=pb.GenerationOptions(response_format=pb.ResponseFormat(type=pb.RESPONSE_FORMAT_TYPE_JSON_OBJECT),
                                       guided_regex="a"))),
    ({"guided_grammar": "start: ("}, dict(options=pb.GenerationOptions(guided_grammar="start: ("))),
    ({"messages": [*USER, {"role": "tool", "content": "42"}]},
     dict(messages=[*HI, pb.ChatMessage(role=pb.ROLE_TOOL, content="42")])),
], ids=["repetition_penalty", "min_p", "top_k", "presence_penalty", "logit_bias", "min_tokens", "tool_choice_auto",
        "unknown_function", "tool_choice_without_tools", "schema_missing", "two_constraints", "bad_grammar",
        "tool_message_without_id"])
async def test_invalid_values_are_invalid_argument_with_the_http_message(stub, gateway, body, request_):
    r = _http(gateway, {"messages": USER, **body})
    assert r.status_code == 400, r.text
    request_ = pb.ChatCompleteRequest(model=MODEL, **{"messages": HI, **request_})
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await _collect(stub.ChatComplete(request_))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details() == r.json()["error"]["message"]
    assert gateway.state.calls == []


async def test_json_carried_as_text_must_parse(stub, gateway):
    bad = [pb.ChatCompleteRequest(model=MODEL, messages=HI, options=pb.GenerationOptions(
               response_format=pb.ResponseFormat(type=pb.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
                                                 json_schema=pb.JsonSchema(schema="{not json")))),
           pb.ChatCompleteRequest(model=MODEL, messages=HI, tools=[pb.Tool(name="f", parameters="[1,")],
                                  tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED))]
    for request_, param in zip(bad, ("response_format.json_schema.schema", "tools[0].parameters")):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _collect(stub.ChatComplete(request_))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(f"{param} is not valid JSON")
