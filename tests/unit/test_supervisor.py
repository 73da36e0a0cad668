"""The local stack's supervisor (kvmesh.supervisor): back-off, exit reasons, and a real service
(the router, which starts in about a second) killed and restarted on its port."""
from __future__ import annotations

import asyncio
import os
import signal

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.launcher import alive, free_port
from kvmesh.procid import ProcessIdentity
from kvmesh.supervisor import Backoff, HangWatch, Supervisor, exit_reason


def test_backoff_doubles_to_its_cap_and_resets_after_a_stable_run():
    b = Backoff(base_s=1.0, cap_s=8.0, stable_s=60.0)
    assert [b.next_delay(ran_s=2.0) for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    assert b.next_delay(ran_s=61.0) == 1  # it had run a minute: a fresh failure
    assert b.next_delay(ran_s=0.5) == 2


def test_exit_reasons_name_the_signal_or_the_code():
    assert exit_reason(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_reason(-signal.SIGSEGV) == "killed by SIGSEGV"
    assert exit_reason(3) == "exited with code 3"


def _router(port: int, metrics_port: int | None = None) -> dict:
    metrics = ["--metrics-port", str(metrics_port)] if metrics_port else []
    return {"name": "router", "module": "kvmesh.services.router", "args": ["--tiers", "m=127.0.0.1:1@1.0", *metrics],
            "port": port, "env": [["OMP_NUM_THREADS", "1"]], "metrics_port": metrics_port}


async def _serving(address: str) -> bool:
    async with grpc.aio.insecure_channel(address) as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30,
                                                         wait_for_ready=True)
    return resp.status == health_pb2.HealthCheckResponse.SERVING


async def test_a_killed_service_is_restarted_on_its_port_and_the_state_says_why(tmp_path):
    port = free_port()
    states: list[list[dict]] = []
    restarted = asyncio.Event()

    def save(state: list[dict]) -> None:
        states.append(state)
        if state[0]["restarts"] == 1 and "restart" not in state[0]["last_exit"]:
            restarted.set()

    metrics_port = free_port()
    sup = Supervisor([_router(port, metrics_port)], tmp_path, save, ready_timeout_s=60, backoff=Backoff(base_s=0.0))
    await sup.start_all()
    first = states[-1][0]
    assert first["metrics"] == f"http://127.0.0.1:{metrics_port}/metrics"  # what `kvmesh status` lists
    async with httpx.AsyncClient() as client:
        assert "kvmesh_router" in (await client.get(first["metrics"], timeout=30)).text
    assert (first["restarts"], first["last_exit"], first["address"]) == (0, "", f"127.0.0.1:{port}")
    live = ProcessIdentity.of(first["pid"])  # the state records what `kvmesh down` verifies
    assert (first["start_ticks"], first["cmdline"]) == (live.start_ticks, list(live.cmdline))
    assert first["cmdline"][1:5] == ["-m", "kvmesh.services.router", "--host", "127.0.0.1"]
    runner = asyncio.ensure_future(sup.run())
    try:
        os.kill(first["pid"], signal.SIGKILL)
        await asyncio.wait_for(restarted.wait(), timeout=60)  # set once the new process is healthy
        now = states[-1][0]
        assert now["pid"] != first["pid"] and alive(now["pid"])
        assert now["last_exit"].startswith("killed by SIGKILL after")
        assert await _serving(f"127.0.0.1:{port}")
        log = (tmp_path / "logs" / "router.log").read_text()
        assert log.count("listening on") == 2  # the same log, both runs
    finally:
        sup.stopping.set()
        await asyncio.wait_for(runner, timeout=60)
    assert not alive(states[-1][0]["pid"])  # stopping the supervisor stopped the service
    assert sup.services[0].restarts == 1  # and did not restart it


async def test_a_hung_service_is_killed_and_restarted_and_the_state_says_it_hung(tmp_path):
    """SIGSTOP: the process lives, its port accepts connections, nothing answers. Two health
    checks unanswered in a row and the supervisor kills it; the usual restart follows."""
    port = free_port()
    states: list[list[dict]] = []
    restarted = asyncio.Event()

    def save(state: list[dict]) -> None:
        states.append(state)
        if state[0]["restarts"] == 1 and "hung" in state[0]["last_exit"]:
            restarted.set()

    sup = Supervisor([_router(port)], tmp_path, save, ready_timeout_s=60, backoff=Backoff(base_s=0.0),
                     hang=HangWatch(interval_s=0.2, timeout_s=0.5, failures=2))
    await sup.start_all()
    first = states[-1][0]
    runner = asyncio.ensure_future(sup.run())
    try:
        os.kill(first["pid"], signal.SIGSTOP)
        await asyncio.wait_for(restarted.wait(), timeout=60)
        now = states[-1][0]
        assert now["pid"] != first["pid"] and not alive(first["pid"])
        assert now["last_exit"].startswith("killed by SIGKILL after")
        assert "(hung: 2 health checks unanswered, DEADLINE_EXCEEDED; killed by the supervisor)" in now["last_exit"]
        assert await _serving(f"127.0.0.1:{port}")
    finally:
        sup.stopping.set()
        await asyncio.wait_for(runner, timeout=60)
    assert sup.services[0].restarts == 1


async def test_a_service_that_cannot_start_fails_the_start_with_its_log(tmp_path):
    bad = {**_router(free_port()), "args": ["--no-such-flag"]}
    sup = Supervisor([bad], tmp_path, lambda state: None, ready_timeout_s=60)
    with pytest.raises(RuntimeError, match=r"router exited with code [12] during start; see .*router\.log"):
        await sup.start_all()
