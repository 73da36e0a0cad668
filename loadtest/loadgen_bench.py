"""`kvmesh bench loadgen`: the load harness's own overhead (issue 20's bar: it sustains >= 200
requests/s against a stub server that answers at once, on at most one core).

The stub (kvmesh.loadtest.harness.stub) runs in its own process; the harness runs here, open
loop at constant rates, and this process's CPU time over the level's wall time is the cores it
used. Lag is how late each request left against its schedule (p50/p99)."""
from __future__ import annotations

import asyncio
import resource
import subprocess
import sys
import time

from kvmesh.launcher import free_port
from kvmesh.loadtest.harness.runner import Target, run_level
from kvmesh.loadtest.harness.stats import percentile, summarize
from kvmesh.loadtest.harness.workloads import random_prompts
from kvmesh.loadtest.report import pivot, row


def _cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def run(quick: bool = False) -> list[dict]:
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "kvmesh.loadtest.harness.stub", str(port), "16"],
                            stdout=subprocess.PIPE, text=True)
    out: list[dict] = []
    try:
        assert stub.stdout.readline().strip() == "ready"
        target = Target(f"http://127.0.0.1:{port}/v1", "stub")
        n = 1000 if quick else 3000
        for rate in (200.0, 400.0):
            requests = random_prompts(n, seed=0, prompt_words=100, max_tokens=16)
            cpu, wall = _cpu_s(), time.perf_counter()
            records = asyncio.run(run_level(target, requests, rate=rate, arrival="constant"))
            cpu, wall = _cpu_s() - cpu, time.perf_counter() - wall
            s = summarize(records)
            lag = [r.sent - r.scheduled for r in records if r.scheduled is not None]
            params = {"offered_rate": rate, "requests": n}
            out += [row("achieved_rate", s.request_throughput, "req/s", **params),
                    row("completed", s.completed, "requests", **params),
                    row("harness_cores", cpu / wall, "cores", **params),
                    row("send_lag_p50", percentile(lag, 50) * 1e3, "ms", **params),
                    row("send_lag_p99", percentile(lag, 99) * 1e3, "ms", **params),
                    row("ttft_p50", s.latency["ttft"]["p50"] * 1e3, "ms", **params)]
    finally:
        stub.kill()
        stub.wait()
    print(pivot(out, "offered_rate"))
    return out
