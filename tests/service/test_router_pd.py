"""The router's P/D route (pool.py's NOTE on P/D) against fake engines: which replica gets which
hop, what the client sees, and every fallback. Real engines: tests/e2e/test_pd_stack.py."""
from __future__ import annotations

import grpc
import pytest

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.telemetry import Telemetry
from router_utils import Script, dead_address, fake_engines, route_request, router_config, serving_router, text_of

LONG = list(range(1, 601))  # 600 tokens: past the default --pd-min-prompt-tokens (256)
SHORT = list(range(1, 101))


def metric(telemetry: Telemetry, name: str, **labels) -> float:
    return telemetry.registry.get_sample_value(name, labels) or 0.0


def pd_tiers(prefill: str, decode: str, *more: str) -> str:
    return ",".join([f"t={prefill}/prefill", f"{decode}/decode", *more])


def tokens_of(msgs) -> list[int]:
    return [t for m in msgs for t in m.response.delta.token_ids]


async def test_a_long_prompt_is_prefilled_on_one_replica_and_decoded_on_the_other():
    telemetry = Telemetry.create("kvmesh-router")
    async with fake_engines(Script(), Script()) as (p, d):
        async with serving_router(router_config(tiers=pd_tiers(p.address, d.address)), telemetry) as r:
            msgs = await r.collect(route_request(LONG, max_tokens=3, logprobs=1))
    hop, cont = p.generate_calls[0], d.generate_calls[0]
    assert hop.kv_handoff and hop.sampling.max_tokens == 1 and list(hop.token_ids.ids) == LONG
    assert not cont.kv_handoff and cont.sampling.max_tokens == 3 and list(cont.resume_token_ids.ids) == [101]
    assert list(cont.token_ids.ids) == LONG and cont.request_id == hop.request_id
    # one stream: the first token from the prefill replica, the rest from the decode one, once each
    assert text_of(msgs) == " e0101 e1102 e1103" and tokens_of(msgs) == [101, 102, 103]
    assert [lp.chosen.token_id for m in msgs for lp in m.response.delta.logprobs] == [101, 102, 103]
    finals = [m.response.final for m in msgs if m.response.HasField("final")]
    assert len(finals) == 1 and finals[0].usage.completion_tokens == 3
    assert msgs[0].route.replica == f"{p.address}>{d.address}"
    assert metric(telemetry, "kvmesh_router_pd_routes_total", model_name="t", tier="t", route="pd", reason="") == 1
    for replica, policy in ((p.address, "pd_prefill"), (d.address, "pd_decode")):
        assert metric(telemetry, "kvmesh_router_requests_total", model_name="t", tier="t", replica=replica,
                      policy=policy, code="OK") == 1


@pytest.mark.parametrize("prompt, sampling, reason", [
    (SHORT, {}, "short_prompt"),
    (LONG, {"max_tokens": 1}, "one_token"),
])
async def test_short_prompts_and_one_token_requests_run_whole_on_a_decode_replica(prompt, sampling, reason):
    telemetry = Telemetry.create("kvmesh-router")
    async with fake_engines(Script(), Script()) as (p, d):
        async with serving_router(router_config(tiers=pd_tiers(p.address, d.address)), telemetry) as r:
            msgs = await r.collect(route_request(prompt, **sampling))
    assert not p.generate_calls and len(d.generate_calls) == 1 and not d.generate_calls[0].kv_handoff
    assert tokens_of(msgs) == [101, 102, 103]
    assert metric(telemetry, "kvmesh_router_pd_routes_total", model_name="t", tier="t", route="colocated",
                  reason=reason) == 1


async def test_the_threshold_is_a_flag():
    async with fake_engines(Script(), Script()) as (p, d):
        cfg = router_config(tiers=pd_tiers(p.address, d.address), pd_min_prompt_tokens=50)
        async with serving_router(cfg) as r:
            await r.collect(route_request(SHORT))
    assert p.generate_calls[0].kv_handoff


async def test_an_answer_that_ends_at_its_first_token_never_reaches_the_decode_replica():
    stop = engine_pb2.Final(finish_reason=common_pb2.FINISH_REASON_STOP)
    async with fake_engines(Script(tokens=(2,), final=stop), Script()) as (p, d):
        async with serving_router(router_config(tiers=pd_tiers(p.address, d.address))) as r:
            msgs = await r.collect(route_request(LONG))
    assert tokens_of(msgs) == [2] and not d.generate_calls
    assert msgs[-1].response.final.finish_reason == common_pb2.FINISH_REASON_STOP


async def test_a_dead_prefill_pool_falls_back_to_colocated_decode():
    telemetry = Telemetry.create("kvmesh-router")
    async with fake_engines(Script()) as (d,):
        async with serving_router(router_config(tiers=pd_tiers(dead_address(), d.address)), telemetry) as r:
            first = await r.collect(route_request(LONG))
            second = await r.collect(route_request(LONG))  # the prefill replica is marked down now
    for msgs in (first, second):
        assert tokens_of(msgs) == [101, 102, 103]
    assert [c.kv_handoff for c in d.generate_calls] == [False, False]
    assert metric(telemetry, "kvmesh_router_pd_routes_total", model_name="t", tier="t", route="colocated",
                  reason="prefill_failed") == 1
    assert metric(telemetry, "kvmesh_router_pd_routes_total", model_name="t", tier="t", route="colocated",
                  reason="pool_down") == 1


async def test_a_decode_hop_no_decode_replica_takes_is_continued_elsewhere():
    async with fake_engines(Script(), Script(generate_error=(grpc.StatusCode.UNAVAILABLE, "gone"))) as (p, d):
        async with serving_router(router_config(tiers=pd_tiers(p.address, d.address))) as r:
            msgs = await r.collect(route_request(LONG))
    assert text_of(msgs) == " e0101 e0102 e0103"
    assert [list(c.resume_token_ids.ids) for c in p.generate_calls] == [[], [101]]
    assert [c.kv_handoff for c in p.generate_calls] == [True, False]


async def test_a_decode_replica_failing_mid_stream_migrates_like_any_request():
    # kv_aware ranks d (which holds the prompt's KV itself) before d2
    async with fake_engines(Script(), Script(fail_after=2, cached_tokens=600), Script()) as (p, d, d2):
        cfg = router_config(tiers=pd_tiers(p.address, d.address, f"{d2.address}/decode"))
        async with serving_router(cfg) as r:
            msgs = await r.collect(route_request(LONG))
    assert text_of(msgs) == " e0101 e1102 e2103"
    assert list(d.generate_calls[0].resume_token_ids.ids) == [101]
    assert list(d2.generate_calls[0].resume_token_ids.ids) == [101, 102]


async def test_prompts_in_parts_and_text_are_not_disaggregated():
    telemetry = Telemetry.create("kvmesh-router")
    async with fake_engines(Script(), Script()) as (p, d):
        async with serving_router(router_config(tiers=pd_tiers(p.address, d.address)), telemetry) as r:
            req = route_request()
            req.request.text = "word " * 2000
            await r.collect(req)
    assert not p.generate_calls and d.generate_calls
    assert metric(telemetry, "kvmesh_router_pd_routes_total", model_name="t", tier="t", route="colocated",
                  reason="not_token_ids") == 1
