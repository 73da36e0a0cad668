"""The load-test harness reads a kvmesh gateway's KV hit counters as the gateway exports them:
labelled with `model_name`, one series per model, summed."""
from __future__ import annotations

import httpx
from prometheus_client import generate_latest

from kvmesh.loadtest.harness.runner import scrape_hits
from kvmesh.metrics import ModelRegistry
from kvmesh.services.gateway.metrics import GatewayMetrics


async def test_hits_of_every_model_are_summed():
    registry = ModelRegistry()
    tokens = GatewayMetrics(registry).tokens
    for model, prompt, cached in (("tiny", 1000, 640), ("big", 200, 60)):
        tokens.labels(model, "prompt").inc(prompt)
        tokens.labels(model, "cached").inc(cached)
        tokens.labels(model, "completion").inc(9)
    text = generate_latest(registry).decode()
    assert 'kvmesh_gateway_tokens_total{kind="cached",model_name="tiny"} 640.0' in text

    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(200, text=text))) as client:
        assert await scrape_hits("http://x:1/v1", client) == (700.0, 1200.0)
