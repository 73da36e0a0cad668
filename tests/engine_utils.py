"""Test helpers for driving an EngineCore synchronously (no threads, exact)."""
from __future__ import annotations

import time

from kvmesh.services.engine.build import build_core
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core import EngineCore, EngineRequest
from kvmesh.services.engine.sampling import SamplingParams


def make_core(loaded, **overrides) -> EngineCore:
    """An EngineCore on `loaded` with a small KV pool unless overridden."""
    base = dict(num_blocks=512, block_size=16, max_num_batched_tokens=256)
    base.update(overrides)
    return build_core(EngineConfig(**base), loaded)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def run_all(core: EngineCore, prompts: dict[str, list[int]], params: dict[str, SamplingParams] | SamplingParams,
            max_steps: int = 100_000) -> dict[str, dict]:
    """Adds every request at once, steps until all finish; returns per-request tokens/text/final."""
    results: dict[str, dict] = {}
    for rid, ids in prompts.items():
        p = params[rid] if isinstance(params, dict) else params
        core.validate(ids, p)
        core.add_request(EngineRequest(rid, list(ids), p, time.monotonic()))
        results[rid] = {"tokens": [], "text": "", "final": None, "logprobs": []}
    for _ in range(max_steps):
        if not core.has_work:
            break
        for out in core.step():
            r = results[out.request_id]
            r["tokens"] += out.token_ids
            r["text"] += out.text
            r["logprobs"] += out.logprobs
            if out.finished:
                r["final"] = out
    assert all(r["final"] is not None for r in results.values()), "engine stopped with unfinished requests"
    return results
