"""A RoPE-scaled model (Llama 3.1's llama3 scaling, tiny and random) with a real KV-cache service:
prefix KV leaves one engine un-rotated and comes back to a fresh one rotated by the model's own
scaled RoPE, and a document's stored KV blended in at a new position has the keys transformers
computes there. With plain RoPE in either direction both would be wrong."""
from __future__ import annotations

import asyncio

import pytest
import torch

from engine_utils import greedy
from kvcache_utils import WordEmbedder, serving
from kvmesh.kv.blend import Segment, blend_prefill
from kvmesh.kv.codec import decode
from kvmesh.kv.keys import document_chunks
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.model.loader import load_model
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.build import build_core, engine_namespace
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.documents import InlineDocument, Tokens
from kvmesh.services.kvcache.config import KvcacheConfig
from model_families import family_model

pytestmark = pytest.mark.slow
CHUNK = 32
TOL = 1e-4


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    torch.set_num_threads(1)
    m = family_model(tmp_path_factory.mktemp("llama3"), "llama", rope_scaling="llama3", seed=3, layers=3)
    return m, load_model(str(m.folder), progress=False)


@pytest.fixture
async def kv(tmp_path):
    cfg = KvcacheConfig(data_dir=tmp_path / "lmdb", disk_map_bytes=64 << 20, max_entry_bytes=8 << 20)
    async with serving(cfg, embedder=WordEmbedder()) as served:
        yield served


def engine(loaded, address: str | None) -> AsyncEngine:
    cfg = EngineConfig(num_blocks=128, block_size=16, max_num_batched_tokens=32, max_num_seqs=4, kvcache_address=address,
                       kv_chunk_tokens=CHUNK, kv_timeout_s=5.0)
    core = build_core(cfg, loaded)
    return AsyncEngine(lambda: core)


async def run(eng: AsyncEngine, prompt=None, *, parts=None, ratio=None, max_tokens: int = 6):
    tokens, logprobs, final = [], [], None
    async for out in eng.generate(prompt, greedy(max_tokens, ignore_eos=True, logprobs=2), parts=parts,
                                  recompute_ratio=ratio):
        tokens += out.token_ids
        logprobs += out.logprobs
        if out.finished:
            final = out
    return tokens, logprobs, final


async def close(eng: AsyncEngine) -> None:
    eng.shutdown()
    if eng.core.kv is not None:
        await asyncio.to_thread(eng.core.kv.flush)
        await eng.core.kv.close()


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_namespace_names_the_scaling(scaled):
    _, loaded = scaled
    rope = engine_namespace(loaded).layout.rope
    assert "llama3 factor=8 low=1 high=4 original=64" in rope and "theta=500000" in rope


async def test_prefix_kv_round_trip_through_the_kv_service(scaled, kv):
    m, loaded = scaled
    prompt = _ids(1, 3 * CHUNK + 4, loaded.config.vocab_size)
    first = engine(loaded, kv.address)
    cold_tokens, cold_lp, cold = await run(first, prompt)
    assert cold.usage.cached_prompt_tokens == 0
    await close(first)
    assert first.core.kv.stats.exported_chunks == 3

    second = engine(loaded, kv.address)  # nothing cached locally
    warm_tokens, warm_lp, warm = await run(second, prompt)
    await close(second)
    assert warm.usage.cached_prompt_tokens == 3 * CHUNK and second.core.kv.stats.fetched_chunks == 3
    assert warm_tokens == cold_tokens
    with torch.no_grad():
        want = torch.log_softmax(m.hf_model(torch.tensor([prompt + warm_tokens])).logits[0].float(), -1)
    for i, entry in enumerate(warm_lp):
        assert entry.logprob == pytest.approx(want[len(prompt) - 1 + i].max().item(), abs=TOL)


async def fetch_blob(kv, key: bytes) -> bytes:
    data = b""
    async for msg in kv.stub.Get(pb.GetRequest(keys=[key])):
        if msg.HasField("header"):
            assert msg.header.found
        else:
            data += msg.data
    return data


async def test_blended_document_keys_are_the_models_at_the_new_position(scaled, kv):
    m, loaded = scaled
    vocab = loaded.config.vocab_size
    doc, head, other_head, tail = (_ids(10, 2 * CHUNK, vocab), _ids(11, 5, vocab), _ids(12, 41, vocab),
                                   _ids(13, 7, vocab))
    eng = engine(loaded, kv.address)
    await run(eng, parts=[Tokens(tuple(head)), InlineDocument(tuple(doc)), Tokens(tuple(tail))])  # stores it
    await asyncio.to_thread(eng.core.kv.flush)
    ns = eng.core.request_namespace("").digest()
    segments = [Segment.new(other_head)]
    for a, b, key in document_chunks(doc, CHUNK, ns):
        k, v, _ = decode(await fetch_blob(kv, key), namespace=ns)
        segments.append(Segment.cached(doc[a:b], k, v))
    segments.append(Segment.new(tail))

    dense = blend_prefill(loaded.model, segments, 0.0)  # pure reuse: the stored KV, re-rotated
    start = len(other_head)
    with torch.no_grad():  # transformers' layer-0 keys of the document at its new position
        out = m.hf_model(torch.tensor([other_head + doc]), use_cache=True)
    hf_k = out.past_key_values.layers[0].keys[0].transpose(0, 1)  # [T, kv_heads, head_dim]
    torch.testing.assert_close(dense.k[0, start:start + len(doc)], hf_k[start:], atol=TOL, rtol=0)
    # the engine, blending the same fetched chunks, picks the dense blend's token
    tokens, _, final = await run(eng, parts=[Tokens(tuple(other_head)), InlineDocument(tuple(doc)),
                                             Tokens(tuple(tail))], ratio=0.0, max_tokens=1)
    assert final.documents.blended_tokens == len(doc)
    assert tokens[0] == int(torch.argmax(dense.logits))
    await close(eng)
