"""`kvmesh down` and `kvmesh status` know a recorded process by pid, start time and command line
(kvmesh.procid): a pid file whose pid now belongs to an unrelated live process is stale, said so,
and that process is never signalled; a process that matches its record is stopped."""
from __future__ import annotations

import errno
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh import launcher
from kvmesh.cli import main
from kvmesh.procid import Liveness, ProcessIdentity

ENGINE_ARGV = [sys.executable, "-m", "kvmesh.services.engine", "--host", "127.0.0.1", "--port", "50061"]


@pytest.fixture
def data(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("KVMESH_DATA_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(params=["pidfd", "no pidfd"])
def kernel(request, monkeypatch) -> None:
    """Signals go through a pidfd; without one (Linux before 5.3) by pid, each after a fresh check."""
    if request.param == "no pidfd":
        def no_pidfd(pid: int, flags: int = 0) -> int:
            raise OSError(errno.ENOSYS, "pidfd_open")
        monkeypatch.setattr("os.pidfd_open", no_pidfd)


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen]:
    """An unrelated live process (`sleep 300`) with SIGTERM blocked: a SIGTERM sent to it stays
    pending where the test can see it, instead of racing the test's liveness check."""
    proc = subprocess.Popen(["sleep", "300"],
                            preexec_fn=lambda: signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}))
    try:
        _exec_done(proc, ["sleep", "300"])
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _exec_done(proc: subprocess.Popen, argv: list[str], timeout_s: float = 10.0) -> None:
    """Wait until the child shows its command line: Popen returns once exec has begun, and the
    kernel sets the new command line a moment later."""
    deadline = time.monotonic() + timeout_s
    while (live := ProcessIdentity.of(proc.pid)) is None or live.cmdline != tuple(argv):
        assert time.monotonic() < deadline, f"{argv} did not start"


def _pending_sigterm(pid: int) -> bool:
    """Whether a SIGTERM waits, blocked, in the process (/proc/PID/status SigPnd and ShdPnd)."""
    fields = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                  if ":\t" in line)
    pending = int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def _record(data: Path, pid: int, service: dict, supervisor: dict | None) -> None:
    """stack.json with one engine entry, and supervisor.json unless `supervisor` is None."""
    entry = {"name": "engine", "pid": pid, "address": "127.0.0.1:50061", "log": str(data / "engine.log"),
             **service}
    launcher.write_json_atomic(data / "stack.json", [entry])
    if supervisor is not None:
        launcher.write_json_atomic(data / "supervisor.json", {"pid": pid, "log": str(data / "supervisor.log"),
                                                              **supervisor})


def _reused(pid: int) -> tuple[dict, dict]:
    """Records of processes that had `pid` before it was reused: another start time."""
    ticks = ProcessIdentity.of(pid).start_ticks - 1
    return ({"start_ticks": ticks, "cmdline": ENGINE_ARGV},
            {"start_ticks": ticks, "cmdline": [sys.executable, "-m", "kvmesh.supervisor", "plan.json"]})


def _old(pid: int) -> tuple[dict, dict]:
    """Records written by an older kvmesh: the pid alone."""
    return {}, {}


@pytest.mark.parametrize("records, why", [(_reused, "was reused"), (_old, "an old record without a start time")])
def test_down_leaves_a_live_unrelated_process_under_a_stale_pid_alone(data, kernel, stranger, capsys, records,
                                                                       why):
    _record(data, stranger.pid, *records(stranger.pid))

    assert main(["status"]) == 1
    out = capsys.readouterr().out
    assert f"engine       pid {stranger.pid:<7d} 127.0.0.1:50061        STALE" in out
    assert "supervisor   NOT RUNNING" in out
    assert out.count(why) == 2 and out.count("left alone") == 2

    assert main(["down"]) == 0
    out = capsys.readouterr().out
    assert stranger.poll() is None and not _pending_sigterm(stranger.pid)  # never signalled
    assert "stopped: nothing was running" in out
    assert "engine: stale: " in out and "supervisor: stale: " in out and out.count(why) == 2
    assert not (data / "stack.json").exists() and not (data / "supervisor.json").exists()


def test_down_stops_a_process_that_matches_its_record(data, kernel, capsys):
    argv = ["sleep", "300"]
    proc = subprocess.Popen(argv)
    try:
        record = ProcessIdentity.started(proc.pid, argv)  # as `up` and the supervisor record it
        _exec_done(proc, argv)
        _record(data, proc.pid, {"start_ticks": record.start_ticks, "cmdline": argv}, None)
        assert launcher.load_state()[0].check().state is Liveness.RUNNING

        assert main(["down"]) == 0
        assert capsys.readouterr().out == "stopped: engine\n"
        assert ProcessIdentity.of(proc.pid) is None  # `down` returned after the exit (and reaped its child)
    finally:
        proc.kill()
        proc.wait()


def test_an_old_record_matches_only_the_kvmesh_service_on_its_port():
    svc = launcher.ServiceProc("engine", 1, "127.0.0.1:50061", "engine.log")
    assert svc.looks_like(tuple(ENGINE_ARGV))
    assert svc.looks_like(("/venv/bin/python", "-m", "kvmesh.services.router", "--port", "50061", "--tiers", "x"))
    assert not svc.looks_like(("/venv/bin/python", "-m", "kvmesh.services.engine", "--port", "50062"))
    assert not svc.looks_like(("sleep", "300"))
    assert not svc.looks_like(("python", "-c", "kvmesh.services.engine --port 50061"))


def test_status_and_down_read_state_without_the_new_fields(data):
    launcher.write_json_atomic(data / "stack.json", [{"name": "router", "pid": 1, "address": "127.0.0.1:50081",
                                                      "log": "router.log", "url": "", "restarts": 0,
                                                      "last_exit": ""}])
    (svc,) = launcher.load_state()
    assert svc.identity == ProcessIdentity(1)  # pid 1 is init: not a kvmesh service
    assert svc.check().state is Liveness.STALE


def test_up_records_and_down_stops_a_real_stack_of_one_router(data, monkeypatch, capsys):
    """`up` through the supervisor with a one-service plan (a router starts in about a second):
    both records carry start time and command line, `status` verifies them, `down` stops both."""
    spec = launcher.ServiceSpec("router", "kvmesh.services.router", ("--tiers", "m=127.0.0.1:1@1.0"),
                                launcher.free_port(), (("OMP_NUM_THREADS", "1"),))
    monkeypatch.setattr(launcher, "stack_services", lambda plan, data: [spec])
    monkeypatch.setattr(launcher, "check_model", lambda plan: None)
    try:
        (router,) = launcher.up(ready_timeout_s=120)
        sup = launcher.supervisor_identity()
        assert router.cmdline[1:3] == ("-m", "kvmesh.services.router") and router.start_ticks is not None
        assert sup.cmdline[1:3] == ("-m", "kvmesh.supervisor") and sup.start_ticks is not None

        assert main(["status"]) == 0
        out = capsys.readouterr().out
        assert f"supervisor   pid {sup.pid:<7d}" in out and "SERVING" in out and "stale" not in out
    finally:
        found = launcher.down(timeout_s=60)
    assert {name: c.state for name, c in found.items()} == {"router": Liveness.RUNNING,
                                                            "supervisor": Liveness.RUNNING}
    assert ProcessIdentity.of(sup.pid) is None  # `down` returns once the supervisor has exited,
    assert ProcessIdentity.of(router.pid) is None  # and the supervisor once it stopped the router


def test_the_same_start_time_with_another_command_line_is_stale(stranger):
    live = ProcessIdentity.of(stranger.pid)
    svc = launcher.ServiceProc("engine", stranger.pid, "127.0.0.1:50061", "engine.log", start_ticks=live.start_ticks,
                               cmdline=tuple(ENGINE_ARGV))
    found = svc.check()
    assert found.state is Liveness.STALE and "now runs another command (sleep 300)" in found.note
    assert launcher.stop_service(svc, timeout_s=1).state is Liveness.STALE
    assert stranger.poll() is None and not _pending_sigterm(stranger.pid)


def test_without_a_pidfd_down_waits_through_an_exit_in_progress(tmp_path, monkeypatch):
    """An exiting process shows an empty command line before it turns zombie: the wait after
    SIGTERM goes on until it is a zombie, instead of taking the empty line for another command."""
    from kvmesh import procid
    argv = ("sleep", "300")
    entry = tmp_path / "4242"
    entry.mkdir()

    def show(state: str, cmdline: tuple[str, ...]) -> None:
        (entry / "stat").write_text(f"4242 (sleep) {state} " + " ".join(["0"] * 18) + " 777 0\n")
        (entry / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in cmdline))

    sent, sleeps = [], []

    def kill(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        show("R", ())  # exit has begun: the memory (and command line) is gone, not yet a zombie

    def sleep(_s: float) -> None:
        sleeps.append(_s)
        show("Z", ())

    show("S", argv)
    monkeypatch.setattr(procid, "PROC", tmp_path)

    def no_pidfd(pid: int, flags: int = 0) -> int:
        raise OSError(errno.ENOSYS, "pidfd_open")

    monkeypatch.setattr(procid.os, "pidfd_open", no_pidfd)
    monkeypatch.setattr(procid.os, "kill", kill)
    monkeypatch.setattr(procid.time, "sleep", sleep)
    monkeypatch.setattr(procid, "_reap", lambda pid: None)
    record = ProcessIdentity(4242, 777, argv)
    assert ProcessIdentity.of(4242) == record

    found = procid.terminate(record, lambda cmdline: False, timeout_s=5.0)

    assert found.state is Liveness.RUNNING
    assert sent == [(4242, signal.SIGTERM)]  # it exited on SIGTERM: no SIGKILL
    assert len(sleeps) == 1 and ProcessIdentity.of(4242) is None  # waited until it was a zombie
