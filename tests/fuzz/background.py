"""Servers on a background event loop, for the synchronous fuzz tests.

Hypothesis drives a synchronous test function, one example at a time; the services under test are
asyncio servers. `LoopThread` runs the repository's async harnesses (kvcache_utils.serving,
draft_utils.serving_draft, engine_utils.serve_engine, router_utils.serving_router) on a loop of
its own thread, so a test enters them once and then calls the servers over real sockets with a
plain blocking gRPC channel, as GatewayHarness does for the gateway.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, AsyncContextManager, TypeVar

T = TypeVar("T")


class LoopThread:
    """An asyncio loop on a daemon thread; `enter` opens async context managers on it, and
    leaving the LoopThread closes them (last first) and stops the loop."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._stack = contextlib.AsyncExitStack()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        """Run `coro` on the loop and return its result (the timeout only bounds a broken test)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def enter(self, manager: AsyncContextManager[T]) -> T:
        """Enter `manager` on the loop; it is exited when this LoopThread closes."""
        return self.run(self._stack.enter_async_context(manager))

    def __enter__(self) -> LoopThread:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.run(self._stack.aclose())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            self.loop.close()
