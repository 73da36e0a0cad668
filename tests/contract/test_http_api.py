"""The OpenAI-compatible HTTP API, driven by the real `openai` SDK (sync and async clients)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway_utils import MAX_MODEL_LEN, MODEL, WORDS

FULL = "".join(WORDS)
USER = [{"role": "user", "content": "hi"}]
# The tiny tokenizer has one token per byte, plus one per special token.
CHAT_PROMPT_TOKENS = len("\nhi\n\n") + len("user") + len("assistant") + 3


def test_models_list_and_retrieve(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "cascade"]
    tiny = client.models.retrieve(MODEL)
    assert (tiny.object, tiny.owned_by) == ("model", "kvmesh")
    assert (tiny.root, tiny.max_model_len) == ("tiny-root", MAX_MODEL_LEN)
    assert tiny.created > 0
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.body["code"] == "model_not_found"


def test_chat_non_streaming(client, gateway):
    r = client.chat.completions.create(model=MODEL, messages=USER, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == FULL
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens == CHAT_PROMPT_TOKENS
    assert r.usage.completion_tokens == len(WORDS)
    assert r.usage.total_tokens == CHAT_PROMPT_TOKENS + len(WORDS)
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    # The gateway applied the chat template and sent both ids and text upstream.
    sent = gateway.state.calls[0].request
    assert sent.prompt_text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert len(sent.request.token_ids.ids) == CHAT_PROMPT_TOKENS
    assert sent.model == MODEL and sent.tenant == "default"
    assert sent.request.sampling.temperature == 0
    assert sent.request.sampling.max_tokens == MAX_MODEL_LEN - CHAT_PROMPT_TOKENS


def test_chat_streaming_with_usage(client, gateway):
    gateway.state.cached_tokens = 7
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=USER, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == FULL
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "stop"
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(WORDS)
    assert last.usage.prompt_tokens_details.cached_tokens == 7
    assert len({c.id for c in chunks}) == 1


def test_stream_ends_with_done_and_no_usage_by_default(gateway):
    body = {"model": MODEL, "messages": USER, "stream": True}
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert all("usage" not in json.loads(e[6:]) for e in events[:-1])


def test_completions_streaming_and_not(client):
    r = client.completions.create(model=MODEL, prompt="Say hi", max_tokens=3)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == "".join(WORDS[:3]) and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len("Say hi") and r.usage.completion_tokens == 3
    chunks = list(client.completions.create(model=MODEL, prompt="Say hi", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == FULL
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions_default_max_tokens_is_16(client, gateway):
    client.completions.create(model=MODEL, prompt="x")
    assert gateway.state.calls[0].request.request.sampling.max_tokens == 16


def test_ignore_eos_reaches_the_engine_only_when_asked(client, gateway):
    client.chat.completions.create(model=MODEL, messages=USER, extra_body={"ignore_eos": True})
    client.completions.create(model=MODEL, prompt="x", extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL, messages=USER)
    assert [c.request.request.sampling.ignore_eos for c in gateway.state.calls] == [True, True, False]


def test_n_fans_out_with_consecutive_seeds(client, gateway):
    r = client.chat.completions.create(model=MODEL, messages=USER, n=3, seed=40)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    by_index = {c.index: c.message.content for c in r.choices}
    assert [by_index[i].split()[0] for i in range(3)] == ["Seed40", "Seed41", "Seed42"]
    assert r.usage.prompt_tokens == CHAT_PROMPT_TOKENS  # the prompt counts once
    assert r.usage.completion_tokens == 3 * len(WORDS)
    ids = {c.request.request.request_id for c in gateway.state.calls}
    assert len(ids) == 3 and all(i.startswith(r.id) for i in ids)


def test_batched_prompts_index_per_prompt_and_n(client):
    r = client.completions.create(model=MODEL, prompt=["a", "bb"], n=2, max_tokens=1, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 3


def test_token_id_prompt(client, gateway):
    client.completions.create(model=MODEL, prompt=[104, 105], max_tokens=1)
    sent = gateway.state.calls[0].request
    assert list(sent.request.token_ids.ids) == [104, 105] and sent.prompt_text == "hi"


@pytest.mark.parametrize("stop", [" fake", [" nothing", "ake"]])
def test_stop_strings(client, gateway, stop):
    r = client.chat.completions.create(model=MODEL, messages=USER, stop=stop)
    assert r.choices[0].message.content == " Hello from the" + ("" if stop == " fake" else " f")
    assert r.choices[0].finish_reason == "stop"
    assert list(gateway.state.calls[0].request.request.sampling.stop) == (
        [stop] if isinstance(stop, str) else stop)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, logprobs=True, top_logprobs=2,
                                       max_tokens=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == list(WORDS[:2])
    assert content[0].logprob == -0.25 and content[0].bytes == list(WORDS[0].encode())
    assert [t.token for t in content[0].top_logprobs] == ["alt0", "alt1"]


def test_completion_logprobs_with_echo(client, gateway):
    r = client.completions.create(model=MODEL, prompt="ab", max_tokens=2, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.text == "ab" + "".join(WORDS[:2])
    lp = c.logprobs
    assert lp.tokens == ["a", "b", *WORDS[:2]]
    assert lp.token_logprobs == [None, -0.25, -0.25, -0.5]
    assert lp.top_logprobs[0] is None and lp.top_logprobs[1] == {"alt0": -1.0}
    assert lp.text_offset == [0, 1, 2, 2 + len(WORDS[0])]
    assert gateway.state.calls[0].request.request.sampling.prompt_logprobs == 1


def test_echo_streaming_without_logprobs(client):
    chunks = list(client.completions.create(model=MODEL, prompt="ab", max_tokens=1, echo=True,
                                            stream=True))
    assert chunks[0].choices[0].text.startswith("ab")
    assert "".join(c.choices[0].text for c in chunks) == "ab" + WORDS[0]


async def test_async_client_chat_and_completions(aclient):
    r = await aclient.chat.completions.create(model=MODEL, messages=USER, max_tokens=2)
    assert r.choices[0].message.content == "".join(WORDS[:2])
    stream = await aclient.completions.create(model=MODEL, prompt="x", stream=True, max_tokens=2,
                                              stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 2


def test_tenant_default_salt_and_unknown_fields_refused(client, gateway):
    client.chat.completions.create(model=MODEL, messages=USER, user="u1")
    assert gateway.state.calls[0].request.request.cache_salt == "tenant:default"
    with pytest.raises(openai.BadRequestError) as e:  # refused, not ignored: see openai_schema
        client.chat.completions.create(model=MODEL, messages=USER, extra_body={"some_future_field": {"x": 1}})
    assert e.value.body["param"] == "some_future_field"


def test_health_and_metrics(gateway, client):
    client.chat.completions.create(model=MODEL, messages=USER, max_tokens=1)
    root = gateway.base_url.removesuffix("/v1")
    health = httpx.get(f"{root}/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    text = httpx.get(f"{root}/metrics").text
    assert ('kvmesh_gateway_requests_total{endpoint="/v1/chat/completions",'
            f'model_name="{MODEL}",status="200",tenant="default"}}') in text
    for name in ("kvmesh_gateway_ttft_seconds_bucket", "kvmesh_gateway_inflight_requests",
                 "kvmesh_gateway_inflight_prompt_tokens"):
        assert name in text


def test_openapi_document_describes_the_api(gateway):
    """GET /openapi.json: OpenAPI 3.1 with the served paths, every $ref resolvable, and the request
    bodies as the gateway parses them (the kvmesh extensions included), for schema-driven tools."""
    from kvmesh.kv.quality import LOSSY_KV_CODECS

    r = httpx.get(gateway.base_url.removesuffix("/v1") + "/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"] == "3.1.0"
    assert set(doc["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models",
                                 "/v1/models/{model_id}", "/health", "/v1/embeddings", "/tokenize",
                                 "/detokenize", "/tokenizer_info", "/version"}
    schemas = doc["components"]["schemas"]

    def refs(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "$ref":
                    yield value
                else:
                    yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    found = set(refs(doc))
    assert "#/components/schemas/ChatCompletionBody" in found and "#/components/schemas/Error" in found
    for ref in found:
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    chat, completion = schemas["ChatCompletionBody"], schemas["CompletionBody"]
    assert {"model", "messages"} <= set(chat["required"]) and {"model", "prompt"} <= set(completion["required"])
    assert "documents" in chat["properties"] and "documents" not in completion["properties"]
    lossy = chat["properties"]["kvmesh"]["properties"]["lossy"]["properties"]
    assert lossy["kv_codec"]["enum"] == list(LOSSY_KV_CODECS)
    body = doc["paths"]["/v1/chat/completions"]["post"]
    assert body["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionBody")
    assert {"200", "400", "401", "429", "503"} <= set(body["responses"])
