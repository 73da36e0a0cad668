"""HTTP responses that notice a client leaving: the SSE stream and the wait for a full response.

NOTE (disconnect detection). Starlette's StreamingResponse alone is not enough: under ASGI spec
2.4 it only learns of a disconnect when a write fails, so a stream waiting on a slow prefill (or
a cascade holding its answer) would keep its upstream call alive, and under older specs it
cancels the writer but leaves the body generator suspended at its `yield` until garbage
collection. Here every response runs a watcher task on the ASGI `receive` channel next to the
work: once the request body is read, the next message the server delivers is `http.disconnect`
(uvicorn sends it as soon as the socket closes). The watcher finishing first cancels the work,
and the `on_close` hook then closes the generation, which cancels the router calls at once.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

CLIENT_CLOSED = 499  # nginx's "client closed request": the outcome label of an abandoned request


class ClientGone(Exception):
    """The HTTP client disconnected before the response was complete."""


async def wait_disconnect(receive: Receive) -> None:
    """Return when the ASGI server reports the client gone (call after the body is read)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def race_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T:
    """`await work`, unless the client disconnects first: then cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


class EventStream(Response):
    """A `text/event-stream` response over `events`, cancelled the moment the client leaves.

    `on_close(disconnected)` runs exactly once after the stream ends for any reason (finished,
    failed, client gone, server shutting down), after `events` has been closed.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes],
                 on_close: Callable[[bool], Awaitable[None]]) -> None:
        self.events = events
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for chunk in self.events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        disconnected = True
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
            # A failed write (OSError) also means the client is gone.
            disconnected = not pump.done() or pump.cancelled() or pump.exception() is not None
        finally:
            pump.cancel()
            watcher.cancel()
            await asyncio.gather(pump, watcher, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
            await self.on_close(disconnected)
