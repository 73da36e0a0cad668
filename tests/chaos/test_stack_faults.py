"""Fault injection under load on the whole local stack (`kvmesh up --replicas 2`, real processes
under the supervisor): 16 greedy chat streams over HTTP while the router is killed or hung. The
bound the README's reliability table states: 0 requests fail and every answer equals the
undisturbed stack's. The supervisor restarts a killed router at once and kills a hung one
(its health checks go unanswered) before restarting it; the gateway resumes each broken stream
after what its client already has (services/gateway/upstream.py, run_choice). The gateway
itself holds the clients' connections: those break with it (the last test states that bound)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from kvmesh import launcher

pytestmark = pytest.mark.slow

STREAMS = 16
MAX_TOKENS = 24
TOPICS = ("rivers", "bread", "comets", "violins", "glaciers", "bees", "lighthouses", "chess", "volcanoes",
          "paper", "owls", "bridges", "tea", "deserts", "clocks", "coral")


def _kvmesh(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvmesh.cli", *args], env=env, capture_output=True, text=True,
                          timeout=600)


def _state(env: dict) -> dict[str, dict]:
    return {p["name"]: p for p in json.loads((Path(env["KVMESH_DATA_DIR"]) / "stack.json").read_text())}


def _restarted(env: dict, name: str, before: dict, timeout_s: float = 120.0) -> dict:
    """The service's state once the supervisor has recorded its restart. Clients can reach the
    new process before the supervisor's own health check passes and it writes the state, and
    another process writes that file: polling is all there is."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = _state(env)[name]
        if now["restarts"] > before["restarts"] and now["pid"] != before["pid"]:
            return now
        assert time.monotonic() < deadline, f"{name}: no restart recorded within {timeout_s:.0f}s: {now}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("stack")
    env = {**os.environ, "KVMESH_DATA_DIR": str(data)}
    engine_port = launcher.free_port()
    ports = [f"--{svc}-port={launcher.free_port()}" for svc in ("http", "gateway", "router", "kvcache", "draft")]
    up = _kvmesh("up", "--replicas", "2", *ports, f"--engine-port={engine_port}",
                 "--engine-arg=--kv-cache-bytes=67108864", env=env)
    assert up.returncode == 0, up.stderr + up.stdout
    try:
        yield env
    finally:
        for p in _state(env).values():  # nothing stays stopped: `down` drains
            if launcher.alive(p["pid"]):
                os.kill(p["pid"], signal.SIGCONT)
        _kvmesh("down", env=env)


async def _chat_all(url: str, fault=None, retries: int = 0):
    """Every topic's chat at once; `fault()` is called once, when every stream has at least 3
    content chunks. Returns per stream (text, completion tokens) or the exception it raised."""
    got = [0] * STREAMS
    fired = []
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=retries, timeout=600) as client:
        async def one(i: int):
            stream = await client.chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": f"Tell me about {TOPICS[i]}."}],
                max_tokens=MAX_TOKENS, temperature=0.0, stream=True, stream_options={"include_usage": True})
            text, usage = "", None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                    got[i] += 1
                    if fault is not None and not fired and min(got) >= 3:
                        fired.append(True)
                        fault()
            return text, usage.completion_tokens

        results = await asyncio.gather(*(one(i) for i in range(STREAMS)), return_exceptions=True)
    assert fault is None or fired, "the fault never fired"
    return results


def _assert_same(results, reference) -> None:
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {len(results)} requests failed: {failed[0]!r}"
    assert results == reference


@pytest.fixture(scope="module")
def reference(stack):
    url = _state(stack)["gateway"]["url"]
    results = asyncio.run(_chat_all(url))
    assert not [r for r in results if isinstance(r, BaseException)]
    assert all(tokens == MAX_TOKENS or len(text) > 0 for text, tokens in results)
    return results


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
async def test_the_router_killed_or_hung_under_16_streams_fails_no_request(stack, reference, fault):
    before = _state(stack)["router"]
    results = await _chat_all(_state(stack)["gateway"]["url"], lambda: os.kill(before["pid"], getattr(signal, fault)))
    _assert_same(results, reference)
    after = _restarted(stack, "router", before)
    assert after["restarts"] == before["restarts"] + 1
    assert after["last_exit"].startswith("killed by SIGKILL")
    assert ("hung:" in after["last_exit"]) == (fault == "SIGSTOP")


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
async def test_the_gateway_killed_or_hung_fails_only_the_requests_it_held(stack, reference, fault):
    """The one failure a client does see, with a single gateway: the HTTP connections it holds
    break (SIGKILL at once; SIGSTOP once the supervisor finds it hung and kills it). The
    supervisor restarts it on its port, and the same requests retried get the same answers."""
    before = _state(stack)["gateway"]
    results = await _chat_all(before["url"], lambda: os.kill(before["pid"], getattr(signal, fault)))
    failed = [r for r in results if isinstance(r, BaseException)]
    assert failed and all(isinstance(e, openai.APIError) for e in failed)
    # what the gateway had already written to a socket still arrives whole
    assert all(r == ref for r, ref in zip(results, reference) if not isinstance(r, BaseException))
    print(f"gateway {fault}: {len(failed)} of {STREAMS} streams in flight broke")
    retried = await _chat_all(before["url"], retries=8)  # the client's own back-off covers the restart
    _assert_same(retried, reference)
    after = _restarted(stack, "gateway", before)
    assert after["restarts"] == before["restarts"] + 1
    assert ("hung:" in after["last_exit"]) == (fault == "SIGSTOP")
