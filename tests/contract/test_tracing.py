"""One client request is one trace: the HTTP SERVER span parents the router call's context."""
from __future__ import annotations

import threading

import httpx
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway_utils import MODEL
from kvmesh.telemetry import setup_telemetry

class _Exporter(InMemorySpanExporter):
    """Also signals when the HTTP request's span ends (it ends after the response is sent)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.seen = name, threading.Event()

    def export(self, spans):
        result = super().export(spans)
        if any(s.name == self.name for s in spans):
            self.seen.set()
        return result


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def test_http_span_context_reaches_the_router_call(gateway):
    exporter = _Exporter("POST /v1/chat/completions")
    provider = setup_telemetry("kvmesh-gateway-test", span_exporter=exporter)
    try:
        r = httpx.post(f"{gateway.base_url}/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                       headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}, timeout=10)
        assert r.status_code == 200
        sent = gateway.state.calls[0].metadata["traceparent"]
        assert sent.split("-")[1] == TRACE_ID  # the client's trace continues upstream
        assert exporter.seen.wait(5)
        # (the fake router runs in this process too: its SERVER span has the same name)
        spans = {(s.name, s.kind): s for s in exporter.get_finished_spans()}
        server = spans["POST /v1/chat/completions", SpanKind.SERVER]
        client = spans["/kvmesh.router.v1.RouterService/Generate", SpanKind.CLIENT]
        assert format(server.context.trace_id, "032x") == TRACE_ID
        assert format(server.parent.span_id, "016x") == CALLER_SPAN
        assert client.parent.span_id == server.context.span_id
        assert sent.split("-")[2] == format(client.context.span_id, "016x")
        assert server.attributes["kvmesh.tenant"] == "default"
        assert server.attributes["http.response.status_code"] == 200
    finally:
        provider.shutdown()
