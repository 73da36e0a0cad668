"""The gateway's span attributes, named by the OpenTelemetry GenAI semantic conventions (the
current release's names: `gen_ai.provider.name`, `gen_ai.usage.cache_read.input_tokens`, and
`gen_ai.input.messages` / `gen_ai.output.messages` for content, which replaced the deprecated
`gen_ai.system`, `gen_ai.prompt` and `gen_ai.completion`).

Content attributes are opt-in (`--trace-content`); they are JSON strings in the conventions'
message shape (`[{"role", "parts": [{"type": "text", "content"}], "finish_reason"?}]`), since
span attributes cannot hold structured values in the Python SDK.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from kvmesh.grammar import ConstraintKind
from kvmesh.services.gateway.spec import GenerationRequest, Usage

PROVIDER = "kvmesh"
"""`gen_ai.provider.name`: the system serving the model (no well-known value fits)."""


def request_attributes(req: GenerationRequest) -> dict:
    """What the client asked for: operation, model and the sampling settings it set."""
    s = req.sampling
    attrs: dict = {"gen_ai.provider.name": PROVIDER,
                   "gen_ai.operation.name": "chat" if req.kind == "chat" else "text_completion",
                   "gen_ai.request.model": req.model}
    optional = {"gen_ai.request.max_tokens": s.max_tokens, "gen_ai.request.temperature": s.temperature,
                "gen_ai.request.top_p": s.top_p, "gen_ai.request.top_k": s.top_k, "gen_ai.request.seed": s.seed,
                "gen_ai.request.presence_penalty": s.presence_penalty,
                "gen_ai.request.frequency_penalty": s.frequency_penalty}
    attrs.update({k: v for k, v in optional.items() if v is not None})
    if s.stop:
        attrs["gen_ai.request.stop_sequences"] = list(s.stop)
    if req.n != 1:
        attrs["gen_ai.request.choice.count"] = req.n
    if s.constraint is not None:
        json_kinds = (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT)
        attrs["gen_ai.output.type"] = "json" if s.constraint.kind in json_kinds else "text"
    return attrs


def response_attributes(response_id: str, model: str, usage: Usage,
                        finish_reasons: Sequence[str]) -> dict:
    """What the generation returned: its id, model, finish reasons (one per choice) and usage."""
    return {"gen_ai.response.id": response_id, "gen_ai.response.model": model,
            "gen_ai.response.finish_reasons": list(finish_reasons),
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens}


def content_attributes(req: GenerationRequest, prompt_texts: Sequence[str], outputs: Sequence[str],
                       finish_reasons: Sequence[str]) -> dict:
    """The opt-in content: the chat's messages (a completion's prompts as user messages) and one
    assistant message per choice."""
    if req.kind == "chat":
        turns = [(t.role, t.content) for t in req.messages]
    else:
        turns = [("user", text) for text in prompt_texts]
    inputs = [_message(role, text) for role, text in turns]
    outs = [dict(_message("assistant", text), finish_reason=reason)
            for text, reason in zip(outputs, finish_reasons)]
    return {"gen_ai.input.messages": json.dumps(inputs, ensure_ascii=False),
            "gen_ai.output.messages": json.dumps(outs, ensure_ascii=False)}


def finish_reasons(by_choice: Mapping[int, str], choices: int) -> list[str]:
    """Every choice's finish reason in choice order ("" where none came)."""
    return [by_choice.get(i, "") for i in range(choices)]


def _message(role: str, text: str) -> dict:
    return {"role": role, "parts": [{"type": "text", "content": text}]}
