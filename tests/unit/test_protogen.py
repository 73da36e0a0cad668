"""kvmesh.protogen: generation into a tree, and --check naming what is stale, missing, orphaned."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh import protogen

REPO = Path(__file__).resolve().parents[2]
ENGINE_STUB = Path("kvmesh/engine/v1/engine_pb2.py")


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of protos/ and a freshly generated output dir for it."""
    protos, out = tmp_path / "protos", tmp_path / "out"
    shutil.copytree(REPO / "protos", protos)
    assert protogen.main(["--protos", str(protos), "--out", str(out)]) == 0
    return protos, out


def check(protos: Path, out: Path) -> int:
    return protogen.main(["--check", "--protos", str(protos), "--out", str(out)])


def test_repo_stubs_are_up_to_date() -> None:
    result = subprocess.run([sys.executable, "-m", "kvmesh.protogen", "--check"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "up to date" in result.stdout


def test_generation_writes_importable_layout_and_is_idempotent(tree: tuple[Path, Path]) -> None:
    protos, out = tree
    assert (out / ENGINE_STUB).is_file()
    assert (out / "kvmesh/engine/v1/engine_pb2_grpc.py").is_file()
    assert (out / "kvmesh/common/v1/common_pb2.pyi").is_file()
    assert check(protos, out) == 0
    mtime = (out / ENGINE_STUB).stat().st_mtime_ns
    again = protogen.generate(protos, out)
    assert again.clean
    assert (out / ENGINE_STUB).stat().st_mtime_ns == mtime


def test_check_names_the_stub_of_a_changed_proto(tree: tuple[Path, Path],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    protos, out = tree
    proto = protos / "kvmesh/engine/v1/engine.proto"
    proto.write_text(proto.read_text() + "\nmessage AddedForTest {\n  uint32 x = 1;\n}\n")
    assert check(protos, out) == 1
    err = capsys.readouterr().err
    assert f"stale: {out / ENGINE_STUB}" in err
    assert "common_pb2" not in err
    assert "python -m kvmesh.protogen" in err
    assert protogen.main(["--protos", str(protos), "--out", str(out)]) == 0
    assert check(protos, out) == 0


def test_check_names_missing_and_orphaned_stubs(tree: tuple[Path, Path],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    protos, out = tree
    (out / "kvmesh/gone/v1").mkdir(parents=True)
    shutil.copy(out / ENGINE_STUB, out / "kvmesh/gone/v1/gone_pb2.py")
    (out / ENGINE_STUB).unlink()
    assert check(protos, out) == 1
    err = capsys.readouterr().err
    assert f"missing: {out / ENGINE_STUB}" in err
    assert f"orphaned: {out / 'kvmesh/gone/v1/gone_pb2.py'}" in err
    diff = protogen.generate(protos, out)
    assert str(ENGINE_STUB) in diff.missing
    assert not (out / "kvmesh/gone/v1/gone_pb2.py").exists()
    assert check(protos, out) == 0


def test_a_broken_proto_fails_with_status_2(tree: tuple[Path, Path]) -> None:
    protos, out = tree
    (protos / "kvmesh/engine/v1/engine.proto").write_text("syntax = \"proto3\";\nmessage {")
    assert check(protos, out) == 2
