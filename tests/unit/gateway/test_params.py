"""OpenAI request bodies → GenerationRequest, and the shared validation (param names, limits)."""
from __future__ import annotations

import json

import pytest

from kvmesh.services.gateway.errors import ApiError
from kvmesh.services.gateway.openai_schema import (
    MAX_JSON_DEPTH,
    chat_request,
    completion_request,
    parse_body,
)
from kvmesh.services.gateway.spec import ChatTurn, Limits, Sampling, validate_request

USER = [{"role": "user", "content": "hi"}]


def _chat(**body):
    return chat_request(parse_body(json.dumps({"model": "m", "messages": USER, **body}).encode(),
                                   "chat"))


def _completion(**body):
    return completion_request(parse_body(json.dumps({"model": "m", "prompt": "p", **body}).encode(),
                                         "completion"))


def _param(fn, **body) -> tuple[str | None, str | None]:
    with pytest.raises(ApiError) as e:
        req = fn(**body)
        validate_request(req, Limits())
    assert e.value.status == 400
    return e.value.param, e.value.error_code


def test_chat_mapping():
    req = _chat(max_completion_tokens=5, temperature=0.5, top_p=0.9, seed=3, stop="x",
                logprobs=True, top_logprobs=4, n=2, user="u",
                messages=[{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]},
                          {"role": "user", "content": "q", "name": "bob"}])
    assert req.kind == "chat" and req.n == 2 and req.user == "u"
    assert req.messages == (ChatTurn("developer", "ab"), ChatTurn("user", "q", "bob"))
    assert req.sampling == Sampling(max_tokens=5, temperature=0.5, top_p=0.9, seed=3, stop=("x",),
                                    logprobs=4)
    assert _chat(max_tokens=7).sampling.max_tokens == 7
    assert _chat().sampling == Sampling()  # all defaults left to the gateway
    assert _chat(logprobs=True).sampling.logprobs == 0
    validate_request(req, Limits())


def test_completion_prompt_shapes():
    assert _completion().prompts == ("p",)
    assert _completion(prompt=["a", "b"]).prompts == ("a", "b")
    assert _completion(prompt=[1, 2, 3]).prompts == ((1, 2, 3),)
    assert _completion(prompt=[[1], [2, 3]]).prompts == ((1,), (2, 3))
    req = _completion(echo=True, logprobs=2, best_of=1, stop=["a", "b"])
    assert req.echo and req.sampling.logprobs == 2 and req.sampling.stop == ("a", "b")


@pytest.mark.parametrize("body, expected", [
    ({"temperature": "hot"}, ("temperature", "invalid_type")),
    ({"max_tokens": "7"}, ("max_tokens", "invalid_type")),  # strict: no silent coercion
    ({"n": True}, ("n", "invalid_type")),
    ({"stream": "yes"}, ("stream", "invalid_type")),
    ({"n": 0}, ("n", "invalid_value")),
    ({"n": 17}, ("n", "invalid_value")),
    ({"stop": [""]}, ("stop", "invalid_value")),
    ({"stop": ["x" * 257]}, ("stop", "invalid_value")),
    ({"seed": -1}, ("seed", "invalid_value")),
    ({"max_tokens": 1, "max_completion_tokens": 1}, ("max_tokens", "invalid_value")),
    ({"frequency_penalty": 3}, ("frequency_penalty", "invalid_value")),
    ({"function_call": "auto"}, ("function_call", "unsupported_parameter")),
    ({"modalities": ["audio"]}, ("modalities", "unsupported_parameter")),
    ({"messages": []}, ("messages", "invalid_value")),
    ({"messages": [{"content": "x"}]}, ("messages[0].role", "missing_required_parameter")),
    ({"messages": [{"role": "assistant", "tool_calls": [{}]}]},
     ("messages[0].tool_calls[0]", "invalid_value")),
    ({"model": ""}, ("model", "missing_required_parameter")),
])
def test_chat_errors_name_the_param(body, expected):
    assert _param(_chat, **body) == expected


def test_zero_penalties_and_text_format_are_accepted():  # and non-zero ones: see test_sampling_extras
    validate_request(_chat(presence_penalty=0, frequency_penalty=0.0,
                           response_format={"type": "text"}, logit_bias={}), Limits())


@pytest.mark.parametrize("body, param", [
    ({"prompt": None}, "prompt"), ({"prompt": [[1], "a"]}, "prompt"), ({"logprobs": 6}, "logprobs"),
    ({"best_of": 3}, "best_of"), ({"prompt": ["a"] * 33}, "prompt"), ({"echo": []}, "echo"),
])
def test_completion_errors_name_the_param(body, param):
    assert _param(_completion, **body)[0] == param


def test_limits_come_from_config():
    validate_request(_chat(n=20), Limits(max_n=32))
    with pytest.raises(ApiError, match="1..4"):
        validate_request(_chat(n=5), Limits(max_n=4))


@pytest.mark.parametrize("raw", [b"{", b"[]", b"\xff", b'"x"'])
def test_body_must_be_a_json_object(raw):
    with pytest.raises(ApiError) as e:
        parse_body(raw, "chat")
    assert e.value.error_code == "invalid_json" and e.value.status == 400


@pytest.mark.parametrize("raw, words", [
    (b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "too deeply"),
    (b'{"model": "m", "prompt": "p", "kvmesh": ' + b'{"a": ' * 40 + b"1" + b"}" * 41, "kvmesh.a.a"),
    (b'{"model": "m", "prompt": "p", "seed": ' + b"9" * 5000 + b"}", "5000 digits"),
    (b'{"model": "m", "prompt": "p", "seed": -' + b"9" * 5000 + b"}", "5000 digits"),
])
def test_bodies_json_cannot_hold_are_a_400(raw, words):
    """Found by tests/fuzz: nesting deeper than json's recursion limit (a RecursionError) and an
    integer past Python's 4300-digit conversion limit (a ValueError) were 500s."""
    with pytest.raises(ApiError) as e:
        parse_body(raw, "completion")
    assert (e.value.status, e.value.error_code) == (400, "invalid_json")
    assert words in e.value.message


def test_nesting_is_refused_past_the_limit_only():
    def body(levels: int) -> bytes:  # `levels` arrays nested inside the body (itself level 1)
        value: object = 1
        for _ in range(levels):
            value = [value]
        return json.dumps({"model": "m", "prompt": "p", "documents": value}).encode()

    assert parse_body(body(MAX_JSON_DEPTH - 1), "completion").documents is not None
    with pytest.raises(ApiError) as e:
        parse_body(body(MAX_JSON_DEPTH), "completion")
    assert e.value.param == "documents" + "[0]" * (MAX_JSON_DEPTH - 1)  # the array at level 33


def test_an_error_quoting_a_lone_surrogate_can_be_sent():
    """Found by tests/fuzz: a lone surrogate in an object key went into the error's message and
    param, and rendering that body as UTF-8 failed (a 500 from the server's error handler)."""
    with pytest.raises(ApiError) as e:
        parse_body(b'{"model": "m", "prompt": "p", "kvmesh": {"\\ud800": 1}}', "completion")
    assert e.value.param == "kvmesh.\\ud800" and e.value.error_code == "invalid_string"
    json.dumps(e.value.body(), ensure_ascii=False).encode("utf-8")  # what the HTTP app sends
