"""Engine Prometheus metrics, named after vLLM's: `vllm:X` → `kvmesh_engine_X` (README, "Metrics",
has the table). Two sources:

- the step loop's hook (`StepMetrics`, AsyncEngine.on_step): gauges of the batch, token counters
  and latency histograms from each step's outputs;
- collectors read at scrape time (`EngineMetrics.instrument` registers them): counters the core,
  its block manager, its KV-service link and its draft-service link keep anyway, so nothing is
  counted twice.

Requests aborted by a client are finished by `EngineCore.abort`, outside any step, so they reach
neither the hook nor `request_success`; their generated tokens were counted as they came.
"""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.metrics import metric_name
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.core import EngineCore, RequestOutput
from kvmesh.services.engine.guardrail import GuardReport
from kvmesh.services.engine.kv_transfer import HandoffResult

_LAT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5)
_TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def _name(name: str) -> str:
    return metric_name("engine", name)


class EngineMetrics:
    """The engine's own counters, gauges and histograms, registered in its registry (one set per
    registry); `instrument` publishes an engine through them."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(_name(name), text, registry=registry)

        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(_name(name), text, labels, registry=registry)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(_name(name), text, buckets=buckets, registry=registry)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of paged-KV blocks in use (0-1).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.gen_tokens = counter("generation_tokens",
                                  "Generated tokens, counted as they are emitted.")
        self.cached_prompt_tokens = counter(
            "cached_prompt_tokens",
            "Prompt tokens of finished requests that were not computed: reused from the prefix "
            "cache, imported from the KV-cache service or blended in (usage.cached_prompt_tokens).")
        self.requests = counter("request_success", "Finished requests by finish reason.",
                                ("finished_reason",))
        for reason in ("stop", "length", "stop_string"):
            self.requests.labels(reason)  # exported from the start at 0, so rate() sees the first
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", _TOKENS)
        self.request_gen_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", _TOKENS)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Arrival to the first generated token.", _LAT)
        self.itl = histogram(
            "inter_token_latency_seconds",
            "Time between two steps that emitted tokens for one request (one observation per "
            "request and step; a step that accepted drafts emits several tokens).", _ITL)
        self.tpot = histogram(
            "request_time_per_output_token_seconds",
            "Per finished request with 2+ tokens: first token to finish, over tokens after the "
            "first.", _ITL)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LAT)
        self.step = histogram("step_seconds", "Duration of one engine step.", _LAT)
        self.propose = histogram(
            "spec_propose_seconds",
            "Duration of one Propose call to the draft service (failed ones included).",
            (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.blend_prompts = counter(
            "blend_prompts", "Finished requests whose prompt blended in cached document KV.")
        self.blend_tokens = counter(
            "blend_tokens", "Prompt tokens whose KV came from cached documents (blended_tokens).")
        self.blend_recomputed = counter(
            "blend_recomputed_tokens",
            "Blended tokens recomputed to restore cross-attention (recomputed_tokens).")
        self.pd_handoffs = counter(
            "pd_handoffs", "P/D prefill hops (GenerateRequest.kv_handoff) by outcome: ok (every "
            "chunk stored) or incomplete (the decode hop computes the rest).", ("outcome",))
        for outcome in ("ok", "incomplete"):
            self.pd_handoffs.labels(outcome)
        self.pd_handoff_tokens = counter(
            "pd_handoff_tokens", "Prompt tokens whose KV P/D prefill hops left in the KV-cache service.")
        self.pd_handoff_bytes = counter(
            "pd_handoff_bytes", "Bytes P/D prefill hops stored in the KV-cache service (compressed chunks).")
        self.pd_handoff_wait = histogram(
            "pd_handoff_wait_seconds",
            "Per P/D prefill hop: the prompt's last computed token to its last chunk stored (what the "
            "transfer adds to the prefill; earlier chunks are stored while later ones compute).",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10))
        self.guard_check = histogram(
            "guard_check_seconds",
            "Duration of one guardrail shadow check (run in an idle step; not in step_seconds).", _LAT)

    def instrument(self, engine: AsyncEngine) -> CoreCollector:
        """Publishes one engine's metrics: installs the step hook, times every Propose call, and
        registers (and returns) its core's collector in the registry (one engine at a time:
        unregister the collector before instrumenting the next)."""
        core = engine.core
        engine.on_step = StepMetrics(self)
        engine.on_abort = engine.on_step.aborted
        if core.drafts is not None:
            core.drafts.on_propose = self.propose.observe
        collector = CoreCollector(core)
        self.registry.register(collector)
        return collector

    def record_handoff(self, result: HandoffResult) -> None:
        """One P/D prefill hop's transfer (EngineServicer.on_handoff)."""
        self.pd_handoffs.labels("ok" if result.ok else "incomplete").inc()
        self.pd_handoff_tokens.inc(result.tokens)
        self.pd_handoff_bytes.inc(result.bytes)
        self.pd_handoff_wait.observe(result.wait_s)

    def record_finished(self, out: RequestOutput) -> None:
        """A request that finished in a step, with its usage."""
        usage = out.usage
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_prompt_tokens.inc(usage.cached_prompt_tokens)
        self.requests.labels(out.finish_reason).inc()
        self.request_prompt_tokens.observe(usage.prompt_tokens)
        self.request_gen_tokens.observe(usage.completion_tokens)
        self.ttft.observe(out.ttft_s)
        self.e2e.observe(out.e2e_s)
        if usage.completion_tokens > 1:
            self.tpot.observe((out.e2e_s - out.ttft_s) / (usage.completion_tokens - 1))
        docs = out.documents
        if docs is not None and docs.blended_tokens:
            self.blend_prompts.inc()
            self.blend_tokens.inc(docs.blended_tokens)
            self.blend_recomputed.inc(docs.recomputed_tokens)


class StepMetrics:
    """The step loop's hook (`AsyncEngine.on_step`): gauges, token counters and latencies.

    Keeps the time of each running request's last emitting step, for the inter-token latency;
    requests that end outside a step (aborts) are dropped from it at the next step.
    """

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self._last_emit: dict[str, float] = {}

    def __call__(self, core: EngineCore, outputs: list[RequestOutput], seconds: float) -> None:
        m = self.metrics
        if core.last_step_checked:  # an idle turn spent on a shadow check, not a batch
            m.guard_check.observe(seconds)
            return
        now = time.monotonic()
        m.step.observe(seconds)
        m.running.set(core.scheduler.num_running)
        m.waiting.set(core.scheduler.num_waiting)
        m.kv_usage.set(core.block_manager.usage)
        for out in outputs:
            if out.token_ids:
                m.gen_tokens.inc(len(out.token_ids))
                last = self._last_emit.get(out.request_id)
                if last is not None:
                    m.itl.observe(now - last)
                self._last_emit[out.request_id] = now
            if out.finished:
                self._last_emit.pop(out.request_id, None)
                if out.usage is not None:
                    m.record_finished(out)
        if len(self._last_emit) > core.scheduler.num_running + core.scheduler.num_waiting:
            live = set(core.request_ids())
            self._last_emit = {rid: t for rid, t in self._last_emit.items() if rid in live}

    def aborted(self, out: RequestOutput) -> None:
        """A request aborted between steps (client gone, deadline): `request_success{abort}` and
        its prompt tokens, as vLLM counts aborted requests."""
        self._last_emit.pop(out.request_id, None)
        if out.usage is not None:
            self.metrics.prompt_tokens.inc(out.usage.prompt_tokens)
            self.metrics.requests.labels(out.finish_reason).inc()


_KV_HELP = {
    "lookups": "Prompts looked up in the KV-cache service.",
    "fetched_chunks": "KV chunks fetched from the KV-cache service and imported.",
    "fetch_failures": "Lookups/fetches that failed (the prompt was recomputed).",
    "bad_blobs": "Fetched blobs rejected (checksum, namespace, shape or token ids) and deleted.",
    "exported_chunks": "KV chunks stored in the KV-cache service.",
    "export_failures": "KV chunks whose store failed.",
    "export_dropped": ("KV chunks not exported because the export queue was full (--kv-export-max-bytes, or "
                       "exports waiting for idle CPU under sustained load)."),
}


class CoreCollector:
    """Counters the core keeps anyway, read at scrape time (no copies, nothing counted twice):
    prefix-cache queries/hits and preemptions always, the KV-service link's counters with a
    KV-cache service, speculative decoding's with a draft service."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def collect(self):
        core = self.core
        bm = core.block_manager
        yield from _counters(
            ("prefix_cache_queries", "Prefix-cache queries in tokens: every admitted sequence's tokens "
                                     "(again after a preemption).", bm.num_queried_tokens),
            ("prefix_cache_hits", "Tokens of those queries found in the engine's prefix cache (whole "
                                  "blocks; KV imported from the KV-cache service is not counted).",
             bm.num_hit_tokens),
            ("num_preemptions", "Running requests preempted (blocks freed, recomputed later).",
             core.scheduler.num_preemptions))
        if core.kv is not None:
            stats = core.kv.stats
            yield from _counters(*((f"kv_{field}", text, getattr(stats, field))
                                   for field, text in _KV_HELP.items()))
        if core.drafts is not None:
            totals, stats = core.spec_totals, core.drafts.stats
            yield from _counters(
                ("spec_decode_num_drafts", "Decode steps of a sequence that verified draft tokens.",
                 totals.steps),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", totals.draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted (and emitted).",
                 totals.accepted_tokens),
                ("spec_draft_failures", "Propose calls that failed or missed their deadline (that step "
                                        "decoded without drafts).", stats.failures),
                ("spec_resyncs", "Sequences the draft service asked to resend whole.", stats.resyncs))
        if core.guardrail is not None:
            yield from _guard_metrics(core.guardrail.snapshot())


def _counters(*rows: tuple[str, str, int]):
    for name, help_text, value in rows:
        yield CounterMetricFamily(_name(name), help_text, value=value)


_GUARD_LABELS = ("path", "namespace")
"""Guardrail metrics per lossy path: its storage name and the first 8 hex digits of its namespace
digest (the model and tenant salt it is used in)."""


def _guard_metrics(report: GuardReport):
    """The guardrail's state per path (services/engine/guardrail.py), read at scrape time."""
    per_path = (
        (CounterMetricFamily, "guard_checks", "Shadow checks recorded (served lossy and replayed).",
         lambda p: p.checks),
        (GaugeMetricFamily, "guard_kl", "Running estimate of mean KL(exact || lossy) per answer token, nats.",
         lambda p: p.kl),
        (GaugeMetricFamily, "guard_top1", "Running estimate of teacher-forced top-1 agreement with exact.",
         lambda p: p.top1),
        (GaugeMetricFamily, "guard_enabled", "1 while the path is served, 0 while the guardrail disables it.",
         lambda p: float(p.enabled)),
        (CounterMetricFamily, "guard_served", "Requests served the lossy path.", lambda p: p.served),
        (CounterMetricFamily, "guard_fallbacks", "Requests that asked for the path and were served exactly.",
         lambda p: p.fallbacks),
        (CounterMetricFamily, "guard_disabled", "Times the guardrail disabled the path.", lambda p: p.disabled_count),
    )
    for family, name, text, value in per_path:
        metric = family(_name(name), text, labels=_GUARD_LABELS)
        for p in report.paths:
            metric.add_metric([p.namespace.storage, p.namespace.digest().hex()[:8]], value(p))
        yield metric
    yield GaugeMetricFamily(_name("guard_pending_checks"), "Shadow checks waiting for an idle engine.",
                            value=report.pending_checks)
    yield from _counters(
        ("guard_dropped_checks", "Shadow checks dropped from a full queue (no idle turn came for them).",
         report.dropped_checks),
        ("guard_failed_checks", "Shadow checks that failed or had nothing to compare.", report.failed_checks))
