"""Name → benchmark. Each benchmark returns rows {params..., metric, value, unit} and prints a table.

Every row carries the model it was measured on (`model`: 'bundled', or the --model path as given).
Benchmarks in BUNDLED_ONLY measure something only the bundled model's setup defines and refuse
another model, naming why; the others take `model` and refuse only a workload the model cannot run
(see kvmesh.loadtest.models)."""
from __future__ import annotations

import importlib
import importlib.util
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
    "pd": "kvmesh.loadtest.pd_bench",
}

BUNDLED_ONLY: dict[str, str] = {
    "routing": "its replica pools are sized in bytes of SmolLM2-135M's KV per token and its tier is the "
               "bundled model's; it measures the router's placement, which does not depend on the model",
    "pd": "it starts `kvmesh up` stacks of the bundled model (one per variant); a P/D stack of your own model "
          "is `kvmesh up --model PATH --pd 1:1`",
    "cascade": "its cheap tier is the bundled model's own int4 weights and its threshold and task set are "
               "tuned to SmolLM2-135M's answers; a cascade of your own model needs its own cheap tier "
               "(kvmesh up --cascade)",
}
"""Benchmarks that run on the bundled model only, and why."""

NO_MODEL: dict[str, str] = {
    "loadgen": "it measures the load harness itself against a stub server that answers at once; "
               "point `kvmesh loadtest --url` at a stack serving your model instead",
    "gpu": "it measures kvmesh.gpu's Triton kernels on synthetic KV of fixed head shapes (SmolLM2-135M's "
           "and a 32/8/128 one), and the engine on random weights of SmolLM2-135M's architecture against "
           "HF transformers on the same weights; speed does not depend on the weights' values",
}
"""Benchmarks that load no model at all, and why."""

NEEDS: dict[str, tuple[tuple[str, str], ...]] = {
    "engine": (("transformers", "its `hf` column runs transformers' generate()"),),
    "gpu": (("triton", "it times kvmesh.gpu's Triton kernels"),
            ("transformers", "its engine rows compare with transformers' generate()")),
}
"""Benchmarks' imports beyond the base install: (module, what for). All come with the `test` extra
and are checked before the benchmark starts, so a missing one fails at once, not after minutes."""

EXTRA = "test"
"""The pip extra that installs every module in NEEDS."""


def check_needs(name: str) -> None:
    """SystemExit naming the first module benchmark `name` needs that is not installed, and how to
    install it (nothing when all are there)."""
    for module, why in NEEDS.get(name, ()):
        if importlib.util.find_spec(module) is None:
            raise SystemExit(f"kvmesh bench {name} needs the Python package {module!r} ({why}), which the base "
                             f"install lacks: pip install -e '.[{EXTRA}]' (or bash scripts/dev.sh test)")


def run_bench(name: str, *, quick: bool, json_path: str | None = None, model: str = BUNDLED) -> list[dict]:
    """Runs benchmark `name` on `model` and returns its rows, each with a `model` param (the module
    prints its own table). Benchmarks that write files beside the JSON (plots) take `json_path`.
    BenchRefused (a SystemExit with the reason) for a benchmark that cannot run on `model`; a
    SystemExit naming the package and the extra when one in NEEDS is missing (before any work)."""
    if name not in BENCHES:
        raise SystemExit(f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(BENCHES))}")
    if model != BUNDLED and name in BUNDLED_ONLY:
        raise BenchRefused(f"kvmesh bench {name} runs on the bundled model only: {BUNDLED_ONLY[name]}")
    if model != BUNDLED and name in NO_MODEL:
        raise BenchRefused(f"kvmesh bench {name} takes no --model: {NO_MODEL[name]}")
    check_needs(name)
    module = importlib.import_module(BENCHES[name])
    run: Callable[..., list[dict]] = module.run
    kwargs: dict = {"quick": quick}
    params = inspect.signature(run).parameters
    if "json_path" in params:
        kwargs["json_path"] = json_path
    if model != BUNDLED:  # a bundled-only module without the parameter is caught above
        kwargs["model"] = model
    return [{"model": model, **r} for r in run(**kwargs)]
