"""Name → benchmark. Each benchmark returns rows {params..., metric, value, unit} and prints a table.

Every row carries the model it was measured on (`model`: 'bundled', or the --model path as given).
Benchmarks in BUNDLED_ONLY measure something only the bundled model's setup defines and refuse
another model, naming why; the others take `model` and refuse only a workload the model cannot run
(see kvmesh.loadtest.models)."""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

from kvmesh.loadtest.models import BUNDLED, BenchRefused

BENCHES: dict[str, str] = {
    "engine": "kvmesh.loadtest.engine_bench",
    "quant": "kvmesh.loadtest.quant_bench",
    "kvcache": "kvmesh.loadtest.kvcache_bench",
    "routing": "kvmesh.loadtest.routing_bench",
    "cascade": "kvmesh.loadtest.cascade_bench",
    "spec": "kvmesh.loadtest.spec_bench",
    "blend": "kvmesh.loadtest.blend_bench",
    "quality": "kvmesh.loadtest.quality_bench",
    "loadgen": "kvmesh.loadtest.loadgen_bench",
    "gpu": "kvmesh.loadtest.gpu_bench",
}

BUNDLED_ONLY: dict[str, str] = {
    "routing": "its replica pools are sized in bytes of SmolLM2-135M's KV per token and its tier is the "
               "bundled model's; it measures the router's placement, which does not depend on the model",
    "cascade": "its cheap tier is the bundled model's own int4 weights and its threshold and task set are "
               "tuned to SmolLM2-135M's answers; a cascade of your own model needs its own cheap tier "
               "(kvmesh up --cascade)",
}
"""Benchmarks that run on the bundled model only, and why."""

NO_MODEL: dict[str, str] = {
    "loadgen": "it measures the load harness itself against a stub server that answers at once; "
               "point `kvmesh loadtest --url` at a stack serving your model instead",
    "gpu": "it measures kvmesh.gpu's Triton kernels on synthetic KV of fixed head shapes (SmolLM2-135M's "
           "and a 32/8/128 one); the kernels' speed does not depend on the weights",
}
"""Benchmarks that load no model at all, and why."""


def run_bench(name: str, *, quick: bool, json_path: str | None = None, model: str = BUNDLED) -> list[dict]:
    """Runs benchmark `name` on `model` and returns its rows, each with a `model` param (the module
    prints its own table). Benchmarks that write files beside the JSON (plots) take `json_path`.
    BenchRefused (a SystemExit with the reason) for a benchmark that cannot run on `model`."""
    if name not in BENCHES:
        raise SystemExit(f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(BENCHES))}")
    if model != BUNDLED and name in BUNDLED_ONLY:
        raise BenchRefused(f"kvmesh bench {name} runs on the bundled model only: {BUNDLED_ONLY[name]}")
    if model != BUNDLED and name in NO_MODEL:
        raise BenchRefused(f"kvmesh bench {name} takes no --model: {NO_MODEL[name]}")
    module = importlib.import_module(BENCHES[name])
    run: Callable[..., list[dict]] = module.run
    kwargs: dict = {"quick": quick}
    params = inspect.signature(run).parameters
    if "json_path" in params:
        kwargs["json_path"] = json_path
    if model != BUNDLED:  # a bundled-only module without the parameter is caught above
        kwargs["model"] = model
    return [{"model": model, **r} for r in run(**kwargs)]
