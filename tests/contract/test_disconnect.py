"""A client that goes away cancels the upstream router call at once, and its slot comes back.

No sleeps and no clock: the fake router's Generate handler waits until it is cancelled (it never
finishes by itself), so its cancellation event being set is the proof that the client's leaving
cancelled it; the wait's timeout only guards against a hang.
"""
from __future__ import annotations

import asyncio
import socket

import httpx

from gateway_utils import MODEL

USER = [{"role": "user", "content": "hi"}]


def _inflight(h) -> int:
    return h.call(lambda: h.gateway.admission.inflight_requests)


def _wait_inflight_zero(h, timeout: float = 2.0) -> bool:
    async def idle() -> None:
        await asyncio.wait_for(h.gateway.admission.wait_idle(), timeout)
    h.run(idle(), timeout + 1)
    return _inflight(h) == 0


def test_streaming_disconnect_cancels_upstream(gateway):
    gateway.state.hang = True  # after the first word, the fake waits until cancelled
    body = {"model": MODEL, "messages": USER, "stream": True, "n": 2}
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", f"{gateway.base_url}/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")  # streaming has begun
            assert _inflight(gateway) == 2
    # leaving both blocks closed the connection with the stream unfinished
    assert gateway.state.cancelled.wait(5), "the upstream call was never cancelled"
    assert _wait_inflight_zero(gateway)


def test_disconnect_before_first_token_cancels_upstream(gateway):
    """Waiting for a slow first token (no bytes sent yet) still notices the client leaving."""
    gateway.state.gate = gateway.call(asyncio.Event)  # never released
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n")
    for stream in (True, False):
        gateway.reset()
        gateway.state.gate = gateway.call(asyncio.Event)
        payload = httpx.Request("POST", "http://x", json={"model": MODEL, "messages": USER,
                                                          "stream": stream}).read()
        sock = socket.create_connection(("127.0.0.1", gateway.http_port))
        sock.sendall(request % len(payload) + payload)
        assert gateway.state.received.wait(5)
        sock.close()
        assert gateway.state.cancelled.wait(5), f"stream={stream}: upstream never cancelled"
        assert _wait_inflight_zero(gateway)


async def test_async_client_abandoning_a_stream_cancels_upstream(gateway):
    import openai

    gateway.state.hang = True
    async with openai.AsyncOpenAI(base_url=gateway.base_url, api_key="x", max_retries=0) as c:
        stream = await c.completions.create(model=MODEL, prompt="x", stream=True)
        async for _ in stream:
            break
        await stream.close()
    assert await asyncio.to_thread(gateway.state.cancelled.wait, 5)
    assert _wait_inflight_zero(gateway)
