"""The engine's request timeline as spans, written when the request finishes (the step loop
records instants; spans are made here, on the serving call's side, so the step loop never
touches the tracer). The one exception: a guardrail shadow check, which runs on the step loop
long after its request ended, writes its own span there (`trace_guard_check`; rare by design).

GenAI attributes use the OpenTelemetry semantic conventions' current names
(`gen_ai.provider.name`, `gen_ai.usage.cache_read.input_tokens`; see services/gateway/tracing.py)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

from opentelemetry import trace

from kvmesh.kv.namespace import EXACT
from kvmesh.services.engine.outputs import RequestOutput
from kvmesh.telemetry import tracer

if TYPE_CHECKING:
    from kvmesh.kv.quality import Comparison
    from kvmesh.services.engine.guardrail import ShadowCheck
    from kvmesh.services.engine.sampling import SamplingParams

PROVIDER = "kvmesh"
"""`gen_ai.provider.name` (the gateway's value too)."""


def request_attributes(model: str, params: SamplingParams, request_id: str) -> dict:
    """The Generate server span's request attributes: operation, model and sampling settings."""
    attrs = {"gen_ai.provider.name": PROVIDER, "gen_ai.operation.name": "text_completion",
             "gen_ai.request.model": model, "gen_ai.request.max_tokens": params.max_tokens,
             "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
             "gen_ai.request.presence_penalty": params.presence_penalty,
             "gen_ai.request.frequency_penalty": params.frequency_penalty,
             "kvmesh.request_id": request_id}
    if params.top_k:
        attrs["gen_ai.request.top_k"] = params.top_k
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = params.seed
    if params.stop:
        attrs["gen_ai.request.stop_sequences"] = list(params.stop)
    return attrs


def trace_request(out: RequestOutput, prompt_tokens: int) -> None:
    """The request's way through the engine as spans under the current (server) span, from its
    timeline: engine.queue (arrival to admission), engine.blend, engine.prefill (admission to the
    first token), engine.decode (first token to the end, with one `spec_verify` event per
    verification step); usage as GenAI semantic-convention attributes on the server span."""
    server = trace.get_current_span()
    usage, t = out.usage, out.timeline
    attrs = {"gen_ai.usage.input_tokens": usage.prompt_tokens if usage else prompt_tokens,
             "gen_ai.usage.output_tokens": usage.completion_tokens if usage else 0,
             "gen_ai.response.finish_reasons": [str(out.finish_reason or "")],
             "gen_ai.usage.cache_read.input_tokens": usage.cached_prompt_tokens if usage else 0,
             "kvmesh.kv.storage": out.reuse_storage,
             "kvmesh.kv.service_tokens": usage.imported_prompt_tokens if usage else 0}
    if out.spec is not None and out.spec.steps:
        attrs.update({"kvmesh.spec.steps": out.spec.steps, "kvmesh.spec.draft_tokens": out.spec.draft_tokens,
                      "kvmesh.spec.accepted_tokens": out.spec.accepted_tokens})
    if out.documents is not None:
        attrs.update({"kvmesh.blend.blended_tokens": out.documents.blended_tokens,
                      "kvmesh.blend.recomputed_tokens": out.documents.recomputed_tokens,
                      "kvmesh.documents": list(out.documents.document_ids)})
    attrs.update(guard_attributes(out))
    server.set_attributes(attrs)
    if t is None or not server.get_span_context().is_valid:
        return
    offset = time.time_ns() - time.monotonic_ns()

    def ns(instant: float) -> int:
        return int(instant * 1e9) + offset

    def span(name: str, start: float | None, end: float | None, **attributes) -> trace.Span | None:
        if start is None or end is None:
            return None
        return tracer("kvmesh.engine").start_span(name, start_time=ns(start), attributes=attributes)

    queue = span("engine.queue", t.arrival, t.admitted or t.finished)
    if queue is not None:
        queue.end(end_time=ns(t.admitted or t.finished))
    if t.blend is not None:
        blend = span("engine.blend", *t.blend, **{k: v for k, v in attrs.items() if k.startswith("kvmesh.blend")})
        blend.end(end_time=ns(t.blend[1]))
    prefill = span("engine.prefill", t.admitted, t.first_token or t.finished,
                   **{"gen_ai.usage.input_tokens": attrs["gen_ai.usage.input_tokens"],
                      "gen_ai.usage.cache_read.input_tokens": attrs["gen_ai.usage.cache_read.input_tokens"]})
    if prefill is not None:
        prefill.end(end_time=ns(t.first_token or t.finished))
    decode = span("engine.decode", t.first_token, t.finished,
                  **{"gen_ai.usage.output_tokens": attrs["gen_ai.usage.output_tokens"]})
    if decode is not None:
        for instant, drafted, accepted in t.spec_steps:
            decode.add_event("spec_verify", {"kvmesh.spec.draft_tokens": drafted,
                                             "kvmesh.spec.accepted_tokens": accepted}, timestamp=ns(instant))
        decode.end(end_time=ns(t.finished))


def guard_attributes(out: RequestOutput) -> dict:
    """The guardrail's part of a request's span: kvmesh.guard.path (the lossy path's storage),
    kvmesh.guard.state ("served": over lossy KV; "fallback": asked for and served exactly),
    kvmesh.guard.shadow (sampled for a shadow check) and kvmesh.guard.fallback (why not served).
    Nothing for a request that asked for no lossy path."""
    ticket = out.guard
    if out.reuse_fallback:
        # Admission.fallback reads "<storage>: <reason>" (several joined by "; ").
        path = ticket.path.namespace.storage if ticket is not None else out.reuse_fallback.split(": ", 1)[0]
        return {"kvmesh.guard.path": path, "kvmesh.guard.state": "fallback", "kvmesh.guard.shadow": ticket is not None,
                "kvmesh.guard.fallback": out.reuse_fallback}
    if out.reuse_storage != EXACT or ticket is not None:
        path = ticket.path.namespace.storage if ticket is not None else out.reuse_storage
        return {"kvmesh.guard.path": path, "kvmesh.guard.state": "served", "kvmesh.guard.shadow": ticket is not None}
    return {}


def trace_guard_check(check: ShadowCheck, result: Optional[Comparison], start: float, end: float) -> None:
    """One shadow check as an `engine.guard_check` span in its request's trace (time.monotonic()
    instants); kl/top1/tokens when it compared anything."""
    offset = time.time_ns() - time.monotonic_ns()
    path = check.ticket.path
    attrs = {"kvmesh.guard.path": path.namespace.storage, "kvmesh.guard.kind": path.kind,
             "kvmesh.guard.replay": not check.ticket.served_lossy}
    if result is not None:
        attrs.update({"kvmesh.guard.kl": result.kl, "kvmesh.guard.top1": result.top1,
                      "kvmesh.guard.tokens": result.tokens})
    span = tracer("kvmesh.engine").start_span("engine.guard_check", context=check.trace_context,
                                              start_time=int(start * 1e9) + offset, attributes=attrs)
    span.end(end_time=int(end * 1e9) + offset)
