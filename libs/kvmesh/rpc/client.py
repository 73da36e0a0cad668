"""Outgoing calls: channels that carry trace context and always a deadline.

    channel = make_channel("127.0.0.1:50061")
    await wait_for_ready(channel, timeout=10)
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest())   # deadline: DEFAULT_TIMEOUT_S
    async for delta in stub.Generate(request, timeout=120): ...

A call without `timeout=` gets the channel's default; inside a servicer every timeout is also
capped by the remaining time of the call being served, so deadlines shrink hop by hop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from kvmesh.errors import Unavailable
from kvmesh.rpc import DEFAULT_MAX_MESSAGE_BYTES
from kvmesh.rpc.interceptors import inbound_deadline
from kvmesh.telemetry import inject_metadata, tracer

DEFAULT_TIMEOUT_S = 30.0
"""Deadline of a call that names none."""

_UNTRACED = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def call_timeout(timeout: float | None = None, *, default: float = DEFAULT_TIMEOUT_S) -> float:
    """Seconds an outgoing call may take: `timeout` (else `default`), capped by the deadline of
    the incoming call being served, if any (0 when that deadline has already passed)."""
    seconds = default if timeout is None else timeout
    deadline = inbound_deadline()
    if deadline is not None:
        seconds = min(seconds, max(deadline - time.monotonic(), 0.0))
    return seconds


def _end_span(span: Span, code: grpc.StatusCode, message: str) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))
    span.end()


class _CallPreparer:
    """Adds the deadline and the trace context to a call, opening its CLIENT span."""

    def __init__(self, default_timeout_s: float) -> None:
        self._default_timeout_s = default_timeout_s

    def _prepare(self, details: grpc.aio.ClientCallDetails
                 ) -> tuple[Span | None, grpc.aio.ClientCallDetails]:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = list(details.metadata or ())
        span = None
        if not method.startswith(_UNTRACED):
            service, _, name = method.lstrip("/").rpartition("/")
            span = tracer("kvmesh.rpc").start_span(
                method, kind=SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
            with trace.use_span(span, end_on_exit=False):
                metadata = inject_metadata(metadata)
        return span, grpc.aio.ClientCallDetails(
            details.method, call_timeout(details.timeout, default=self._default_timeout_s),
            grpc.aio.Metadata(*metadata), details.credentials, details.wait_for_ready)


class _UnaryUnaryInterceptor(_CallPreparer, grpc.aio.UnaryUnaryClientInterceptor):
    """Deadline + CLIENT span for unary calls; the span ends with the response."""

    async def intercept_unary_unary(self, continuation: Callable[..., Awaitable[Any]],
                                    client_call_details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        span, details = self._prepare(client_call_details)
        call = await continuation(details, request)
        if span is None:
            return call
        code, message = grpc.StatusCode.OK, ""
        try:
            await call  # the caller awaits it again and gets the same response or error
        except grpc.aio.AioRpcError as e:
            code, message = e.code(), e.details() or ""
        except asyncio.CancelledError:
            _end_span(span, grpc.StatusCode.CANCELLED, "cancelled by the caller")
            raise
        _end_span(span, code, message)
        return call


class _UnaryStreamInterceptor(_CallPreparer, grpc.aio.UnaryStreamClientInterceptor):
    """Deadline + CLIENT span for server streams; the span ends with the stream."""

    async def intercept_unary_stream(self, continuation: Callable[..., Awaitable[Any]],
                                     client_call_details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        span, details = self._prepare(client_call_details)
        call = await continuation(details, request)
        return call if span is None else _traced_stream(call, span)


async def _traced_stream(call: Any, span: Span) -> AsyncIterator[Any]:
    code, message = grpc.StatusCode.OK, ""
    try:
        async for response in call:
            yield response
    except grpc.aio.AioRpcError as e:
        code, message = e.code(), e.details() or ""
        raise
    except (asyncio.CancelledError, GeneratorExit):
        code, message = grpc.StatusCode.CANCELLED, "cancelled by the caller"
        raise
    finally:
        _end_span(span, code, message)


def make_channel(target: str, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 default_timeout_s: float = DEFAULT_TIMEOUT_S,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An insecure asyncio channel to `target` ("host:port") with kvmesh's client interceptor.

    Every unary and server-streaming call gets a deadline (`default_timeout_s` unless the call
    passes `timeout=`, capped by the incoming call's deadline) and, except health and
    reflection, a CLIENT span whose context travels in the call's metadata. `options` are extra
    grpc channel arguments (e.g. reconnect back-off). Close it with `await channel.close()`.
    """
    return grpc.aio.insecure_channel(
        target,
        options=[("grpc.max_send_message_length", max_message_bytes),
                 ("grpc.max_receive_message_length", max_message_bytes), *options],
        # grpc files each interceptor under one call type only, hence one object per type.
        interceptors=[_UnaryUnaryInterceptor(default_timeout_s),
                      _UnaryStreamInterceptor(default_timeout_s)])


class _SyncTracing(grpc.UnaryUnaryClientInterceptor, grpc.StreamUnaryClientInterceptor):
    """CLIENT span + trace context for blocking calls (threads that are not on an event loop:
    the engine's step loop calling the draft service, its export thread storing KV). The span's
    parent is the thread's current context, which the caller sets to the request's."""

    def _traced(self, continuation, details, request):
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.startswith(_UNTRACED):
            return continuation(details, request)
        service, _, name = method.lstrip("/").rpartition("/")
        span = tracer("kvmesh.rpc").start_span(
            method, kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
        with trace.use_span(span, end_on_exit=False):
            metadata = inject_metadata(details.metadata)
        details = _SyncDetails(details.method, details.timeout, metadata, details.credentials,
                               details.wait_for_ready, details.compression)
        try:
            outcome = continuation(details, request)
            outcome.result()  # blocks until the answer (or raises its error)
        except grpc.RpcError as e:
            _end_span(span, e.code(), e.details() or "")
            raise
        _end_span(span, grpc.StatusCode.OK, "")
        return outcome

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return self._traced(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return self._traced(continuation, client_call_details, request_iterator)


class _SyncDetails(grpc.ClientCallDetails):
    def __init__(self, method, timeout, metadata, credentials, wait_for_ready, compression) -> None:
        self.method, self.timeout, self.metadata = method, timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = credentials, wait_for_ready, compression


def make_sync_channel(target: str, *, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A blocking insecure channel to `target` whose unary and client-streaming calls open a
    CLIENT span in the calling thread's current context and carry it in their metadata (callers
    pass their own deadlines)."""
    return grpc.intercept_channel(grpc.insecure_channel(target, options=list(options)), _SyncTracing())


async def wait_for_ready(channel: grpc.aio.Channel, timeout: float, service: str = "") -> None:
    """Wait until the server behind `channel` reports `service` ("" = the whole server) SERVING.

    Uses a health Watch with wait_for_ready, so it connects as soon as the server listens and
    returns on the first SERVING; raises `Unavailable` when that does not happen within `timeout`.
    """
    call = health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True)
    last = "no answer"
    try:
        async for response in call:
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return
            last = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    except grpc.aio.AioRpcError as e:
        last = e.code().name
    finally:
        call.cancel()
    raise Unavailable(f"{service or 'server'} was not SERVING within {timeout}s (last: {last}); "
                      "check that it is running and listening on the target address")
