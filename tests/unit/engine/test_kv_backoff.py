"""The engine's KV-service client backs off after a call goes unanswered (KvcacheClient's NOTE):
requests then skip the service instead of each waiting out the deadline."""
import pytest

from fake_clock import FakeClock
from kvmesh.errors import Unavailable
from kvmesh.launcher import free_port
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
