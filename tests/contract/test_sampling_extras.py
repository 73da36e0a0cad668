"""The full sampling set and structured output over HTTP, through the `openai` SDK: every field
reaches the engine's SamplingParams as asked (and only when asked); tools become a JSON-schema
constraint; unknown fields and what cannot be done are a 400 naming the parameter."""
from __future__ import annotations

import json

import openai
import pytest

from gateway_utils import MODEL

USER = [{"role": "user", "content": "hi"}]


def _sampling(gateway):
    [call] = gateway.state.calls
    return call.request.request.sampling


def test_every_extra_reaches_the_engine(client, gateway):
    client.chat.completions.create(
        model=MODEL, messages=USER, presence_penalty=0.5, frequency_penalty=-0.25,
        logit_bias={"7": 3.5, "11": -100}, user="u1", metadata={"k": "v"}, store=False,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [3, 4],
                    "min_tokens": 2, "ignore_eos": True})
    sp = _sampling(gateway)
    assert (sp.presence_penalty, sp.frequency_penalty) == (0.5, -0.25)
    assert dict(sp.logit_bias) == {7: 3.5, 11: -100.0}
    assert (sp.top_k, sp.min_tokens, list(sp.stop_token_ids), sp.ignore_eos) == (5, 2, [3, 4], True)
    assert sp.min_p == pytest.approx(0.1) and sp.repetition_penalty == pytest.approx(1.2)
    assert not sp.HasField("structured_output")


def test_unset_extras_keep_the_engines_defaults(client, gateway):
    client.completions.create(model=MODEL, prompt="x", extra_body={"top_k": -1})
    sp = _sampling(gateway)
    for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
                 "top_k", "structured_output"):
        assert not sp.HasField(name), name
    assert not sp.logit_bias


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("kwargs, kind, expected", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}},
     "json_schema", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", None),
    ({"extra_body": {"guided_json": SCHEMA}}, "json_schema", SCHEMA),
    ({"extra_body": {"guided_regex": "[ab]+"}}, "regex", "[ab]+"),
    ({"extra_body": {"guided_choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"extra_body": {"guided_grammar": 'start: "x" | "y"'}}, "grammar", 'start: "x" | "y"'),
])
def test_structured_output_reaches_the_engine(client, gateway, kwargs, kind, expected):
    client.chat.completions.create(model=MODEL, messages=USER, **kwargs)
    so = _sampling(gateway).structured_output
    assert so.WhichOneof("kind") == kind
    if kind == "json_schema":
        assert json.loads(so.json_schema) == expected
    elif kind == "choice":
        assert list(so.choice.choices) == expected
    elif expected is not None:
        assert getattr(so, kind) == expected


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "g"}}]


def test_tool_choice_required_constrains_to_an_array_of_calls(client, gateway):
    client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False)
    schema = json.loads(_sampling(gateway).structured_output.json_schema)
    assert schema["type"] == "array" and (schema["minItems"], schema["maxItems"]) == (1, 1)
    names = [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]]
    assert names == ["f", "g"] and schema["items"]["anyOf"][0]["properties"]["parameters"] == SCHEMA


def test_a_named_tool_constrains_to_its_parameters(client, gateway):
    client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS,
                                   tool_choice={"type": "function", "function": {"name": "f"}})
    assert json.loads(_sampling(gateway).structured_output.json_schema) == SCHEMA


def test_tool_choice_none_generates_text(client, gateway):
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert not _sampling(gateway).HasField("structured_output")


@pytest.mark.parametrize("kwargs, param, code", [
    ({"tools": TOOLS}, "tool_choice", "unsupported_parameter"),  # OpenAI's default: "auto"
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "unsupported_parameter"),
    ({"tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "h"}}},
     "tool_choice.function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2, "tool_choice": "required"},
     "tools", "invalid_value"),
    ({"tools": [{"type": "code_interpreter"}], "tool_choice": "required"}, "tools[0]", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s"}}},
     "response_format.json_schema.schema", "missing_required_parameter"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
     "guided_regex", "invalid_value"),
    ({"extra_body": {"guided_json": "{not json"}}, "guided_json", "invalid_value"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "invalid_value"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty", "invalid_value"),
    ({"extra_body": {"min_p": 2}}, "min_p", "invalid_value"),
    ({"extra_body": {"top_k": -2}}, "top_k", "invalid_value"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "invalid_value"),
    ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern", "unknown_parameter"),
    ({"extra_body": {"stream_options": {"include_usage": True, "x": 1}}}, "stream_options.x",
     "unknown_parameter"),
])
def test_what_cannot_be_done_is_a_400_naming_the_param(client, gateway, kwargs, param, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{"model": MODEL, "messages": USER, **kwargs})
    err = e.value.body
    assert (err["param"], err["code"]) == (param, code), err
    assert gateway.state.calls == []


def test_an_unknown_field_is_named_with_what_to_do(client, gateway):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", extra_body={"temprature": 0.5})
    assert e.value.body["param"] == "temprature"
    assert "unrecognized request argument supplied: 'temprature'; remove it" in e.value.body["message"]


def test_a_replayed_assistant_message_with_response_fields_is_accepted(client, gateway):
    messages = [*USER, {"role": "assistant", "content": "hello", "refusal": None, "annotations": []},
                {"role": "user", "content": "again"}]
    client.chat.completions.create(model=MODEL, messages=messages)
    assert len(gateway.state.calls) == 1
