"""One client request is one trace: the HTTP SERVER span parents the router call's context."""
from __future__ import annotations

import json
import threading

import httpx
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from gateway_utils import MODEL

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
    processor = SimpleSpanProcessor(exporter)
    gateway.telemetry.tracer_provider.add_span_processor(processor)  # the gateway's spans
    try:
        r = httpx.post(f"{gateway.base_url}/chat/completions",
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                       headers={"traceparent": f"00-{TRACE_ID}-{CALLER_SPAN}-01"}, timeout=10)
        assert r.status_code == 200
        sent = gateway.state.calls[0].metadata["traceparent"]
        assert sent.split("-")[1] == TRACE_ID  # the client's trace continues upstream
        assert exporter.seen.wait(5)
        # (the fake router runs in this process too, tracing to a provider of its own)
        spans = {(s.name, s.kind): s for s in exporter.get_finished_spans()}
        server = spans["POST /v1/chat/completions", SpanKind.SERVER]
        client = spans["/kvmesh.router.v1.RouterService/Generate", SpanKind.CLIENT]
        assert format(server.context.trace_id, "032x") == TRACE_ID
        assert format(server.parent.span_id, "016x") == CALLER_SPAN
        assert client.parent.span_id == server.context.span_id
        assert sent.split("-")[2] == format(client.context.span_id, "016x")
        assert server.attributes["kvmesh.tenant"] == "default"
        assert server.attributes["http.response.status_code"] == 200
        # GenAI semantic conventions, and no content unless the operator opts in
        usage = r.json()["usage"]
        assert server.attributes["gen_ai.provider.name"] == "kvmesh"
        assert server.attributes["gen_ai.operation.name"] == "chat"
        assert server.attributes["gen_ai.request.model"] == MODEL
        assert server.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert server.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
        assert server.attributes["gen_ai.usage.cache_read.input_tokens"] == 0
        assert server.attributes["gen_ai.response.id"] == r.json()["id"]
        assert list(server.attributes["gen_ai.response.finish_reasons"]) == [r.json()["choices"][0]["finish_reason"]]
        deprecated = ("gen_ai.system", "gen_ai.prompt", "gen_ai.completion", "kvmesh.usage.cached_tokens")
        assert not any(k in server.attributes for k in deprecated)
        assert not any(k in server.attributes for k in ("gen_ai.input.messages", "gen_ai.output.messages"))
    finally:
        processor.shutdown()


def test_content_is_recorded_only_when_the_operator_opts_in():
    from gateway_utils import GatewayHarness

    exporter = _Exporter("POST /v1/chat/completions")
    processor = SimpleSpanProcessor(exporter)
    try:
        with GatewayHarness(trace_content=True) as gw:
            gw.telemetry.tracer_provider.add_span_processor(processor)
            r = httpx.post(f"{gw.base_url}/chat/completions",
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi there"}]}, timeout=10)
            assert r.status_code == 200
            assert exporter.seen.wait(5)
        [server] = [s for s in exporter.get_finished_spans()
                    if s.name == "POST /v1/chat/completions" and s.kind is SpanKind.SERVER]
        choice = r.json()["choices"][0]
        assert json.loads(server.attributes["gen_ai.input.messages"]) == [
            {"role": "user", "parts": [{"type": "text", "content": "hi there"}]}]
        assert json.loads(server.attributes["gen_ai.output.messages"]) == [
            {"role": "assistant", "parts": [{"type": "text", "content": choice["message"]["content"]}],
             "finish_reason": choice["finish_reason"]}]
    finally:
        processor.shutdown()
