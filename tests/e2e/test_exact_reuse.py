"""A cache hit must not change the answer: with the default configuration, 50 prompts (RAG, chat,
code) x 64 tokens on the real model (half greedy, half sampled at temperature 0.8 with a seed)
give identical tokens served cold, warm from the
engine's own prefix cache, warm through the KV service on a second replica, and warm from LMDB
after the KV service restarted. Fails if the default codec becomes lossy (or KV is stored in any
way that does not give back exactly what the engine computed)."""
from __future__ import annotations

import asyncio
import inspect
import json
import random
import textwrap

import pytest

from engine_utils import greedy
from kvcache_utils import serving
from kvmesh.kv.namespace import EXACT
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.build import build_core
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.kvcache.config import KvcacheConfig

pytestmark = pytest.mark.slow
TOKENS = 64


def _sources() -> list[str]:
    """Text this machine has offline: the standard library's own docstrings and code."""
    import argparse
    import collections
    import dataclasses
    import email.message
    import functools
    import http.client
    import json.decoder
    import logging
    import pathlib
    import statistics
    import textwrap as tw
    import zipfile

    mods = [argparse, collections, dataclasses, email.message, functools, http.client, json.decoder, logging,
            pathlib, statistics, tw, zipfile]
    docs = []
    for m in mods:
        for _, obj in inspect.getmembers(m, lambda o: inspect.isclass(o) or inspect.isfunction(o)):
            doc = inspect.getdoc(obj) or ""
            if len(doc) > 400:
                docs.append(doc)
    return docs


def build_prompts(tokenizer) -> list[list[int]]:
    """50 prompts of 300-900 tokens: 20 RAG (three documents and a question), 15 multi-turn chats,
    15 code questions. Seeded: the same prompts every run."""
    rng = random.Random(16)
    docs = _sources()
    code = [inspect.getsource(f) for f in (json.dumps, textwrap.fill, random.Random.shuffle, random.Random.sample,
                                           textwrap.indent, json.loads, random.Random.choices, textwrap.shorten)]
    chats = []
    for i in range(20):
        picked = rng.sample(docs, 3)
        body = "\n\n".join(f"Document {j + 1}:\n{d[:900]}" for j, d in enumerate(picked))
        chats.append([{"role": "system", "content": "Answer from the documents."},
                      {"role": "user", "content": f"{body}\n\nQuestion: what does document {i % 3 + 1} describe?"}])
    for i in range(15):
        turns = [{"role": "system", "content": "You are a concise assistant."}]
        for t in range(3):
            turns += [{"role": "user", "content": rng.choice(docs)[:500] + "\nSummarize this."},
                      {"role": "assistant", "content": rng.choice(docs)[:300]}]
        turns.append({"role": "user", "content": f"And in one sentence, what was turn {i % 3 + 1} about?"})
        chats.append(turns)
    for i in range(15):
        src = "\n\n".join(rng.sample(code, 3))
        chats.append([{"role": "user", "content": f"Explain what these functions do:\n```python\n{src[:3000]}\n```"}])
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False) for c in chats]
    return [p[:900] for p in prompts]


def engine(loaded, address: str | None, **overrides) -> AsyncEngine:
    """A fresh engine with the deployment's settings (its KV codec and chunk size; no draft
    service), linked to the KV service at `address`, on a pool that holds every prompt. The KV
    service runs in this test's process, sharing two cores with the engine while 50 requests
    fetch ~12 MB fp32 chunks at once: a generous KV deadline keeps a slow fetch from turning
    into a recompute, which would leave the path under test unexercised."""
    cfg = EngineConfig(kvcache_address=address, num_blocks=2600, kv_timeout_s=300.0, **overrides)
    core = build_core(cfg, loaded)
    return AsyncEngine(lambda: core)


def params(i: int) -> SamplingParams:
    """Prompt i's sampling: greedy for even i, seeded sampling for odd i (the same seed in every run)."""
    if i % 2 == 0:
        return greedy(TOKENS, ignore_eos=True)
    return SamplingParams(max_tokens=TOKENS, temperature=0.8, seed=1000 + i, ignore_eos=True)


async def serve_all(eng: AsyncEngine, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    """Every prompt at once (continuous batching); (tokens per prompt, prompt tokens reused).
    Every final output reports the reuse as exact."""
    async def one(i, ids):
        tokens, final = [], None
        async for out in eng.generate(ids, params(i)):
            tokens += out.token_ids
            final = out if out.finished else final
        assert final.reuse_storage == EXACT
        return tokens, final.usage.cached_prompt_tokens

    results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return [t for t, _ in results], sum(c for _, c in results)


async def test_the_default_configuration_reuses_exactly(bundled_model, tmp_path):
    prompts = build_prompts(bundled_model.tokenizer)
    assert len(prompts) == 50 and min(len(p) for p in prompts) >= 300
    cold_engine = engine(bundled_model, None, enable_prefix_caching=False)  # computes every token
    cold, reused = await serve_all(cold_engine, prompts)
    cold_engine.shutdown()
    assert reused == 0
    runs = {}
    kv_cfg = KvcacheConfig(data_dir=tmp_path / "lmdb", disk_map_bytes=2 << 30, max_entry_bytes=64 << 20)
    async with serving(kv_cfg) as kv:
        first = engine(bundled_model, kv.address)
        assert first.core.request_namespace().storage == EXACT  # the default stores exact KV
        runs["storing"], _ = await serve_all(first, prompts)  # shared chat templates are hits already
        assert await asyncio.to_thread(first.core.kv.flush)
        assert first.core.kv.stats.exported_chunks >= 50
        runs["in-process"], reused = await serve_all(first, prompts)  # the engine's own prefix cache
        assert reused >= 50 * 256
        await first.core.kv.close()
        first.shutdown()

        second = engine(bundled_model, kv.address)  # another replica: nothing local
        runs["KV service"], reused = await serve_all(second, prompts)
        assert reused >= 50 * 256 and second.core.kv.stats.fetched_chunks >= 50
        assert second.core.kv.stats.fetch_failures == 0
        await second.core.kv.close()
        second.shutdown()
    async with serving(kv_cfg) as kv:  # restarted: the memory tier is empty, LMDB holds the chunks
        third = engine(bundled_model, kv.address)
        runs["LMDB"], reused = await serve_all(third, prompts)
        assert reused >= 50 * 256 and third.core.kv.stats.fetched_chunks >= 50
        assert third.core.kv.stats.fetch_failures == 0
        await third.core.kv.close()
        third.shutdown()
    for name, run in runs.items():
        differ = [i for i, (a, b) in enumerate(zip(cold, run)) if a != b]
        assert not differ, f"{name} changed the answer of prompts {differ} (of 50) against no cache at all"
