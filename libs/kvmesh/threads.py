"""The one place that sizes torch's intra-op thread pool. Importing it does not import torch (the
router and the gateway never load torch).

NOTE (why one place). On a small shared CPU, torch running more threads than there are cores
slows it 10-50x, and "every core" must mean the cores this process may actually use, not the
machine's: its affinity mask (as `taskset` or docker's `cpuset` sets it) and its CPU quota (as
docker's `cpus:` or systemd's `CPUQuota=` sets it: cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`).
A quota of 1.5 CPUs on an 8-core machine is 2 threads, not 8. `usable_cores` applies that rule,
and every automatic thread count (`--threads 0`, the launcher's split between engines, the
benchmarks) comes from it. `set_torch_threads` applies it to torch; `torch_threads` holds a
count for a block (a helper that must not compete with the engine's step loop) and restores the
caller's afterwards.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")


def usable_cores(*, cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int:
    """The cores this process may use: its affinity set, capped by its CPU quota rounded up
    (`quota_cores`); at least 1. The paths are parameters so tests can point them at fake files."""
    cores = len(os.sched_getaffinity(0))
    quota = quota_cores(cgroup_root=cgroup_root, self_cgroup=self_cgroup)
    return max(1, cores if quota is None else min(cores, quota))


def quota_cores(*, cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> int | None:
    """The CPU quota of this process's cgroup as whole cores (quota / period rounded up: 1.5 CPUs
    is 2), or None when no quota limits it. cgroup v2 (`cpu.max`: "150000 100000", or "max
    100000" for none) when any `cpu.max` is there, else v1 (`cpu.cfs_quota_us` over
    `cpu.cfs_period_us`, -1 for none). A parent cgroup's quota limits its children too, so the
    process's cgroup and every one above it up to `cgroup_root` count, and the smallest wins
    (in a container the root is usually the container's own cgroup)."""
    v2_path, v1_path = _own_cgroups(self_cgroup)
    v2 = [f for d in _up_to(cgroup_root, v2_path) if (f := d / "cpu.max").is_file()]
    if v2:
        limits = [_ratio(*fields) if len(fields := _read(f).split()) == 2 else None for f in v2]
    else:
        v1_root = next((d for d in (cgroup_root / "cpu", cgroup_root / "cpu,cpuacct") if d.is_dir()), None)
        if v1_root is None:
            return None
        limits = [_ratio(_read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us"))
                  for d in _up_to(v1_root, v1_path)]
    found = [n for n in limits if n is not None]
    return min(found) if found else None


def _own_cgroups(self_cgroup: Path) -> tuple[str, str]:
    """This process's cgroup v2 path and v1 `cpu` controller path ('/' when not listed)."""
    v2 = v1 = "/"
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


def _up_to(root: Path, path: str) -> list[Path]:
    """`root/path` and each folder above it up to `root`, those that exist. In a container the
    path names the cgroup as the host sees it, which is not there: the root alone is read."""
    parts = [p for p in path.split("/") if p and p != ".."]
    dirs = [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _ratio(quota: str, period: str) -> int | None:
    """ceil(quota / period) in whole cores; None for no quota ("max", -1) or unreadable values."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    if q <= 0 or p <= 0:
        return None
    return -(-q // p)


def set_torch_threads(n: int) -> int:
    """Size torch's intra-op pool to `n` threads (0: `usable_cores()`); returns the count set.
    It also sizes the calling thread's OpenMP team: call it on the thread that runs the work."""
    import torch

    count = n or usable_cores()
    torch.set_num_threads(count)
    return count


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with `n` torch threads (0: `usable_cores()`), then restore the count the
    thread had."""
    import torch

    before = torch.get_num_threads()
    try:
        yield set_torch_threads(n)
    finally:
        torch.set_num_threads(before)


def lower_thread_priority() -> str:
    """Moves the calling thread to Linux's idle scheduling class (SCHED_IDLE): it then runs only
    on a core that no other thread of the machine wants, so background work (the engine's KV
    exports) never takes a core from the step loop's OpenMP team, whose every step waits for its
    slowest thread. Falls back to nice 19 (a small share of a busy core), else leaves the thread
    as it is. Returns what it applied: "idle", "nice" or "unchanged". Per thread only: never
    call it on a thread that runs the step loop or a request's path."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread (Linux)
        return "idle"
    except (AttributeError, OSError):
        pass
    if sys.platform.startswith("linux"):  # elsewhere setpriority on this id could renice the process
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            return "nice"
        except OSError:
            pass
    return "unchanged"


def parse_cpu_list(text: str) -> set[int]:
    """A CPU list as taskset and cgroups write it ("0", "0-3,8") -> the CPU numbers; ValueError
    naming what is wrong."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        first, dash, last = part.partition("-")
        try:
            lo, hi = int(first), int(last if dash else first)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not N or N-M; write e.g. 0 or 0-3,8") from None
        if lo < 0 or hi < lo:
            raise ValueError(f"CPU list {text!r}: {part!r} is not an ascending range of CPU numbers")
        cpus.update(range(lo, hi + 1))
    return cpus
