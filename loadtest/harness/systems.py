"""The systems `kvmesh loadtest --compare` starts, one at a time (each gets the whole machine
while it is measured), on the bundled GGUF:

  kvmesh           `kvmesh up` with its defaults (one engine on every core, the KV-cache and
                   draft services, router, gateway)
  kvmesh-blend     the same stack, every request opting into blending its documents
                   ("kvmesh": {"lossy": {"recompute_ratio": 0.15}}: the deployment default's
                   measured quality, README "Quality"); only meaningful on the rag workload
  kvmesh-noreuse   the same stack with KV reuse off: no engine prefix cache, no KV-cache service
                   (the ablation)
  llamacpp-server  llama.cpp's own server on the same GGUF file, one continuous-batching slot per
                   concurrent request, its prompt cache on (its default: its own KV reuse)
  kvmesh-slo       the default stack with SLO-aware admission on (the gateway's --slo-ttft-s =
                   the TTFT bound of --slo, 2 s without one); not in the default --compare set
  kvmesh-pd        prefill/decode disaggregation: `kvmesh up --pd 1:1 --pin-engines`, one prefill
                   and one decode engine, each pinned to its share of the cores
  kvmesh-2x        its colocated baseline: `kvmesh up --replicas 2 --pin-engines`, two whole-request
                   engines on the same cores (kvmesh-pd and kvmesh-2x: not in the default set)
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Optional

import httpx

from kvmesh import launcher
from kvmesh.threads import usable_cores

SYSTEMS = ("kvmesh", "kvmesh-blend", "kvmesh-noreuse", "llamacpp-server")
KNOWN = (*SYSTEMS, "kvmesh-slo", "kvmesh-pd", "kvmesh-2x")
BLEND = {"kvmesh": {"lossy": {"recompute_ratio": 0.15}}}


@dataclass(frozen=True)
class Served:
    """A running system: its OpenAI base URL and what its requests add."""

    url: str
    extra: Optional[dict] = None


def _kvmesh(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], env=env, capture_output=True, text=True,
                          timeout=900)


@contextlib.contextmanager
def _stack(engine_args: tuple[str, ...] = (), gateway_args: tuple[str, ...] = (),
           up_args: tuple[str, ...] = ()) -> Iterator[str]:
    data = tempfile.mkdtemp(prefix="kvmesh-loadtest-")
    env = {**os.environ, "KVMESH_DATA_DIR": data}
    http = launcher.free_port()
    ports = [f"--{svc}-port={launcher.free_port()}" for svc in ("gateway", "router", "engine", "kvcache", "draft")]
    up = _kvmesh("up", f"--http-port={http}", *ports, *up_args, *(f"--engine-arg={a}" for a in engine_args),
                 *(f"--gateway-arg={a}" for a in gateway_args), env=env)
    if up.returncode != 0:
        raise SystemExit(f"kvmesh loadtest: the stack did not start: {up.stderr.strip()}")
    try:
        yield f"http://127.0.0.1:{http}/v1"
    finally:
        _kvmesh("down", env=env)


@contextlib.contextmanager
def _llama_server(parallel: int, per_slot: int) -> Iterator[str]:
    from kvmesh.loadtest.engine_bench import BUILD_HINT, llama_server_path
    from kvmesh.model.loader import bundled_gguf_path

    binary = llama_server_path()
    if binary is None:
        raise SystemExit(f"kvmesh loadtest: llama-server is not built; run `{BUILD_HINT}`")
    port, threads = launcher.free_port(), str(usable_cores())
    log = open(os.path.join(tempfile.mkdtemp(prefix="llama-server-"), "server.log"), "wb")
    proc = subprocess.Popen([str(binary), "-m", str(bundled_gguf_path()), "--host", "127.0.0.1", "--port", str(port),
                             "-t", threads, "-tb", threads, "--parallel", str(parallel), "-c", str(parallel * per_slot),
                             "--cont-batching", "--jinja"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:  # another process: its /health is all there is to wait on
            if proc.poll() is not None:
                raise SystemExit(f"kvmesh loadtest: llama-server exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"kvmesh loadtest: llama-server not ready after 120 s; see {log.name}")
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


@contextlib.contextmanager
def serving(system: str, *, parallel: int = 16, per_slot: int = 4096, slo_ttft_s: float = 2.0) -> Iterator[Served]:
    """Starts `system` (see the module docstring) and stops it on exit."""
    if system in ("kvmesh", "kvmesh-blend"):
        with _stack() as url:
            yield Served(url, BLEND if system == "kvmesh-blend" else None)
    elif system == "kvmesh-slo":
        with _stack(gateway_args=(f"--slo-ttft-s={slo_ttft_s:g}",)) as url:
            yield Served(url)
    elif system == "kvmesh-pd":
        with _stack(up_args=("--pd=1:1", "--pin-engines")) as url:
            yield Served(url)
    elif system == "kvmesh-2x":
        with _stack(up_args=("--replicas=2", "--pin-engines")) as url:
            yield Served(url)
    elif system == "kvmesh-noreuse":
        with _stack(("--enable-prefix-caching=false", "--kvcache-address=")) as url:
            yield Served(url)
    elif system == "llamacpp-server":
        with _llama_server(parallel, per_slot) as url:
            yield Served(url)
    else:
        raise SystemExit(f"kvmesh loadtest: unknown system {system!r}; choose from {', '.join(KNOWN)}")
