"""The engine's KV-service client backs off after a call goes unanswered (KvcacheClient's NOTE):
requests then skip the service instead of each waiting out the deadline."""
import asyncio
import time

import grpc
import pytest

from fake_clock import FakeClock
from kvmesh.errors import Unavailable
from kvmesh.kvcache.v1 import kvcache_pb2_grpc
from kvmesh.launcher import free_port
from kvmesh.rpc import interceptors
from kvmesh.services.engine.kvcache_client import KvcacheClient

KEYS = [b"k" * 32]


async def test_an_unanswered_call_skips_the_service_for_retry_s_then_tries_again():
    clock = FakeClock()
    client = KvcacheClient(f"127.0.0.1:{free_port()}", timeout_s=2.0, retry_s=3.0, clock=clock)  # nothing listens
    try:
        with pytest.raises(Unavailable, match="UNAVAILABLE"):
            await client.lookup(KEYS)
        clock.advance(2.9)
        for call in (lambda: client.lookup(KEYS), lambda: anext(client.get(KEYS))):
            with pytest.raises(Unavailable, match=r"not called for 0\.1s more after it failed \(UNAVAILABLE"):
                await call()
        assert client.skipped_calls == 2
        clock.advance(0.2)
        with pytest.raises(Unavailable, match="UNAVAILABLE"):  # called again: still down
            await client.lookup(KEYS)
        assert client.skipped_calls == 2
    finally:
        await client.close()


async def test_retry_s_zero_never_skips():
    client = KvcacheClient(f"127.0.0.1:{free_port()}", timeout_s=2.0, retry_s=0.0, clock=FakeClock())
    try:
        for _ in range(2):
            with pytest.raises(Unavailable, match="UNAVAILABLE"):
                await client.lookup(KEYS)
        assert client.skipped_calls == 0
    finally:
        await client.close()


class _HungKvService(kvcache_pb2_grpc.KvcacheServiceServicer):
    """Answers no Lookup: each waits until its caller gives up."""

    def __init__(self) -> None:
        self.calls = 0

    async def Lookup(self, request, context):
        self.calls += 1
        await asyncio.Event().wait()


async def test_a_call_cut_short_by_the_served_requests_deadline_does_not_mark_the_service_down():
    server = grpc.aio.server()
    hung = _HungKvService()
    kvcache_pb2_grpc.add_KvcacheServiceServicer_to_server(hung, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = KvcacheClient(f"127.0.0.1:{port}", timeout_s=1.0, retry_s=30.0, clock=FakeClock())
    try:
        # Served with 0.2 s left: the Lookup inherits that deadline and misses it; the service
        # was not given the client's own second, so it is not marked down.
        token = interceptors._inbound_deadline.set(time.monotonic() + 0.2)
        try:
            with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED"):
                await client.lookup(KEYS)
        finally:
            interceptors._inbound_deadline.reset(token)
        # The next call is made (not skipped); with its full second unanswered, the service is down.
        with pytest.raises(Unavailable, match="DEADLINE_EXCEEDED"):
            await client.lookup(KEYS)
        assert (hung.calls, client.skipped_calls) == (2, 0)
        with pytest.raises(Unavailable, match="not called for"):
            await client.lookup(KEYS)
        assert (hung.calls, client.skipped_calls) == (2, 1)
    finally:
        await client.close()
        await server.stop(None)
