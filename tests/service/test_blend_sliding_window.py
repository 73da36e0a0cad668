"""Blending on a sliding-window model (a tiny random Mistral) with a real KV-cache service: a prompt
longer than the window asks for blending and is computed exactly instead, its final output saying
so (KvReuse.fallback), with the tokens of a run without any cache; a prompt that fits the window is
blended as on any model."""
from __future__ import annotations

import asyncio

import pytest

from engine_utils import greedy
from kvcache_utils import WordEmbedder, serving
from kvmesh.model.loader import load_model
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.build import build_core
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.documents import InlineDocument, Tokens
from kvmesh.services.kvcache.config import KvcacheConfig
from model_families import family_model

CHUNK = 16


@pytest.fixture
async def kv(tmp_path):
    cfg = KvcacheConfig(data_dir=tmp_path / "lmdb", disk_map_bytes=64 << 20, max_entry_bytes=8 << 20)
    async with serving(cfg, embedder=WordEmbedder()) as served:
        yield served


def mistral(folder, window: int):
    return load_model(str(family_model(folder, "mistral", sliding_window=window).folder), progress=False)


def engine(loaded, address: str | None) -> AsyncEngine:
    core = build_core(EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=64, kvcache_address=address,
                                   kv_chunk_tokens=CHUNK, kv_timeout_s=30.0), loaded)
    return AsyncEngine(lambda: core)


async def run(eng: AsyncEngine, prompt=None, *, parts=None, ratio=None):
    tokens, final = [], None
    async for out in eng.generate(prompt, greedy(6, ignore_eos=True), parts=parts, recompute_ratio=ratio):
        tokens += out.token_ids
        final = out if out.finished else final
    return tokens, final


async def close(eng: AsyncEngine) -> None:
    eng.shutdown()
    if eng.core.kv is not None:
        await asyncio.to_thread(eng.core.kv.flush)
        await eng.core.kv.close()


def prompts(tok):
    """Two orders of the same two 16-token documents between a header and a question."""
    a = tok.encode("The quick brown fox jumps over the lazy dog. A cache keeps what was computed")[:CHUNK]
    b = tok.encode("Serving a language model means turning prompts into tokens, tokens into keys and values, "
                   "and keys and values into the next token.")[:CHUNK]
    head, sep, q = tok.encode("Read:"), tok.encode("\n\n"), tok.encode("Which?")
    assert len(a) == len(b) == CHUNK

    def parts(first, second):
        return ([Tokens(tuple(head)), InlineDocument(tuple(first)), Tokens(tuple(sep)), InlineDocument(tuple(second)),
                 Tokens(tuple(q))], head + first + sep + second + q)
    return parts(a, b), parts(b, a)


async def store_then_blend(loaded, address: str):
    """Stores both documents (first order), then asks for the second order blended at 0.2:
    (tokens, final output, the prompt's ids)."""
    (seen, _), (parts, ids) = prompts(loaded.tokenizer)
    eng = engine(loaded, address)
    await run(eng, parts=seen)
    await asyncio.to_thread(eng.core.kv.flush)
    tokens, final = await run(eng, parts=parts, ratio=0.2)
    await close(eng)
    return tokens, final, ids


async def test_a_prompt_past_the_window_falls_back_to_exact_and_says_why(tmp_path, kv):
    loaded = mistral(tmp_path / "w8", window=8)
    tokens, final, ids = await store_then_blend(loaded, kv.address)
    assert len(ids) > 8
    assert final.documents.blended_tokens == 0
    assert "sliding window of 8 tokens" in final.reuse_fallback and final.reuse_fallback.startswith("blend:")
    plain = engine(loaded, None)
    assert tokens == (await run(plain, ids))[0]  # exactly what no cache computes
    await close(plain)


async def test_a_prompt_inside_the_window_is_blended(tmp_path, kv):
    loaded = mistral(tmp_path / "w256", window=256)
    tokens, final, ids = await store_then_blend(loaded, kv.address)
    assert len(ids) <= 256
    assert final.documents.blended_tokens == 2 * CHUNK and final.reuse_fallback == ""
