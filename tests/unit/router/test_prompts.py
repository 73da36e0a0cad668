"""What the router reads of a prompt: length, probe ids and catalog parts, for every prompt kind."""
from __future__ import annotations

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.services.router.prompts import catalog_parts, probe_ids, prompt_tokens


def tokens(*ids: int) -> engine_pb2.PromptPart:
    return engine_pb2.PromptPart(tokens=common_pb2.TokenIds(ids=ids))


def document(*ids: int) -> engine_pb2.PromptPart:
    return engine_pb2.PromptPart(document=common_pb2.TokenIds(ids=ids))


def in_parts(*parts: engine_pb2.PromptPart) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(parts=engine_pb2.Prompt(parts=parts))


CATALOG = engine_pb2.PromptPart(document_id="cat-7")
RETRIEVE = engine_pb2.PromptPart(retrieve=engine_pb2.Retrieve(
    query="q", k=3, separator=common_pb2.TokenIds(ids=[10, 10])))


def test_prompt_length_counts_plain_and_inline_document_tokens():
    request = in_parts(tokens(1, 2, 3), document(4, 5), tokens(9), CATALOG, tokens(9), RETRIEVE,
                       tokens(9), tokens(6, 7))
    assert prompt_tokens(request) == 3 + 2 + 1 + 1 + 1 + 2  # catalogued and retrieved: unknown
    assert prompt_tokens(engine_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[1, 2]))) == 2
    assert prompt_tokens(engine_pb2.GenerateRequest(text="x" * 9)) == 3  # 4 characters a token
    assert prompt_tokens(engine_pb2.GenerateRequest(), "y" * 8) == 2
    assert prompt_tokens(in_parts(CATALOG, RETRIEVE)) == 0


def test_probe_ids_are_the_leading_plain_tokens():
    assert probe_ids(in_parts(tokens(1, 2), tokens(3), document(4, 5), tokens(6), CATALOG)) == \
        [1, 2, 3]
    assert probe_ids(in_parts(tokens(1, 2), CATALOG, tokens(3))) == [1, 2]
    assert probe_ids(in_parts(tokens(1, 2), tokens(3))) == [1, 2, 3]
    assert probe_ids(in_parts(document(4), tokens(1))) is None  # nothing cacheable in order
    assert probe_ids(engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[7, 8]))) == \
        [7, 8]
    assert probe_ids(engine_pb2.GenerateRequest(text="hi")) is None


def test_catalog_parts_name_what_only_an_engine_resolves():
    assert catalog_parts(in_parts(tokens(1), RETRIEVE, CATALOG, CATALOG)) == \
        ["document_id", "retrieve"]
    assert catalog_parts(in_parts(tokens(1), document(2))) == []
    assert catalog_parts(engine_pb2.GenerateRequest(text="hi")) == []
