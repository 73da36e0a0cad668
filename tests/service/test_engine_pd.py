"""P/D disaggregation on the real model: a prefill engine hands the prompt's KV to a decode engine
through the KV-cache service, behind the router's P/D route (pool.py's NOTE on P/D). Greedy
outputs equal a colocated engine's, also when the KV service stops storing mid-transfer (the
decode engine then computes what it could not fetch)."""
from __future__ import annotations

import grpc
import pytest

from engine_utils import greedy, run_all, serve_engine
from kvcache_utils import serving
from kvmesh.model.perplexity import reference_text
from kvmesh.services.engine.build import build_core
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.services.kvcache.servicer import KvcacheServicer
from kvmesh.telemetry import Telemetry
from router_utils import route_request, router_config, serving_router

pytestmark = pytest.mark.slow
CHUNK = 32
NEW_TOKENS = 12
SETTINGS = dict(num_blocks=256, block_size=16, max_num_batched_tokens=64, kv_chunk_tokens=CHUNK, kv_timeout_s=5.0)


@pytest.fixture(scope="module")
def prompts(bundled_model) -> list[list[int]]:
    ids = bundled_model.tokenizer.encode(reference_text())
    # 20 prompts of 70..203 tokens, each starting elsewhere in the text (no shared prefix)
    return [ids[37 * i: 37 * i + 70 + 7 * i] for i in range(20)]


@pytest.fixture(scope="module")
def colocated(bundled_model, prompts) -> list[list[int]]:
    core = build_core(EngineConfig(**SETTINGS), bundled_model)
    out = run_all(core, {str(i): p for i, p in enumerate(prompts)}, greedy(NEW_TOKENS, ignore_eos=True))
    return [out[str(i)]["tokens"] for i in range(len(prompts))]


def tokens_of(msgs) -> list[int]:
    return [t for m in msgs for t in m.response.delta.token_ids]


async def test_pd_outputs_equal_colocated_ones_even_when_the_kv_service_stops_mid_transfer(
        bundled_model, prompts, colocated, tmp_path, monkeypatch):
    puts = {"left": None}  # None: every Put is stored; n: n more, then the service refuses them
    put = KvcacheServicer.Put

    async def failing_put(self, request_iterator, context):
        if puts["left"] is not None:
            if puts["left"] <= 0:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "the KV service went away")
            puts["left"] -= 1
        return await put(self, request_iterator, context)

    monkeypatch.setattr(KvcacheServicer, "Put", failing_put)
    kv_cfg = KvcacheConfig(data_dir=tmp_path / "lmdb", disk_map_bytes=256 << 20, max_entry_bytes=32 << 20)
    telemetry = Telemetry.create("kvmesh-router")
    async with serving(kv_cfg) as kv:
        cores = [build_core(EngineConfig(**SETTINGS, kvcache_address=kv.address, role=role, kv_retry_s=0.0),
                            bundled_model) for role in ("prefill", "decode")]
        async with serve_engine(cores[0]) as p, serve_engine(cores[1]) as d:
            cfg = router_config(tiers=f"t={p.address}/prefill,{d.address}/decode", pd_min_prompt_tokens=64,
                                generate_timeout_s=120.0)
            async with serving_router(cfg, telemetry) as r:
                served = []
                for i, prompt in enumerate(prompts):
                    if i == 10:
                        puts["left"] = 1  # the service stores one more chunk, then stops
                    served.append(await r.collect(route_request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True),
                                                  timeout=120))
    assert [tokens_of(m) for m in served] == colocated
    for msgs in served:
        assert msgs[0].route.replica == f"{p.address}>{d.address}"
    imported = [m[-1].response.final.reuse.kv_service_tokens for m in served]
    # before the stop every decode hop imported the whole prompt, its partial last chunk too (the
    # tail key), but for its last block, which it computes with the first token
    for prompt, tokens in zip(prompts[:10], imported[:10]):
        assert tokens == (len(prompt) - 1) // 16 * 16
    # after it, what was not stored was computed by the decode engine
    assert all(t < len(prompt) // CHUNK * CHUNK for prompt, t in zip(prompts[11:], imported[11:]))
    assert telemetry.registry.get_sample_value("kvmesh_router_pd_routes_total",
                                               {"model_name": "t", "tier": "t", "route": "pd", "reason": ""}) == 20
