"""The local stack's supervisor: starts the services `kvmesh up` plans, restarts one that exits
while the stack is up, with back-off, and logs why; `kvmesh down` stops it and it stops them.

    python -m kvmesh.supervisor PLAN.json     # started detached by kvmesh.launcher.up

PLAN.json holds the ServiceSpecs (kvmesh.launcher.stack_services) in start order. The
supervisor starts each and waits until its gRPC health says SERVING, then writes the stack's
state (kvmesh.launcher's stack.json: pid, start time and command line, address, log,
restarts, last exit of each service) and its answer on stdout, which `up` reads and shows: a line
``healthy <name> <address> <seconds>`` as each service reports SERVING, then ``ready``, or, when
one fails to start, ``log <line>`` for each of the last lines that service wrote in this run
(its own error message) and ``failed: <why>``. From then on it awaits every child's exit. A service that exits (a
crash, the OOM killer, a stray SIGKILL) is started again on the same port after a delay
(`Backoff`: 1 s doubling to 30 s, back to 1 s once a run lasted 60 s), and its exit, the tail
of its log and the restart go to the supervisor's log and the state, which `kvmesh status`
shows. A service that is up but hung (a stopped process, a deadlock: its health check goes
unanswered `HangWatch.failures` times in a row, `interval_s` apart) is killed with SIGKILL and
so restarted the same way; its last exit says it hung. SIGTERM (from `down`) stops the
services in reverse start order (each gets SIGTERM, a drain, then SIGKILL) and then the
supervisor. Every signal goes through the child's own process handle, never a pid read back.

Clients of a restarted service see it as unreachable for a while: the router routes around a
dead engine replica, the gateway retries idempotent router calls (kvmesh.services.gateway), and
the engines fall back to recompute without the KV or draft service.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.procid import Liveness, ProcessIdentity, check

log = logging.getLogger("kvmesh.supervisor")


@dataclass
class Backoff:
    """Delay before restart number n of a service: base, doubling, at most `cap_s`; a run that
    lasted `stable_s` resets it (a service that crashes once a day restarts at once)."""

    base_s: float = 1.0
    cap_s: float = 30.0
    stable_s: float = 60.0
    failures: int = 0

    def next_delay(self, ran_s: float) -> float:
        if ran_s >= self.stable_s:
            self.failures = 0
        delay = min(self.cap_s, self.base_s * (2 ** self.failures))
        self.failures += 1
        return delay


def exit_reason(returncode: int) -> str:
    """'killed by SIGKILL' or 'exited with code 1' for an asyncio/subprocess return code."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


def log_tail(path: str, lines: int = 5, max_bytes: int = 8192, start: int = 0) -> str:
    """The last lines of a service's log (what it said before it died), from byte `start` on
    (where this run of it began writing)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(start, f.tell() - max_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True)
class HangWatch:
    """How a running service is checked for a hang: a health Check every `interval_s` with a
    `timeout_s` deadline; `failures` unanswered in a row (late or unreachable while the process
    lives) mean hung. Health is answered by the service's event loop, never behind its work (an
    engine's steps run on their own thread), so a busy service still answers."""

    interval_s: float = 5.0
    timeout_s: float = 5.0
    failures: int = 3


@dataclass
class _Service:
    spec: dict  # a ServiceSpec as JSON (name, module, args, port, env, http_port, metrics_port)
    log_path: str
    proc: asyncio.subprocess.Process | None = None
    identity: ProcessIdentity | None = None
    """The running process as recorded in the state (pid, start time, command line)."""
    started: float = 0.0
    restarts: int = 0
    last_exit: str = ""
    backoff: Backoff = field(default_factory=Backoff)
    hung: str = ""
    """Why the hang watch killed the running process ("" if it did not)."""
    up: bool = False
    """The running process reported SERVING since it started (only then is it watched for hangs)."""
    log_start: int = 0
    """Size of the log when the running process started: what it wrote begins there."""

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.spec['port']}"


class StartFailed(RuntimeError):
    """A service did not come up at start; `tail` is what it wrote to its log in that run."""

    def __init__(self, message: str, tail: str) -> None:
        super().__init__(message)
        self.tail = tail


class Supervisor:
    """Runs the services of one plan (see the module docstring). `clock` is injectable for tests;
    `ready_timeout_s` bounds each (re)start's wait for health."""

    def __init__(self, specs: list[dict], data: Path, state: Callable[[list[dict]], None],
                 ready_timeout_s: float = 300.0, clock: Callable[[], float] = time.monotonic,
                 backoff: Backoff = Backoff(), hang: HangWatch | None = HangWatch()) -> None:
        logs = data / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.services = [_Service(s, str(logs / f"{s['name']}.log"), backoff=replace(backoff)) for s in specs]
        self.save_state = state
        self.ready_timeout_s = ready_timeout_s
        self.clock = clock
        self.hang = hang
        self.stopping = asyncio.Event()

    def state(self) -> list[dict]:
        out = []
        for s in self.services:
            http = s.spec.get("http_port")
            ident = s.identity or ProcessIdentity(0)
            metrics = s.spec.get("metrics_port") or http
            out.append({"name": s.spec["name"], "pid": ident.pid, "start_ticks": ident.start_ticks,
                        "cmdline": list(ident.cmdline), "address": s.address, "log": s.log_path,
                        "url": f"http://127.0.0.1:{http}/v1" if http else "", "restarts": s.restarts,
                        "last_exit": s.last_exit,
                        "metrics": f"http://127.0.0.1:{metrics}/metrics" if metrics else ""})
        return out

    async def _spawn(self, s: _Service) -> None:
        spec = s.spec
        argv = [sys.executable, "-m", spec["module"], "--host", "127.0.0.1", "--port", str(spec["port"]),
                *spec["args"]]
        with open(s.log_path, "ab") as out:
            s.log_start = out.seek(0, os.SEEK_END)
            s.proc = await asyncio.create_subprocess_exec(
                *argv, stdout=out, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                env={**os.environ, **dict(spec.get("env", ()))}, start_new_session=True)
        s.identity = ProcessIdentity.started(s.proc.pid, argv)
        s.started = self.clock()

    async def _healthy(self, s: _Service) -> None:
        """Waits until `s` reports SERVING; raises RuntimeError if it exits or times out first."""
        assert s.proc is not None
        exited = asyncio.ensure_future(s.proc.wait())
        ready = asyncio.ensure_future(_wait_serving(s.address, self.ready_timeout_s))
        try:
            done, _ = await asyncio.wait({exited, ready}, return_when=asyncio.FIRST_COMPLETED)
            if ready in done and ready.result():
                return
            if exited in done:
                raise RuntimeError(f"{s.spec['name']} {exit_reason(exited.result())} during start; see {s.log_path}")
            raise RuntimeError(f"{s.spec['name']} not ready after {self.ready_timeout_s:.0f}s; see {s.log_path}")
        finally:
            ready.cancel()
            if not exited.done():
                exited.cancel()

    async def start_all(self, progress: Callable[[str], None] = lambda line: None) -> None:
        """Starts every service in order, each once the one before is healthy; `progress` gets a
        ``healthy`` line for each. StartFailed (with the service's log tail) when one does not
        come up."""
        for s in self.services:
            begun = self.clock()
            await self._spawn(s)
            try:
                await self._healthy(s)
            except RuntimeError as err:
                raise StartFailed(str(err), log_tail(s.log_path, lines=10, start=s.log_start)) from None
            s.up = True
            log.info("%s started (pid %d, %s)", s.spec["name"], s.proc.pid, s.address)
            progress(f"healthy {s.spec['name']} {s.address} {self.clock() - begun:.1f}")
        self.save_state(self.state())

    async def _watch(self, s: _Service) -> None:
        while not self.stopping.is_set():
            assert s.proc is not None
            code = await s.proc.wait()
            s.up = False
            if self.stopping.is_set():
                return
            ran = self.clock() - s.started
            s.last_exit = f"{exit_reason(code)} after {ran:.0f}s{s.hung}"
            s.hung = ""
            delay = s.backoff.next_delay(ran)
            log.warning("%s (pid %d) %s; restarting in %.0fs. Its log ends:\n%s", s.spec["name"], s.proc.pid,
                        s.last_exit, delay, log_tail(s.log_path))
            self.save_state(self.state())
            try:
                await asyncio.wait_for(self.stopping.wait(), timeout=delay)
                return  # stopped during the back-off
            except asyncio.TimeoutError:
                pass
            s.restarts += 1
            await self._spawn(s)
            try:
                await self._healthy(s)
                s.up = True
                log.info("%s restarted (pid %d, restart %d)", s.spec["name"], s.proc.pid, s.restarts)
            except RuntimeError as err:
                log.warning("%s", err)  # its exit is handled by the next turn of this loop
                if s.proc.returncode is None:  # up but not serving in time: stop it, and retry
                    s.proc.kill()
            self.save_state(self.state())

    async def _watch_hangs(self, s: _Service) -> None:
        """Kills `s` when it stops answering health checks (see HangWatch); `_watch` restarts it."""
        hang = self.hang
        missed = 0
        async with grpc.aio.insecure_channel(s.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not self.stopping.is_set():
                try:
                    await asyncio.wait_for(self.stopping.wait(), timeout=hang.interval_s)
                    return
                except asyncio.TimeoutError:
                    pass
                proc = s.proc
                if proc is None or proc.returncode is not None or not s.up:
                    missed = 0
                    continue
                try:
                    await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=hang.timeout_s)
                    missed = 0
                except grpc.aio.AioRpcError as err:
                    missed += 1
                    if missed < hang.failures or proc is not s.proc or proc.returncode is not None:
                        continue
                    if s.identity is None or check(s.identity, lambda _: False).state is not Liveness.RUNNING:
                        continue  # exited (and its pid perhaps reused) before `_watch` saw it: never kill by pid
                    s.hung = (f" (hung: {missed} health checks unanswered, {err.code().name}; killed by the "
                              "supervisor)")
                    log.warning("%s (pid %d) did not answer %d health checks in a row; killing it",
                                s.spec["name"], proc.pid, missed)
                    proc.kill()
                    missed = 0

    async def run(self) -> None:
        """Watches every service until `stopping` is set, then stops them all."""
        watchers = [asyncio.ensure_future(self._watch(s)) for s in self.services]
        if self.hang is not None:
            watchers += [asyncio.ensure_future(self._watch_hangs(s)) for s in self.services]
        await self.stopping.wait()
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await self.stop_all()

    async def stop_all(self, grace_s: float = 20.0) -> None:
        for s in reversed(self.services):
            p = s.proc
            if p is None or p.returncode is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(p.wait(), timeout=grace_s)
            except asyncio.TimeoutError:
                p.kill()
                await p.wait()
            log.info("%s stopped (%s)", s.spec["name"], exit_reason(p.returncode))


async def _wait_serving(address: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    async with grpc.aio.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            try:
                # wait_for_ready blocks on the channel until the server listens (no sleep loop)
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=""),
                                        timeout=min(left, 5.0), wait_for_ready=True)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError as err:
                if err.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    raise


async def main_async(plan_path: Path, data: Path, state_path: Path) -> int:
    from kvmesh.launcher import write_json_atomic

    specs = json.loads(plan_path.read_text())
    sup = Supervisor(specs, data, lambda st: write_json_atomic(state_path, st))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, sup.stopping.set)
    try:
        await sup.start_all(progress=_say)
    except StartFailed as err:
        log.error("start failed: %s", err)
        await sup.stop_all(grace_s=5.0)
        for line in err.tail.splitlines():
            _say(f"log {line}")
        _tell(f"failed: {err}")
        return 1
    _tell("ready")
    await sup.run()
    state_path.unlink(missing_ok=True)
    log.info("stack stopped")
    return 0


def _say(line: str) -> None:
    """One line of the start's progress for `up` (see the module docstring)."""
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError:
        pass  # `up` went away: nobody to tell


def _tell(line: str) -> None:
    """The last line `up` waits for, then stdout is closed (the supervisor outlives `up`)."""
    _say(line)
    try:
        os.close(sys.stdout.fileno())
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    from kvmesh.launcher import data_dir

    ap = argparse.ArgumentParser(prog="python -m kvmesh.supervisor", description=__doc__.split("\n\n")[0])
    ap.add_argument("plan", type=Path, help="the ServiceSpecs to run, as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    data = data_dir()
    return asyncio.run(main_async(args.plan, data, data / "stack.json"))


if __name__ == "__main__":
    sys.exit(main())
