"""`kvmesh up` converts a GGUF model the weights cache lacks in its own process (its progress bar
on the terminal), before any service starts; a warm cache converts nothing (a fake converter)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvmesh import launcher
from kvmesh.launcher import StackPlan, convert_models
from kvmesh.model import gguf_loader


@pytest.fixture
def fake_convert(tmp_path, monkeypatch) -> list[Path]:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []

    def convert(path, out_dir, *, progress=True):
        assert progress  # the bar is on (it goes to this process's stderr)
        calls.append(Path(path))
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(gguf_loader, "convert_gguf", convert)
    return calls


def _gguf(tmp_path: Path, name: str, body: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(body)
    return str(path)


def test_a_cold_cache_is_converted_once_with_progress_lines(tmp_path, fake_convert):
    model, draft = _gguf(tmp_path, "m.gguf", b"model"), _gguf(tmp_path, "d.gguf", b"draft")
    lines: list[str] = []
    plan = StackPlan(model=model, draft_model=draft)
    assert convert_models(plan, lines.append) == [model, draft]
    assert fake_convert == [Path(model), Path(draft)]
    assert len(lines) == 4 and "converting m.gguf" in lines[0] and "converted in" in lines[1]
    lines.clear()
    assert convert_models(plan, lines.append) == [] and lines == []  # warm: nothing to do, nothing said
    assert len(fake_convert) == 2


def test_hf_folders_and_ngram_drafts_are_not_converted(tmp_path, fake_convert):
    folder = tmp_path / "hf"
    folder.mkdir()
    assert convert_models(StackPlan(model=str(folder), draft_model="none")) == []
    assert fake_convert == []


def test_up_converts_before_any_process_starts(tmp_path, fake_convert, monkeypatch):
    monkeypatch.setenv("KVMESH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(launcher, "check_model", lambda plan: None)
    model = _gguf(tmp_path, "m.gguf", b"weights")
    started = []

    def popen(*a, **kw):
        started.append(list(fake_convert))
        raise RuntimeError("stop here")

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(RuntimeError, match="stop here"):
        launcher.up(StackPlan(model=model), progress=lambda line: None)
    assert started == [[Path(model)]]  # converted before the supervisor was started
