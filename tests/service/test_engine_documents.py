"""Prompts that mark documents, on the real model with a real KV-cache service: documents' KV is
stored by content, found again at other positions and in another order, and blended in; the
catalog (ingest, cite by id, retrieve) feeds the same path."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine_utils import greedy
from kvcache_utils import WordEmbedder, serving
from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.kv.blend import Segment, blend_prefill
from kvmesh.kv.codec import decode
from kvmesh.kv.keys import document_chunks
from kvmesh.model.perplexity import reference_text
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.build import build_core
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.documents import CatalogDocument, InlineDocument, Retrieval, Tokens
from kvmesh.services.engine.ingest import IngestRequest
from kvmesh.services.kvcache.config import KvcacheConfig

pytestmark = pytest.mark.slow
CHUNK = 32


@pytest.fixture
async def kv(tmp_path):
    cfg = KvcacheConfig(data_dir=tmp_path / "lmdb", disk_map_bytes=256 << 20, max_entry_bytes=32 << 20)
    async with serving(cfg, embedder=WordEmbedder()) as served:
        yield served


def engine(loaded, address: str | None, **overrides) -> AsyncEngine:
    settings = dict(num_blocks=256, block_size=16, max_num_batched_tokens=64, kvcache_address=address,
                    kv_chunk_tokens=CHUNK, kv_codec="fp16", kv_timeout_s=5.0)
    core = build_core(EngineConfig(**{**settings, **overrides}), loaded)
    return AsyncEngine(lambda: core)


async def run(eng: AsyncEngine, prompt=None, *, parts=None, ratio=None, max_tokens: int = 6):
    tokens, final = [], None
    async for out in eng.generate(prompt, greedy(max_tokens, ignore_eos=True), parts=parts, recompute_ratio=ratio):
        tokens += out.token_ids
        if out.finished:
            final = out
    return tokens, final


async def close(eng: AsyncEngine) -> None:
    eng.shutdown()
    if eng.core.kv is not None:
        await asyncio.to_thread(eng.core.kv.flush)
        await eng.core.kv.close()


@pytest.fixture(scope="module")
def texts(bundled_model):
    tok = bundled_model.tokenizer
    text = reference_text()
    docs = [tok.encode(text[5000 + 3000 * i: 5000 + 3000 * i + 260]) for i in range(2)]  # ~50-70 tokens
    return {"a": docs[0], "b": docs[1], "head1": tok.encode("Read these notes.\n"),
            "head2": tok.encode("Here are two passages from the Python docs:\n\n"),
            "sep": tok.encode("\n\n"), "q": tok.encode("\nWhat are they about?")}


def prompt_parts(t, first: str, second: str, head: str):
    parts = [Tokens(tuple(t[head])), InlineDocument(tuple(t[first])), Tokens(tuple(t["sep"])),
             InlineDocument(tuple(t[second])), Tokens(tuple(t["q"]))]
    ids = t[head] + t[first] + t["sep"] + t[second] + t["q"]
    return parts, ids


async def test_documents_are_stored_by_content_and_blended_at_new_positions(bundled_model, kv, texts):
    eng = engine(bundled_model, kv.address)
    parts, ids = prompt_parts(texts, "a", "b", "head1")
    cold_tokens, cold = await run(eng, parts=parts)
    assert cold.documents.blended_tokens == 0
    plain_tokens, _ = await run(engine(bundled_model, None), ids)
    assert cold_tokens == plain_tokens  # nothing cached yet: a plain prefill
    await asyncio.to_thread(eng.core.kv.flush)
    n_chunks = sum(len(document_chunks(texts[d], CHUNK, b"\0" * 16)) for d in "ab")
    assert eng.core.kv.stats.exported_chunks >= n_chunks  # document chunks by content (+ prefix chunks)

    # Other order, other header: both documents' KV found by content and blended in.
    parts, ids = prompt_parts(texts, "b", "a", "head2")
    cached = len(texts["a"]) + len(texts["b"])
    _, warm = await run(eng, parts=parts, ratio=0.15)
    assert warm.documents.blended_tokens == cached
    assert warm.documents.recomputed_tokens == round(0.15 * cached)
    assert warm.usage.cached_prompt_tokens > 0

    # Ratio 1 is a full prefill: the same tokens as a plain request of the same ids.
    full_tokens, full = await run(eng, parts=parts, ratio=1.0)
    assert full.documents.blended_tokens == 0
    assert full_tokens == (await run(engine(bundled_model, None), ids))[0]
    await close(eng)


async def test_engine_blend_matches_the_dense_blend(bundled_model, kv, texts):
    """The engine's first token under blending is the dense blend_prefill's argmax for the same
    segments: the blended KV lands at the right positions of the paged cache."""
    eng = engine(bundled_model, kv.address)
    await run(eng, parts=prompt_parts(texts, "a", "b", "head1")[0])  # stores both documents
    await asyncio.to_thread(eng.core.kv.flush)
    ns = eng.core.request_namespace("").digest()
    segments = [Segment.new(texts["head2"])]
    for name, tail in (("b", texts["sep"]), ("a", texts["q"])):
        for a, b, key in document_chunks(texts[name], CHUNK, ns):
            blob = await fetch_blob(kv, key)
            k, v, _ = decode(blob, namespace=ns)
            segments.append(Segment.cached(texts[name][a:b], k, v))
        segments.append(Segment.new(tail))
    for ratio in (0.0, 0.3):
        dense = blend_prefill(bundled_model.model, segments, ratio)
        tokens, final = await run(eng, parts=prompt_parts(texts, "b", "a", "head2")[0], ratio=ratio, max_tokens=1)
        assert final.documents.blended_tokens == len(texts["a"]) + len(texts["b"])
        assert tokens[0] == int(torch.argmax(dense.logits))
    await close(eng)


async def fetch_blob(kv, key: bytes) -> bytes:
    from kvmesh.kvcache.v1 import kvcache_pb2 as pb

    data = b""
    async for msg in kv.stub.Get(pb.GetRequest(keys=[key])):
        if msg.HasField("header"):
            assert msg.header.found
        else:
            data += msg.data
    return data


async def test_catalog_ingest_cite_and_retrieve(bundled_model, kv, texts):
    eng = engine(bundled_model, kv.address)
    tok = bundled_model.tokenizer
    docs = {"cats": "Cats purr when they are content and sleep most of the afternoon.",
            "rivers": "Rivers carry water from the mountains down to the sea through valleys.",
            "python": tok.decode(texts["a"])}
    for doc_id, text in docs.items():
        got = await eng.ingest_document(IngestRequest(doc_id, tok.encode(text), text, metadata={"k": doc_id}))
        assert got.reused_chunks == 0 and got.chunks == len(document_chunks(tok.encode(text), CHUNK, b"\0" * 16))
    again = await eng.ingest_document(IngestRequest("python", tok.encode(docs["python"]), docs["python"]))
    assert again.reused_chunks == again.chunks  # every chunk already stored: nothing computed again

    head, q = tuple(texts["head1"]), tuple(tok.encode("\nSummarize."))
    parts = [Tokens(head), CatalogDocument("python"), Tokens(q)]
    exact_tokens, exact = await run(eng, parts=parts)  # no opt-in: the document is computed in place
    assert exact.documents.document_ids == ("python",)
    assert exact.documents.blended_tokens == 0 and not exact.reuse_storage.startswith("blend")
    plain = engine(bundled_model, None)
    plain_tokens, _ = await run(plain, list(head) + tok.encode(docs["python"]) + list(q))
    await close(plain)
    assert exact_tokens == plain_tokens
    _, cited = await run(eng, parts=parts, ratio=0.15)  # blending opted into
    assert cited.documents.document_ids == ("python",)
    assert cited.documents.blended_tokens == len(texts["a"])
    assert cited.reuse_storage.startswith("blend:") and ":0.1500:" in cited.reuse_storage

    _, found = await run(eng, parts=[Tokens(head), Retrieval("where do rivers carry water", 1), Tokens(q)],
                         ratio=0.15)
    assert found.documents.document_ids == ("rivers",)
    assert found.documents.blended_tokens == len(tok.encode(docs["rivers"]))

    with pytest.raises(NotFound, match="ingest it first"):
        await run(eng, parts=[Tokens(head), CatalogDocument("nope"), Tokens(q)])
    await close(eng)


async def test_bad_parts_are_refused_with_what_to_fix(bundled_model, kv, texts):
    eng = engine(bundled_model, kv.address)
    head = Tokens(tuple(texts["head1"]))
    with pytest.raises(InvalidArgument, match="parts are empty"):
        await run(eng, parts=[])
    with pytest.raises(InvalidArgument, match="k must be 1..16"):
        await run(eng, parts=[head, Retrieval("rivers", 0)])
    with pytest.raises(InvalidArgument, match="no token ids"):
        await run(eng, parts=[head, InlineDocument(())])
    with pytest.raises(InvalidArgument, match=r"recompute_ratio must be in \[0, 1\]"):
        await run(eng, parts=[head, InlineDocument(tuple(texts["a"]))], ratio=1.5)
    await close(eng)
    plain = engine(bundled_model, None)  # no KV service: inline documents are plain text, ids need it
    tokens, final = await run(plain, parts=[head, InlineDocument(tuple(texts["a"])), Tokens(tuple(texts["q"]))])
    assert len(tokens) == 6 and final.documents is None
    with pytest.raises(FailedPrecondition, match="--kvcache-address"):
        await run(plain, parts=[head, CatalogDocument("python")])
    plain.shutdown()


async def test_hot_lru_serves_documents_cited_again_without_a_fetch(bundled_model, kv, texts):
    eng = engine(bundled_model, kv.address)
    await run(eng, parts=prompt_parts(texts, "a", "b", "head1")[0])  # stores both documents by content
    await asyncio.to_thread(eng.core.kv.flush)
    stats = eng.core.kv.stats
    first_tokens, first = await run(eng, parts=prompt_parts(texts, "b", "a", "head2")[0], ratio=0.15)
    fetched = stats.fetched_chunks
    assert fetched > 0 and stats.hot_chunks == 0 and first.documents.blended_tokens > 0
    # the same documents in another prompt: every chunk from the engine's LRU, no Get
    _, again = await run(eng, parts=prompt_parts(texts, "a", "b", "head2")[0], ratio=0.15)
    assert stats.fetched_chunks == fetched and stats.hot_chunks == fetched
    assert again.documents.blended_tokens == first.documents.blended_tokens
    await close(eng)

    # a budget of one chunk's bytes keeps one chunk: the others are fetched again
    one_chunk = 2 * bundled_model.config.num_layers * CHUNK * bundled_model.config.num_kv_heads \
        * bundled_model.config.head_dim * 4
    small = engine(bundled_model, kv.address, kv_hot_bytes=one_chunk)
    tokens, _ = await run(small, parts=prompt_parts(texts, "b", "a", "head2")[0], ratio=0.15)
    assert tokens == first_tokens  # the LRU changes where KV comes from, not the output
    await run(small, parts=prompt_parts(texts, "a", "b", "head2")[0], ratio=0.15)
    s = small.core.kv.stats
    assert small.core.kv.hot._bytes <= one_chunk and 0 < s.hot_chunks < fetched
    assert s.fetched_chunks + s.hot_chunks == 2 * fetched
    await close(small)
