"""API keys and tenants over HTTP: 401 without a valid key, tenants' KV salts, per-tenant caps."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from gateway_utils import MODEL

USER = [{"role": "user", "content": "hi"}]


def _client(h, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base_url, api_key=key, max_retries=0)


def test_bad_key_is_401(keyed_gateway):
    with _client(keyed_gateway, "sk-kvmesh-wrong") as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.chat.completions.create(model=MODEL, messages=USER)
        assert e.value.status_code == 401
        assert e.value.response.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    assert keyed_gateway.state.calls == []


def test_no_header_is_401(keyed_gateway):
    r = httpx.post(f"{keyed_gateway.base_url}/chat/completions",
                   json={"model": MODEL, "messages": USER})
    assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
    root = keyed_gateway.base_url.removesuffix("/v1")
    assert httpx.get(f"{root}/health").status_code == 200  # probes need no key


def test_good_key_is_200_and_tenants_get_their_own_salt(keyed_gateway, keys_and_file):
    keys, _ = keys_and_file
    for tenant in ("acme", "globex", "shared-a", "shared-b"):
        with _client(keyed_gateway, keys[tenant]) as c:
            assert c.chat.completions.create(model=MODEL, messages=USER).choices
    sent = {c.request.tenant: c.request.request.cache_salt for c in keyed_gateway.state.calls}
    assert sent["acme"] == "tenant:acme" and sent["globex"] == "tenant:globex"
    assert sent["acme"] != sent["globex"]
    assert sent["shared-a"] == sent["shared-b"] == "ns:team"  # the operator chose to share
    metrics = httpx.get(keyed_gateway.base_url.removesuffix("/v1") + "/metrics").text
    assert f'endpoint="/v1/chat/completions",model_name="{MODEL}",status="200",tenant="acme"' in metrics
    assert 'model_name="*",status="401",tenant="unauthenticated"' in metrics  # no model before the key


async def test_tenant_in_flight_cap_is_429(keyed_gateway, keys_and_file):
    keys, _ = keys_and_file
    h = keyed_gateway
    h.state.gate = h.call(asyncio.Event)
    async with openai.AsyncOpenAI(base_url=h.base_url, api_key=keys["globex"], max_retries=0) as c:
        held = asyncio.ensure_future(c.chat.completions.create(model=MODEL, messages=USER))
        assert await asyncio.to_thread(h.state.received.wait, 5)
        with pytest.raises(openai.RateLimitError) as e:
            await c.chat.completions.create(model=MODEL, messages=USER)
        assert e.value.response.headers["retry-after"] == "1"
        assert e.value.body["code"] == "rate_limit_exceeded" and "globex" in e.value.body["message"]
        async with openai.AsyncOpenAI(base_url=h.base_url, api_key=keys["acme"],
                                      max_retries=0) as other:  # other tenants are not capped
            gate_open = asyncio.ensure_future(other.chat.completions.create(model=MODEL, messages=USER))
            h.call(h.state.gate.set)
            await gate_open
        await held
    assert h.call(lambda: h.gateway.admission.inflight_requests) == 0


def test_keys_added_while_running_work_without_restart(keyed_gateway, keys_and_file):
    from kvmesh.services.gateway.keys import add_key

    _, path = keys_and_file
    _, key = add_key(path, "newcomer")
    # Requests re-check the file at most once a second; force the check instead of waiting.
    keyed_gateway.call(keyed_gateway.gateway.keys.reload_if_changed)
    with _client(keyed_gateway, key) as c:
        assert [m.id for m in c.models.list().data][0] == MODEL
