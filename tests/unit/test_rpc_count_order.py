"""A failed call is counted before its status goes out, whichever way it fails.

The interceptor's wrapped handlers run against a fake context that reads
`kvmesh_rpc_server_handled_total` at the moment `abort` is called, i.e. when grpc would send the
status: a client that has seen the status must find the call counted. (On a real server the
ordering shows only when a race hits; here it is checked every time.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
import pytest

from kvmesh.errors import NotFound
from kvmesh.rpc.interceptors import ServerInterceptor
from kvmesh.telemetry import Telemetry

METHOD = "/kvmesh.test.v1.Order/Call"


class FakeContext:
    """What the interceptor and a servicer use of grpc's context, recording each abort with the
    count its code had at that moment."""

    def __init__(self, interceptor: ServerInterceptor) -> None:
        self.interceptor = interceptor
        self.aborts: list[tuple[grpc.StatusCode, float]] = []
        self._code: grpc.StatusCode | None = None
        self._details: str | None = None

    def invocation_metadata(self) -> tuple:
        return ()

    def time_remaining(self) -> float | None:
        return None

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str | None:
        return self._details

    def handled(self, code: grpc.StatusCode) -> float:
        labels = {"grpc_service": "kvmesh.test.v1.Order", "grpc_method": "Call",
                  "grpc_code": code.name}
        value = self.interceptor.telemetry.registry.get_sample_value(
            "kvmesh_rpc_server_handled_total", labels)
        return value or 0.0

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> NoReturn:
        if self._code is not None:  # grpc refuses a second abort the same way
            raise RuntimeError("abort called twice")
        self._code, self._details = code, details
        self.aborts.append((code, self.handled(code)))
        raise grpc.aio.AbortError(details)


async def fail_with(kind: str, context: Any) -> None:
    if kind == "raise":
        raise NotFound("chunk 7 is gone; insert it again")
    if kind == "crash":
        raise ZeroDivisionError("mid-call")
    if kind == "abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")


EXPECTED = {"raise": grpc.StatusCode.NOT_FOUND, "crash": grpc.StatusCode.INTERNAL,
            "abort": grpc.StatusCode.PERMISSION_DENIED}


@pytest.mark.parametrize("kind", sorted(EXPECTED))
async def test_unary_failure_is_counted_before_its_status_is_sent(kind: str) -> None:
    interceptor = ServerInterceptor(Telemetry.create("kvmesh-test"))

    async def behavior(request: bytes, context: Any) -> bytes:
        await fail_with(kind, context)
        return request

    unary = interceptor._wrap(METHOD, behavior, client_stream=False)
    context = FakeContext(interceptor)
    with pytest.raises(grpc.aio.AbortError):
        await unary(b"x", context)
    code = EXPECTED[kind]
    assert context.aborts == [(code, 1.0)]  # counted once, before the status
    assert context.handled(code) == 1.0  # and not again when the call ended
    assert interceptor.in_flight == 0


@pytest.mark.parametrize("kind", sorted(EXPECTED))
async def test_stream_failure_mid_stream_is_counted_before_its_status_is_sent(kind: str) -> None:
    interceptor = ServerInterceptor(Telemetry.create("kvmesh-test"))

    async def behavior(request: bytes, context: Any) -> AsyncIterator[bytes]:
        yield b"0"
        await fail_with(kind, context)
        yield b"1"

    stream = interceptor._wrap(METHOD, behavior, client_stream=False)
    context = FakeContext(interceptor)
    received = []
    with pytest.raises(grpc.aio.AbortError):
        async for item in stream(b"x", context):
            received.append(item)
    code = EXPECTED[kind]
    assert received == [b"0"]
    assert context.aborts == [(code, 1.0)]
    assert context.handled(code) == 1.0
    assert interceptor.in_flight == 0


async def test_servicer_context_passes_everything_else_through() -> None:
    interceptor = ServerInterceptor(Telemetry.create("kvmesh-test"))
    seen = []

    async def behavior(request: bytes, context: Any) -> bytes:
        seen.append((context.time_remaining(), context.invocation_metadata()))
        return request

    context = FakeContext(interceptor)
    assert await interceptor._wrap(METHOD, behavior, client_stream=False)(b"x", context) == b"x"
    assert seen == [(None, ())]
    assert context.handled(grpc.StatusCode.OK) == 1.0 and context.aborts == []
