"""The guardrail on the real bundled model (fp32), with an in-process KV service: a lossy codec
whose decoded KV is deliberately wrecked is switched off within 200 lossy requests at the default
2% shadow share, the requests after it get exactly the tokens of a run without cache, and the
path comes back once its replays pass; the int8 codec and exact reuse are never switched off
over 1,000 requests; the shadow check's exact recompute equals what an engine computes without
cache. Checks run when the engine is idle: tests wait for them with `Guardrail.wait_idle` (an
event, not a sleep)."""
from __future__ import annotations

import asyncio
import inspect
import random
from pathlib import Path

import pytest
import torch

from engine_utils import greedy, make_core, run_all
from kvcache_utils import serving
from kvmesh.kv import codec
from kvmesh.kv.namespace import EXACT
from kvmesh.kv.quality import DEFAULT_BUDGET
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.blending import BlendConfig
from kvmesh.services.engine.build import build_core
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.guardrail import GuardTicket, LossyPath, ShadowCheck
from kvmesh.services.engine.outputs import EngineRequest
from kvmesh.services.engine.shadow import ShadowChecker
from kvmesh.services.kvcache.config import KvcacheConfig

slow = pytest.mark.slow
CHUNK = 64
TOKENS = 4
CHECK_TIMEOUT_S = 120.0  # bounds a failing test only


def _documents(tokenizer) -> list[list[int]]:
    """Token ids of standard-library docstrings (text every machine has offline)."""
    import argparse
    import collections
    import dataclasses
    import functools
    import json.decoder
    import logging
    import pathlib
    import statistics
    import textwrap

    docs = []
    for m in (argparse, collections, dataclasses, functools, json.decoder, logging, pathlib, statistics, textwrap):
        for _, obj in inspect.getmembers(m, lambda o: inspect.isclass(o) or inspect.isfunction(o)):
            doc = inspect.getdoc(obj) or ""
            if len(doc) > 300:
                docs.append(tokenizer.encode(doc, add_special_tokens=False))
    return docs


def build_prompts(tokenizer, n: int, seed: int) -> list[list[int]]:
    """`n` prompts of 69-88 tokens: one of 24 shared 64-token openings (a whole KV chunk, stored
    once, reused by every later prompt that starts with it) and 5-24 tokens of another text."""
    rng = random.Random(seed)
    docs = _documents(tokenizer)
    openings = [d[:CHUNK] for d in docs[:24]]
    return [rng.choice(openings) + rng.choice(docs)[:rng.randint(5, 24)] for _ in range(n)]


def engine(loaded, address: str, **overrides) -> AsyncEngine:
    """An engine on the KV service at `address` with CHUNK-token chunks and no prefix cache of its
    own: every hit comes through the KV service and its codec, every time. Exports run at normal
    priority: at idle priority (the default) 16 busy streams hold them back, and a later request
    with the same opening misses the chunks still waiting to be stored."""
    cfg = EngineConfig(kvcache_address=address, num_blocks=512, kv_chunk_tokens=CHUNK, kv_timeout_s=300.0,
                       enable_prefix_caching=False, kv_export_priority="normal", **overrides)
    core = build_core(cfg, loaded)
    return AsyncEngine(lambda: core)


async def serve(eng: AsyncEngine, prompts: list[list[int]], concurrency: int, options: list[dict] | None = None,
                **kw) -> list[tuple[list[int], object]]:
    """(tokens, final output) of each prompt, `concurrency` requests in flight at a time; each
    request's generate() arguments are options[i], else `kw`."""
    gate = asyncio.Semaphore(concurrency)

    async def one(ids, options):
        async with gate:
            tokens, final = [], None
            async for out in eng.generate(ids, greedy(TOKENS, ignore_eos=True), **options):
                tokens += out.token_ids
                final = out if out.finished else final
            return tokens, final

    options = options or [kw] * len(prompts)
    return list(await asyncio.gather(*(one(p, o) for p, o in zip(prompts, options))))


async def checks_done(eng: AsyncEngine) -> None:
    assert await asyncio.to_thread(eng.core.guardrail.wait_idle, CHECK_TIMEOUT_S)


def no_cache_tokens(loaded, prompts: list[list[int]]) -> list[list[int]]:
    core = make_core(loaded, enable_prefix_caching=False)
    res = run_all(core, {str(i): p for i, p in enumerate(prompts)}, greedy(TOKENS, ignore_eos=True))
    return [res[str(i)]["tokens"] for i in range(len(prompts))]


def noisy_int8(monkeypatch) -> None:
    """int8 chunks decode with gaussian noise of their own scale added (seeded by the blob: the
    same chunk gets the same noise), in the engine's fetches and in the guardrail's replays."""
    decode = codec.decode

    def noisy(blob, **kw):
        k, v, header = decode(blob, **kw)
        if header.codec == "int8":
            gen = torch.Generator().manual_seed(int.from_bytes(bytes(blob[-8:]), "little") >> 1)
            k = k + k.std() * torch.randn(k.shape, generator=gen, dtype=k.dtype)
            v = v + v.std() * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        return k, v, header

    monkeypatch.setattr(codec, "decode", noisy)


def the_path(eng: AsyncEngine):
    (path,) = eng.core.guardrail.snapshot().paths
    return path


def the_path_enabled(eng: AsyncEngine) -> bool:
    paths = eng.core.guardrail.snapshot().paths
    return not paths or paths[0].enabled


@slow
async def test_a_noisy_codec_is_disabled_within_200_lossy_requests_then_served_exactly(
        bundled_model, tmp_path: Path, monkeypatch):
    noisy_int8(monkeypatch)
    prompts = build_prompts(bundled_model.tokenizer, 260, seed=1)
    kv_cfg = KvcacheConfig(data_dir=tmp_path / "kv", disk_map_bytes=1 << 30)
    async with serving(kv_cfg) as kv:
        # Default shadow share (2%); a cheaper way back than the defaults' 8 replays at 10%.
        eng = engine(bundled_model, kv.address, guard_replay_share=0.5, guard_reenable_checks=3)
        int8 = eng.kv_codec("int8", True)
        served = 0
        while the_path_enabled(eng) and served < 200:  # groups of 10, checks run in between
            batch = prompts[served:served + 10]
            results = await serve(eng, batch, concurrency=10, kv_codec=int8)
            assert all(final.reuse_fallback == "" for _, final in results)  # still enabled while they ran
            await checks_done(eng)
            served += len(batch)
        path = the_path(eng)
        assert not path.enabled, f"still served after {path.served} lossy requests: {path}"
        assert path.served <= 200 and path.disabled_count == 1 and path.kl > 4 * DEFAULT_BUDGET.max_kl
        assert eng.core.kv.stats.fetched_chunks > 0

        after = prompts[200:212]
        results = await serve(eng, after, concurrency=4, kv_codec=int8)
        await checks_done(eng)
        for tokens, final in results:
            assert final.reuse_storage == EXACT and "disabled by the guardrail" in final.reuse_fallback
        assert [t for t, _ in results] == no_cache_tokens(bundled_model, after)
        path = the_path(eng)
        assert path.fallbacks == 12 and path.replays >= 3 and not path.enabled  # replays still see the noise

        monkeypatch.undo()  # the codec is sound again: replays pass, the path comes back
        back = None
        for i in range(212, 240):
            (_, final), = await serve(eng, [prompts[i]], concurrency=1, kv_codec=int8)
            await checks_done(eng)
            if the_path_enabled(eng):
                back = i
                break
        assert back is not None and back - 212 < 6, "not enabled within 3 passing replays at 50%"
        (_, final), = await serve(eng, [prompts[back + 1]], concurrency=1, kv_codec=int8)
        assert final.reuse_fallback == "" and final.reuse_storage.startswith("int8")
        await eng.core.kv.close()
        eng.shutdown()


@slow
async def test_int8_and_exact_reuse_are_never_disabled_over_1000_requests(bundled_model, tmp_path: Path):
    prompts = build_prompts(bundled_model.tokenizer, 1000, seed=2)
    kv_cfg = KvcacheConfig(data_dir=tmp_path / "kv", disk_map_bytes=1 << 30)
    async with serving(kv_cfg) as kv:
        eng = engine(bundled_model, kv.address, guard_queue=32)  # every check kept, however busy
        int8 = eng.kv_codec("int8", True)
        options = [{} if i % 5 == 4 else {"kv_codec": int8} for i in range(len(prompts))]  # 200 exact, 800 int8
        results = await serve(eng, prompts, concurrency=16, options=options)
        await checks_done(eng)
        report = eng.core.guardrail.snapshot()
        await eng.core.kv.close()
        eng.shutdown()
    assert all(final.reuse_fallback == "" for _, final in results)
    storages = [final.reuse_storage for _, final in results]
    assert storages.count(EXACT) == 200 and all(s.startswith("int8c-") for s in storages if s != EXACT)
    reused = [final.usage.imported_prompt_tokens > 0 for _, final in results]
    assert sum(reused) >= 900  # each of the 24 openings is stored once per namespace, then reused
    (path,) = report.paths  # exact reuse is not a lossy path: never guarded, never refused
    assert path.namespace.storage.startswith("int8c-")
    assert path.enabled and path.disabled_count == 0 and path.fallbacks == 0 and path.served == 800
    assert path.checks >= 10 and report.dropped_checks == 0 and report.failed_checks == 0
    assert path.kl < DEFAULT_BUDGET.max_kl / 10 and path.top1 >= DEFAULT_BUDGET.min_top1


@slow
def test_the_exact_recompute_equals_an_engine_run_without_cache(bundled_model):
    """The check's exact side: its logits are what the engine computes for the same tokens
    without any cache (log-probabilities to 1e-4), and a ticket on a request whose reused KV is
    exact (the engine's own prefix cache) measures nothing lost."""
    prompt = build_prompts(bundled_model.tokenizer, 1, seed=3)[0]
    core = make_core(bundled_model)
    cold = run_all(core, {"cold": prompt}, greedy(8, ignore_eos=True, logprobs=5))["cold"]
    rows, _ = core.shadow.exact(prompt, cold["tokens"])
    logprobs = torch.log_softmax(rows, dim=-1)
    for i, lp in enumerate(cold["logprobs"]):
        assert [t for t, _ in lp.top] == logprobs[i].topk(5).indices.tolist()
        assert max(abs(v - float(logprobs[i, t])) for t, v in lp.top) < 1e-4

    ticket = GuardTicket(LossyPath(core.namespace, "codec", None, None, DEFAULT_BUDGET), served_lossy=True)
    core.add_request(EngineRequest("warm", prompt, greedy(8, ignore_eos=True), 0.0, guard=ticket))
    finals = []
    while core.has_work:  # the request, then its check in the idle step after it
        finals += [out for out in core.step() if out.finished]
    (final,) = finals
    assert final.usage.cached_prompt_tokens >= CHUNK and final.guard is ticket and final.token_ids
    (path,) = core.guardrail.snapshot().paths
    assert path.checks == 1 and path.kl < 1e-6 and path.top1 == 1.0


@slow
def test_replays_measure_what_the_lossy_path_loses(bundled_model):
    """The offline replays on the real model: an exact store loses nothing, int8 a little, int2
    more; a blend at ratio 1 (every token recomputed) nothing, pure reuse (ratio 0) clearly more."""
    tok = bundled_model.tokenizer
    checker = ShadowChecker(bundled_model.model, block_size=16, chunk_tokens=CHUNK, blend=BlendConfig())
    namespace = make_core(bundled_model, num_blocks=16).namespace
    docs = _documents(tok)
    prompt = docs[0][:100] + docs[1][:90] + tok.encode("\nWhich of these two texts is about", add_special_tokens=False)
    answer = docs[2][:12]
    spans = ((0, 100), (100, 190))

    def loss(kind: str, spec, ratio=None) -> float:
        storage = f"{spec.name if spec else EXACT}:{ratio}"
        path = LossyPath(namespace.with_storage(storage), kind, spec, ratio, DEFAULT_BUDGET)
        return checker.run(ShadowCheck(GuardTicket(path, False, spans), tuple(prompt), tuple(answer))).kl

    exact, int8, int2 = (loss("codec", codec.CodecSpec(name=n)) for n in ("fp32", "int8", "int2"))
    assert exact < 1e-6 and 0 < int8 < int2 and int8 < DEFAULT_BUDGET.max_kl
    full, reuse = loss("blend", None, 1.0), loss("blend", None, 0.0)
    assert full < 1e-6 and reuse > 1e-3
    assert loss("blend", codec.CodecSpec(name="int2"), 0.0) > reuse


async def test_get_guardrail_metrics_and_status_lines_report_every_path(tmp_path: Path):
    """GetGuardrail, the metrics and `kvmesh status` read one snapshot: a path disabled by two
    far-over checks and a healthy one (made-up results on a tiny model)."""
    from prometheus_client import CollectorRegistry

    from engine_utils import load_tiny, make_tiny_checkpoint, serve_engine
    from kvmesh.cli import _guardrail_lines, format_guardrail
    from kvmesh.engine.v1 import engine_pb2
    from kvmesh.services.engine.metrics import EngineMetrics

    core = make_core(load_tiny(make_tiny_checkpoint(tmp_path / "tiny")), num_blocks=64)
    guard = core.guardrail
    bad = LossyPath(core.namespace.for_tenant("tenant:a").with_storage("int2-g64-r0-h1-o16"), "codec", None, None,
                    DEFAULT_BUDGET)
    good = LossyPath(core.namespace.with_storage("int8c-g16-r0-h1-o0"), "codec", None, None, DEFAULT_BUDGET)
    for _ in range(3):
        guard.admit(bad)
        guard.admit(good)
    for _ in range(2):
        guard.record(GuardTicket(bad, True), positions=8, kl=1.5, top1=0.5)
        guard.record(GuardTicket(good, True), positions=8, kl=0.001, top1=1.0)
    assert not guard.admit(bad).serve
    async with serve_engine(core) as srv:
        registry = CollectorRegistry()
        EngineMetrics(registry).instrument(srv.engine)
        resp = await srv.stub.GetGuardrail(engine_pb2.GetGuardrailRequest(), timeout=10)
        lines = await asyncio.to_thread(_guardrail_lines, srv.address)
    assert resp.shadow_share == pytest.approx(0.02) and resp.pending_checks == 0
    by_storage = {p.namespace.storage: p for p in resp.paths}
    b, g = by_storage["int2-g64-r0-h1-o16"], by_storage["int8c-g16-r0-h1-o0"]
    assert b.state == engine_pb2.GUARD_STATE_DISABLED and b.namespace.tenant_salt == "tenant:a"
    assert (b.checks, b.served, b.fallbacks, b.disabled_count) == (2, 3, 1, 1)
    assert b.kl == pytest.approx(1.5) and b.top1 == pytest.approx(0.5)
    assert b.budget.max_kl == pytest.approx(0.05) and b.budget.min_top1 == pytest.approx(0.95)
    assert g.state == engine_pb2.GUARD_STATE_ENABLED and (g.checks, g.served, g.fallbacks) == (2, 3, 0)
    assert lines == format_guardrail(resp) and len(lines) == 2
    line = next(x for x in lines if "int2" in x)
    assert "tenant:a  DISABLED  2 checks  KL 1.5000  top-1 50.0%" in line and "fallbacks 1" in line

    def sample(name: str, p) -> float:
        return registry.get_sample_value(f"kvmesh_engine_{name}",
                                         {"path": p.namespace.storage, "namespace": p.namespace.digest().hex()[:8]})
    assert sample("guard_enabled", bad) == 0.0 and sample("guard_enabled", good) == 1.0
    assert sample("guard_checks_total", bad) == 2.0 and sample("guard_fallbacks_total", bad) == 1.0
    assert sample("guard_kl", bad) == pytest.approx(1.5) and sample("guard_disabled_total", bad) == 1.0
    assert registry.get_sample_value("kvmesh_engine_guard_dropped_checks_total") == 0.0
    assert format_guardrail(engine_pb2.GetGuardrailResponse()) == ["  guardrail  no lossy paths used"]
    assert (await asyncio.to_thread(_guardrail_lines, "127.0.0.1:1", 0.5))[0].startswith("  guardrail  not available")
