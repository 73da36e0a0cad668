"""Metrics checked exactly, without a dashboard: a known workload goes through the engine, the
KV-cache service and the gateway, then /metrics is scraped (the real endpoint and exposition
format) and every counter must have moved by exactly the known amount.

Each test gets a registry of its own, as the entry helper gives each service process one, served
at `metrics_url` (the gateway's is served by its HTTP app). The tests compare scrapes before and
after; collectors of one engine or store (prefix cache, KV link, speculation, tiers) are
registered for their part of the test only, so their values are absolute. Every scraped sample
must carry `model_name`: the registry's (`MODEL_NAME`, as an engine's carries its served name)
unless the series names its own (the gateway's per-request ones).
"""
from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint, run_all
from gateway_utils import MODEL, GatewayHarness
from kvcache_utils import serving
from kvmesh.kv import codec
from kvmesh.metrics import start_metrics_server
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.documents import InlineDocument, Tokens
from kvmesh.services.engine.metrics import EngineMetrics
from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.telemetry import Telemetry

CHUNK = 32
KVCACHE = "kvmesh.kvcache.v1.KvcacheService"
MODEL_NAME = "tiny"


@dataclass(frozen=True)
class Scrape:
    """One scrape of /metrics: sample name + labels -> value. A lookup that names no model_name
    means the scrape's default one."""

    values: dict[tuple[str, tuple[tuple[str, str], ...]], float]
    model_name: str

    def _key(self, name: str, labels: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
        return name, tuple(sorted({"model_name": self.model_name, **labels}.items()))

    def __call__(self, name: str, **labels: str) -> float:
        """The sample's value; KeyError when the scrape lacks it (a misspelt name fails)."""
        return self.values[self._key(name, labels)]

    def get(self, name: str, **labels: str) -> float:
        """The sample's value, 0 when absent (a labelled child not created yet)."""
        return self.values.get(self._key(name, labels), 0.0)

    def has(self, name: str, **labels: str) -> bool:
        return self._key(name, labels) in self.values


def scrape(url: str, model_name: str = MODEL_NAME) -> Scrape:
    text = httpx.get(url, timeout=10).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    unlabelled = sorted({s.name for s in samples if not s.labels.get("model_name")})
    assert not unlabelled, f"samples without a model_name label: {unlabelled}"
    return Scrape({(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}, model_name)


class Deltas:
    """Scrapes before and after; `moved(name, **labels)` is after minus before."""

    def __init__(self, url: str, model_name: str = MODEL_NAME) -> None:
        self.url, self.model_name = url, model_name
        self.before = scrape(url, model_name)
        self.after = self.before

    def rescrape(self) -> Scrape:
        self.after = scrape(self.url, self.model_name)
        return self.after

    def moved(self, name: str, **labels: str) -> float:
        return self.after(name, **labels) - self.before.get(name, **labels)


@pytest.fixture
def telemetry() -> Telemetry:
    """The test's telemetry: one service's registry (and tracer provider), its samples labelled
    with MODEL_NAME."""
    return Telemetry.create("kvmesh-test", model_name=MODEL_NAME)


@pytest.fixture
def metrics_url(telemetry: Telemetry):
    """The test's registry served the way every service serves its own (kvmesh.metrics)."""
    server = start_metrics_server("127.0.0.1", 0, telemetry.registry)
    yield f"http://127.0.0.1:{server.port}/metrics"
    server.close()


@pytest.fixture
def engine_metrics(telemetry: Telemetry) -> EngineMetrics:
    """The engine's metrics in the test's registry (the engines of one test share them)."""
    return EngineMetrics(telemetry.registry)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@contextlib.contextmanager
def instrumented(core, metrics: EngineMetrics):
    """An AsyncEngine on `core`, published the way engine/__main__ does, unpublished after."""
    engine = AsyncEngine(lambda: core)
    collector = metrics.instrument(engine)
    try:
        yield engine
    finally:
        metrics.registry.unregister(collector)
        engine.shutdown()


async def generate(engine: AsyncEngine, prompt=None, max_tokens: int = 5, **kw):
    final = None
    async for out in engine.generate(prompt, greedy(max_tokens, ignore_eos=True), **kw):
        final = out if out.finished else final
    return final


def prompt(first: int, n: int) -> list[int]:
    return [(first + 7 * j) % 250 + 1 for j in range(n)]


async def test_engine_counters_after_a_known_workload(tiny, metrics_url, engine_metrics):
    # 3 prompts of 40 tokens at once, then the first again: its 2 full blocks (32 tokens; the
    # last prompt token is always computed) come from the prefix cache. 5 tokens each.
    core = make_core(tiny, num_blocks=64, block_size=16, max_num_batched_tokens=256)
    with instrumented(core, engine_metrics) as engine:
        d = Deltas(metrics_url)
        prompts = [prompt(i, 40) for i in (0, 1, 2)]
        finals = await asyncio.gather(*(generate(engine, p) for p in prompts))
        finals.append(await generate(engine, prompts[0]))
        after = await asyncio.to_thread(d.rescrape)

    assert [f.usage.completion_tokens for f in finals] == [5] * 4
    e = "kvmesh_engine_"
    assert d.moved(e + "request_success_total", finished_reason="length") == 4
    assert d.moved(e + "prompt_tokens_total") == 4 * 40
    assert d.moved(e + "generation_tokens_total") == 4 * 5
    assert d.moved(e + "cached_prompt_tokens_total") == 32
    assert after(e + "prefix_cache_queries_total") == 4 * 40  # this core's own counters
    assert after(e + "prefix_cache_hits_total") == 32
    assert after(e + "num_preemptions_total") == 0
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                 "request_time_per_output_token_seconds"):
        assert d.moved(e + hist + "_count") == 4, hist
    assert d.moved(e + "inter_token_latency_seconds_count") == 4 * 4  # one per step after the first
    assert d.moved(e + "request_prompt_tokens_sum") == 160 and d.moved(e + "request_prompt_tokens_count") == 4
    assert d.moved(e + "request_generation_tokens_sum") == 20
    assert d.moved(e + "request_prompt_tokens_bucket", le="50.0") == 4
    assert d.moved(e + "request_prompt_tokens_bucket", le="20.0") == 0
    assert after(e + "num_requests_running") == 0 and after(e + "num_requests_waiting") == 0
    assert after(e + "kv_cache_usage_perc") == 0.0
    assert not after.has(e + "spec_decode_num_drafts_total")  # no draft service
    assert not after.has(e + "kv_lookups_total")  # no KV-cache service
    assert after.values[(e + "prompt_tokens_total", (("model_name", MODEL_NAME),))] == 4 * 40


async def test_speculative_decoding_counters(tiny, metrics_url, engine_metrics):
    # A drafter that knows the greedy continuation: every draft is accepted. With 4 drafts per
    # step and 12 tokens: prefill emits 1, two steps verify 4 drafts and emit 5 each, the last
    # token is a plain step (no room for drafts) -> 2 drafts, 8 draft tokens, 8 accepted.
    ids = prompt(3, 30)
    reference = run_all(make_core(tiny), {"r": ids}, greedy(12, ignore_eos=True))["r"]["tokens"]
    full = ids + reference
    fake = FakeDraftService(lambda rid, history, k: full[len(history):len(history) + k])
    try:
        # n-gram mode: every step drafts (ADAPTIVE requests follow the SpecGate's arms, whose
        # exploration has its own tests)
        core = make_core(tiny, draft_address=fake.address, draft_timeout_s=5.0, spec_max_draft_tokens=4,
                         speculation="ngram")
        with instrumented(core, engine_metrics) as engine:
            d = Deltas(metrics_url)
            final = await generate(engine, ids, max_tokens=12)
            after = await asyncio.to_thread(d.rescrape)
        core.drafts.close()
    finally:
        fake.stop()

    e = "kvmesh_engine_"
    assert (final.spec.steps, final.spec.draft_tokens, final.spec.accepted_tokens) == (2, 8, 8)
    assert after(e + "spec_decode_num_drafts_total") == 2
    assert after(e + "spec_decode_num_draft_tokens_total") == 8
    assert after(e + "spec_decode_num_accepted_tokens_total") == 8
    assert after(e + "spec_draft_failures_total") == 0 and after(e + "spec_resyncs_total") == 0
    assert d.moved(e + "spec_propose_seconds_count") == core.drafts.stats.calls == 2
    assert d.moved(e + "generation_tokens_total") == 12
    assert d.moved(e + "inter_token_latency_seconds_count") == 3  # 4 emitting steps: 1, 5, 5, 1 tokens


def blob_bytes(loaded) -> int:
    """Size of one exported chunk of the tiny model with fp16, no zstd (independent of values)."""
    c = loaded.config
    k = torch.zeros(c.num_layers, CHUNK, c.num_kv_heads, c.head_dim)
    ns = bytes(16)  # the size of a blob does not depend on its namespace
    return len(codec.encode(k, k, codec.ChunkMeta(ns, (1,) * CHUNK), codec.CodecSpec("fp16", zstd=False)))


def kv_engine(loaded, address: str):
    return make_core(loaded, num_blocks=64, block_size=16, max_num_batched_tokens=256, kvcache_address=address,
                     kv_chunk_tokens=CHUNK, kv_codec="fp16", kv_zstd=False, kv_timeout_s=5.0)


@contextlib.asynccontextmanager
async def kv_service(tmp_path, memory_bytes: int, telemetry: Telemetry):
    cfg = KvcacheConfig(data_dir=tmp_path / "lmdb", memory_bytes=memory_bytes,
                        disk_map_bytes=64 << 20, max_entry_bytes=1 << 20)
    async with serving(cfg, telemetry=telemetry) as served:
        collector = served.backend.metrics.watch_store(served.backend)
        try:
            yield served
        finally:
            telemetry.registry.unregister(collector)


async def test_kv_service_and_engine_link_counters(tiny, metrics_url, engine_metrics, telemetry,
                                                   tmp_path):
    # A 100-token prompt is 3 chunks of 32. The memory tier holds 2.5 chunks, the disk all.
    # Engine 1: Lookup (0 found), then 3 Puts; the memory tier evicts chunk 0 to take chunk 2.
    # Engine 2 (empty caches): Lookup finds 3 (memory 1-2, disk 0), one Get of 3 keys: memory
    # hits 1-2 and misses 0, disk hits 0, which is promoted into memory and evicts chunk 1.
    size = blob_bytes(tiny)
    ids = prompt(5, 100)
    async with kv_service(tmp_path, size * 5 // 2, telemetry) as kv:
        d = Deltas(metrics_url)
        with instrumented(kv_engine(tiny, kv.address), engine_metrics) as first:
            cold = await generate(first, ids)
            assert await asyncio.to_thread(first.core.kv.flush)
            one = await asyncio.to_thread(scrape, metrics_url)
            await first.core.kv.close()
        with instrumented(kv_engine(tiny, kv.address), engine_metrics) as second:
            warm = await generate(second, ids)
            assert await asyncio.to_thread(second.core.kv.flush)
            two = await asyncio.to_thread(d.rescrape)
            await second.core.kv.close()

    assert (cold.usage.cached_prompt_tokens, warm.usage.cached_prompt_tokens) == (0, 96)
    k = "kvmesh_kvcache_"
    assert d.moved(k + "lookup_requests_total") == 2
    assert d.moved(k + "lookup_chunks_total") == 6 and d.moved(k + "lookup_tokens_total") == 6 * CHUNK
    assert d.moved(k + "lookup_hit_chunks_total") == 3 and d.moved(k + "lookup_hit_tokens_total") == 3 * CHUNK
    assert d.moved(k + "get_requests_total") == 1
    assert d.moved(k + "get_chunks_total") == 3 and d.moved(k + "get_hit_chunks_total") == 3
    assert d.moved(k + "read_bytes_total") == 3 * size
    assert d.moved(k + "put_requests_total") == 3 and d.moved(k + "written_bytes_total") == 3 * size
    # The store as the scrape saw it (this service's tiers only).
    tier = {name: {t: two(k + name, tier=t) for t in ("memory", "disk")} for name in (
        "tier_entries", "tier_bytes", "tier_capacity_bytes", "tier_hits_total", "tier_misses_total",
        "tier_evictions_total", "tier_errors_total")}
    assert tier["tier_entries"] == {"memory": 2, "disk": 3}
    assert tier["tier_bytes"] == {"memory": 2 * size, "disk": 3 * size}
    assert tier["tier_capacity_bytes"]["memory"] == size * 5 // 2
    assert tier["tier_hits_total"] == {"memory": 2, "disk": 1}
    assert tier["tier_misses_total"] == {"memory": 1, "disk": 0}
    assert tier["tier_evictions_total"] == {"memory": 2, "disk": 0}
    assert tier["tier_errors_total"] == {"memory": 0, "disk": 0}
    assert two(k + "corrupt_entries_total") == 0
    # The same calls as the RPC layer counted them.
    for method, calls in (("Lookup", 2), ("Get", 1), ("Put", 3)):
        assert d.moved("kvmesh_rpc_server_handled_total", grpc_service=KVCACHE, grpc_method=method,
                       grpc_code="OK") == calls, method
    # Each engine's link, as its own collector saw it while registered.
    e = "kvmesh_engine_"
    assert [one(e + f) for f in ("kv_lookups_total", "kv_fetched_chunks_total", "kv_exported_chunks_total")] == [1, 0, 3]
    assert [two(e + f) for f in ("kv_lookups_total", "kv_fetched_chunks_total", "kv_exported_chunks_total")] == [1, 3, 0]
    assert two(e + "kv_fetch_failures_total") == 0 and two(e + "kv_bad_blobs_total") == 0
    assert d.moved(e + "cached_prompt_tokens_total") == 96  # imported, not the engine's prefix cache
    assert two(e + "prefix_cache_queries_total") == 100 and two(e + "prefix_cache_hits_total") == 0


async def test_blending_counters(tiny, metrics_url, engine_metrics, telemetry, tmp_path):
    # Two 64-token documents (2 chunks each). The first prompt stores them by content; the
    # second holds them in the other order behind another header: 128 tokens blended, 25% of
    # them (32) recomputed.
    docs = {"a": prompt(11, 64), "b": prompt(12, 64)}

    def parts(first: str, second: str, head: list[int]):
        return [Tokens(tuple(head)), InlineDocument(tuple(docs[first])), Tokens((9, 9)),
                InlineDocument(tuple(docs[second])), Tokens((3, 4, 5, 6))]

    async with kv_service(tmp_path, 64 << 20, telemetry) as kv:
        with instrumented(kv_engine(tiny, kv.address), engine_metrics) as engine:
            d = Deltas(metrics_url)
            cold = await generate(engine, parts=parts("a", "b", prompt(20, 8)), recompute_ratio=0.25)
            assert await asyncio.to_thread(engine.core.kv.flush)
            warm = await generate(engine, parts=parts("b", "a", prompt(30, 5)), recompute_ratio=0.25)
            await asyncio.to_thread(d.rescrape)
            await engine.core.kv.close()

    assert (cold.documents.blended_tokens, warm.documents.blended_tokens) == (0, 128)
    assert warm.documents.recomputed_tokens == 32
    e = "kvmesh_engine_"
    assert d.moved(e + "blend_prompts_total") == 1
    assert d.moved(e + "blend_tokens_total") == 128
    assert d.moved(e + "blend_recomputed_tokens_total") == 32
    assert d.moved(e + "request_success_total", finished_reason="length") == 2
    assert d.moved(e + "prompt_tokens_total") == (8 + 64 + 2 + 64 + 4) + (5 + 64 + 2 + 64 + 4)


def test_gateway_counters():
    # 3 completions of a 4-token prompt, 3 tokens each, 2 of them cached upstream; then one
    # request for a model that does not exist. Scraped at the gateway's own GET /metrics.
    with GatewayHarness() as h:
        h.state.cached_tokens = 2
        # ALL_MODELS on the gateway's own series (in flight, requests of no served model)
        d = Deltas(f"http://127.0.0.1:{h.http_port}/metrics", model_name="*")
        with httpx.Client(base_url=h.base_url, timeout=10) as client:
            for _ in range(3):
                r = client.post("/completions", json={"model": MODEL, "prompt": "abcd", "max_tokens": 3})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert client.post("/completions", json={"model": "nope", "prompt": "abcd"}).status_code == 404
        d.rescrape()

    g, ep, m = "kvmesh_gateway_", "/v1/completions", MODEL
    assert d.moved(g + "requests_total", model_name=m, endpoint=ep, status="200", tenant="default") == 3
    assert d.moved(g + "requests_total", endpoint=ep, status="404", tenant="default") == 1  # "nope": "*"
    assert not d.after.has(g + "requests_total", model_name="nope", endpoint=ep, status="404", tenant="default")
    assert d.moved(g + "tokens_total", model_name=m, kind="prompt") == 3 * 4
    assert d.moved(g + "tokens_total", model_name=m, kind="completion") == 3 * 3
    assert d.moved(g + "tokens_total", model_name=m, kind="cached") == 3 * 2
    assert d.moved(g + "request_seconds_count", model_name=m, endpoint=ep) == 3
    assert d.moved(g + "request_seconds_count", endpoint=ep) == 1
    assert d.moved(g + "ttft_seconds_count", model_name=m, endpoint=ep) == 3
    assert d.after(g + "inflight_requests") == 0 and d.after(g + "inflight_prompt_tokens") == 0


async def test_an_aborted_request_counts_as_abort(tiny, metrics_url, engine_metrics):
    """A client that goes away mid-stream: request_success{abort} and its prompt tokens."""
    import threading

    core = make_core(tiny, num_blocks=64, block_size=16, max_num_batched_tokens=256)
    with instrumented(core, engine_metrics) as engine:
        applied = threading.Event()
        hook = engine.on_abort
        engine.on_abort = lambda out: (hook(out), applied.set())
        d = Deltas(metrics_url)
        stream = engine.generate(prompt(3, 24), greedy(50, ignore_eos=True))
        first = await stream.__anext__()  # one output, then the client leaves
        await stream.aclose()
        assert not first.finished
        assert await asyncio.to_thread(applied.wait, 10)  # the step loop applied the abort
        await asyncio.to_thread(d.rescrape)
        assert d.moved("kvmesh_engine_request_success_total", finished_reason="abort") == 1
        assert d.moved("kvmesh_engine_prompt_tokens_total") == 24
