"""Structured output and tool calls on the OpenAI API.

A request asks for at most one constraint, from one of: `response_format` (`json_object`, or
`json_schema` whose `schema` the output is constrained to -- always enforced, `strict` or not),
vLLM's `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` (Lark or GBNF), or
`tools` with `tool_choice`. The engine enforces it token by token (services/engine/structured.py);
this module only builds it, checks that it compiles (a 400 with the grammar library's message)
and turns a tool-call output back into OpenAI `tool_calls`.

Tools, as vLLM without a tool-call parser: `tool_choice` "required" constrains the output to a
JSON array of `{"name": <one of the tools>, "parameters": <its arguments>}` (one element when
`parallel_tool_calls` is false); a named function (`{"type": "function", "function": {"name":
...}}`) constrains it to that function's `parameters` schema. Both come back as `tool_calls` with
finish_reason "tool_calls". "none" generates plain text. "auto" (OpenAI's default when tools are
given) would need a parser that tells a tool call from text in this model's own format: it is
refused with a 400 that says what to send instead.
"""
from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from kvmesh.errors import InvalidArgument
from kvmesh.grammar import Constraint, ConstraintKind, check_grammar
from kvmesh.services.gateway.errors import ApiError, invalid

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
"""A function's arguments when its `parameters` is omitted (OpenAI: no arguments)."""


@dataclass(frozen=True)
class ToolCallOutput:
    """How a constrained output becomes tool calls."""

    function: str | None = None
    """The named function (the output is its arguments); None: tool_choice "required" (the output
    is a JSON array of {"name", "parameters"})."""


@dataclass(frozen=True)
class StructuredRequest:
    """What a request's body asks for: the constraint, and how its output maps to tool calls."""

    constraint: Constraint | None = None
    tool_calls: ToolCallOutput | None = None


def _unsupported(param: str, why: str) -> ApiError:
    return invalid(f"{param} {why}", param, "unsupported_parameter")


def _compiled(c: Constraint, param: str) -> Constraint:
    try:
        check_grammar(c)
    except InvalidArgument as e:
        raise invalid(f"invalid value for '{param}': {e.message}", param, "invalid_value") from None
    return c


def json_value(text: str, param: str) -> Any:
    """A parameter that holds JSON as text, decoded (a 400 naming it when it is not JSON)."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise invalid(f"{param} is not valid JSON ({e})", param) from None


def _schema_text(schema: Any, param: str) -> str:
    if not isinstance(schema, dict):
        raise invalid(f"'{param}' must be a JSON Schema object, got {type(schema).__name__}", param)
    return json.dumps(schema, ensure_ascii=False, sort_keys=True)


def response_format_constraint(fmt: dict[str, Any] | None) -> tuple[Constraint | None, str]:
    """(constraint, parameter) of `response_format` (None for absent or {"type": "text"})."""
    if fmt is None:
        return None, ""
    kind = fmt.get("type")
    if kind == "text":
        return None, ""
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT), "response_format"
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise invalid("response_format.json_schema must be an object with a 'schema' (and "
                          "'name')", "response_format.json_schema")
        if "schema" not in spec:
            raise invalid("missing required parameter: 'response_format.json_schema.schema'",
                          "response_format.json_schema.schema", "missing_required_parameter")
        param = "response_format.json_schema.schema"
        return Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(spec["schema"], param)), param
    raise invalid(f"response_format.type {kind!r} is not supported; use 'text', 'json_object' or "
                  "'json_schema'", "response_format.type")


def guided_constraints(guided_json: Any, guided_regex: str | None, guided_choice: list[str] | None,
                       guided_grammar: str | None) -> list[tuple[Constraint, str]]:
    """The constraints vLLM's guided_* fields ask for, with their parameter names."""
    out = []
    if guided_json is not None:
        if isinstance(guided_json, str):
            guided_json = json_value(guided_json, "guided_json")
        out.append((Constraint(ConstraintKind.JSON_SCHEMA, _schema_text(guided_json, "guided_json")),
                    "guided_json"))
    if guided_regex is not None:
        out.append((Constraint(ConstraintKind.REGEX, guided_regex), "guided_regex"))
    if guided_choice is not None:
        out.append((Constraint(ConstraintKind.CHOICE, choices=tuple(guided_choice)), "guided_choice"))
    if guided_grammar is not None:
        out.append((Constraint(ConstraintKind.GRAMMAR, guided_grammar), "guided_grammar"))
    return out


def _function(i: int, tool: Any) -> tuple[str, dict[str, Any]]:
    """(name, parameters schema) of tools[i]."""
    param = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(f"{param} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; "
                      "only function tools are supported", param)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise invalid(f"missing required parameter: '{param}.function.name'", f"{param}.function.name",
                      "missing_required_parameter")
    parameters = fn.get("parameters", EMPTY_PARAMETERS)
    if not isinstance(parameters, dict):
        raise invalid(f"'{param}.function.parameters' must be a JSON Schema object", f"{param}.function.parameters")
    return name, parameters


def tools_constraint(tools: list[Any] | None, tool_choice: Any,
                     parallel_tool_calls: bool | None) -> tuple[Constraint | None, ToolCallOutput | None]:
    """The constraint and tool-call mapping of `tools` + `tool_choice` (see the module docstring)."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise invalid("tool_choice needs tools; send the tools the model may call", "tool_choice")
        return None, None
    functions = dict(_function(i, t) for i, t in enumerate(tools))
    if len(functions) != len(tools):
        raise invalid("tools must have distinct function names", "tools")
    if tool_choice == "none":
        return None, None
    if tool_choice is None or tool_choice == "auto":
        raise _unsupported("tool_choice", "'auto' (the default when tools are sent) is not supported: "
                           "this server has no parser for the model's own tool-call format; set "
                           "tool_choice to 'required' or to {\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}, or to 'none'")
    if tool_choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, params in functions.items()]
        schema: dict[str, Any] = {"type": "array", "minItems": 1,
                                  "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True)), ToolCallOutput()
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in functions:
            raise invalid(f"tool_choice names function {name!r}, which is not in tools "
                          f"({', '.join(functions)})", "tool_choice.function.name")
        text = json.dumps(functions[name], sort_keys=True)
        return Constraint(ConstraintKind.JSON_SCHEMA, text), ToolCallOutput(function=name)
    raise invalid("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                  "\"function\": {\"name\": ...}}", "tool_choice")


def structured_request(*, response_format: dict[str, Any] | None = None, guided_json: Any = None,
                       guided_regex: str | None = None, guided_choice: list[str] | None = None,
                       guided_grammar: str | None = None, tools: list[Any] | None = None,
                       tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> StructuredRequest:
    """A body's constraint (at most one may be asked for), checked to compile (400 naming the
    parameter, with the grammar library's message, when it does not)."""
    asked: list[tuple[Constraint, str]] = []
    fmt, fmt_param = response_format_constraint(response_format)
    if fmt is not None:
        asked.append((fmt, fmt_param))
    asked += guided_constraints(guided_json, guided_regex, guided_choice, guided_grammar)
    tool_constraint, calls = tools_constraint(tools, tool_choice, parallel_tool_calls)
    if tool_constraint is not None:
        asked.append((tool_constraint, "tools"))
    if len(asked) > 1:
        names = ", ".join(p.split(".")[0] for _, p in asked)
        raise invalid(f"ask for one structured output at a time; this request sets {names}",
                      asked[1][1].split(".")[0])
    if not asked:
        return StructuredRequest()
    constraint, param = asked[0]
    return StructuredRequest(_compiled(constraint, param), calls)


def tool_call_result(text: str, finish_reason: str | None, out: ToolCallOutput
                     ) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """(content, tool_calls, finish_reason) of a finished tool-call choice whose whole output is
    `text`: its calls with "tool_calls" when it ended on its own and parses, else the text with
    its own finish_reason (an output cut by max_tokens)."""
    calls = parse_tool_calls(text, out) if finish_reason == "stop" else None
    if calls is None:
        return text, None, finish_reason
    return None, calls, "tool_calls"


def parse_tool_calls(text: str, out: ToolCallOutput) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` of a complete constrained output, or None when it does not parse
    (an output cut by max_tokens)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if out.function is not None:
        calls = [(out.function, value)]
    elif isinstance(value, list) and all(isinstance(v, dict) and "name" in v for v in value):
        calls = [(v["name"], v.get("parameters", {})) for v in value]
    else:
        return None
    return [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}
            for name, args in calls]
