"""The gateway's published OpenAPI 3.1 document (GET /openapi.json): the OpenAI endpoints it
serves, their bodies as the gateway parses them (kvmesh.services.gateway.openai_schema's models),
the kvmesh extensions, the error body and the bearer-key scheme -- so tools (client generators,
schema-driven fuzzers such as schemathesis) can exercise the API.

The routes take the raw request (the gateway parses bodies itself, to answer every problem with
an OpenAI error body), so FastAPI cannot infer this document; it is built here once, from the same
pydantic models that `parse_body` validates with. Ranges enforced after parsing (temperature,
max_tokens against the context, ...) are not all in the schemas: a value the schema admits may
still get a 400 that names it.
"""
from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from kvmesh import __version__
from kvmesh.kv.quality import LOSSY_KV_CODECS
from kvmesh.services.gateway.embeddings import EmbeddingsBody
from kvmesh.services.gateway.openai_schema import ChatCompletionBody, CompletionBody
from kvmesh.services.gateway.tokenization import DetokenizeBody, TokenizeChatBody, TokenizeTextBody

_REF = "#/components/schemas/{model}"

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type"],
        "properties": {
            "message": {"type": "string"},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"]},
            "code": {"type": ["string", "null"]},
        },
    }},
}

_MODEL = {
    "type": "object",
    "required": ["id", "object", "owned_by"],
    "properties": {
        "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
        "owned_by": {"type": "string"}, "root": {"type": "string"},
        "max_model_len": {"type": "integer", "description": "kvmesh: the model's context length"},
    },
}

_KVMESH_EXTENSION = {
    "type": ["object", "null"],
    "description": "kvmesh's extension object: `lossy` opts this request into lossy reuse paths "
                   "with the quality it accepts (unset fields come from the tenant's keys-file "
                   "entry, then the deployment). Exact reuse needs no opt-in.",
    "properties": {"lossy": {
        "type": "object",
        "properties": {
            "kv_codec": {"type": "string", "enum": list(LOSSY_KV_CODECS)},
            "recompute_ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "max_kl": {"type": "number", "minimum": 0},
            "min_top1": {"type": "number", "minimum": 0, "maximum": 1},
        },
    }},
}

_ERRORS = {
    "400": "a parameter is missing, malformed or out of range (`param` names it)",
    "401": "missing or unknown API key",
    "404": "unknown model",
    "429": "the tenant's quota or the stack is over capacity; retry after `Retry-After`",
    "503": "the gateway is full or draining, or no replica can serve; retry after `Retry-After`",
    "504": "the request's deadline passed upstream",
}


def _responses(ok: dict[str, Any], *codes: str) -> dict[str, Any]:
    out: dict[str, Any] = {"200": ok}
    for code in codes:
        out[code] = {"description": _ERRORS[code],
                     "content": {"application/json": {"schema": {"$ref": _REF.format(model="Error")}}}}
    return out


def _generation(body: str, summary: str) -> dict[str, Any]:
    ok = {"description": "the completion; with `stream: true`, server-sent events of chunks ending "
                         "in `data: [DONE]` (an error after the first chunk is an error event)",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"schema": {"type": "string"}}}}
    return {"post": {
        "summary": summary,
        "security": [{"bearer": []}],
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": _REF.format(model=body)}}}},
        "responses": _responses(ok, "400", "401", "404", "429", "503", "504"),
    }}


def openapi_document() -> dict[str, Any]:
    """The document GET /openapi.json serves."""
    _, defs = models_json_schema([(CompletionBody, "validation"), (ChatCompletionBody, "validation")],
                                 ref_template=_REF)
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    for name in ("CompletionBody", "ChatCompletionBody"):
        props = schemas[name]["properties"]
        props["kvmesh"] = _KVMESH_EXTENSION
        props["model"]["description"] = "a model id from GET /v1/models"
    chat = schemas["ChatCompletionBody"]["properties"]
    chat["documents"]["description"] = ("kvmesh: documents placed before the conversation, each "
                                        "{\"id\"} (from the catalog) or {\"text\"}, their KV reused in "
                                        "any order")
    chat["retrieve"]["description"] = "kvmesh: let the question pick `top_k` catalogued documents"
    chat["recompute_ratio"]["description"] = ("kvmesh: share of reused document tokens recomputed "
                                              "(lossy below 1; opt in through `kvmesh.lossy`)")
    for name in ("documents", "retrieve", "recompute_ratio"):  # chat-only extensions
        schemas["CompletionBody"]["properties"].pop(name, None)
    schemas["Error"] = _ERROR
    schemas["Model"] = _MODEL
    model_list = {"type": "object", "required": ["object", "data"],
                  "properties": {"object": {"const": "list"},
                                 "data": {"type": "array", "items": {"$ref": _REF.format(model="Model")}}}}
    json_ok = lambda ref: {"description": "OK", "content": {"application/json": {"schema": ref}}}  # noqa: E731
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvmesh gateway", "version": __version__,
                 "description": "OpenAI-compatible completions and chat completions, with kvmesh's "
                                "reuse extensions. Every error is an OpenAI error body."},
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                                      "description": "an API key (any key when the "
                                                                     "gateway runs without a keys file)"}}},
        "paths": {
            "/v1/completions": _generation("CompletionBody", "Text completion"),
            "/v1/chat/completions": _generation("ChatCompletionBody", "Chat completion"),
            "/v1/models": {"get": {"summary": "The served models", "security": [{"bearer": []}],
                                   "responses": _responses(json_ok(model_list), "401")}},
            "/v1/models/{model_id}": {"get": {
                "summary": "One served model", "security": [{"bearer": []}],
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": _responses(json_ok({"$ref": _REF.format(model="Model")}), "401", "404")}},
            "/health": {"get": {"summary": "Readiness: 200 when an upstream router answers",
                                "responses": {"200": {"description": "ready"},
                                              "503": {"description": "not ready (the body says why)"}}}},
            **_extra_paths(schemas),
        },
    }


def _extra_paths(schemas: dict[str, Any]) -> dict[str, Any]:
    """Embeddings, vLLM's tokenizer endpoints and /version; their body schemas go into `schemas`."""
    _, defs = models_json_schema([(m, "validation") for m in (EmbeddingsBody, TokenizeTextBody,
                                                               TokenizeChatBody, DetokenizeBody)],
                                 ref_template=_REF)
    schemas.update(defs.get("$defs", {}))
    ref = lambda name: {"$ref": _REF.format(model=name)}  # noqa: E731

    def post(summary: str, body: dict[str, Any], ok: dict[str, Any], *codes: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "security": [{"bearer": []}],
                         "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
                         "responses": _responses({"description": "OK", "content": {"application/json": {"schema": ok}}},
                                                 *codes)}}

    obj = lambda **props: {"type": "object", "required": list(props), "properties": props}  # noqa: E731
    ints = {"type": "array", "items": {"type": "integer"}}
    return {
        "/v1/embeddings": post(
            "Sentence embeddings from the KV service's embedding model (listed in /v1/models with "
            "kind `embedding`)", ref("EmbeddingsBody"),
            obj(object={"const": "list"}, model={"type": "string"},
                data={"type": "array", "items": obj(object={"const": "embedding"}, index={"type": "integer"},
                                                    embedding={"type": ["array", "string"]})},
                usage=obj(prompt_tokens={"type": "integer"}, total_tokens={"type": "integer"})),
            "400", "401", "404", "503"),
        "/tokenize": post(
            "vLLM's /tokenize: a prompt, or messages through the chat template, as token ids",
            {"oneOf": [ref("TokenizeTextBody"), ref("TokenizeChatBody")]},
            obj(count={"type": "integer"}, max_model_len={"type": "integer"}, tokens=ints,
                token_strs={"type": ["array", "null"], "items": {"type": "string"}}),
            "400", "401", "404"),
        "/detokenize": post("vLLM's /detokenize: token ids as text (special tokens kept)",
                            ref("DetokenizeBody"), obj(prompt={"type": "string"}), "400", "401", "404"),
        "/tokenizer_info": {"get": {
            "summary": "vLLM's /tokenizer_info: the tokenizer's tokenizer_config.json fields (BOS/EOS, "
                       "chat template) and model_max_length, as lm-eval's remote tokenizer reads them",
            "security": [{"bearer": []}],
            "responses": _responses({"description": "OK", "content": {"application/json": {"schema": {
                "type": "object", "required": ["tokenizer_class"],
                "properties": {"tokenizer_class": {"type": "string"}}}}}}, "401")}},
        "/version": {"get": {"summary": "The kvmesh version",
                             "responses": {"200": {"description": "OK", "content": {"application/json": {
                                 "schema": obj(version={"type": "string"})}}}}}},
    }
