"""The local stack as real processes: `kvmesh up/status/chat/down`, and drain on SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import psutil
import pytest

from kvmesh import launcher
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.slow



def _kvmesh(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def _state(env: dict, name: str) -> dict:
    import json

    state = json.loads((Path(env["KVMESH_DATA_DIR"]) / "stack.json").read_text())
    return next(p for p in state if p["name"] == name)


def _wait_state(env: dict, name: str, done, timeout_s: float = 180.0) -> dict:
    """Polls the supervisor's state file (another process writes it; there is nothing to wait
    on) until `done` holds for service `name`, then waits for that service's health."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            entry = _state(env, name)
            if done(entry) and launcher.health(entry["address"]) == "SERVING":
                return entry
        except (FileNotFoundError, ValueError, StopIteration):
            pass
        assert time.monotonic() < deadline, f"{name} not restarted within {timeout_s:.0f}s"
        time.sleep(0.2)


def test_up_status_chat_down(tmp_path):
    env = {**os.environ, "KVMESH_DATA_DIR": str(tmp_path)}
    ports = [f"--{svc}-port={launcher.free_port()}" for svc in ("http", "gateway", "router", "engine", "kvcache", "draft")]
    up = _kvmesh("up", *ports, "--engine-arg=--kv-cache-bytes=67108864", env=env)
    assert up.returncode == 0, up.stderr
    try:
        status = _kvmesh("status", env=env)
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("SERVING") == 5, status.stdout   # kvcache, draft, engine, router, gateway
        assert "restarts a service that exits" in status.stdout  # the supervisor's line
        assert status.stdout.count("/metrics") == 5, status.stdout  # every service's scrape URL
        engine_metrics = _state(env, "engine")["metrics"]
        assert "kvmesh_engine_" in httpx.get(engine_metrics, timeout=30).text
        # The router dies: the supervisor starts it again on its port, and the gateway's calls
        # wait for it. The chat below goes through the restarted router.
        router = _state(env, "router")
        os.kill(router["pid"], signal.SIGKILL)
        restarted = _wait_state(env, "router", lambda r: r["restarts"] == 1 and r["pid"] != router["pid"])
        assert restarted["last_exit"].startswith("killed by SIGKILL after"), restarted
        status = _kvmesh("status", env=env)
        assert "restarts 1 (last: killed by SIGKILL" in status.stdout, status.stdout
        assert "killed by SIGKILL" in (tmp_path / "logs" / "supervisor.log").read_text()
        # through the gateway's OpenAI API, found from the stack's state
        chat = _kvmesh("chat", "What is the capital of France?", "--max-tokens", "12", env=env)
        assert chat.returncode == 0, chat.stderr
        assert "Paris" in chat.stdout
        assert "tok/s" in chat.stderr
    finally:
        down = _kvmesh("down", env=env)
    assert down.returncode == 0
    assert all(name in down.stdout for name in ("gateway", "router", "engine", "draft", "kvcache")), down.stdout
    after = _kvmesh("status", env=env)
    assert after.returncode == 3
    assert (tmp_path / "logs" / "engine.log").read_text().count("listening on") == 1
    assert (tmp_path / "kvcache").is_dir()  # the KV service's LMDB lives in the data directory


def test_sigterm_drains_in_flight_requests(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMESH_DATA_DIR", str(tmp_path))
    port = launcher.free_port()
    svc = launcher.start_service("engine", "kvmesh.services.engine",
                                 ["--kv-cache-bytes", "67108864", "--grace-s", "60"], port)

    async def run() -> engine_pb2.GenerateResponse:
        async with grpc.aio.insecure_channel(svc.address) as ch:
            stub = engine_pb2_grpc.EngineServiceStub(ch)
            call = stub.Generate(engine_pb2.GenerateRequest(
                text="Count slowly:", sampling=engine_pb2.SamplingParams(max_tokens=24, ignore_eos=True)),
                timeout=120)
            last = None
            async for msg in call:
                if last is None:
                    os.kill(svc.pid, signal.SIGTERM)   # drain starts while we are streaming
                last = msg
            return last

    proc = psutil.Process(svc.pid)
    try:
        last = asyncio.run(run())
        # the in-flight request finished normally although SIGTERM came after its first token
        assert last.final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.final.usage.completion_tokens == 24
        assert proc.wait(timeout=60) == 0   # then the engine exited cleanly by itself
    finally:
        launcher.stop_service(svc, timeout_s=5)
