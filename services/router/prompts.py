"""What the router reads of a request's prompt: its length (difficulty routing, placement
score), the ids replicas' prefix caches are probed with, and the parts only an engine resolves.

A prompt in parts (GenerateRequest.parts, documents marked) is known only in part: plain and
inline-document tokens count, catalogued and retrieved documents (resolved by the engine from
the KV service's catalog) count 0. Only its leading plain tokens are a prefix a replica may hold
in its prefix cache: documents' KV is found by content wherever they land, so the probe ids stop
at the first part that is not plain tokens.
"""
from __future__ import annotations

import math

from kvmesh.engine.v1 import engine_pb2

CHARS_PER_TOKEN = 4
"""Prompt length estimate for text prompts (difficulty routing only)."""

CATALOG_PARTS = ("document_id", "retrieve")
"""Prompt parts that need the KV service's catalog: only a kvmesh engine can serve them."""


def prompt_tokens(request: engine_pb2.GenerateRequest, prompt_text: str = "") -> int:
    """The prompt's length in tokens: estimated from characters for text prompts; for prompts in
    parts, the tokens known before the engine resolves documents."""
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        return len(request.token_ids.ids)
    if which == "parts":
        return sum(len(p.tokens.ids) + len(p.document.ids) for p in request.parts.parts)
    text = request.text if which == "text" else prompt_text
    return math.ceil(len(text) / CHARS_PER_TOKEN)


def probe_ids(request: engine_pb2.GenerateRequest) -> list[int] | None:
    """The ids to probe prefix caches with: the token prompt, or a prompt's leading plain
    tokens in parts; None when there is nothing to probe with (text, or a leading document)."""
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        return list(request.token_ids.ids)
    if which != "parts":
        return None
    ids: list[int] = []
    for part in request.parts.parts:
        if part.WhichOneof("part") != "tokens":
            break
        ids.extend(part.tokens.ids)
    return ids or None


def catalog_parts(request: engine_pb2.GenerateRequest) -> list[str]:
    """The kinds of the prompt's parts that need the KV service's catalog, in order, distinct."""
    if request.WhichOneof("prompt") != "parts":
        return []
    kinds = [p.WhichOneof("part") for p in request.parts.parts]
    return [k for k in CATALOG_PARTS if k in kinds]
