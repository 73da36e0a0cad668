"""The native kernels' build folders: one per Python environment, and a build lock left by an
interrupted build does not stall later loads."""
from __future__ import annotations

import fcntl
import sys
import threading
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension

import kvmesh.model.native as native


def test_each_python_environment_builds_in_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    here = native.extension_dir("int f();", "x-")
    assert here == native.extension_dir("int f();", "x-")  # stable within one environment
    assert here.parent == tmp_path / "native" and here.name.startswith("x-")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert native.extension_dir("int f();", "x-") != here
    assert native.extension_dir("int g();", "x-") != native.extension_dir("int f();", "x-")


def fake_load_inline(seen):
    """Stands in for torch's builder: it would wait forever on a lock file left in the folder."""
    def load_inline(name, cpp_sources, build_directory, **_):
        folder = Path(build_directory)
        if (folder / native._TORCH_LOCK).exists():
            raise AssertionError("torch's builder would wait forever on the stale lock")
        held = open(folder / "build.flock")
        with pytest.raises(BlockingIOError):  # the build runs under the exclusive flock
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.close()
        seen.append((name, cpp_sources[0]))
        return "module"
    return load_inline


def test_a_lock_left_by_an_interrupted_build_is_cleared_and_logged(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline(seen))
    folder = native.extension_dir("int f() { return 1; }", "t-")
    folder.mkdir(parents=True)
    (folder / native._TORCH_LOCK).touch()  # what a killed build leaves
    with caplog.at_level("WARNING", logger="kvmesh.model.native"):
        assert native.load_extension("t", "int f() { return 1; }", ["f"], "t-") == "module"
    assert len(seen) == 1 and 'm.def("f"' in seen[0][1]
    assert not (folder / native._TORCH_LOCK).exists()
    assert "interrupted build" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="kvmesh.model.native"):  # a clean folder: nothing to say
        native.load_extension("t", "int f() { return 1; }", ["f"], "t-")
    assert len(seen) == 2 and caplog.text == ""


def test_a_build_in_progress_keeps_its_lock_and_the_next_load_waits_for_it(tmp_path):
    torch_lock = tmp_path / native._TORCH_LOCK
    holding, release, order = threading.Event(), threading.Event(), []

    def builder():
        with native._build_lock(tmp_path):
            torch_lock.touch()  # torch's builder, mid-build
            holding.set()
            release.wait()
            order.append("built")
            torch_lock.unlink()  # and done

    first = threading.Thread(target=builder)
    first.start()
    holding.wait()
    probe = open(tmp_path / "build.flock")
    with pytest.raises(BlockingIOError):  # a second load cannot take the folder now...
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    probe.close()
    assert torch_lock.exists()  # ...nor clear the running build's lock

    def loader():
        with native._build_lock(tmp_path):
            order.append("loaded")

    second = threading.Thread(target=loader)
    second.start()
    release.set()
    first.join()
    second.join()
    assert order == ["built", "loaded"]


def test_without_flock_the_build_runs_under_torchs_lock_alone(monkeypatch, tmp_path, caplog):
    def no_flock(handle, op):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(native.fcntl, "flock", no_flock)
    (tmp_path / native._TORCH_LOCK).touch()  # may be a running build's: cannot tell, so kept
    ran = []
    with caplog.at_level("WARNING", logger="kvmesh.model.native"):
        with native._build_lock(tmp_path):
            ran.append(True)
    assert ran == [True] and (tmp_path / native._TORCH_LOCK).exists()
    assert "no flock" in caplog.text and "not cleared" in caplog.text
