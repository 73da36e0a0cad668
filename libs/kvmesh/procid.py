"""Which process a recorded pid means: the pid plus the process's start time and command line.

NOTE (why not the pid alone). Pids are reused: once a recorded service has exited, its pid may
belong to any later process, and signalling the pid would SIGTERM a stranger. So whoever starts
a process records its `ProcessIdentity`: the pid, its start time (field 22 of /proc/PID/stat,
clock ticks after boot: exact, where a wall-clock create time can shift by a second) and its
command line. A live pid is the recorded process only when both match; otherwise the record is
STALE: reported, never signalled. `terminate` opens a pidfd before it checks and signals through
it, so a pid reused between the check and the signal still cannot be hit (a pidfd keeps pointing
at the process it was opened on). Where there are no pidfds (Linux before 5.3) it checks again
right before each signal instead.

Records written by an older kvmesh hold only a pid (`start_ticks` None). They cannot be verified:
their process is signalled only if its command line looks like the process the record names
(the caller's `expect`), and the check's note says so.
"""
from __future__ import annotations

import enum
import os
import select
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
_KILL_WAIT_S = 10.0
"""How long `terminate` waits for a SIGKILLed process to be gone."""


class Liveness(enum.Enum):
    """What runs under a recorded pid."""

    RUNNING = "running"
    """The recorded process (verified; or, for an old record, its command line looks right)."""
    EXITED = "exited"
    """No process (or only a zombie) has the pid."""
    STALE = "stale"
    """Another process has the pid: it is never signalled."""


@dataclass(frozen=True)
class ProcessIdentity:
    """A process as recorded when it was started (or as it runs now: `of`)."""

    pid: int
    start_ticks: int | None = None
    """Field 22 of /proc/PID/stat (clock ticks after boot); None in a record from an older kvmesh."""
    cmdline: tuple[str, ...] = ()

    @classmethod
    def of(cls, pid: int) -> ProcessIdentity | None:
        """The live process with `pid`, or None when there is none or only a zombie."""
        stat = _stat_fields(pid)
        if stat is None or stat[0] in ("Z", "X"):
            return None
        try:
            raw = (PROC / str(pid) / "cmdline").read_bytes()
        except OSError:
            return None
        return cls(pid, int(stat[19]), tuple(a.decode("utf-8", "replace") for a in raw.split(b"\0")[:-1]))

    @classmethod
    def started(cls, pid: int, argv: Sequence[str]) -> ProcessIdentity:
        """The record for a child just started with `argv` (read even if it already exited)."""
        stat = _stat_fields(pid)
        return cls(pid, int(stat[19]) if stat else None, tuple(argv))


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on; the command name before it may hold spaces."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


@dataclass(frozen=True)
class Check:
    """What a recorded pid was found to be, with a note for `kvmesh status` and `down`."""

    state: Liveness
    note: str = ""
    """Why it is stale, or that an old record was matched by its command line; '' otherwise."""


def check(recorded: ProcessIdentity, expect: Callable[[tuple[str, ...]], bool]) -> Check:
    """Whether the recorded process still runs under its pid. `expect` judges a live command line
    for a record without a start time (from an older kvmesh)."""
    live = ProcessIdentity.of(recorded.pid)
    if live is None:
        return Check(Liveness.EXITED)
    shown = " ".join(live.cmdline)[:120] or "?"
    if recorded.start_ticks is None:
        if expect(live.cmdline):
            return Check(Liveness.RUNNING, "unverified: an old record without a start time; its command line matches")
        return Check(Liveness.STALE, f"an old record without a start time, and pid {recorded.pid} now runs "
                                     f"another command ({shown}): left alone")
    if live.start_ticks != recorded.start_ticks:
        return Check(Liveness.STALE, f"pid {recorded.pid} was reused: it now runs a process started at another "
                                     f"time ({shown}): left alone")
    if live.cmdline != recorded.cmdline:
        return Check(Liveness.STALE, f"pid {recorded.pid} now runs another command ({shown}): left alone")
    return Check(Liveness.RUNNING)


def terminate(recorded: ProcessIdentity, expect: Callable[[tuple[str, ...]], bool],
              timeout_s: float) -> Check:
    """SIGTERM the recorded process, SIGKILL it if it has not exited after `timeout_s`, and wait
    for its exit (reaping it if it is our child) — only when `check` finds it RUNNING. Returns
    that check: EXITED and STALE records are not signalled."""
    try:
        fd = os.pidfd_open(recorded.pid)
    except ProcessLookupError:
        return Check(Liveness.EXITED)
    except OSError:  # no pidfds (Linux before 5.3, an old container seccomp profile)
        return _terminate_by_pid(recorded, expect, timeout_s)
    try:
        found = check(recorded, expect)  # after the open: a reused pid cannot redirect the signal
        if found.state is Liveness.STALE:
            return found
        if found.state is Liveness.RUNNING:
            for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, _KILL_WAIT_S)):
                try:
                    signal.pidfd_send_signal(fd, sig)
                except ProcessLookupError:
                    break  # it exited on its own
                if select.select([fd], [], [], wait_s)[0]:  # a pidfd is readable once its process exited
                    break
        try:  # a zombie child of ours (a test's start_service) is reaped, as it would be by its parent
            os.waitid(os.P_PIDFD, fd, os.WEXITED | os.WNOHANG)
        except ChildProcessError:
            pass  # not our child: its parent reaps it
        return found
    finally:
        os.close(fd)


def _terminate_by_pid(recorded: ProcessIdentity, expect: Callable[[tuple[str, ...]], bool],
                      timeout_s: float) -> Check:
    """`terminate` without a pidfd: the record is checked again right before each signal, which
    leaves only the instant between that check and the signal open to pid reuse. After a signal
    it waits for the process it signalled (same pid, same start time) to be gone: an exiting
    process shows an empty command line for a moment before it turns zombie, which `check`
    would call stale."""
    found = check(recorded, expect)
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, _KILL_WAIT_S)):
        live = ProcessIdentity.of(recorded.pid)
        if live is None or check(recorded, expect).state is not Liveness.RUNNING:
            break
        os.kill(recorded.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _reap(recorded.pid)
            if not _still_runs(live):
                break
            time.sleep(0.05)  # polling another process's exit: no handle to wait on
    _reap(recorded.pid)
    return found


def _still_runs(signalled: ProcessIdentity) -> bool:
    """Whether the process that was signalled (its pid and start time) is neither gone nor a zombie."""
    now = ProcessIdentity.of(signalled.pid)  # (its command line may already read empty)
    return now is not None and now.start_ticks == signalled.start_ticks


def _reap(pid: int) -> None:
    """Reap `pid` if it is an exited child of ours."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
