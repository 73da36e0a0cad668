"""Document-marked chat prompts through the real gateway (HTTP and gRPC) and the fake router:
the extension fields in, the parts upstream, the `kvmesh` report out."""
from __future__ import annotations

import json

import grpc
import httpx
import openai
import pytest

from gateway_utils import MODEL, WORDS
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.gateway.v1 import gateway_pb2 as pb
from kvmesh.gateway.v1 import gateway_pb2_grpc

USER = [{"role": "user", "content": "What is X?"}]
DOCS = {"documents": [{"text": "X is a letter."}, {"id": "cat-7"}], "retrieve": {"top_k": 2},
        "recompute_ratio": 0.5}
REPORT = {"document_ids": ["cat-7", "r1", "r2"], "blended_tokens": 40, "recomputed_tokens": 20}


def _engine_report(gateway) -> None:
    """The fake router's final message reports what an engine would for DOCS."""
    gateway.state.final = engine_pb2.Final(
        blended_tokens=40, recomputed_tokens=20, document_ids=["cat-7", "r1", "r2"],
        usage=common_pb2.Usage(prompt_tokens=120))


def test_chat_with_documents_sends_parts_and_reports_the_blend(client, gateway):
    _engine_report(gateway)
    r = client.chat.completions.create(model=MODEL, messages=USER, extra_body=DOCS)
    assert r.choices[0].message.content == "".join(WORDS)
    assert r.model_extra["kvmesh"] == REPORT
    assert r.usage.prompt_tokens == 120  # the engine's count: it resolved the documents
    g = gateway.state.calls[0].request.request
    kinds = [p.WhichOneof("part") for p in g.parts.parts]
    assert kinds == ["tokens", "document", "tokens", "document_id", "tokens", "retrieve",
                     "tokens", "tokens"]
    assert list(g.parts.parts[1].document.ids) == list(b"X is a letter.")
    assert g.parts.parts[3].document_id == "cat-7"
    assert (g.parts.parts[5].retrieve.query, g.parts.parts[5].retrieve.k) == ("What is X?", 2)
    assert g.blend.recompute_ratio == 0.5 and not g.HasField("token_ids")
    assert "X is a letter.\n\nWhat is X?" in gateway.state.calls[0].request.prompt_text


def test_the_streamed_usage_chunk_carries_the_report(gateway):
    _engine_report(gateway)
    body = {"model": MODEL, "messages": USER, "stream": True,
            "stream_options": {"include_usage": True}, **DOCS}
    r = httpx.post(f"{gateway.base_url}/chat/completions", json=body, timeout=10)
    assert r.status_code == 200
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert events[-1]["choices"] == [] and events[-1]["kvmesh"] == REPORT
    assert all("kvmesh" not in e for e in events[:-1])


def test_plain_chat_has_no_report(client, gateway):
    _engine_report(gateway)
    r = client.chat.completions.create(model=MODEL, messages=USER)
    assert "kvmesh" not in (r.model_extra or {})
    assert gateway.state.calls[0].request.request.WhichOneof("prompt") == "token_ids"


@pytest.mark.parametrize("extra, param", [
    ({"documents": [{"id": "a", "text": "b"}]}, "documents[0]"),
    ({"retrieve": {"top_k": 99}}, "retrieve.top_k"),
    ({"recompute_ratio": 0.3}, "recompute_ratio"),
])
def test_bad_document_fields_are_400(client, gateway, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=USER, extra_body=extra)
    assert e.value.body["param"] == param and e.value.body["type"] == "invalid_request_error"
    assert gateway.state.calls == []


async def test_grpc_chat_with_documents_reports_on_the_last_message(gateway):
    _engine_report(gateway)
    async with grpc.aio.insecure_channel(gateway.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        request = pb.ChatCompleteRequest(
            model=MODEL, messages=[pb.ChatMessage(role=pb.ROLE_USER, content="What is X?")],
            documents=[pb.Document(text="X is a letter."), pb.Document(id="cat-7")],
            retrieve=pb.Retrieve(top_k=2, query="letters"), recompute_ratio=0.5)
        chunks = [c async for c in stub.ChatComplete(request)]
        assert not any(c.HasField("documents") for c in chunks[:-1])
        last = chunks[-1]
        assert (list(last.documents.document_ids), last.documents.blended_tokens,
                last.documents.recomputed_tokens) == (REPORT["document_ids"], 40, 20)
        assert last.usage.prompt_tokens == 120
        g = gateway.state.calls[0].request.request
        assert g.parts.parts[5].retrieve.query == "letters"
        plain = [c async for c in stub.ChatComplete(pb.ChatCompleteRequest(
            model=MODEL, messages=[pb.ChatMessage(role=pb.ROLE_USER, content="hi")]))]
        assert not plain[-1].HasField("documents")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ChatComplete(pb.ChatCompleteRequest(
                model=MODEL, messages=[pb.ChatMessage(role=pb.ROLE_USER, content="hi")],
                retrieve=pb.Retrieve(top_k=0))).read()
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "retrieve.top_k" in e.value.details()
