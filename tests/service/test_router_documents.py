"""Prompts in parts (documents marked) through the router: placement probes the leading plain
tokens, engines get the parts and their blend report is relayed, and OpenAI-compatible tiers
refuse what only an engine can resolve."""
from __future__ import annotations

import grpc
import pytest

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.router.v1 import router_pb2
from router_utils import (FakeOpenAI, Script, fake_engines, router_config, serving_openai,
                          serving_router, text_of)

PREFIX = list(range(1, 97))  # 96 plain tokens before the first document


def tokens(ids) -> engine_pb2.PromptPart:
    return engine_pb2.PromptPart(tokens=common_pb2.TokenIds(ids=ids))


def parts_request(*parts: engine_pb2.PromptPart, model: str = "") -> router_pb2.RouteRequest:
    return router_pb2.RouteRequest(model=model, tenant="t1", request=engine_pb2.GenerateRequest(
        parts=engine_pb2.Prompt(parts=parts), cache_salt="salt",
        blend=engine_pb2.BlendOptions(recompute_ratio=0.25)))


INLINE = engine_pb2.PromptPart(document=common_pb2.TokenIds(ids=[500] * 64))
CATALOG = engine_pb2.PromptPart(document_id="cat-7")
RETRIEVE = engine_pb2.PromptPart(retrieve=engine_pb2.Retrieve(
    query="q", k=2, separator=common_pb2.TokenIds(ids=[10, 10])))


async def test_parts_are_placed_by_their_leading_tokens_and_the_blend_report_is_relayed():
    report = engine_pb2.Final(blended_tokens=64, recomputed_tokens=16, document_ids=["cat-7"])
    async with fake_engines(Script(cached_tokens=0), Script(cached_tokens=64, final=report)
                            ) as (e0, e1):
        async with serving_router(router_config(tiers=f"t={e0.address},{e1.address}")) as r:
            request = parts_request(tokens(PREFIX[:64]), tokens(PREFIX[64:]), INLINE,
                                    tokens([10, 10]), CATALOG, tokens([7, 8]))
            msgs = await r.collect(request)
    for engine in (e0, e1):
        [probe] = engine.probe_calls
        assert list(probe.token_ids.ids) == PREFIX and probe.cache_salt == "salt"
    assert msgs[0].route.replica == e1.address and msgs[0].route.expected_cached_tokens == 64
    [sent] = e1.generate_calls
    assert list(sent.parts.parts) == list(request.request.parts.parts)
    assert sent.blend.recompute_ratio == 0.25 and not e0.generate_calls
    final = msgs[-1].response.final
    assert (final.blended_tokens, final.recomputed_tokens, list(final.document_ids)) == \
        (64, 16, ["cat-7"])


async def test_parts_that_start_with_a_document_are_not_probed():
    async with fake_engines(Script(), Script()) as (e0, e1):
        async with serving_router(router_config(tiers=f"t={e0.address},{e1.address}")) as r:
            msgs = await r.collect(parts_request(INLINE, tokens([1, 2, 3])))
    assert not e0.probe_calls and not e1.probe_calls
    assert msgs[0].route.policy == router_pb2.PLACEMENT_POLICY_LEAST_LOADED and msgs[-1].response.HasField("final")


async def test_difficulty_routing_counts_plain_and_inline_document_tokens():
    async with fake_engines(Script(), Script()) as (cheap, strong):
        cfg = router_config(tiers=f"cheap={cheap.address}@0.2;strong={strong.address}@1",
                            cascades="auto=cheap,strong", difficulty_prompt_tokens=100)
        async with serving_router(cfg) as r:
            long = await r.collect(parts_request(tokens(PREFIX[:40]), INLINE, CATALOG))
            short = await r.collect(parts_request(tokens(PREFIX[:30]), INLINE, CATALOG))
    assert long[0].route.cascade[0].reason == router_pb2.CASCADE_REASON_DIFFICULTY  # 40 + 64 >= 100
    assert short[0].route.cascade[0].reason == router_pb2.CASCADE_REASON_CONFIDENT  # 30 + 64 < 100


@pytest.mark.parametrize("part, kind", [(CATALOG, "document_id"), (RETRIEVE, "retrieve")])
async def test_an_openai_tier_refuses_catalogued_documents(part, kind):
    async with serving_openai(FakeOpenAI()) as oai:
        async with serving_router(router_config(tiers=f"oai={oai.url}#{oai.model}")) as r:
            request = parts_request(tokens([1, 2]), part, tokens([3]))
            request.prompt_text = "Say hello"
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await r.collect(request)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert f"cannot resolve {kind} prompt parts" in e.value.details()
    assert "send the documents inline" in e.value.details()
    assert oai.bodies == []  # refused before any HTTP call


async def test_an_openai_tier_serves_inline_documents_as_text_and_a_cascade_escalates():
    async with serving_openai(FakeOpenAI()) as oai, fake_engines(Script()) as (strong,):
        cfg = router_config(tiers=f"cheap={oai.url}#{oai.model}@0.1;strong={strong.address}",
                            cascades="auto=cheap,strong")
        async with serving_router(cfg) as r:
            inline = parts_request(tokens([1, 2]), INLINE, tokens([3]), model="cheap")
            inline.prompt_text = "Doc.\n\nSay hello"
            served = await r.collect(inline)
            retrieval = parts_request(tokens([1, 2]), RETRIEVE, tokens([3]), model="auto")
            retrieval.prompt_text = "Say hello"
            escalated = await r.collect(retrieval)
    assert text_of(served) == "Hello, world" and oai.bodies[0]["prompt"] == "Doc.\n\nSay hello"
    assert len(oai.bodies) == 1  # the retrieval request never reached the endpoint
    assert [(s.tier, s.reason) for s in escalated[0].route.cascade] == \
        [("cheap", router_pb2.CASCADE_REASON_TIER_FAILED), ("strong", router_pb2.CASCADE_REASON_LAST_TIER)]
    assert strong.generate_calls[0].parts.parts[1].retrieve.k == 2
