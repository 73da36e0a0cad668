"""Generate the Python gRPC stubs from protos/ into libs/ (they are not committed).

    python -m kvmesh.protogen            # (re)generate; rewrites only files whose bytes changed
    python -m kvmesh.protogen --check    # exit 1 naming stale, missing or orphaned stubs

`protos/kvmesh/<service>/v1/<service>.proto` becomes `libs/kvmesh/<service>/v1/<service>_pb2.py`
(+ `.pyi` and `_pb2_grpc.py`), importable as `kvmesh.<service>.v1.<service>_pb2`. Both modes
compile every proto into a temporary directory with `grpc_tools.protoc` and compare bytes with
the output tree, so the answer never depends on file times.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROTOS = REPO_ROOT / "protos"
DEFAULT_OUT = REPO_ROOT / "libs"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class ProtocError(RuntimeError):
    """protoc rejected a proto file (its own diagnostics went to stderr)."""


@dataclass(frozen=True)
class Diff:
    """How an output tree differs from a fresh generation (paths relative to the output dir)."""

    stale: tuple[str, ...]
    missing: tuple[str, ...]
    orphaned: tuple[str, ...]

    @property
    def clean(self) -> bool:
        return not (self.stale or self.missing or self.orphaned)


def _well_known_protos() -> Path:
    return Path(str(importlib.resources.files("grpc_tools") / "_proto"))


def _compile(protos: Path, out: Path) -> None:
    sources = sorted(p.relative_to(protos).as_posix() for p in protos.rglob("*.proto"))
    if not sources:
        raise ProtocError(f"no .proto files under {protos}")
    args = [
        "grpc_tools.protoc",
        f"-I{protos}",
        f"-I{_well_known_protos()}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise ProtocError(f"protoc failed on the protos under {protos} (see the errors above)")


def _generated_files(root: Path) -> set[str]:
    if not root.is_dir():
        return set()
    return {
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file() and p.name.endswith(GENERATED_SUFFIXES)
    }


def _diff(fresh: Path, out: Path) -> Diff:
    want, have = _generated_files(fresh), _generated_files(out)
    stale = sorted(
        f for f in want & have if not filecmp.cmp(fresh / f, out / f, shallow=False)
    )
    return Diff(tuple(stale), tuple(sorted(want - have)), tuple(sorted(have - want)))


def check(protos: Path = DEFAULT_PROTOS, out: Path = DEFAULT_OUT) -> Diff:
    """Compare `out` with a fresh generation from `protos`; writes nothing under `out`."""
    with tempfile.TemporaryDirectory(prefix="kvmesh-protogen-") as tmp:
        _compile(protos, Path(tmp))
        return _diff(Path(tmp), out)


def generate(protos: Path = DEFAULT_PROTOS, out: Path = DEFAULT_OUT) -> Diff:
    """Bring `out` up to date: write stale and missing stubs, delete orphaned ones.

    Each file is replaced atomically, and unchanged files are left untouched (no rewrite, no
    bytecode invalidation), so running it again is cheap. Returns what it changed.
    """
    with tempfile.TemporaryDirectory(prefix="kvmesh-protogen-") as tmp:
        fresh = Path(tmp)
        _compile(protos, fresh)
        diff = _diff(fresh, out)
        for rel in diff.stale + diff.missing:
            target = out / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}.tmp")
            shutil.copyfile(fresh / rel, partial)
            os.replace(partial, target)
        for rel in diff.orphaned:
            (out / rel).unlink()
    return diff


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvmesh.protogen", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--check", action="store_true", help="report differences, write nothing")
    parser.add_argument("--protos", type=Path, default=DEFAULT_PROTOS, help="proto source root")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="stub output root")
    args = parser.parse_args(argv)
    try:
        diff = (check if args.check else generate)(args.protos, args.out)
    except ProtocError as e:
        print(f"protogen: {e}", file=sys.stderr)
        return 2
    if args.check:
        if diff.clean:
            print(f"protogen: stubs in {args.out} are up to date")
            return 0
        for label, files in (("stale", diff.stale), ("missing", diff.missing),
                             ("orphaned", diff.orphaned)):
            for rel in files:
                print(f"protogen: {label}: {args.out / rel}", file=sys.stderr)
        print("protogen: run `python -m kvmesh.protogen` to regenerate", file=sys.stderr)
        return 1
    changed = len(diff.stale) + len(diff.missing)
    print(f"protogen: {changed} written, {len(diff.orphaned)} removed under {args.out}"
          if changed or diff.orphaned else f"protogen: stubs in {args.out} are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
