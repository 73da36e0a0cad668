"""RpcServer + client channel on a real server (port 0) with a raw-bytes probe service."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client import REGISTRY, CollectorRegistry

from kvmesh.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.rpc.client import DEFAULT_TIMEOUT_S, call_timeout, make_channel, wait_for_ready
from kvmesh.rpc.server import RpcServer, ServerSettings
from kvmesh.telemetry import Telemetry, tracer

SERVICE = "kvmesh.test.v1.Probe"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Probe:
    """Echo (unary) and Count (server-streaming) whose behaviour the payload selects."""

    def __init__(self) -> None:
        self.release = asyncio.Event()  # lets a b"hold" stream send its second item
        self.draining = asyncio.Event()  # set by on_drain
        self.stream_closed = asyncio.Event()  # a Count generator ran its cleanup

    async def echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if request == b"invalid":
            raise InvalidArgument("payload must not be 'invalid'; send anything else")
        if request == b"boom":
            raise RuntimeError("kaboom")
        if request == b"abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "no")
        if request == b"span":
            ctx = trace.get_current_span().get_span_context()
            return f"{ctx.trace_id:032x}:{ctx.span_id:016x}".encode()
        if request == b"remaining":
            return str(context.time_remaining()).encode()
        if request == b"outgoing-timeout":
            return str(call_timeout()).encode()
        return request

    async def count(self, request: bytes,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            if request == b"hold":
                yield b"first"
                await self.release.wait()
                yield b"second"
                return
            n, _, failure = request.decode().partition(":")
            for i in range(int(n)):
                yield str(i).encode()
            if failure == "notfound":
                raise NotFound("chunk 7 is gone; insert it again")
            if failure == "boom":
                raise ZeroDivisionError("mid-stream")
        finally:
            self.stream_closed.set()

    async def on_drain(self) -> None:
        self.draining.set()

    def register(self, server: grpc.aio.Server) -> None:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {
            "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
            "Count": grpc.unary_stream_rpc_method_handler(self.count),
        }),))


@dataclass
class Harness:
    server: RpcServer
    probe: Probe
    channel: grpc.aio.Channel

    async def echo(self, payload: bytes, **kwargs) -> bytes:
        return await self.channel.unary_unary(f"/{SERVICE}/Echo")(payload, **kwargs)

    def count(self, payload: bytes, **kwargs):
        return self.channel.unary_stream(f"/{SERVICE}/Count")(payload, **kwargs)


@pytest.fixture(scope="module")
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def traced(spans: InMemorySpanExporter) -> Telemetry:
    """The module's tracer provider, exporting to `spans`."""
    return Telemetry.create("kvmesh-test", span_exporter=spans)


@pytest.fixture
async def h(spans: InMemorySpanExporter, traced: Telemetry) -> AsyncIterator[Harness]:
    spans.clear()
    probe = Probe()
    server = RpcServer("probe", ServerSettings(grace_s=30), probe.register, [SERVICE],
                       telemetry=Telemetry(CollectorRegistry(), traced.tracer_provider),
                       on_drain=probe.on_drain)
    port = await server.start()
    channel = make_channel(f"127.0.0.1:{port}")
    await wait_for_ready(channel, timeout=10, service=SERVICE)
    yield Harness(server, probe, channel)
    await channel.close()
    await server.drain(0)


async def collect(call) -> list[bytes]:
    return [item async for item in call]


async def test_unary_and_stream_round_trip(h: Harness) -> None:
    assert await h.echo(b"hello", timeout=5) == b"hello"
    assert await collect(h.count(b"3", timeout=5)) == [b"0", b"1", b"2"]


async def test_domain_error_maps_to_its_code_and_message(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await h.echo(b"invalid", timeout=5)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "payload must not be 'invalid'; send anything else"


async def test_domain_error_mid_stream_keeps_items_already_sent(h: Harness) -> None:
    received = []
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for item in h.count(b"2:notfound", timeout=5):
            received.append(item)
    assert received == [b"0", b"1"]
    assert err.value.code() is grpc.StatusCode.NOT_FOUND
    assert err.value.details() == "chunk 7 is gone; insert it again"


async def test_servicer_abort_passes_through(h: Harness) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await h.echo(b"abort", timeout=5)
    assert err.value.code() is grpc.StatusCode.PERMISSION_DENIED


async def test_unexpected_exception_is_internal_logged_and_server_survives(
        h: Harness, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="kvmesh.rpc.interceptors"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.echo(b"boom", timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as mid_stream:
            await collect(h.count(b"1:boom", timeout=5))
    assert err.value.code() is grpc.StatusCode.INTERNAL
    assert "RuntimeError" in err.value.details() and "kaboom" not in err.value.details()
    assert mid_stream.value.code() is grpc.StatusCode.INTERNAL
    logged = [r for r in caplog.records if r.exc_info]
    assert [type(r.exc_info[1]) for r in logged] == [RuntimeError, ZeroDivisionError]
    assert await h.echo(b"still here", timeout=5) == b"still here"


async def test_rpc_metrics_count_calls_by_code(h: Harness) -> None:
    def handled(code: str) -> float:
        labels = {"grpc_service": SERVICE, "grpc_method": "Echo", "grpc_code": code}
        return h.server.telemetry.registry.get_sample_value("kvmesh_rpc_server_handled_total",
                                                            labels) or 0.0

    before_ok, before_invalid = handled("OK"), handled("INVALID_ARGUMENT")
    await h.echo(b"x", timeout=5)
    with pytest.raises(grpc.aio.AioRpcError):
        await h.echo(b"invalid", timeout=5)
    assert (handled("OK"), handled("INVALID_ARGUMENT")) == (before_ok + 1, before_invalid + 1)


async def test_metrics_endpoint_serves_rpc_metrics() -> None:
    probe = Probe()
    server = RpcServer("probe", ServerSettings(metrics_port=0), probe.register, [SERVICE],
                       telemetry=Telemetry.create("kvmesh-test"))
    port = await server.start()
    channel = make_channel(f"127.0.0.1:{port}")
    try:
        await channel.unary_unary(f"/{SERVICE}/Echo")(b"x", timeout=5)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        assert b'kvmesh_rpc_server_handled_total{grpc_code="OK",grpc_method="Echo"' in body
        assert b"kvmesh_rpc_server_handling_seconds_bucket" in body
    finally:
        await channel.close()
        await server.drain(0)
    assert server.metrics_port is None  # the endpoint stopped with the server


async def test_two_servers_in_one_process_count_into_their_own_registries(h: Harness) -> None:
    other = RpcServer("other", ServerSettings(), Probe().register, [SERVICE],
                      telemetry=Telemetry.create("kvmesh-other"))
    channel = make_channel(f"127.0.0.1:{await other.start()}")
    try:
        await channel.unary_unary(f"/{SERVICE}/Echo")(b"x", timeout=5)
    finally:
        await channel.close()
        await other.drain(0)
    def handled(registry: CollectorRegistry) -> float | None:
        labels = {"grpc_service": SERVICE, "grpc_method": "Echo", "grpc_code": "OK"}
        return registry.get_sample_value("kvmesh_rpc_server_handled_total", labels)

    assert handled(other.telemetry.registry) == 1
    assert handled(h.server.telemetry.registry) is None
    assert handled(REGISTRY) is None  # prometheus_client's default registry stays empty


async def test_every_call_carries_a_deadline_and_it_propagates(h: Harness) -> None:
    remaining = float(await h.echo(b"remaining"))
    assert 0 < remaining <= DEFAULT_TIMEOUT_S + 1  # grpc rounds the wire timeout up
    # Inside the servicer an outgoing call's default (30 s) is capped by the inbound 2 s.
    assert float(await h.echo(b"outgoing-timeout", timeout=2)) <= 2.5


async def test_health_and_reflection(h: Harness) -> None:
    stub = health_pb2_grpc.HealthStub(h.channel)
    for name in ("", SERVICE):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(h.channel)
    call = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
    names = {s.name for r in await collect(call) for s in r.list_services_response.service}
    assert names == {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


async def test_drain_finishes_in_flight_stream_and_refuses_new_calls(h: Harness) -> None:
    health = health_pb2_grpc.HealthStub(h.channel)
    stream = h.count(b"hold", timeout=10)
    items = aiter(stream)
    assert await anext(items) == b"first"
    watch = aiter(health.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=10))
    assert (await anext(watch)).status == SERVING

    draining = asyncio.ensure_future(h.server.drain())  # grace 30 s
    assert (await anext(watch)).status == NOT_SERVING
    await asyncio.wait_for(h.probe.draining.wait(), 5)
    for name in ("", SERVICE):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await h.echo(b"late", timeout=5)
    assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "draining" in refused.value.details()
    assert not draining.done()

    h.probe.release.set()
    assert [item async for item in items] == [b"second"]
    assert await stream.code() is grpc.StatusCode.OK
    # Done well inside the grace period, although the health watch is still open.
    await asyncio.wait_for(draining, 5)
    await asyncio.wait_for(h.server.wait_closed(), 5)


async def test_drain_cancels_calls_left_when_grace_runs_out(h: Harness) -> None:
    stream = h.count(b"hold", timeout=10)
    items = aiter(stream)
    assert await anext(items) == b"first"
    await asyncio.wait_for(h.server.drain(0.05), 5)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await anext(items)
    assert err.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    await asyncio.wait_for(h.probe.stream_closed.wait(), 5)


async def test_sigterm_drains(h: Harness) -> None:
    h.server.install_signal_handlers()
    os.kill(os.getpid(), signal.SIGTERM)
    await asyncio.wait_for(h.server.wait_closed(), 5)
    assert h.probe.draining.is_set()


async def test_client_cancel_closes_the_servicer_stream(h: Harness) -> None:
    stream = h.count(b"hold", timeout=10)
    items = aiter(stream)
    assert await anext(items) == b"first"
    stream.cancel()
    await asyncio.wait_for(h.probe.stream_closed.wait(), 5)
    assert await h.echo(b"ok", timeout=5) == b"ok"


async def test_one_trace_from_client_to_servicer(h: Harness, spans: InMemorySpanExporter) -> None:
    # the caller traces into the server's provider, found in the context (kvmesh.telemetry NOTE)
    with h.server.telemetry.activated(), tracer("test").start_as_current_span("caller") as caller:
        reply = (await h.echo(b"span", timeout=5)).decode()
    by_kind = {s.kind: s for s in spans.get_finished_spans() if s.name.endswith("/Echo")}
    client, server = by_kind[SpanKind.CLIENT], by_kind[SpanKind.SERVER]
    trace_id = caller.get_span_context().trace_id
    assert client.context.trace_id == server.context.trace_id == trace_id
    assert client.parent.span_id == caller.get_span_context().span_id
    assert server.parent.span_id == client.context.span_id
    assert server.name == f"/{SERVICE}/Echo"
    assert server.attributes["rpc.service"] == SERVICE
    assert server.attributes["rpc.method"] == "Echo"
    # The servicer's code ran with the server span current.
    assert reply == f"{trace_id:032x}:{server.context.span_id:016x}"


async def test_stream_spans_and_error_status(h: Harness, spans: InMemorySpanExporter) -> None:
    with h.server.telemetry.activated(), pytest.raises(grpc.aio.AioRpcError):
        await collect(h.count(b"1:notfound", timeout=5))
    by_kind = {s.kind: s for s in spans.get_finished_spans() if s.name.endswith("/Count")}
    client, server = by_kind[SpanKind.CLIENT], by_kind[SpanKind.SERVER]
    assert server.parent.span_id == client.context.span_id
    for span in (client, server):
        assert span.status.status_code is StatusCode.ERROR
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


async def test_health_checks_are_not_traced(h: Harness, spans: InMemorySpanExporter) -> None:
    await health_pb2_grpc.HealthStub(h.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert not [s for s in spans.get_finished_spans() if "Health" in s.name]


async def test_wait_for_ready_times_out_with_unavailable() -> None:
    channel = make_channel("127.0.0.1:1")  # nothing listens on port 1
    try:
        with pytest.raises(Unavailable) as err:
            await wait_for_ready(channel, timeout=0.2)
        assert "not SERVING within 0.2s" in str(err.value)
    finally:
        await channel.close()


async def test_busy_port_is_a_clear_error(h: Harness) -> None:
    clash = RpcServer("clash", ServerSettings(port=h.server.port), Probe().register, [SERVICE],
                      telemetry=Telemetry.create("kvmesh-clash"))
    with pytest.raises(OSError, match="another process"):
        await clash.start()
