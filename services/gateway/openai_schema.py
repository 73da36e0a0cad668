"""OpenAI request bodies (pydantic) and their translation into the gateway's `GenerationRequest`.

Refuse rather than ignore: an unknown field, at the top level or inside a message, is a 400
naming it (OpenAI's "unrecognized request argument supplied"; vLLM only logs a warning, but a
client relying on a field the server drops gets wrong output). Known knobs the stack cannot honour
(best_of != n, suffix, functions/function_call, prediction, audio, tool_choice "auto") are refused
with a 400 that names them too. OpenAI fields that cannot change the output are accepted and not
interpreted: `user`, `metadata`, `store`, and in a replayed assistant message `refusal` and
`annotations`.

Sampling: OpenAI's temperature, top_p, seed, stop, presence/frequency penalties and logit_bias,
plus vLLM's extensions top_k, min_p, repetition_penalty, stop_token_ids, min_tokens and
ignore_eos. Structured output: response_format (json_object, json_schema), vLLM's guided_json,
guided_regex, guided_choice and guided_grammar, and tools with tool_choice "required" or a named
function (services/gateway/structured.py). Range checks shared with the gRPC API live in
`spec.validate_request`.

kvmesh extensions of chat completions: `documents` (a list of `{"id": ...}` or `{"text": ...}`),
`retrieve` (`{"top_k": 1..kvmesh.limits.MAX_RETRIEVE_K, "query": optional}`) and `recompute_ratio` (0..1); see
`spec.GenerationRequest`. Completions refuse them.

The `kvmesh` extension object of both: `{"lossy": {"kv_codec": "int8", "recompute_ratio": 0.15,
"max_kl": 0.05, "min_top1": 0.95}}` opts the request into lossy reuse paths with the quality it
accepts (kvmesh.kv.quality.LossyOptIn; every field optional, unset ones come from the tenant).
"""
from __future__ import annotations

import json
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, ValidationError

from kvmesh.kv.quality import LossyOptIn
from kvmesh.services.gateway.errors import ApiError, invalid
from kvmesh.services.gateway.spec import (
    ChatTurn,
    DocumentRef,
    GenerationRequest,
    Retrieval,
    Sampling,
)
from kvmesh.services.gateway.structured import StructuredRequest, structured_request


class _Body(BaseModel):
    # strict: "5" is not a number, "yes" no bool; forbid: an unknown field is a 400 naming it
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class ContentPart(_Body):
    type: str
    text: str | None = None
    image_url: Any = None
    """OpenAI's other part types' payloads: declared so that their `type` is what gets refused."""
    input_audio: Any = None
    file: Any = None


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None
    """A response's own fields, sent back with the message in multi-turn use: they do not
    change the prompt, so they are accepted (function_call and audio only when null)."""
    annotations: Any = None


class DocumentBody(_Body):
    """One entry of `documents`: exactly one of `id` (catalogued) and `text` (inline)."""

    id: str | None = None
    text: str | None = None


class RetrieveBody(_Body):
    top_k: int
    query: str | None = None


class _Common(_Body):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    """Harmless OpenAI fields, accepted and not interpreted: `user`, `metadata`, `store`."""
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # vLLM's sampling extensions
    ignore_eos: bool | None = None
    """Keep generating past end-of-sequence, up to max_tokens."""
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    # vLLM's structured-output extensions (services/gateway/structured.py)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    kvmesh: Any = None


class CompletionBody(_Common):
    """POST /v1/completions."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None
    documents: Any = None
    retrieve: Any = None
    recompute_ratio: Any = None


class ChatCompletionBody(_Common):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    prediction: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    documents: list[DocumentBody] | None = None
    retrieve: RetrieveBody | None = None
    recompute_ratio: float | None = None


Body = Union[CompletionBody, ChatCompletionBody]


MAX_JSON_DEPTH = 32
"""Deepest nesting of arrays and objects in a body (OpenAI's bodies need 5, at
messages[i].content[j]); deeper ones are refused before any recursive walk meets them."""
MAX_NUMBER_DIGITS = 1000
"""Longest integer literal in a body, far past any field's range (Python itself refuses to
convert one of more than 4300 digits, with a ValueError)."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_NUMBER_DIGITS:
        raise ValueError(f"a number of {len(text.lstrip('-'))} digits; at most {MAX_NUMBER_DIGITS}")
    return int(text)


def decode_object(raw: bytes) -> dict[str, Any]:
    """A request body decoded as one JSON object within the gateway's limits (nesting depth,
    valid Unicode, integers); a 400 naming what to fix otherwise. Every JSON endpoint uses it."""
    try:
        data = json.loads(raw, parse_int=_parse_int)
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise invalid(f"the request body nests arrays or objects too deeply to decode; at most "
                      f"{MAX_JSON_DEPTH} levels", None, "invalid_json") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors too
        raise invalid(f"the request body is not valid JSON ({e}); send a JSON object",
                      None, "invalid_json") from e
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_json")
    deep = too_deep(data, MAX_JSON_DEPTH)
    if deep is not None:
        raise invalid(f"invalid value for '{deep}': nested more than {MAX_JSON_DEPTH} levels deep",
                      deep, "invalid_json")
    bad = lone_surrogate(data)
    if bad is not None:
        param, index = bad
        raise invalid(f"invalid value for '{param}': a lone UTF-16 surrogate at character {index}; "
                      "strings must be valid Unicode (send a surrogate only as half of a pair)",
                      param, "invalid_string")
    return data


def parse_body(raw: bytes, kind: Literal["completion", "chat"]) -> Body:
    """Decode and shape-check a JSON body; 400 naming the parameter on any problem."""
    data = decode_object(raw)
    schema = ChatCompletionBody if kind == "chat" else CompletionBody
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise validation_error(e.errors()) from e


def too_deep(value: Any, limit: int) -> str | None:
    """The parameter path of the first array or object in a decoded JSON value nested more than
    `limit` levels deep (the body itself is level 1), or None. Iterative, so that it never runs out
    of stack itself."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        item, path, depth = stack.pop()
        if depth > limit:
            return path or "body"
        if isinstance(item, dict):
            children = [(v, f"{path}.{k}" if path else str(k)) for k, v in item.items()
                        if isinstance(v, (dict, list))]
        else:
            children = [(v, f"{path}[{i}]") for i, v in enumerate(item) if isinstance(v, (dict, list))]
        stack.extend((v, where, depth + 1) for v, where in reversed(children))
    return None


def lone_surrogate(value: Any, path: str = "") -> tuple[str, int] | None:
    """(parameter path, character index) of the first string (or object key) in a decoded JSON
    value holding a lone UTF-16 surrogate, or None. JSON's \\ud800 escapes decode to such strings,
    which no UTF-8 encoder (protobuf's, the tokenizer's) accepts."""
    if isinstance(value, str):
        for i, ch in enumerate(value):
            if "\ud800" <= ch <= "\udfff":
                return path or "body", i
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            found = lone_surrogate(key, where) or lone_surrogate(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def validation_error(errors: list[Any]) -> ApiError:
    """A pydantic/FastAPI error list as one 400 naming the first bad parameter."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union members add their type names to the path ("prompt.str"): keep the field part only.
    names = [p for p in loc if p.isdigit() or not _is_type_name(p)]
    param = ""
    for part in names:
        param += f"[{part}]" if part.isdigit() else (f".{part}" if param else part)
    kind = first.get("type", "")
    message = first.get("msg", "invalid value")
    if kind == "extra_forbidden":
        return invalid(f"unrecognized request argument supplied: '{param}'; remove it (this server "
                       "refuses parameters it does not implement rather than ignore them)",
                       param or None, "unknown_parameter")
    if kind == "missing":
        return invalid(f"missing required parameter: '{param}'", param or None,
                       "missing_required_parameter")
    shown = f" (got {first['input']!r})" if "input" in first and kind != "missing" else ""
    return invalid(f"invalid value for '{param or 'body'}': {message}{shown}", param or None,
                   "invalid_type")


def _is_type_name(part: str) -> bool:
    return part in ("str", "int", "float", "bool", "list", "dict") or "[" in part


def _unsupported(name: str, hint: str = "") -> ApiError:
    return invalid(f"{name} is not supported by this server{hint}", name.split(" ")[0],
                   "unsupported_parameter")


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


KVMESH_FIELDS = ("lossy",)


def _lossy(body: _Common) -> LossyOptIn | None:
    """The request's `kvmesh.lossy` opt-in (400 naming the field when malformed)."""
    ext = body.kvmesh
    if ext is None:
        return None
    if not isinstance(ext, dict):
        raise invalid("kvmesh must be an object, e.g. {\"lossy\": {\"kv_codec\": \"int8\"}}", "kvmesh")
    unknown = sorted(set(ext) - set(KVMESH_FIELDS))
    if unknown:
        raise invalid(f"kvmesh.{unknown[0]} is not a kvmesh extension; use one of {', '.join(KVMESH_FIELDS)}",
                      f"kvmesh.{unknown[0]}")
    if ext.get("lossy") is None:
        return None
    try:
        return LossyOptIn.from_json(ext["lossy"])
    except ValueError as e:
        raise invalid(f"kvmesh.lossy: {e}", "kvmesh.lossy") from None


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias (token id strings -> bias) as (token id, bias) pairs."""
    out = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or len(key) > 9:
            raise invalid(f"logit_bias keys must be token ids (decimal strings), got {key!r}",
                          "logit_bias")
        out.append((int(key), float(value)))
    return tuple(out)


def _sampling(body: _Common, *, max_tokens: int | None, logprobs: int | None,
              structured: StructuredRequest) -> Sampling:
    """The sampling and stopping fields both endpoints share."""
    return Sampling(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
        stop=_stop(body.stop), logprobs=logprobs, ignore_eos=bool(body.ignore_eos),
        top_k=body.top_k, min_p=body.min_p, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias), stop_token_ids=tuple(body.stop_token_ids or ()),
        min_tokens=body.min_tokens, constraint=structured.constraint)


def _structured(body: _Common, **tools: Any) -> StructuredRequest:
    return structured_request(response_format=body.response_format, guided_json=body.guided_json,
                              guided_regex=body.guided_regex, guided_choice=body.guided_choice,
                              guided_grammar=body.guided_grammar, **tools)


def completion_request(body: CompletionBody) -> GenerationRequest:
    """POST /v1/completions as a GenerationRequest (400 for unsupported knobs)."""
    n = 1 if body.n is None else body.n
    if body.best_of is not None and body.best_of != n:
        raise _unsupported("best_of", f" unless equal to n ({n}); use n")
    if body.suffix:
        raise _unsupported("suffix")
    for name in ("documents", "retrieve", "recompute_ratio"):
        if getattr(body, name) is not None:
            raise invalid(f"{name} is only supported by chat completions "
                          "(/v1/chat/completions)", name, "unsupported_parameter")
    prompt = body.prompt
    if isinstance(prompt, str):
        prompts: tuple[str | tuple[int, ...], ...] = (prompt,)
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = (tuple(prompt),)  # type: ignore[arg-type]
    else:
        prompts = tuple(p if isinstance(p, str) else tuple(p) for p in prompt)  # type: ignore[union-attr]
    return GenerationRequest(
        kind="completion", model=body.model, prompts=prompts, n=n, echo=bool(body.echo),
        user=body.user or "", lossy=_lossy(body),
        sampling=_sampling(body, max_tokens=body.max_tokens, logprobs=body.logprobs,
                           structured=_structured(body)))


def replayed_tool_call(i: int, j: int, call: Any) -> dict[str, Any]:
    """messages[i].tool_calls[j] as chat templates take it (the arguments as an object, when
    they are a JSON object: Hugging Face's convention, which vLLM follows)."""
    param = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
            or not isinstance(fn.get("arguments", "{}"), str):
        raise invalid(f"{param} must be {{\"id\": ..., \"type\": \"function\", \"function\": "
                      "{\"name\": ..., \"arguments\": \"<JSON text>\"}}", param)
    arguments: Any = fn.get("arguments", "{}")
    try:
        parsed = json.loads(arguments)
        arguments = parsed if isinstance(parsed, dict) else arguments
    except ValueError:
        pass
    return {"id": str(call.get("id", "")), "type": "function",
            "function": {"name": fn["name"], "arguments": arguments}}


def _turn(i: int, m: ChatMessage) -> ChatTurn:
    return ChatTurn(m.role, _message_text(i, m), m.name,
                    tuple(replayed_tool_call(i, j, c) for j, c in enumerate(m.tool_calls or ())),
                    m.tool_call_id)


def _message_text(i: int, m: ChatMessage) -> str:
    for name in ("function_call", "audio"):
        if getattr(m, name) is not None:
            raise _unsupported(f"messages[{i}].{name}")
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text" or part.text is None:
            raise invalid(f"messages[{i}].content[{j}] has type {part.type!r}; only text parts "
                          "are supported", f"messages[{i}].content[{j}].type",
                          "unsupported_content_type")
        texts.append(part.text)
    return "".join(texts)


def chat_request(body: ChatCompletionBody) -> GenerationRequest:
    """POST /v1/chat/completions as a GenerationRequest (400 for unsupported knobs)."""
    for name in ("functions", "function_call", "prediction", "audio"):
        if getattr(body, name):
            raise _unsupported(name, "; use tools and tool_choice" if "function" in name else "")
    if body.modalities and set(body.modalities) != {"text"}:
        raise _unsupported("modalities", "; only [\"text\"]")
    structured = _structured(body, tools=body.tools, tool_choice=body.tool_choice,
                             parallel_tool_calls=body.parallel_tool_calls)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise invalid("set max_completion_tokens or max_tokens, not both", "max_tokens")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    messages = tuple(_turn(i, m) for i, m in enumerate(body.messages))
    return GenerationRequest(
        kind="chat", model=body.model, messages=messages, n=1 if body.n is None else body.n,
        user=body.user or "", tool_calls=structured.tool_calls, tools=tuple(body.tools or ()),
        sampling=_sampling(body, max_tokens=max_tokens, logprobs=logprobs, structured=structured),
        documents=tuple(DocumentRef(d.id, d.text) for d in body.documents or ()),
        retrieve=(None if body.retrieve is None
                  else Retrieval(body.retrieve.top_k, body.retrieve.query)),
        recompute_ratio=body.recompute_ratio, lossy=_lossy(body))
