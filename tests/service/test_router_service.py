"""The router's gRPC API against fake engines (real gRPC servers on port 0, in this process)."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.rpc.client import wait_for_ready
from kvmesh.telemetry import Telemetry
from router_utils import (ROUTER_SERVICE, FakeOpenAI, Script, dead_address, fake_engines, route_request,
                          router_config, serving_openai, serving_router, text_of)

PROMPT = list(range(1, 161))  # 160 tokens
KV_AWARE, ROUND_ROBIN, FAILOVER = (router_pb2.PLACEMENT_POLICY_KV_AWARE, router_pb2.PLACEMENT_POLICY_ROUND_ROBIN,
                                   router_pb2.PLACEMENT_POLICY_FAILOVER)
CONFIDENT, LOW_CONFIDENCE, DIFFICULTY, LAST_TIER, TIER_FAILED = (
    router_pb2.CASCADE_REASON_CONFIDENT, router_pb2.CASCADE_REASON_LOW_CONFIDENCE,
    router_pb2.CASCADE_REASON_DIFFICULTY, router_pb2.CASCADE_REASON_LAST_TIER,
    router_pb2.CASCADE_REASON_TIER_FAILED)


def metric(telemetry: Telemetry, name: str, **labels) -> float:
    return telemetry.registry.get_sample_value(name, labels) or 0.0


def tiers(*engines, name="t") -> str:
    return f"{name}=" + ",".join(e.address for e in engines)


def replica_of(messages) -> str:
    return messages[0].route.replica


# --- placement ------------------------------------------------------------------------------

async def test_kv_aware_picks_the_replica_with_the_longest_cached_prefix():
    async with fake_engines(Script(cached_tokens=0), Script(cached_tokens=128),
                            Script(cached_tokens=64)) as (e0, e1, e2):
        async with serving_router(router_config(tiers=tiers(e0, e1, e2))) as r:
            req = route_request(PROMPT)
            req.request.cache_salt = "tenant-salt"
            msgs = await r.collect(req)
    assert replica_of(msgs) == e1.address and len(e1.generate_calls) == 1
    assert not e0.generate_calls and not e2.generate_calls
    route = msgs[0].route
    assert (route.tier, route.policy, route.expected_cached_tokens) == ("t", KV_AWARE, 128)
    assert [p.cache_salt for p in e0.probe_calls + e1.probe_calls + e2.probe_calls] == \
        ["tenant-salt"] * 3
    assert list(e0.probe_calls[0].token_ids.ids) == PROMPT
    assert text_of(msgs) == " e1101 e1102 e1103"
    assert msgs[-1].response.final.usage.cached_prompt_tokens == 128
    assert sum(m.HasField("route") for m in msgs) == 1


async def test_kv_aware_avoids_a_warm_replica_whose_load_outweighs_its_cache():
    # warm: (160 - 128) + 4 x 64 = 288; cold: 160 + 0 = 160
    async with fake_engines(Script(cached_tokens=128, running=3, waiting=1),
                            Script(cached_tokens=0)) as (warm, cold):
        async with serving_router(router_config(tiers=tiers(warm, cold), load_weight=64)) as r:
            assert replica_of(await r.collect(route_request(PROMPT))) == cold.address
        async with serving_router(router_config(tiers=tiers(warm, cold), load_weight=16)) as r:
            # warm: 32 + 64 = 96 < 160
            assert replica_of(await r.collect(route_request(PROMPT))) == warm.address


async def test_round_robin_alternates_without_probing():
    async with fake_engines(Script(), Script()) as (e0, e1):
        async with serving_router(router_config(tiers=tiers(e0, e1), policy="round_robin")) as r:
            replicas = [replica_of(await r.collect(route_request())) for _ in range(4)]
    assert replicas == [e0.address, e1.address, e0.address, e1.address]
    assert not e0.probe_calls and not e1.probe_calls
    assert len(e0.generate_calls) == len(e1.generate_calls) == 2


async def test_a_down_replica_is_skipped_and_the_request_succeeds():
    dead = dead_address()
    async with fake_engines(Script()) as (live,):
        cfg = router_config(tiers=f"t={dead},{live.address}", policy="round_robin")
        telemetry = Telemetry.create("kvmesh-router")
        before = metric(telemetry, "kvmesh_router_requests_total", model_name="t", tier="t", replica=dead,
                        policy="round_robin", code="UNAVAILABLE")
        async with serving_router(cfg, telemetry) as r:
            first = await r.collect(route_request())      # the cursor points at the dead one
            second = await r.collect(route_request())     # now marked down: not tried again
    assert (replica_of(first), first[0].route.policy) == (live.address, FAILOVER)
    assert (replica_of(second), second[0].route.policy) == (live.address, ROUND_ROBIN)
    assert text_of(first) == " e0101 e0102 e0103"
    assert metric(telemetry, "kvmesh_router_requests_total", model_name="t", tier="t", replica=dead,
                  policy="round_robin", code="UNAVAILABLE") == before + 1


async def test_kv_aware_marks_a_replica_whose_probe_is_refused_down():
    dead = dead_address()
    async with fake_engines(Script(), Script(cached_tokens=16)) as (e0, e1):
        async with serving_router(router_config(tiers=f"t={dead},{e0.address},{e1.address}")) as r:
            msgs = await r.collect(route_request(PROMPT))
            pool = r.servicer.router.pools["t"]
            assert pool.state.is_down(dead) and not pool.state.is_down(e0.address)
    assert (replica_of(msgs), msgs[0].route.policy) == (e1.address, KV_AWARE)


async def test_a_slow_probe_leaves_the_replica_up_but_ranked_last():
    # The slow probe never answers, so it misses the router's deadline whatever the machine's
    # load; the deadline stays the generous test default so the prompt replica meets it.
    async with fake_engines(Script(cached_tokens=160, probe_hangs=True), Script()) as (slow, e1):
        async with serving_router(router_config(tiers=tiers(slow, e1))) as r:
            msgs = await r.collect(route_request(PROMPT))
            assert not r.servicer.router.pools["t"].state.is_down(slow.address)
    assert replica_of(msgs) == e1.address


async def test_generate_unavailable_before_the_first_token_fails_over():
    async with fake_engines(Script(cached_tokens=100,
                                   generate_error=(grpc.StatusCode.UNAVAILABLE, "gone")),
                            Script()) as (bad, good):
        async with serving_router(router_config(tiers=tiers(bad, good))) as r:
            msgs = await r.collect(route_request(PROMPT))
            assert r.servicer.router.pools["t"].state.is_down(bad.address)
    assert len(bad.generate_calls) == 1
    assert (replica_of(msgs), msgs[0].route.policy) == (good.address, FAILOVER)


async def test_an_overloaded_replica_is_passed_over_but_not_marked_down():
    async with fake_engines(Script(generate_error=(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")),
                            Script()) as (full, e1):
        async with serving_router(router_config(tiers=tiers(full, e1), policy="round_robin")) as r:
            msgs = await r.collect(route_request())
            assert not r.servicer.router.pools["t"].state.is_down(full.address)
    assert replica_of(msgs) == e1.address


async def test_a_draining_replica_is_avoided():
    async with fake_engines(Script(hold_after=1), Script()) as (draining, e1):
        channel = grpc.aio.insecure_channel(draining.address)
        held = engine_pb2_grpc.EngineServiceStub(channel).Generate(
            engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1])), timeout=10)
        await held.read()
        drain = asyncio.ensure_future(draining.server.drain(10.0))  # keeps serving `held`
        await asyncio.wait_for(draining.holding.wait(), 5)
        try:
            for policy in ("round_robin", "kv_aware"):
                cfg = router_config(tiers=tiers(draining, e1), policy=policy)
                async with serving_router(cfg) as r:
                    msgs = await r.collect(route_request(PROMPT))
                    assert r.servicer.router.pools["t"].state.is_down(draining.address)
                assert replica_of(msgs) == e1.address
            assert len(draining.generate_calls) == 1  # only the held one got through
        finally:
            draining.release.set()
            await drain
            await channel.close()


# --- migration (pool's NOTE on migration) ----------------------------------------------------

async def test_a_replica_failing_mid_stream_hands_the_request_to_another_that_resumes_it():
    telemetry = Telemetry.create("kvmesh-router")
    async with fake_engines(Script(fail_after=1), Script()) as (flaky, e1):
        cfg = router_config(tiers=tiers(flaky, e1), policy="round_robin")
        async with serving_router(cfg, telemetry) as r:
            msgs = await r.collect(route_request(PROMPT, logprobs=1, prompt_logprobs=1))
            assert r.servicer.router.pools["t"].state.is_down(flaky.address)
    # one stream, no gap, nothing twice: e0 sent token 101 and died, e1 resumed after it
    assert text_of(msgs) == " e0101 e1102 e1103"
    assert [t for m in msgs for t in m.response.delta.token_ids] == [101, 102, 103]
    assert [lp.chosen.token_id for m in msgs for lp in m.response.delta.logprobs] == [101, 102, 103]
    assert replica_of(msgs) == flaky.address and sum(m.HasField("route") for m in msgs) == 1
    resumed = e1.generate_calls[0]
    assert list(resumed.resume_token_ids.ids) == [101] and list(resumed.token_ids.ids) == PROMPT
    assert resumed.request_id == flaky.generate_calls[0].request_id
    assert not resumed.sampling.HasField("prompt_logprobs") and resumed.sampling.logprobs == 1
    assert msgs[-1].response.final.usage.completion_tokens == 3
    assert metric(telemetry, "kvmesh_router_migrations_total", model_name="t", tier="t", outcome="migrated") == 1
    assert metric(telemetry, "kvmesh_router_requests_total", model_name="t", tier="t", replica=flaky.address,
                  policy="round_robin", code="UNAVAILABLE") == 1
    assert metric(telemetry, "kvmesh_router_requests_total", model_name="t", tier="t", replica=e1.address,
                  policy="migration", code="OK") == 1


# kv_aware placement by cached prefix makes the order of replicas e0, e1, e2 for these tests
IN_ORDER = (dict(cached_tokens=150), dict(cached_tokens=100), dict(cached_tokens=50))


async def test_a_stream_broken_after_its_final_message_is_not_migrated():
    async with fake_engines(Script(fail_after_final=True, **IN_ORDER[0]), Script(**IN_ORDER[1])) as (e0, e1):
        async with serving_router(router_config(tiers=tiers(e0, e1))) as r:
            msgs = await r.collect(route_request(PROMPT))
    assert text_of(msgs) == " e0101 e0102 e0103" and msgs[-1].response.HasField("final")
    assert sum(m.response.HasField("final") for m in msgs) == 1 and not e1.generate_calls


async def test_a_request_moves_again_when_its_new_replica_fails_too():
    async with fake_engines(Script(fail_after=1, **IN_ORDER[0]), Script(fail_after=2, **IN_ORDER[1]),
                            Script(**IN_ORDER[2])) as (e0, e1, e2):
        async with serving_router(router_config(tiers=tiers(e0, e1, e2))) as r:
            msgs = await r.collect(route_request(PROMPT))
    assert text_of(msgs) == " e0101 e1102 e2103"
    assert [list(c.resume_token_ids.ids) for c in e1.generate_calls + e2.generate_calls] == [[101], [101, 102]]


async def test_a_request_that_arrives_resumed_keeps_its_resumed_tokens_when_it_moves():
    async with fake_engines(Script(fail_after=2, **IN_ORDER[0]), Script(**IN_ORDER[1])) as (e0, e1):
        async with serving_router(router_config(tiers=tiers(e0, e1))) as r:
            req = route_request(PROMPT)
            req.request.resume_token_ids.ids[:] = [101]  # a gateway resuming across a router restart
            msgs = await r.collect(req)
    assert text_of(msgs) == " e0102 e1103"
    assert list(e1.generate_calls[0].resume_token_ids.ids) == [101, 102]


async def test_a_mid_stream_failure_reaches_the_caller_when_no_replica_can_continue():
    async with fake_engines(Script(fail_after=1, **IN_ORDER[0]), Script(fail_after=2, **IN_ORDER[1])) as (e0, e1):
        async with serving_router(router_config(tiers=tiers(e0, e1))) as r:
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for m in r.stub.Generate(route_request(PROMPT), timeout=10):
                    got.append(m)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "e1 crashed; migrating the request failed: no healthy replica in tier t" in err.value.details()
    assert text_of(got) == " e0101 e1102"


@pytest.mark.parametrize("limit", [0, 1])
async def test_the_migration_limit_bounds_how_often_a_request_moves(limit):
    async with fake_engines(Script(fail_after=1, **IN_ORDER[0]), Script(fail_after=2, **IN_ORDER[1]),
                            Script(**IN_ORDER[2])) as (e0, e1, e2):
        cfg = router_config(tiers=tiers(e0, e1, e2), migration_limit=limit)
        async with serving_router(cfg) as r:
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for m in r.stub.Generate(route_request(PROMPT), timeout=10):
                    got.append(m)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "--migration-limit" in err.value.details()
    assert len(got) == 1 + limit and not e2.generate_calls


async def test_a_stream_that_stalls_is_treated_as_a_failed_replica():
    """A replica that holds the stream open and sends nothing (hung, not dead): after the stall
    timeout its call is cancelled and the request resumes elsewhere."""
    async with fake_engines(Script(hold_after=1), Script()) as (hung, e1):
        cfg = router_config(tiers=tiers(hung, e1), policy="round_robin", stall_timeout_s=0.3)
        async with serving_router(cfg) as r:
            msgs = await r.collect(route_request(PROMPT))
            await asyncio.wait_for(hung.cancelled_event.wait(), 10)
    assert text_of(msgs) == " e0101 e1102 e1103"
    assert hung.cancelled == [hung.generate_calls[0].request_id]


@pytest.mark.parametrize("sampling, pinned", [
    (dict(temperature=0.8), True), (dict(top_p=0.9), True), (dict(temperature=0.8, seed=5), False),
    (dict(), False), (dict(temperature=0.0, top_k=5), False)])
async def test_sampled_requests_get_a_seed_so_a_continuation_draws_the_same(sampling, pinned):
    async with fake_engines(Script()) as (e0,):
        async with serving_router(router_config(tiers=tiers(e0))) as r:
            await r.collect(route_request(PROMPT, **sampling))
    sent = e0.generate_calls[0].sampling
    if pinned:
        assert sent.HasField("seed")
    else:
        assert sent.HasField("seed") == ("seed" in sampling) and sent.seed == sampling.get("seed", 0)


async def test_no_healthy_replica_is_unavailable():
    async with serving_router(router_config(tiers=f"t={dead_address()},{dead_address()}")) as r:
        for _ in range(2):  # refused connections, then both marked down
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.collect(route_request(PROMPT))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "no healthy replica in tier t" in err.value.details()


# --- requests -------------------------------------------------------------------------------

async def test_unknown_model_is_not_found_and_names_the_known_ones():
    async with fake_engines(Script()) as (e0,):
        cfg = router_config(tiers=f"cheap={e0.address};strong={e0.address}",
                            cascades="auto=cheap,strong")
        async with serving_router(cfg) as r:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.collect(route_request(model="gpt-9"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'gpt-9'" in err.value.details() and "cheap, strong, auto" in err.value.details()


async def test_request_ids_are_kept_or_assigned():
    async with fake_engines(Script()) as (e0,):
        async with serving_router(router_config(tiers=tiers(e0))) as r:
            req = route_request()
            req.request.request_id = "client-id"
            await r.collect(req)
            msgs = await r.collect(route_request())
    assert e0.generate_calls[0].request_id == "client-id"
    assert e0.generate_calls[1].request_id.startswith("rt-")
    assert msgs[-1].response.request_id == e0.generate_calls[1].request_id


async def test_client_cancel_cancels_the_engine_call():
    async with fake_engines(Script(hold_after=1)) as (e0,):
        async with serving_router(router_config(tiers=tiers(e0))) as r:
            call = r.stub.Generate(route_request(), timeout=10)
            first = await call.read()
            assert first.response.delta.token_ids == [101]
            call.cancel()
            await asyncio.wait_for(e0.cancelled_event.wait(), 5)
    assert e0.cancelled == [e0.generate_calls[0].request_id]


async def test_the_router_call_deadline_cancels_the_engine_call():
    async with fake_engines(Script(hold_after=1)) as (e0,):
        async with serving_router(router_config(tiers=tiers(e0))) as r:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.collect(route_request(), timeout=0.5)
            await asyncio.wait_for(e0.cancelled_event.wait(), 5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


async def test_engine_deadlines_shrink_to_the_router_call_s():
    async with fake_engines(Script()) as (e0,):
        async with serving_router(router_config(tiers=tiers(e0), generate_timeout_s=60)) as r:
            await r.collect(route_request(), timeout=3)
            await r.collect(route_request(), timeout=None)
    assert 0 < e0.time_remaining[0] < 3.2      # grpc-timeout travels rounded up a little
    assert 50 < e0.time_remaining[1] < 60.2


# --- cascade --------------------------------------------------------------------------------

def cascade_config(cheap, strong, **overrides):
    return router_config(tiers=f"cheap={cheap.address}@0.2;strong={strong.address}@1",
                         cascades="auto=cheap,strong", **overrides)


async def test_cascade_keeps_a_confident_cheap_answer():
    telemetry = Telemetry.create("kvmesh-router")
    before = metric(telemetry, "kvmesh_router_cascade_decisions_total", model_name="auto", route="auto",
                    tier="cheap", reason="confident")
    async with fake_engines(Script(logprobs=[-0.1, -0.2, -0.3]), Script()) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong), telemetry) as r:
            msgs = await r.collect(route_request())
    assert not strong.generate_calls
    assert cheap.generate_calls[0].sampling.logprobs == 0  # forced on: chosen token only
    assert text_of(msgs) == " e0101 e0102 e0103"
    assert all(not m.response.delta.logprobs for m in msgs)        # the client did not ask
    route = msgs[0].route
    assert (route.tier, route.replica) == ("cheap", cheap.address)
    [step] = route.cascade
    assert (step.tier, step.signal, step.accepted, step.reason, step.completion_tokens) == \
        ("cheap", router_pb2.CONFIDENCE_SIGNAL_MEAN_LOGPROB, True, CONFIDENT, 3)
    assert step.confidence == pytest.approx(-0.2) and step.threshold == -0.5
    assert msgs[-1].response.final.usage.completion_tokens == 3
    assert metric(telemetry, "kvmesh_router_cascade_decisions_total", model_name="auto", route="auto",
                  tier="cheap", reason="confident") == before + 1


async def test_cascade_escalates_a_low_confidence_answer_and_streams_only_the_kept_one():
    async with fake_engines(Script(logprobs=[-2.0, -1.0, -3.0]),
                            Script(tokens=[7, 8])) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong)) as r:
            msgs = await r.collect(route_request())
    assert text_of(msgs) == " e17 e18"
    assert not strong.generate_calls[0].sampling.HasField("logprobs")  # last tier: as asked
    route = msgs[0].route
    assert (route.tier, route.replica) == ("strong", strong.address)
    assert [(s.tier, s.accepted, s.reason) for s in route.cascade] == \
        [("cheap", False, LOW_CONFIDENCE), ("strong", True, LAST_TIER)]
    assert route.cascade[0].confidence == pytest.approx(-2.0)
    assert msgs[-1].response.final.usage.completion_tokens == 2  # the kept tier's usage


async def test_a_request_may_set_its_own_cascade_threshold():
    async with fake_engines(Script(logprobs=[-0.3, -0.3, -0.3]), Script()) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong)) as r:   # router threshold -0.5
            strict = route_request()
            strict.cascade_threshold = -0.1
            escalated = await r.collect(strict)
            kept = await r.collect(route_request())
            bad = route_request()
            bad.cascade_threshold = 0.5
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await r.collect(bad)
    assert [(s.tier, s.reason, s.threshold) for s in escalated[0].route.cascade] == \
        [("cheap", LOW_CONFIDENCE, pytest.approx(-0.1)), ("strong", LAST_TIER, pytest.approx(-0.1))]
    assert [(s.tier, s.reason) for s in kept[0].route.cascade] == [("cheap", CONFIDENT)]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "<= 0" in err.value.details()


async def test_cascade_keeps_the_logprobs_the_client_asked_for():
    async with fake_engines(Script(top=[[-0.01, -6, -7, -8, -9]] * 3), Script()) as (cheap, strong):
        cfg = cascade_config(cheap, strong, cascade_signal="neg_entropy", cascade_threshold=-0.5)
        async with serving_router(cfg) as r:
            msgs = await r.collect(route_request(logprobs=1))
    assert cheap.generate_calls[0].sampling.logprobs == 5       # top-5 for the entropy
    assert msgs[0].route.cascade[0].reason == CONFIDENT and not strong.generate_calls
    lps = [lp for m in msgs for lp in m.response.delta.logprobs]
    assert len(lps) == 3 and all(len(lp.top) == 1 for lp in lps)
    assert lps[0].chosen.logprob == pytest.approx(-0.1)


async def test_a_failing_cheap_tier_escalates():
    async with fake_engines(Script(fail_after=2), Script()) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong)) as r:
            msgs = await r.collect(route_request())
    assert text_of(msgs) == " e1101 e1102 e1103"
    assert [(s.tier, s.reason, s.completion_tokens) for s in msgs[0].route.cascade] == \
        [("cheap", TIER_FAILED, 2), ("strong", LAST_TIER, 0)]


async def test_difficulty_routing_sends_long_prompts_to_the_last_tier():
    async with fake_engines(Script(), Script()) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong,
                                                 difficulty_prompt_tokens=100)) as r:
            long = await r.collect(route_request(PROMPT))
            short = await r.collect(route_request(PROMPT[:99]))
    assert [(s.tier, s.accepted, s.reason) for s in long[0].route.cascade] == \
        [("cheap", False, DIFFICULTY), ("strong", True, LAST_TIER)]
    assert long[0].route.tier == "strong" and short[0].route.tier == "cheap"
    assert len(cheap.generate_calls) == 1 and len(strong.generate_calls) == 1


async def test_cancel_while_the_cheap_tier_is_held_cancels_it():
    async with fake_engines(Script(hold_after=2), Script()) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong)) as r:
            call = r.stub.Generate(route_request(), timeout=10)
            reader = asyncio.ensure_future(call.read())
            await asyncio.wait_for(cheap.holding.wait(), 5)
            call.cancel()
            await asyncio.wait_for(cheap.cancelled_event.wait(), 5)
            reader.cancel()
    assert not strong.generate_calls


async def test_a_named_tier_bypasses_the_cascade():
    async with fake_engines(Script(logprobs=[-9, -9, -9]), Script()) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong)) as r:
            msgs = await r.collect(route_request(model="cheap"))
    assert msgs[0].route.tier == "cheap" and not msgs[0].route.cascade
    assert not strong.generate_calls


# --- models, OpenAI replicas, telemetry ------------------------------------------------------

async def test_list_models_cards_for_tiers_and_cascades_cached():
    async with fake_engines(Script(model="small", max_model_len=2048),
                            Script(model="big", max_model_len=8192)) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong)) as r:
            first = (await r.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)).models
            again = (await r.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)).models
    assert [(m.id, m.root, m.max_model_len, m.kind, list(m.tiers)) for m in first] == [
        ("cheap", "small", 2048, router_pb2.MODEL_KIND_TIER, ["cheap"]),
        ("strong", "big", 8192, router_pb2.MODEL_KIND_TIER, ["strong"]),
        ("auto", "small", 2048, router_pb2.MODEL_KIND_CASCADE, ["cheap", "strong"])]
    assert list(again) == list(first) and cheap.info_calls == strong.info_calls == 1


async def test_openai_replicas_serve_a_tier_and_a_cascade_step():
    async with serving_openai(FakeOpenAI()) as oai, fake_engines(Script()) as (strong,):
        cfg = router_config(tiers=f"cheap={oai.url}#{oai.model}@0.1;strong={strong.address}",
                            cascades="auto=cheap,strong")
        async with serving_router(cfg) as r:
            req = route_request(max_tokens=3)
            req.prompt_text = "Say hello"
            msgs = await r.collect(req)
            models = (await r.stub.ListModels(router_pb2.ListModelsRequest(), timeout=5)).models
    assert text_of(msgs) == "Hello, world" and not strong.generate_calls, msgs[0].route
    assert msgs[0].route.replica == f"{oai.url}#{oai.model}"
    assert msgs[0].route.cascade[0].reason == CONFIDENT
    assert oai.bodies[0]["prompt"] == "Say hello" and oai.bodies[0]["logprobs"] == 0
    assert oai.bodies[0]["max_tokens"] == 3 and oai.bodies[0]["model"] == "fake-oai"
    assert msgs[-1].response.final.usage.completion_tokens == 3
    assert (models[0].root, models[0].max_model_len, models[2].max_model_len) == \
        ("fake-oai-root", 4096, 2048)


async def test_route_decisions_are_span_attributes():
    spans = InMemorySpanExporter()
    telemetry = Telemetry.create("kvmesh-router-test", span_exporter=spans)
    async with fake_engines(Script(logprobs=[-3.0] * 3), Script()) as (cheap, strong):
        async with serving_router(cascade_config(cheap, strong), telemetry) as r:
            await r.collect(route_request())
    [server] = [s for s in spans.get_finished_spans()
                if s.name == "/kvmesh.router.v1.RouterService/Generate"]
    attrs = server.attributes
    assert (attrs["kvmesh.route.tier"], attrs["kvmesh.route.replica"]) == ("strong", strong.address)
    assert attrs["kvmesh.cascade.escalated"] is True
    assert attrs["kvmesh.cascade.reason"] == "last_tier"
    assert tuple(attrs["kvmesh.cascade.reasons"]) == ("low_confidence", "last_tier")
    assert [e.attributes["kvmesh.cascade.reason"] for e in server.events] == \
        ["low_confidence", "last_tier"]
    engine_calls = [s for s in spans.get_finished_spans()
                    if s.name == "/kvmesh.engine.v1.EngineService/Generate"]
    assert {s.context.trace_id for s in engine_calls} == {server.context.trace_id}


def test_the_router_process_never_imports_torch():
    code = ("import sys, kvmesh.services.router.__main__; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


async def test_the_router_process_serves_and_drains_on_sigterm():
    async with fake_engines(Script()) as (e0,):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvmesh.services.router", "--port", "0",
            "--tiers", f"t={e0.address}", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
            assert line.startswith("kvmesh-router listening on 127.0.0.1:"), line
            channel = grpc.aio.insecure_channel(line.split()[-1])
            await wait_for_ready(channel, timeout=10, service=ROUTER_SERVICE)
            msgs = [m async for m in router_pb2_grpc.RouterServiceStub(channel).Generate(
                route_request(), timeout=10)]
            await channel.close()
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert text_of(msgs) == " e0101 e0102 e0103" and msgs[0].route.replica == e0.address


# --- the real engine servicer (a tiny random-weight model) ----------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from engine_utils import load_tiny, make_tiny_checkpoint

    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


async def test_real_engines_kv_aware_placement_and_a_cascade(tiny):
    from engine_utils import make_core, serve_engine

    prompt = [(7 * i + 1) % 256 for i in range(100)]
    cores = [make_core(tiny, num_blocks=64, block_size=16, max_num_batched_tokens=64)
             for _ in range(2)]
    async with serve_engine(cores[0]) as e0, serve_engine(cores[1]) as e1:
        warm = engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt),
                                          sampling=engine_pb2.SamplingParams(max_tokens=1))
        await e1.collect(warm)                                # e1 now holds 96 prompt tokens
        cfg = router_config(tiers=f"t={e0.address},{e1.address};cheap={e0.address}@0.1;"
                                  f"strong={e1.address}", cascades="auto=cheap,strong",
                            default_model="t", cascade_signal="neg_entropy")
        async with serving_router(cfg) as r:
            placed = await r.collect(route_request(prompt, max_tokens=4, ignore_eos=True))
            kept = await r.collect(route_request(prompt[:20], model="auto", max_tokens=4,
                                                 ignore_eos=True, logprobs=2))
    route = placed[0].route
    assert (route.replica, route.policy, route.expected_cached_tokens) == (e1.address, KV_AWARE, 96)
    assert placed[-1].response.final.usage.cached_prompt_tokens == 96
    steps = kept[0].route.cascade
    assert steps[0].tier == "cheap" and steps[0].signal == router_pb2.CONFIDENCE_SIGNAL_NEG_ENTROPY
    assert steps[0].reason in (CONFIDENT, LOW_CONFIDENCE)
    lps = [lp for m in kept for lp in m.response.delta.logprobs]
    assert len(lps) == 4 and all(len(lp.top) == 2 for lp in lps)  # as asked, not the forced 5
    assert kept[-1].response.final.usage.completion_tokens == 4
