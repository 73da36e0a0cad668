"""OpenAI response bodies and SSE chunks from domain deltas."""
from __future__ import annotations

import json

from kvmesh.services.gateway.openai_format import DONE, Formatter, sse
from kvmesh.services.gateway.spec import ChoiceDelta, EchoedPrompt, TokenLogprob, TopLogprob, Usage


def _lp(token: str, logprob: float | None, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(0, token, logprob, tuple(TopLogprob(1, t, v) for t, v in top))


def _usage() -> Usage:
    u = Usage(prompt_tokens=10)
    u.add_choice(0, 3, 4)
    u.add_choice(0, 2, 6)  # a second copy of the same prompt: cached counts once (the most)
    return u


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert DONE == b"data: [DONE]\n\n"


def test_usage_counts_prompts_once():
    u = _usage()
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.cached_tokens) == (10, 5, 15, 6)


def test_chat_chunks_role_first_and_finish_apart():
    f = Formatter("chat", "chatcmpl-1", 7, "m", logprobs=False, include_usage=True)
    first = f.chunks(ChoiceDelta(0, "", first=True))
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}]
    assert first[0]["object"] == "chat.completion.chunk" and first[0]["usage"] is None
    last = f.chunks(ChoiceDelta(0, "end", finish_reason="stop"))
    assert [c["choices"][0]["delta"] for c in last] == [{"content": "end"}, {}]
    assert [c["choices"][0]["finish_reason"] for c in last] == [None, "stop"]
    usage = f.usage_chunk(_usage())
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 6}
    assert f.chunks(ChoiceDelta(0, "")) == []  # nothing to say


def test_chat_logprobs_entries():
    f = Formatter("chat", "c", 1, "m", logprobs=True, include_usage=False)
    [chunk] = f.chunks(ChoiceDelta(0, "hé", logprobs=(_lp("hé", -0.5, ("x", -1.0)),)))
    assert "usage" not in chunk
    assert chunk["choices"][0]["logprobs"] == {"content": [{
        "token": "hé", "logprob": -0.5, "bytes": [104, 195, 169],
        "top_logprobs": [{"token": "x", "logprob": -1.0, "bytes": [120]}]}], "refusal": None}


def test_completion_legacy_logprobs_with_echo_and_offsets():
    f = Formatter("completion", "cmpl-1", 1, "m", logprobs=True, include_usage=False)
    echo = EchoedPrompt("ab", (97, 98), (_lp("a", None), _lp("b", -0.1, ("c", -2.0))))
    deltas = [ChoiceDelta(0, "xy", logprobs=(_lp("xy", -0.2),), echo=echo, first=True),
              ChoiceDelta(0, "z", logprobs=(_lp("z", -0.3),), finish_reason="length")]
    streamed = [f.chunks(d)[0]["choices"][0] for d in deltas]
    assert streamed[0]["text"] == "abxy" and streamed[1]["finish_reason"] == "length"
    assert streamed[0]["logprobs"] == {"tokens": ["a", "b", "xy"], "token_logprobs": [None, -0.1, -0.2],
                                       "top_logprobs": [None, {"c": -2.0}, {}],
                                       "text_offset": [0, 1, 2]}
    assert streamed[1]["logprobs"]["text_offset"] == [4]
    g = Formatter("completion", "cmpl-1", 1, "m", logprobs=True, include_usage=False)
    for d in deltas:
        g.add(d)
    body = g.response(_usage())
    choice = body["choices"][0]
    assert (body["object"], choice["text"], choice["finish_reason"]) == ("text_completion", "abxyz", "length")
    assert choice["logprobs"]["text_offset"] == [0, 1, 2, 4]
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                             "prompt_tokens_details": {"cached_tokens": 6}}


def test_chat_response_orders_choices():
    f = Formatter("chat", "c", 1, "m", logprobs=False, include_usage=False)
    for d in (ChoiceDelta(1, "B", finish_reason="stop", first=True), ChoiceDelta(0, "A", first=True),
              ChoiceDelta(0, "a", finish_reason="length")):
        f.add(d)
    body = f.response(Usage())
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in body["choices"]] == [
        (0, "Aa", "length"), (1, "B", "stop")]
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["logprobs"] is None
    json.dumps(body)


def test_the_kvmesh_object_says_what_was_reused_and_how():
    from kvmesh.services.gateway.openai_format import kvmesh_body
    from kvmesh.services.gateway.spec import KvReuse

    assert kvmesh_body(Usage(prompt_tokens=10)) is None  # nothing reused, no documents
    exact = Usage(prompt_tokens=300)
    exact.add_choice(0, 3, 256, KvReuse("exact", kv_service_tokens=0))
    exact.add_choice(0, 3, 272, KvReuse("exact", kv_service_tokens=256))  # the copy that reused most
    assert kvmesh_body(exact) == {"reuse": {"storage": "exact", "exact": True, "prefix_cache_tokens": 16,
                                            "kv_service_tokens": 256}}
    lossy = Usage(prompt_tokens=600)
    lossy.add_choice(0, 3, 256, KvReuse("int4-g64-r0-h0-o0", kv_service_tokens=256))
    lossy.add_choice(1, 3, 0, KvReuse("exact"))  # a prompt that reused nothing says nothing
    report = kvmesh_body(lossy)["reuse"]
    assert (report["storage"], report["exact"], report["kv_service_tokens"]) == ("int4-g64-r0-h0-o0", False, 256)
    body = json.loads(json.dumps(Formatter("completion", "cmpl-1", 7, "m", logprobs=False,
                                           include_usage=False).response(lossy)))
    assert body["kvmesh"]["reuse"]["exact"] is False
