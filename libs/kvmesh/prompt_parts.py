"""A prompt in parts that marks its documents: the domain side of `kvmesh.engine.v1.Prompt`,
shared by the gateway (which builds it from a chat request) and the engine (which resolves it).
No torch here: the gateway imports it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2


@dataclass(frozen=True)
class Tokens:
    """Plain prompt tokens: chat template, instructions, the question."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class InlineDocument:
    """A document sent with the request, tokenized alone."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class CatalogDocument:
    """A document of the KV service's catalog, resolved by the engine."""

    document_id: str


@dataclass(frozen=True)
class Retrieval:
    """The `k` catalogued documents nearest to `query`, `separator` between them."""

    query: str
    k: int
    separator: tuple[int, ...] = ()


Part = Union[Tokens, InlineDocument, CatalogDocument, Retrieval]


def part_to_proto(part: Part) -> engine_pb2.PromptPart:
    if isinstance(part, Tokens):
        return engine_pb2.PromptPart(tokens=common_pb2.TokenIds(ids=part.ids))
    if isinstance(part, InlineDocument):
        return engine_pb2.PromptPart(document=common_pb2.TokenIds(ids=part.ids))
    if isinstance(part, CatalogDocument):
        return engine_pb2.PromptPart(document_id=part.document_id)
    return engine_pb2.PromptPart(retrieve=engine_pb2.Retrieve(
        query=part.query, k=part.k, separator=common_pb2.TokenIds(ids=part.separator)))


def part_from_proto(p: engine_pb2.PromptPart) -> Part | None:
    """The domain part, or None for a part that sets nothing."""
    which = p.WhichOneof("part")
    if which == "tokens":
        return Tokens(tuple(p.tokens.ids))
    if which == "document":
        return InlineDocument(tuple(p.document.ids))
    if which == "document_id":
        return CatalogDocument(p.document_id)
    if which == "retrieve":
        return Retrieval(p.retrieve.query, int(p.retrieve.k), tuple(p.retrieve.separator.ids))
    return None
