"""Name → benchmark. Each benchmark returns rows {params..., metric, value, unit} and prints a table."""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

BENCHES: dict[str, str] = {
    "engine": "kvmesh.loadtest.engine_bench",
    "quant": "kvmesh.loadtest.quant_bench",
    "kvcache": "kvmesh.loadtest.kvcache_bench",
    "routing": "kvmesh.loadtest.routing_bench",
    "cascade": "kvmesh.loadtest.cascade_bench",
    "spec": "kvmesh.loadtest.spec_bench",
    "blend": "kvmesh.loadtest.blend_bench",
    "quality": "kvmesh.loadtest.quality_bench",
}


def run_bench(name: str, *, quick: bool, json_path: str | None = None) -> list[dict]:
    """Runs benchmark `name` and returns its rows (the module prints its own table). Benchmarks
    that write files beside the JSON (plots) take `json_path`."""
    if name not in BENCHES:
        raise SystemExit(f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(BENCHES))}")
    module = importlib.import_module(BENCHES[name])
    run: Callable[..., list[dict]] = module.run
    if "json_path" in inspect.signature(run).parameters:
        return run(quick=quick, json_path=json_path)
    return run(quick=quick)
