"""/health follows the router and the drain; a draining gateway finishes what it admitted."""
from __future__ import annotations

import asyncio

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway_utils import MODEL, GatewayHarness

USER = [{"role": "user", "content": "hi"}]


def test_health_is_503_while_the_router_is_unreachable(gateway):
    root = gateway.base_url.removesuffix("/v1")
    gateway.state.models_fail = grpc.StatusCode.UNAVAILABLE
    r = httpx.get(f"{root}/health")
    assert r.status_code == 503 and "router is unavailable" in r.json()["status"]
    with openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as c:
        with pytest.raises(openai.InternalServerError) as e:
            c.models.list()
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    gateway.state.models_fail = None
    assert httpx.get(f"{root}/health").status_code == 200


async def test_drain_refuses_new_work_and_finishes_admitted_work():
    with GatewayHarness(grace_s=5.0) as h:
        h.state.gate = h.call(asyncio.Event)
        root = h.base_url.removesuffix("/v1")
        async with openai.AsyncOpenAI(base_url=h.base_url, api_key="x", max_retries=0) as c, \
                grpc.aio.insecure_channel(h.grpc_address) as channel:
            held = asyncio.ensure_future(c.chat.completions.create(model=MODEL, messages=USER))
            assert await asyncio.to_thread(h.state.received.wait, 5)
            drained = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(h.server.stop(), h.loop))
            health = health_pb2_grpc.HealthStub(channel)
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            async for status in watch:  # SERVING first, then NOT_SERVING once the drain began
                if status.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                    break
            watch.cancel()
            async with httpx.AsyncClient() as http:
                r = await http.get(f"{root}/health")
                assert r.status_code == 503 and r.json() == {"status": "draining"}
            with pytest.raises(openai.InternalServerError) as e:
                await c.chat.completions.create(model=MODEL, messages=USER)
            assert e.value.status_code == 503 and e.value.body["code"] == "draining"
            h.call(h.state.gate.set)
            assert (await held).choices[0].finish_reason == "stop"
            await asyncio.wait_for(drained, 5)
