"""Engine Prometheus metrics. Names follow vLLM's (`vllm:X` → `kvmesh_engine_X`)."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvmesh.services.engine.core import EngineCore, RequestOutput

_LAT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

RUNNING = Gauge("kvmesh_engine_num_requests_running", "Requests in the running batch.")
WAITING = Gauge("kvmesh_engine_num_requests_waiting", "Requests waiting to be scheduled.")
KV_USAGE = Gauge("kvmesh_engine_kv_cache_usage_perc", "Fraction of paged-KV blocks in use (0-1).")
PROMPT_TOKENS = Counter("kvmesh_engine_prompt_tokens", "Prompt tokens of finished requests.")
GEN_TOKENS = Counter("kvmesh_engine_generation_tokens", "Generated tokens.")
CACHED_TOKENS = Counter("kvmesh_engine_prefix_cache_hits", "Prompt tokens served from the prefix cache.")
REQUESTS = Counter("kvmesh_engine_request_success", "Finished requests by finish reason.", ["finished_reason"])
TTFT = Histogram("kvmesh_engine_time_to_first_token_seconds", "Time to first token.", buckets=_LAT)
E2E = Histogram("kvmesh_engine_e2e_request_latency_seconds", "Arrival to finish.", buckets=_LAT)
STEP = Histogram("kvmesh_engine_step_seconds", "Duration of one engine step.", buckets=_LAT)
PROPOSE = Histogram("kvmesh_engine_spec_propose_seconds",
                    "Duration of one Propose call to the draft service (failed ones included).",
                    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))


def record_step(core: EngineCore, outputs: list[RequestOutput], seconds: float) -> None:
    """Step-loop hook: updates gauges and counters from one step's outputs."""
    STEP.observe(seconds)
    RUNNING.set(core.scheduler.num_running)
    WAITING.set(core.scheduler.num_waiting)
    KV_USAGE.set(core.block_manager.usage)
    for out in outputs:
        GEN_TOKENS.inc(len(out.token_ids))
        if out.finished and out.usage is not None:
            PROMPT_TOKENS.inc(out.usage.prompt_tokens)
            CACHED_TOKENS.inc(out.usage.cached_prompt_tokens)
            REQUESTS.labels(out.finish_reason).inc()
            TTFT.observe(out.ttft_s)
            E2E.observe(out.e2e_s)


class _KvConnectorCollector:
    """Exposes the KV-service link's counters at scrape time (the connector counts; no copies)."""

    _HELP = {
        "lookups": "Prompts looked up in the KV-cache service.",
        "fetched_chunks": "KV chunks fetched from the KV-cache service and imported.",
        "fetch_failures": "Lookups/fetches that failed (the prompt was recomputed).",
        "bad_blobs": "Fetched blobs rejected (checksum, namespace, shape or token ids) and deleted.",
        "exported_chunks": "KV chunks stored in the KV-cache service.",
        "export_failures": "KV chunks whose store failed.",
        "export_dropped": "KV chunks not exported because the export queue was full.",
    }

    def __init__(self, stats) -> None:
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for field, help_text in self._HELP.items():
            yield CounterMetricFamily(f"kvmesh_engine_kv_{field}", help_text, value=getattr(self.stats, field))


def register_kv_connector(connector) -> None:
    """Publish `connector.stats` as kvmesh_engine_kv_* counters."""
    from prometheus_client import REGISTRY

    REGISTRY.register(_KvConnectorCollector(connector.stats))


class _SpecCollector:
    """Exposes speculative decoding counters at scrape time (the core and draft client count)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        totals, stats = self.core.spec_totals, self.core.drafts.stats
        for name, help_text, value in (
                ("spec_steps", "Decode steps of a sequence that verified draft tokens.", totals.steps),
                ("spec_draft_tokens", "Draft tokens verified.", totals.draft_tokens),
                ("spec_accepted_tokens", "Draft tokens accepted (and emitted).", totals.accepted_tokens),
                ("spec_draft_failures", "Propose calls that failed or missed their deadline "
                                        "(that step decoded without drafts).", stats.failures),
                ("spec_resyncs", "Sequences the draft service asked to resend whole.", stats.resyncs)):
            yield CounterMetricFamily(f"kvmesh_engine_{name}", help_text, value=value)


def register_speculation(core: EngineCore) -> None:
    """Publish the core's speculative decoding counters as kvmesh_engine_spec_* and time every
    Propose call in kvmesh_engine_spec_propose_seconds (call when core.drafts is set)."""
    from prometheus_client import REGISTRY

    core.drafts.on_propose = PROPOSE.observe
    REGISTRY.register(_SpecCollector(core))
