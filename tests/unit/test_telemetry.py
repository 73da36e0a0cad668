"""Trace context from incoming metadata: a malformed tracestate is dropped (W3C Trace Context
allows it) instead of logging a warning on every call; the traceparent still applies."""
import logging

from opentelemetry import trace

from kvmesh.telemetry import extract_context, valid_tracestate

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_tracestate_grammar():
    assert valid_tracestate("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
    assert valid_tracestate("t@sys=1, a=b ")
    assert not valid_tracestate("Bad Key=1")
    assert not valid_tracestate("a=b=c,=x")
    assert not valid_tracestate(",".join(f"k{i}=v" for i in range(33)))


def test_a_bad_tracestate_is_dropped_silently_and_the_parent_kept(caplog):
    caplog.set_level(logging.DEBUG)
    ctx = extract_context([("traceparent", PARENT), ("tracestate", "%%% not a list member")])
    span = trace.get_current_span(ctx).get_span_context()
    assert f"{span.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert len(span.trace_state) == 0
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    good = extract_context([("traceparent", PARENT), ("tracestate", "rojo=00f067aa0ba902b7")])
    assert trace.get_current_span(good).get_span_context().trace_state.get("rojo") == "00f067aa0ba902b7"
