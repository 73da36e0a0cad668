"""Automatic thread counts (kvmesh.threads.usable_cores): the affinity set capped by the cgroup
CPU quota rounded up, read from fake cgroup v2 and v1 trees under tmp_path."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.threads import quota_cores, usable_cores


@pytest.fixture
def cores8(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)))


def _tree(root: Path, files: dict[str, str], self_cgroup: str = "0::/\n") -> dict[str, Path]:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "self-cgroup").write_text(self_cgroup)
    return {"cgroup_root": root / "fs", "self_cgroup": root / "self-cgroup"}


@pytest.mark.parametrize("cpu_max, cores", [
    ("200000 100000\n", 2),   # docker `cpus: 2`
    ("150000 100000\n", 2),   # 1.5 CPUs: rounded up
    ("50000 100000\n", 1),    # half a CPU: at least 1
    ("max 100000\n", 8),      # no quota: the affinity set
    ("1600000 100000\n", 8),  # a quota above the affinity set: the affinity set
])
def test_cgroup_v2_cpu_max(tmp_path, cores8, cpu_max, cores):
    assert usable_cores(**_tree(tmp_path, {"fs/cpu.max": cpu_max})) == cores


def test_cgroup_v2_quota_is_read_along_the_process_cgroup_and_the_smallest_wins(tmp_path, cores8):
    paths = _tree(tmp_path, {"fs/cpu.max": "max 100000", "fs/kvmesh.slice/cpu.max": "300000 100000",
                             "fs/kvmesh.slice/engine.scope/cpu.max": "max 100000"},
                  self_cgroup="0::/kvmesh.slice/engine.scope\n")
    assert quota_cores(**paths) == 3
    assert usable_cores(**paths) == 3


def test_a_container_reads_its_own_root_when_the_host_path_is_not_there(tmp_path, cores8):
    paths = _tree(tmp_path, {"fs/cpu.max": "250000 100000"}, self_cgroup="0::/system.slice/docker-1a2b.scope\n")
    assert usable_cores(**paths) == 3


@pytest.mark.parametrize("quota, period, cores", [
    ("200000", "100000", 2),
    ("150000", "100000", 2),  # fractional: rounded up
    ("-1", "100000", 8),      # no quota
])
def test_cgroup_v1_cfs_quota(tmp_path, cores8, quota, period, cores):
    paths = _tree(tmp_path, {"fs/cpu,cpuacct/cpu.cfs_quota_us": quota, "fs/cpu,cpuacct/cpu.cfs_period_us": period,
                             "fs/unified/cgroup.controllers": ""},  # hybrid: v2 mounted, without cpu
                  self_cgroup="2:cpu,cpuacct:/\n0::/\n")
    assert usable_cores(**paths) == cores


def test_cgroup_v1_uses_the_cpu_controller_path(tmp_path, cores8):
    paths = _tree(tmp_path, {"fs/cpu/cpu.cfs_quota_us": "-1", "fs/cpu/cpu.cfs_period_us": "100000",
                             "fs/cpu/batch/cpu.cfs_quota_us": "100000", "fs/cpu/batch/cpu.cfs_period_us": "100000"},
                  self_cgroup="4:memory:/batch\n3:cpu,cpuacct:/batch\n")
    assert usable_cores(**paths) == 1


def test_v2_wins_over_v1_when_both_have_files(tmp_path, cores8):
    paths = _tree(tmp_path, {"fs/cpu.max": "max 100000", "fs/cpu/cpu.cfs_quota_us": "100000",
                             "fs/cpu/cpu.cfs_period_us": "100000"})
    assert quota_cores(**paths) is None


def test_missing_or_unreadable_files_mean_no_quota(tmp_path, cores8):
    assert usable_cores(cgroup_root=tmp_path / "none", self_cgroup=tmp_path / "none-either") == 8
    paths = _tree(tmp_path, {"fs/cpu.max": "garbage"})
    assert usable_cores(**paths) == 8
    paths = _tree(tmp_path / "v1", {"fs/cpu/cpu.cfs_quota_us": "100000"})  # no period file
    assert usable_cores(**paths) == 8


def test_a_small_affinity_set_wins_over_a_larger_quota(tmp_path, monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
    assert usable_cores(**_tree(tmp_path, {"fs/cpu.max": "400000 100000"})) == 1
