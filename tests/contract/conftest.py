"""Contract-test fixtures: the real gateway in front of the fake router (see tests/gateway_utils.py).

Each harness is started once per module; `reset` gives every test a fresh fake-router state.
"""
from __future__ import annotations

import openai
import pytest

from gateway_utils import GatewayHarness, write_keys


@pytest.fixture(scope="module")
def gateway():
    """An open gateway (no keys file): every request is tenant "default"."""
    with GatewayHarness() as h:
        yield h


@pytest.fixture(autouse=True)
def _fresh_fake(request):
    for name in ("gateway", "keyed_gateway", "small_gateway"):
        if name in request.fixturenames:
            request.getfixturevalue(name).reset()


@pytest.fixture(scope="module")
def keys_and_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    keys = write_keys(path, {"acme": {}, "globex": {"max_inflight_requests": 1},
                             "shared-a": {"cache_namespace": "team"},
                             "shared-b": {"cache_namespace": "team"}})
    return keys, path


@pytest.fixture(scope="module")
def keyed_gateway(keys_and_file):
    """A gateway with a keys file of four tenants (globex capped at 1 request in flight)."""
    _, path = keys_and_file
    with GatewayHarness(keys_file=path) as h:
        yield h


@pytest.fixture(scope="module")
def small_gateway():
    """A gateway that admits at most 2 upstream requests / 300 prompt tokens in flight."""
    with GatewayHarness(max_inflight_requests=2, max_inflight_prompt_tokens=300) as h:
        yield h


@pytest.fixture
def client(gateway):
    with openai.OpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture
async def aclient(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="unused", max_retries=0) as c:
        yield c
