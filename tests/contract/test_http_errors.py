"""HTTP error contract: OpenAI error bodies, statuses, Retry-After, and slots always returned."""
from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import openai
import pytest

from gateway_utils import MAX_MODEL_LEN, MODEL, WORDS

USER = [{"role": "user", "content": "hi"}]


def _inflight(h) -> tuple[int, int]:
    return h.call(lambda: (h.gateway.admission.inflight_requests,
                           h.gateway.admission.inflight_prompt_tokens))


def _error(e: pytest.ExceptionInfo) -> dict:
    return e.value.body


@pytest.mark.parametrize("kwargs, param, code", [
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"n": 99}, "n", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"stop": ["x"] * 17}, "stop", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"top_logprobs": 2}, "top_logprobs", "invalid_value"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"logit_bias": {"1": 500}}, "logit_bias", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice", "unsupported_parameter"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format.json_schema.schema", "invalid_value"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex", "invalid_value"),
    ({"extra_body": {"guided_choice": ["a"], "guided_regex": "a"}}, "guided_choice", "invalid_value"),
    ({"extra_body": {"best_of_n": 2}}, "best_of_n", "unknown_parameter"),
    ({"extra_body": {"min_tokens": 5}, "max_tokens": 2}, "min_tokens", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "unsupported_content_type"),
])
def test_bad_chat_parameters_are_400_naming_the_param(client, gateway, kwargs, param, code):
    body = {"model": MODEL, "messages": USER, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    err = _error(e)
    assert (err["param"], err["code"]) == (param, code), err
    assert e.value.response.json()["error"]["type"] == "invalid_request_error"
    assert gateway.state.calls == []


@pytest.mark.parametrize("kwargs, param", [
    ({"best_of": 2}, "best_of"), ({"suffix": "x"}, "suffix"), ({"logprobs": 6}, "logprobs"),
    ({"prompt": []}, "prompt"), ({"prompt": [[1], "a", 3]}, "prompt"),
    ({"prompt": [300]}, "prompt"), ({"echo": "maybe"}, "echo"),
])
def test_bad_completion_parameters(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{"model": MODEL, "prompt": "x", **kwargs})
    assert _error(e)["param"] == param, _error(e)


def test_missing_model_and_malformed_json_are_400_not_422(gateway):
    url = f"{gateway.base_url}/chat/completions"
    r = httpx.post(url, json={"messages": USER})
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "missing required parameter: 'model'",
                                 "type": "invalid_request_error", "param": "model",
                                 "code": "missing_required_parameter"}
    r = httpx.post(url, content=b'{"model": "tiny", ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx.post(url, json=[1, 2])
    assert r.status_code == 400


@pytest.mark.parametrize("path, body, param", [
    ("chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "stop": "\\ud800"}', "stop"),
    ("chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a \\udfff b"}]}',
     "messages[0].content"),
    ("completions", '{"model": "%s", "prompt": ["ok", "x\\ud83d"]}', "prompt[1]"),
    ("completions", '{"model": "%s", "prompt": "x", "user": "\\ude00"}', "user"),
])
def test_a_lone_surrogate_is_400_naming_the_field(gateway, path, body, param):
    """JSON allows \\ud800 escapes that decode to no Unicode character; such a string is refused
    (never a 500 from an encoder further in), while a surrogate pair is an ordinary character."""
    url = f"{gateway.base_url}/{path}"
    r = httpx.post(url, content=(body % MODEL).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, "invalid_string", "invalid_request_error")
    assert "surrogate" in err["message"]
    assert gateway.state.calls == []
    pair = '{"model": "%s", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 2}'
    r = httpx.post(f"{gateway.base_url}/chat/completions", content=(pair % MODEL).encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, param", [
    ('{"model": "%s", "prompt": "hi", "\\udc00": 1}', "\\udc00"),
    ('{"model": "%s", "prompt": ' + "[" * 50_000 + "]" * 50_000 + "}", None),
    ('{"model": "%s", "prompt": "hi", "kvmesh": ' + '{"a": ' * 40 + "1" + "}" * 41, "kvmesh" + ".a" * 31),
    ('{"model": "%s", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", None),
])
def test_bodies_that_broke_the_json_layer_are_a_400(gateway, body, param):
    """Found by tests/fuzz (each was a 500): a lone surrogate in an object key (quoted in the
    error body, which then failed to encode), nesting past json's recursion limit, and an integer
    of more digits than Python converts."""
    r = httpx.post(f"{gateway.base_url}/completions", content=(body % MODEL).encode(),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] in ("invalid_json", "invalid_string")
    assert gateway.state.calls == []


def test_context_length_exceeded_says_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="abc", max_tokens=MAX_MODEL_LEN)
    err = _error(e)
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in err["message"]
    assert f"requested {MAX_MODEL_LEN + 3} tokens (3 in the prompt, {MAX_MODEL_LEN} in" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 300}])
    assert _error(e)["code"] == "context_length_exceeded" and _error(e)["param"] == "messages"


def test_unknown_model_and_route_are_404(client, gateway):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=USER)
    assert _error(e)["code"] == "model_not_found" and _error(e)["param"] == "model"
    r = httpx.get(f"{gateway.base_url}/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("code, status, exc, retry", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, openai.RateLimitError, "1"),
    (grpc.StatusCode.UNAVAILABLE, 503, openai.InternalServerError, "1"),
    (grpc.StatusCode.DEADLINE_EXCEEDED, 504, openai.InternalServerError, None),
    (grpc.StatusCode.INVALID_ARGUMENT, 400, openai.BadRequestError, None),
    (grpc.StatusCode.INTERNAL, 500, openai.InternalServerError, None),
])
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_status_codes_map_to_http(client, gateway, code, status, exc, retry, stream):
    gateway.state.fail = (code, "engine queue is full", 0)
    with pytest.raises(exc) as e:
        r = client.chat.completions.create(model=MODEL, messages=USER, stream=stream)
        list(r) if stream else None
    assert e.value.status_code == status
    assert e.value.response.headers.get("retry-after") == retry
    assert "engine queue is full" in _error(e)["message"]
    assert _inflight(gateway) == (0, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_router_unavailable_before_the_first_message_is_retried(client, gateway, stream):
    """The router's call fails UNAVAILABLE before anything reached the client (a router that
    died under it and is coming back): the gateway starts the request once more, and the client
    gets the whole answer, once."""
    gateway.state.fail, gateway.state.fail_times = (grpc.StatusCode.UNAVAILABLE, "router restarting", 0), 1
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=USER, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        text = client.chat.completions.create(model=MODEL, messages=USER).choices[0].message.content
    assert text == "".join(WORDS)
    assert len(gateway.state.calls) == 2 and gateway.state.fail_times == 0
    gateway.state.fail, gateway.state.fail_times = (grpc.StatusCode.UNAVAILABLE, "router down", 0), 3
    with pytest.raises(openai.APIStatusError) as e:  # three times in a row: the client is told to retry
        client.chat.completions.create(model=MODEL, messages=USER)
    assert e.value.status_code == 503 and len(gateway.state.calls) == 5


@pytest.mark.parametrize("stream", [True, False])
def test_a_router_dying_mid_stream_is_resumed_after_what_the_client_has(client, gateway, stream):
    """The router's stream breaks UNAVAILABLE after two tokens (the router died; its supervisor
    restarts it): the gateway calls it again resuming after those two tokens with the seed the
    router reported, and the client gets one answer, whole, nothing twice."""
    gateway.state.fail, gateway.state.fail_times = (grpc.StatusCode.UNAVAILABLE, "router died", 2), 1
    kwargs = dict(model=MODEL, messages=USER, temperature=0.7, logprobs=True)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        response = client.chat.completions.create(**kwargs)
        text, usage = response.choices[0].message.content, response.usage
    assert text == "".join(WORDS) and usage.completion_tokens == len(WORDS)
    first, second = (c.request.request for c in gateway.state.calls)
    assert list(second.resume_token_ids.ids) == [2000, 2001] and not first.HasField("resume_token_ids")
    assert second.sampling.temperature == pytest.approx(0.7) and second.sampling.logprobs == first.sampling.logprobs


def test_error_after_streaming_began_is_an_sse_error_event(gateway, client):
    gateway.state.fail = (grpc.StatusCode.UNAVAILABLE, "replica died", 2)
    r = httpx.post(f"{gateway.base_url}/chat/completions",
                   json={"model": MODEL, "messages": USER, "stream": True}, timeout=10)
    assert r.status_code == 200
    events = [e[6:] for e in r.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    assert '"error"' in events[-2] and "replica died" in events[-2]
    content = [json.loads(e)["choices"][0]["delta"].get("content") for e in events[:-2]]
    assert "".join(c or "" for c in content) == "".join(WORDS[:2])
    with pytest.raises(openai.APIError, match="replica died"):
        list(client.chat.completions.create(model=MODEL, messages=USER, stream=True))
    assert _inflight(gateway) == (0, 0)


async def test_gateway_full_is_503_with_retry_after_and_slots_come_back(small_gateway):
    h = small_gateway
    h.state.gate = h.call(asyncio.Event)
    async with openai.AsyncOpenAI(base_url=h.base_url, api_key="x", max_retries=0) as c:
        held = asyncio.ensure_future(c.chat.completions.create(model=MODEL, messages=USER, n=2))
        assert await asyncio.to_thread(h.state.received.wait, 5)
        assert _inflight(h)[0] == 2
        with pytest.raises(openai.InternalServerError) as e:
            await c.chat.completions.create(model=MODEL, messages=USER)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "overloaded"
        with pytest.raises(openai.BadRequestError) as e:  # can never fit: not "retry later"
            await c.chat.completions.create(model=MODEL, messages=USER, n=3)
        assert e.value.body["code"] == "request_too_large"
        h.call(h.state.gate.set)
        assert len((await held).choices) == 2
        assert _inflight(h) == (0, 0)
        r = await c.chat.completions.create(model=MODEL, messages=USER, n=2)
        assert len(r.choices) == 2
    root = h.base_url.removesuffix("/v1")
    assert (f'kvmesh_gateway_rejected_total{{model_name="{MODEL}",reason="inflight_requests"}}'
            in httpx.get(f"{root}/metrics").text)


async def test_slo_admission_sheds_what_would_miss_the_ttft_slo_with_retry_after():
    """--slo-ttft-s 1: with the measured rate set to 1.5 prompts' worth of tokens per second, one
    request held before its first token leaves room for nobody else (2 prompts: 1.33 s > 1 s)."""
    from gateway_utils import GatewayHarness

    with GatewayHarness(slo_ttft_s=1.0) as h:
        h.state.gate = h.call(asyncio.Event)
        async with openai.AsyncOpenAI(base_url=h.base_url, api_key="x", max_retries=0) as c:
            held = asyncio.ensure_future(c.chat.completions.create(model=MODEL, messages=USER))
            assert await asyncio.to_thread(h.state.received.wait, 5)
            slo = h.gateway.slo
            tokens = slo.waiting_tokens  # the held request's prompt, admitted with no evidence yet
            assert tokens > 0 and slo.predict(tokens) is None

            def measured():
                slo.rate, slo.samples = 1.5 * tokens, slo.min_samples
            h.call(measured)
            with pytest.raises(openai.InternalServerError) as e:
                await c.chat.completions.create(model=MODEL, messages=USER)
            assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
            assert e.value.body["code"] == "overloaded" and "TTFT SLO (1s, --slo-ttft-s)" in e.value.body["message"]
            h.call(h.state.gate.set)
            await held  # its first token: it leaves the queue
            assert slo.waiting_tokens == 0
            assert (await c.chat.completions.create(model=MODEL, messages=USER)).choices
        root = h.base_url.removesuffix("/v1")
        assert (f'kvmesh_gateway_rejected_total{{model_name="{MODEL}",reason="slo_ttft"}} 1.0'
                in httpx.get(f"{root}/metrics").text)
        assert len(h.state.calls) == 2  # the shed one never reached the router


async def test_prompt_token_budget_is_enforced(small_gateway):
    h = small_gateway
    h.state.gate = h.call(asyncio.Event)
    async with openai.AsyncOpenAI(base_url=h.base_url, api_key="x", max_retries=0) as c:
        held = asyncio.ensure_future(c.completions.create(model=MODEL, prompt="x" * 200, max_tokens=1))
        assert await asyncio.to_thread(h.state.received.wait, 5)
        assert _inflight(h) == (1, 200)
        with pytest.raises(openai.InternalServerError) as e:
            await c.completions.create(model=MODEL, prompt="y" * 150, max_tokens=1)
        assert e.value.status_code == 503
        h.call(h.state.gate.set)
        await held
    assert _inflight(h) == (0, 0)
