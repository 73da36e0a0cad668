"""Name → benchmark. Each benchmark returns rows {params..., metric, value, unit} and prints a table."""
from __future__ import annotations

import importlib
from typing import Callable

BENCHES: dict[str, str] = {
    "engine": "kvmesh.loadtest.engine_bench",
    "quant": "kvmesh.loadtest.quant_bench",
    "kvcache": "kvmesh.loadtest.kvcache_bench",
}


def run_bench(name: str, *, quick: bool) -> list[dict]:
    """Runs benchmark `name` and returns its rows (the module prints its own table)."""
    if name not in BENCHES:
        raise SystemExit(f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(BENCHES))}")
    module = importlib.import_module(BENCHES[name])
    run: Callable[..., list[dict]] = module.run
    return run(quick=quick)
