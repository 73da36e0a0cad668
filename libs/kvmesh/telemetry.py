"""OpenTelemetry set-up and W3C trace-context propagation over gRPC metadata.

Each service calls `setup_telemetry(...)` once at start. The rpc interceptors (kvmesh.rpc)
then open a SERVER span per incoming call, parented by the caller's `traceparent`, and a CLIENT
span per outgoing call that carries the current context on, so one request is one trace across
gateway → router → engine → {draft, kvcache}.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

Metadata = list[tuple[str, str]]

# NOTE: OpenTelemetry allows setting the global tracer provider once per process. kvmesh keeps
# its own reference so that a later setup_telemetry() (tests, several servers in one process)
# still takes effect for kvmesh's spans; the first provider also becomes the global one.
_provider: TracerProvider | None = None
_tracers: dict[str, trace.Tracer] = {}


def setup_telemetry(service_name: str, *, otlp_endpoint: str | None = None,
                    span_exporter: SpanExporter | None = None) -> TracerProvider:
    """Create the tracer provider for this process and install the W3C propagators globally.

    Spans go to an OTLP gRPC collector when `otlp_endpoint` (or `OTEL_EXPORTER_OTLP_ENDPOINT`)
    is set — batched, off the request path — and synchronously to `span_exporter` when one is
    given (e.g. an InMemorySpanExporter in tests). With neither, spans are created and dropped.
    An endpoint without a scheme (``127.0.0.1:4317``) is reached without TLS. The caller owns
    the returned provider (`shutdown()` flushes it at exit).
    """
    global _provider
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
    propagate.set_global_textmap(
        CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()]))
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        trace.set_tracer_provider(provider)
    _provider = provider
    _tracers.clear()
    return provider


def tracer(name: str) -> trace.Tracer:
    """A tracer from kvmesh's provider (the global one until setup_telemetry has run)."""
    found = _tracers.get(name)
    if found is None:
        found = _tracers[name] = (_provider or trace.get_tracer_provider()).get_tracer(name)
    return found


def inject_metadata(metadata: Iterable[tuple[str, str]] | None = None) -> Metadata:
    """Return `metadata` plus the current context's `traceparent`/`tracestate`/`baggage`.

    Entries already carrying those keys are replaced, so re-injecting never duplicates them.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    kept = [(k, v) for k, v in (metadata or ()) if k.lower() not in carrier]
    return kept + list(carrier.items())


def extract_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The remote context carried by incoming gRPC metadata (an empty one when absent)."""
    carrier = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)
