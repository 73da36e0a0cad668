"""Where a service's metrics and spans go (`Telemetry`), and W3C trace-context propagation over
gRPC metadata.

The entry helper (kvmesh.rpc.entry) creates one `Telemetry` per service process and passes it
to what records metrics (each metrics class registers in `telemetry.registry`) and to the
servers that open spans. The rpc interceptors (kvmesh.rpc) then open a SERVER span per incoming
call, parented by the caller's `traceparent`, and a CLIENT span per outgoing call that carries
the current context on, so one request is one trace across gateway → router → engine →
{draft, kvcache}.

NOTE (which provider a span goes to). There is no process-wide provider: the provider travels
in the OpenTelemetry context, next to the current span. A server puts its telemetry's provider
into the context of every call it serves (`Telemetry.context`), the entry helper into the
context the service runs in (`Telemetry.activated`), and `tracer(name)` takes it from the
current context — so code deep in a service (an outgoing call, an engine step's spans, a thread
that attaches a request's captured context) needs no provider of its own, and two services in
one process (tests) each trace into their own. Outside any of these, `tracer` falls back to
OpenTelemetry's global provider, a no-op unless an application installed one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import (GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR,
                               CollectorRegistry)

from kvmesh.metrics import ALL_MODELS, ModelRegistry

log = logging.getLogger(__name__)

Metadata = list[tuple[str, str]]

_PROVIDER_KEY = otel_context.create_key("kvmesh-tracer-provider")
_PROPAGATOR = CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])


@dataclass(frozen=True)
class Telemetry:
    """One service's telemetry: the Prometheus registry its metrics live in (and its /metrics
    endpoint serves) and the tracer provider its spans go to. One per service, never shared by
    two servers: each server registers its RPC metrics in the registry."""

    registry: CollectorRegistry
    tracer_provider: TracerProvider

    @classmethod
    def create(cls, service_name: str, *, model_name: str = ALL_MODELS, otlp_endpoint: str | None = None,
               span_exporter: SpanExporter | None = None) -> Telemetry:
        """A fresh registry (with the process, platform and GC collectors prometheus_client's
        default registry has) whose samples carry `model_name` unless they name their own
        (kvmesh.metrics.ModelRegistry), and a tracer provider for `service_name`.

        Spans go to an OTLP gRPC collector when `otlp_endpoint` (or `OTEL_EXPORTER_OTLP_ENDPOINT`)
        is set — batched, off the request path — and synchronously to `span_exporter` when one
        is given (e.g. an InMemorySpanExporter in tests). With neither, spans are created and
        dropped. An endpoint without a scheme (``127.0.0.1:4317``) is reached without TLS. The
        caller owns the result (`shutdown()` flushes the spans at exit).
        """
        provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                            "service.namespace": "kvmesh"}))
        endpoint = otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint:
            insecure = None if "://" in endpoint else True
            provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
            log.info("exporting traces of %s to %s", service_name, endpoint)
        if span_exporter is not None:
            provider.add_span_processor(SimpleSpanProcessor(span_exporter))
        registry = ModelRegistry(model_name)
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            registry.register(collector)  # read-only views of this process, safe to share
        return cls(registry, provider)

    def tracer(self, name: str) -> trace.Tracer:
        """A tracer of this telemetry's provider."""
        return self.tracer_provider.get_tracer(name)

    def context(self, parent: otel_context.Context | None = None) -> otel_context.Context:
        """`parent` (default: the current context) with this provider as the one `tracer(name)`
        finds in it (see the module NOTE)."""
        return otel_context.set_value(_PROVIDER_KEY, self.tracer_provider, parent)

    @contextlib.contextmanager
    def activated(self) -> Iterator[None]:
        """Within the block, and in the tasks started from it, `tracer(name)` uses this
        telemetry's provider."""
        token = otel_context.attach(self.context())
        try:
            yield
        finally:
            otel_context.detach(token)

    def shutdown(self) -> None:
        """Flush and stop span export (at process exit)."""
        self.tracer_provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    """A tracer of the provider in the current context (see the module NOTE)."""
    provider = otel_context.get_value(_PROVIDER_KEY)
    return (provider or trace.get_tracer_provider()).get_tracer(name)


def inject_metadata(metadata: Iterable[tuple[str, str]] | None = None) -> Metadata:
    """Return `metadata` plus the current context's `traceparent`/`tracestate`/`baggage`.

    Entries already carrying those keys are replaced, so re-injecting never duplicates them.
    """
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    kept = [(k, v) for k, v in (metadata or ()) if k.lower() not in carrier]
    return kept + list(carrier.items())


# W3C Trace Context's tracestate list member: key=value (keys: simple or tenant@system).
_TRACESTATE_MEMBER = re.compile(
    r"\s*(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]\s*")


def valid_tracestate(header: str) -> bool:
    """Whether a tracestate header parses under W3C Trace Context (at most 32 members)."""
    members = [m for m in header.split(",") if m.strip()]
    return len(members) <= 32 and all(_TRACESTATE_MEMBER.fullmatch(m) for m in members)


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The remote context carried by incoming gRPC metadata (an empty one when absent). A
    tracestate that does not parse is dropped, as W3C Trace Context allows, before the
    propagator sees it: it would log a warning on every call of a client that sends one."""
    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    if "tracestate" in carrier and not valid_tracestate(carrier["tracestate"]):
        del carrier["tracestate"]
    return _PROPAGATOR.extract(carrier)
