"""Fault injection under load: the KV-cache service slow, hung (SIGSTOP) and killed (SIGKILL)
while 16 greedy streams with long prompts run on an engine that uses it (real processes, the
bundled model). The bound the README's reliability table states: 0 requests fail, every output
equals the undisturbed run's (a miss is a recompute, and exact reuse gives the same tokens), and
a request waits on an unanswering service at most --kv-timeout-s before it computes its prompt
(later ones skip the service for --kv-retry-s: KvcacheClient's NOTE on back-off)."""
from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from chaos_utils import KV_TIMEOUT_S, check, run_all
from kvmesh import launcher

pytestmark = pytest.mark.slow



class DelayProxy:
    """A TCP proxy on its own thread and event loop that holds every chunk of bytes it forwards
    for `delay_s` (network latency injection; 0 forwards at once)."""

    def __init__(self, upstream_port: int) -> None:
        self.delay_s = 0.0
        self.upstream_port = upstream_port
        self.port = launcher.free_port()
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        started.wait()

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        started.set()
        self.loop.run_forever()

    async def _pump(self, reader, writer) -> None:
        try:
            while data := await reader.read(65536):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)  # the fault itself, not a synchronization
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _serve(self, reader, writer) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


async def test_the_kv_service_slow_hung_or_killed_fails_no_request(tmp_path, monkeypatch, long_prompts):
    monkeypatch.setenv("KVMESH_DATA_DIR", str(tmp_path))
    one = {"OMP_NUM_THREADS": "1"}
    kv_port = launcher.free_port()
    kv = launcher.start_service("kvcache", "kvmesh.services.kvcache", ["--data-dir", str(tmp_path / "kv")],
                                kv_port, env=one)
    proxy = DelayProxy(kv_port)
    engine = None
    try:
        engine = launcher.start_service(
            "engine", "kvmesh.services.engine",
            ["--kvcache-address", f"127.0.0.1:{proxy.port}", "--kv-timeout-s", str(KV_TIMEOUT_S),
             "--kv-retry-s", "2", "--kv-chunk-tokens", "64", "--kv-cache-bytes", str(64 << 20)],
            launcher.free_port())
        reference = await run_all(engine.address, long_prompts)
        ref_ttft = check("undisturbed", reference, reference)

        proxy.delay_s = 3 * KV_TIMEOUT_S  # every KV call misses its deadline
        check("KV service past its deadline", await run_all(engine.address, long_prompts), reference)
        proxy.delay_s = 0.2 * KV_TIMEOUT_S  # slow, within the deadline
        check("KV service slow", await run_all(engine.address, long_prompts), reference)
        proxy.delay_s = 0.0

        os.kill(kv.pid, signal.SIGSTOP)  # hung: connections stay open, nothing answers
        stopped = check("KV service SIGSTOPped", await run_all(engine.address, long_prompts), reference)
        # a request waits on the hung service at most the deadline, then computes (generous
        # margin: 16 prefills share two cores with everything else)
        assert stopped[-1] <= KV_TIMEOUT_S + 2 * ref_ttft[-1] + 5.0
        os.kill(kv.pid, signal.SIGCONT)

        os.kill(kv.pid, signal.SIGKILL)
        check("KV service SIGKILLed", await run_all(engine.address, long_prompts), reference)
        assert launcher.health(engine.address) == "SERVING"
    finally:
        if engine is not None:
            launcher.stop_service(engine, timeout_s=5)
        proxy.close()
        if launcher.alive(kv.pid):
            os.kill(kv.pid, signal.SIGCONT)
        launcher.stop_service(kv, timeout_s=5)


def _scrape(port: int) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_a_full_lmdb_map_under_load_fails_no_request(tmp_path, monkeypatch, long_prompts):
    """A 4 MiB disk tier (no memory tier) under 16 long prompts whose chunks are 0.7 MB each: the
    map is full all the time and every Put evicts (lmdb_tier's NOTE on eviction)."""
    monkeypatch.setenv("KVMESH_DATA_DIR", str(tmp_path))
    metrics_port = launcher.free_port()
    kv = launcher.start_service(
        "kvcache", "kvmesh.services.kvcache",
        ["--data-dir", str(tmp_path / "kv"), "--tiers", "disk", "--disk-map-bytes", str(4 << 20),
         "--max-entry-bytes", str(1 << 20), "--metrics-port", str(metrics_port)],
        launcher.free_port(), env={"OMP_NUM_THREADS": "1"})
    engine = None
    try:
        engine = launcher.start_service(
            "engine", "kvmesh.services.engine",
            # Exports at normal priority: at idle priority (the default) a machine kept busy
            # by something else can hold them back past the second pass.
            ["--kvcache-address", kv.address, "--kv-chunk-tokens", "16", "--kv-cache-bytes", str(64 << 20),
             "--kv-export-priority", "normal"],
            launcher.free_port())
        reference = await run_all(engine.address, long_prompts)
        check("map full, first pass", reference, reference)
        check("map full, second pass", await run_all(engine.address, long_prompts), reference)
        assert launcher.health(kv.address) == "SERVING"
        # A graceful stop finishes the engine's queued exports (KvConnector.close): every Put
        # has been answered before the counters are read.
        launcher.stop_service(engine, timeout_s=120)
        engine_log, engine = engine.log, None
        with open(engine_log, encoding="utf-8", errors="replace") as f:
            assert "engine: closed" in f.read(), (
                f"the engine did not finish its graceful stop within 120 s (SIGKILLed: its queued "
                f"exports were lost, so the counters below would be short); see {engine_log}")
        assert launcher.health(kv.address) == "SERVING"
        metrics = _scrape(metrics_port)
        evictions = metrics["kvmesh_kvcache_tier_evictions_total[('model_name', '*'), ('tier', 'disk')]"]
        held = metrics["kvmesh_kvcache_tier_bytes[('model_name', '*'), ('tier', 'disk')]"]
        print(f"map full: {evictions:.0f} evictions, {held / 2**20:.1f} MiB held of 4 MiB")
        assert evictions > 0 and 0 < held <= 4 << 20
    finally:
        if engine is not None:
            launcher.stop_service(engine, timeout_s=5)
        launcher.stop_service(kv, timeout_s=5)
