"""Structured output, tool calls and the sampling extras through the `openai` SDK, on the whole
stack as processes (what `kvmesh up` starts, speculative decoding included) with the real model:
50 varied JSON schemas whose every output parses and validates, tool calls with "required" and a
named function whose arguments validate, vLLM's guided_* extensions, extras that change the
output as they say (min_tokens outlasting a stop string too), and unknown fields refused with a
400 naming them. Then the same through the gRPC API: the sampling fields, JSON schemas and tool
calls (as ToolCall messages)."""
from __future__ import annotations

import json
import random
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema_rs
import openai
import pytest

from kvmesh.common.v1 import common_pb2 as cpb
from kvmesh.gateway.v1 import gateway_pb2 as gpb
from kvmesh.gateway.v1 import gateway_pb2_grpc
from kvmesh.model.bundled import source_tokenizer
from test_openai_stack import stack  # noqa: F401  (the same module-scoped stack fixture)

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"
WORDS = ["red", "blue", "cat", "dog", "north", "south", "alpha", "beta"]


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=stack["gateway"].url, api_key="unused", max_retries=0, timeout=300)


def _leaf(rng: random.Random, depth: int) -> dict:
    """A small, bounded schema: every output fits in a few dozen tokens."""
    kinds = ["integer", "boolean", "enum", "string", "pattern", "array", "null", "const", "anyOf"]
    if depth < 1:
        kinds.append("object")
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 900)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice([r"^[a-z]{1,8}$", r"^[A-Z]{2}-[0-9]{2,4}$",
                                                          r"^(yes|no)$"])}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "array":
        return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    if kind == "null":
        return {"type": "null"}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    if kind == "anyOf":
        return {"anyOf": [{"type": "boolean"}, {"enum": rng.sample(WORDS, 2)}]}
    return _object(rng, depth + 1)


def _object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["name", "age", "color", "ok", "items", "city", "score", "tag"], rng.randint(1, 3))
    required = [n for n in names if rng.random() < 0.8]
    return {"type": "object", "properties": {n: _leaf(rng, depth) for n in names}, "required": required,
            "additionalProperties": False}


def schemas(count: int = 50, seed: int = 7) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        top = rng.random()
        if top < 0.8:
            out.append(_object(rng))
        elif top < 0.9:
            out.append({"type": "array", "items": _object(rng, 1), "maxItems": 2})
        else:
            out.append(_leaf(rng, 1))
    return out


def test_fifty_varied_json_schemas_give_outputs_that_parse_and_validate(client):
    cases = schemas()
    assert len({json.dumps(s, sort_keys=True) for s in cases}) == len(cases), "schemas should differ"

    def ask(i_schema):
        i, schema = i_schema
        return client.chat.completions.create(
            model=MODEL, max_tokens=160, temperature=0,
            messages=[{"role": "user", "content": f"Describe item {i} as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}})

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(ask, enumerate(cases)))
    bad = []
    for schema, r in zip(cases, responses):
        choice = r.choices[0]
        if choice.finish_reason != "stop":
            bad.append((schema, choice.finish_reason, choice.message.content))
        elif not jsonschema_rs.validator_for(schema).is_valid(json.loads(choice.message.content)):
            bad.append((schema, "invalid", choice.message.content))
    assert not bad, f"{len(bad)} of {len(cases)}: {bad}"


def test_json_object_gives_an_object(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=64, temperature=0,
                                       messages=[{"role": "user", "content": "A JSON object about cats."}],
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "add", "description": "Adds two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                       "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "What is 12 plus 30?"])
def test_tool_choice_required_gives_valid_tool_calls(client, question):
    r = client.chat.completions.create(model=MODEL, max_tokens=120, temperature=0, tools=TOOLS,
                                       tool_choice="required", messages=[{"role": "user", "content": question}])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id
        args = json.loads(call.function.arguments)
        assert jsonschema_rs.validator_for(PARAMS[call.function.name]).is_valid(args), args


def test_a_named_tool_choice_calls_that_function_streamed_or_not(client):
    kwargs = dict(model=MODEL, max_tokens=80, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "add"}},
                  messages=[{"role": "user", "content": "Add 3 and 4."}])
    r = client.chat.completions.create(**kwargs)
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "add" and r.choices[0].finish_reason == "tool_calls"
    args = json.loads(call.function.arguments)
    assert jsonschema_rs.validator_for(PARAMS["add"]).is_valid(args)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    [streamed] = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert streamed.function.name == "add" and json.loads(streamed.function.arguments) == args
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_guided_choice_and_regex(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=10, temperature=0,
                                       messages=[{"role": "user", "content": "Is the sky blue?"}],
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert r.choices[0].message.content in ("yes", "no", "maybe")
    r = client.completions.create(model=MODEL, prompt="A US phone number:", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"})
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.choices[0].text), r.choices[0].text


def test_extras_change_the_output_as_they_say(client):
    messages = [{"role": "user", "content": "Answer with one word: is water wet?"}]
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                          logprobs=True)
    first = base.choices[0].logprobs.content[0].token
    longer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            extra_body={"min_tokens": base.usage.completion_tokens + 4})
    assert longer.usage.completion_tokens >= base.usage.completion_tokens + 4
    [token_id] = source_tokenizer("bundled").encode(first)  # the tokenizer the stack serves
    banned = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                            logprobs=True, logit_bias={str(token_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first
    assert first not in [t.token for t in banned.choices[0].logprobs.content]


@pytest.mark.parametrize("extra, param", [
    ({"best_of_n": 2}, "best_of_n"), ({"guided_decoding_backend": "x"}, "guided_decoding_backend"),
    ({"messages": [{"role": "user", "content": "x", "colour": "red"}]}, "messages[0].colour"),
])
def test_unknown_fields_are_refused_naming_them(client, extra, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**{**body, "extra_body": extra})
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_a_stop_string_inside_the_first_min_tokens_does_not_end_the_output(client):
    """vLLM's min_tokens: a stop string counts only when it ends after the min_tokens-th token."""
    messages = [{"role": "user", "content": "Count from 1 to 30, one number per line."}]
    base = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                          logprobs=True)
    text, tokens = base.choices[0].message.content, [t.token for t in base.choices[0].logprobs.content]
    assert "".join(tokens) == text and text.count("\n") >= 4, text
    cut = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0, stop=["\n"])
    assert cut.choices[0].message.content == text[:text.index("\n")]
    min_tokens = next(i for i in range(1, len(tokens)) if "\n" in "".join(tokens[:i])) + 2
    boundary = len("".join(tokens[:min_tokens]))  # a stop string must end past the text of these tokens
    later = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                           stop=["\n"], extra_body={"min_tokens": min_tokens})
    assert later.choices[0].finish_reason == "stop"
    assert later.choices[0].message.content == text[:text.index("\n", boundary)]


# --- the same through the gRPC API (kvmesh.gateway.v1.GatewayService) ----------------------------

@pytest.fixture
def stub(stack):
    with grpc.insecure_channel(stack["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayServiceStub(channel)


def _chat(stub, content: str, **kw) -> tuple[list[gpb.ChoiceDelta], gpb.CompletionChunk]:
    options = kw.pop("options", {})
    chunks = list(stub.ChatComplete(gpb.ChatCompleteRequest(
        model=MODEL, messages=[gpb.ChatMessage(role=gpb.ROLE_USER, content=content)],
        options=gpb.GenerationOptions(temperature=0, **options), **kw), timeout=300))
    return [d for c in chunks for d in c.choices], chunks[-1]


def _ids(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_grpc_sampling_fields_reach_the_engine(stub):
    question = "Answer with one word: is water wet?"
    base, last = _chat(stub, question, options={"max_tokens": 16})
    assert base[-1].finish_reason == cpb.FINISH_REASON_STOP and last.usage.completion_tokens < 12
    n = last.usage.completion_tokens
    forced = _ids(_chat(stub, question, options={"max_tokens": 4, "logit_bias": {42: 100.0}})[0])
    assert forced == [42] * 4  # greedy with a +100 bias: only that token
    stop_id = _ids(base)[1]
    stopped, _ = _chat(stub, question, options={"max_tokens": 16, "stop_token_ids": [stop_id]})
    assert _ids(stopped) == _ids(base)[:_ids(base).index(stop_id) + 1]
    assert stopped[-1].finish_reason == cpb.FINISH_REASON_STOP
    _, longer = _chat(stub, question, options={"max_tokens": 16, "min_tokens": n + 3})
    assert longer.usage.completion_tokens >= n + 3
    eos, last = _chat(stub, question, options={"max_tokens": n + 5, "ignore_eos": True})
    assert last.usage.completion_tokens == n + 5 and eos[-1].finish_reason == cpb.FINISH_REASON_LENGTH


def test_grpc_json_schema_output_parses_and_validates(stub):
    for i, schema in enumerate(schemas(count=5, seed=11)):
        deltas, _ = _chat(stub, f"Describe item {i} as JSON.", options={"max_tokens": 160, "response_format": gpb.ResponseFormat(
            type=gpb.RESPONSE_FORMAT_TYPE_JSON_SCHEMA,
            json_schema=gpb.JsonSchema(name=f"s{i}", schema=json.dumps(schema), strict=True))})
        assert deltas[-1].finish_reason == cpb.FINISH_REASON_STOP
        text = "".join(d.text for d in deltas)
        assert jsonschema_rs.validator_for(schema).is_valid(json.loads(text)), (schema, text)


def test_grpc_tool_calls_come_back_as_tool_calls(stub):
    tools = [gpb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                      parameters=json.dumps(t["function"]["parameters"])) for t in TOOLS]
    deltas, _ = _chat(stub, "What is 12 plus 30?", tools=tools, options={"max_tokens": 120},
                      tool_choice=gpb.ToolChoice(mode=gpb.TOOL_CHOICE_MODE_REQUIRED))
    assert deltas[-1].finish_reason == cpb.FINISH_REASON_TOOL_CALLS and not any(d.text for d in deltas)
    assert deltas[-1].tool_calls
    for call in deltas[-1].tool_calls:
        assert call.id.startswith("call_")
        assert jsonschema_rs.validator_for(PARAMS[call.name]).is_valid(json.loads(call.arguments))
    deltas, _ = _chat(stub, "Add 3 and 4.", tools=tools, options={"max_tokens": 80},
                      tool_choice=gpb.ToolChoice(function="add"))
    [call] = deltas[-1].tool_calls
    assert call.name == "add" and jsonschema_rs.validator_for(PARAMS["add"]).is_valid(json.loads(call.arguments))
