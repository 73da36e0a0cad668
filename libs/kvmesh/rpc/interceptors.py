"""The one server interceptor: domain errors → status codes, a SERVER span per call, RPC metrics.

Every kvmesh servicer method runs inside `ServerInterceptor`, which

- maps a `KvmeshError` raised by the method (before or in the middle of a stream) to
  `context.abort(error.code, error.message)`, the message cut to `MAX_DETAILS_BYTES`;
- maps any other exception to INTERNAL, logging its traceback; the server keeps serving;
- opens a SERVER span named after the full method, parented by the W3C `traceparent` in the
  call's metadata, current while the method's code runs (so its outgoing calls join the trace);
- records `kvmesh_rpc_server_handled_total` and `kvmesh_rpc_server_handling_seconds` in the
  server's registry; a failed call (raised, crashed, or aborted by the servicer itself) is
  counted before its status goes out, so a client that has seen the status finds it counted;
- answers a request protobuf cannot parse (a string field that is not UTF-8, say) with
  INVALID_ARGUMENT naming the field (kvmesh.rpc.wire) rather than grpc's INTERNAL, in a client
  stream too (when the servicer reaches that message);
- exposes the call's deadline to outgoing calls (`inbound_deadline`), counts calls in flight
  so a draining server knows when they are done, and, once told the server is draining,
  refuses new calls with UNAVAILABLE (a clear "retry elsewhere" for routers).

Health and reflection calls pass through untouched: probes would flood traces and metrics, and
a health Watch never ends on its own, so it must not count as work in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, NoReturn

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import CollectorRegistry, Counter, Histogram

from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.metrics import metric_name
from kvmesh.rpc.wire import describe_invalid
from kvmesh.telemetry import Telemetry, extract_context

log = logging.getLogger(__name__)

_PASS_THROUGH = ("/grpc.health.v1.Health/", "/grpc.reflection.")
MAX_DETAILS_BYTES = 2000
"""Longest status message sent, in UTF-8 bytes. grpc carries it percent-encoded in a trailer, and
clients refuse trailers past 8-16 KiB: a message quoting a huge input (a 1 MiB model name) would
reach the caller as RESOURCE_EXHAUSTED "metadata size exceeds hard limit", not as its status."""


def _details(message: str) -> str:
    """`message` cut to MAX_DETAILS_BYTES (saying so), lone surrogates escaped: what the caller gets."""
    raw = message.encode("utf-8", "backslashreplace")
    if len(raw) <= MAX_DETAILS_BYTES:
        return raw.decode("utf-8")
    kept = raw[:MAX_DETAILS_BYTES].decode("utf-8", "ignore")
    return f"{kept}... ({len(raw) - len(kept.encode('utf-8'))} more bytes cut)"


class RpcMetrics:
    """A server's call counts and durations, registered in its service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handled = Counter(
            metric_name("rpc", "server_handled"), "Finished server calls by status code.",
            ["grpc_service", "grpc_method", "grpc_code"], registry=registry)
        self.handling_seconds = Histogram(
            metric_name("rpc", "server_handling_seconds"),
            "Server call duration, first byte in to status out.", ["grpc_service", "grpc_method"],
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300), registry=registry)


# time.monotonic() by which the call being served must finish; None outside a call or when the
# caller set no deadline.
_inbound_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "kvmesh_inbound_deadline", default=None)


def inbound_deadline() -> float | None:
    """The `time.monotonic()` deadline of the incoming call whose code is running, if any."""
    return _inbound_deadline.get()


class _Call:
    """Span, deadline, metrics and in-flight accounting of one incoming call."""

    def __init__(self, owner: ServerInterceptor, method: str, context: grpc.aio.ServicerContext):
        self.owner, self.method = owner, method
        self.service, _, self.name = method.lstrip("/").rpartition("/")
        self.started = time.perf_counter()
        self.code = grpc.StatusCode.OK
        self.message = ""
        self.counted = False
        remote = extract_context(context.invocation_metadata())
        self.span = owner.telemetry.tracer("kvmesh.rpc").start_span(
            method, context=remote, kind=SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": self.service,
                        "rpc.method": self.name})
        # the servicer's code (its outgoing calls, its own spans) traces into this server's provider
        self.otel_context = owner.telemetry.context(trace.set_span_in_context(self.span, remote))
        remaining = context.time_remaining()
        self.deadline = None if remaining is None else time.monotonic() + remaining
        owner._enter()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make the span current and the deadline visible while the servicer's code runs."""
        token = otel_context.attach(self.otel_context)
        deadline_token = _inbound_deadline.set(self.deadline)
        try:
            yield
        finally:
            _inbound_deadline.reset(deadline_token)
            otel_context.detach(token)

    async def fail(self, exc: BaseException, context: grpc.aio.ServicerContext) -> NoReturn:
        """Turn `exc` into the call's status: abort with a code, or re-raise as it is."""
        if isinstance(exc, KvmeshError):
            self.code, self.message = exc.code, _details(exc.message)
            self.count()
            await context.abort(exc.code, self.message)
        if isinstance(exc, grpc.aio.AbortError):  # the servicer aborted (counted in its abort)
            if not self.counted:
                self.code = context.code() or grpc.StatusCode.UNKNOWN
                self.message = context.details() or ""
        elif isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            self.code = grpc.StatusCode.CANCELLED
        elif isinstance(exc, Exception):
            trace_id = format(self.span.get_span_context().trace_id, "032x")
            log.error("unhandled %s in %s (trace_id %s)", type(exc).__name__, self.method,
                      trace_id, exc_info=exc)
            self.code = grpc.StatusCode.INTERNAL
            self.message = (f"internal error in {self.method} ({type(exc).__name__}); "
                            f"see the server log for trace_id {trace_id}")
            self.count()
            await context.abort(self.code, self.message)
        raise exc

    def count(self) -> None:
        """Count the call under its status code, once; before an abort sends the status, so a
        client that has seen the status finds it counted."""
        if not self.counted:
            self.counted = True
            self.owner.metrics.handled.labels(self.service, self.name, self.code.name).inc()

    def end(self) -> None:
        """Close the span, record metrics and leave the in-flight count."""
        self.span.set_attribute("rpc.grpc.status_code", self.code.value[0])
        if self.code is not grpc.StatusCode.OK:
            self.span.set_status(Status(StatusCode.ERROR, f"{self.code.name}: {self.message}"))
        self.span.end()
        metrics = self.owner.metrics
        self.count()
        metrics.handling_seconds.labels(self.service, self.name).observe(
            time.perf_counter() - self.started)
        self.owner._leave()


class _CountingContext:
    """The context a servicer gets: the call's own, except that an `abort` the servicer sends
    itself is counted under its code first (as for a raised error), so the count is never behind
    a status the client has already seen."""

    def __init__(self, context: grpc.aio.ServicerContext, call: _Call) -> None:
        self._context, self._call = context, call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "",
                    trailing_metadata: Any = ()) -> NoReturn:
        self._call.code, self._call.message = code, details
        self._call.count()
        await self._context.abort(code, details, trailing_metadata)


class _Unparsable:
    """What a lenient deserializer returns for bytes protobuf refused: the call then fails with
    INVALID_ARGUMENT and this message (a deserializer that raises gets INTERNAL from grpc)."""

    def __init__(self, message: str) -> None:
        self.message = message


def _lenient(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    cls = getattr(deserializer, "__self__", None)  # generated code passes Message.FromString
    descriptor = getattr(cls, "DESCRIPTOR", None)
    if descriptor is None:
        return deserializer

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except Exception:  # protobuf's DecodeError (the C and Python backends raise alike)
            return _Unparsable(describe_invalid(descriptor, raw))
    return parse


def _check_parsed(request: Any) -> None:
    if isinstance(request, _Unparsable):
        raise InvalidArgument(request.message)


async def _checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream whose unparsable messages raise InvalidArgument where the servicer reads
    them (with grpc's own deserializer, they raised DecodeError there: INTERNAL)."""
    async for request in requests:
        _check_parsed(request)
        yield request


def _parsed(request: Any, client_stream: bool) -> Any:
    """The request, or for a client stream the stream, that the servicer gets (see above)."""
    if client_stream:
        return _checked_stream(request)
    _check_parsed(request)
    return request


class ServerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every async servicer method of one server (see the module docstring); spans go to
    `telemetry`'s provider, metrics to its registry."""

    def __init__(self, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.metrics = RpcMetrics(telemetry.registry)
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._refusal: str | None = None

    def refuse_new_calls(self, message: str) -> None:
        """From now on answer new calls (health and reflection excepted) UNAVAILABLE(message)."""
        self._refusal = message

    @property
    def in_flight(self) -> int:
        """Calls whose servicer code is running (health and reflection excluded)."""
        return self._in_flight

    async def wait_idle(self) -> None:
        """Return once no call is in flight."""
        await self._idle.wait()

    def _enter(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def _leave(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_PASS_THROUGH):
            return handler
        for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
            behavior = getattr(handler, kind)
            if behavior is None:
                continue
            if self._refusal is not None:
                return handler._replace(**{kind: self._refuse(method, self._refusal)})
            wrapped = {kind: self._wrap(method, behavior, handler.request_streaming)}
            if handler.request_deserializer is not None:
                wrapped["request_deserializer"] = _lenient(handler.request_deserializer)
            return handler._replace(**wrapped)
        return handler

    def _refuse(self, method: str, message: str):
        service, _, name = method.lstrip("/").rpartition("/")

        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> NoReturn:
            self.metrics.handled.labels(service, name, grpc.StatusCode.UNAVAILABLE.name).inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, message)
        return refuse

    def _wrap(self, method: str, behavior: Callable[..., Any],
              client_stream: bool) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            return self._wrap_stream(method, behavior, client_stream)
        if inspect.iscoroutinefunction(behavior):
            return self._wrap_unary(method, behavior, client_stream)
        return behavior  # a sync method runs in grpc's executor; kvmesh servicers are async

    def _wrap_unary(self, method: str, behavior: Callable[..., Awaitable[Any]],
                    client_stream: bool):
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            call = _Call(self, method, context)
            try:
                with call.active():
                    return await behavior(_parsed(request, client_stream),
                                          _CountingContext(context, call))
            except BaseException as exc:
                await call.fail(exc, context)
            finally:
                call.end()
        return unary

    def _wrap_stream(self, method: str, behavior: Callable[..., AsyncIterator[Any]],
                     client_stream: bool):
        # NOTE: the span is current only while the servicer's generator runs (around each
        # __anext__), never across our own `yield`: grpc may finalize this generator from another
        # task after a cancel, and an OpenTelemetry token must be detached where it was attached.
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = _Call(self, method, context)
            try:
                responses = behavior(_parsed(request, client_stream),
                                     _CountingContext(context, call))
                async with contextlib.aclosing(responses):
                    while True:
                        with call.active():
                            try:
                                item = await anext(responses)
                            except StopAsyncIteration:
                                break
                        yield item
            except BaseException as exc:
                await call.fail(exc, context)
            finally:
                call.end()
        return stream
