"""Gateway metrics (Prometheus; served at GET /metrics on the HTTP port).

`status` is the HTTP status of the outcome on both front ends (gRPC codes mapped by
`errors.http_status`), so one dashboard covers both; `endpoint` is the HTTP path or
`grpc:<Method>`; `tenant` is the authenticated tenant ("unauthenticated" before that).
`model_name` is the request's model as /v1/models lists it, or ALL_MODELS ("*") for a request
that names none the gateway serves (refused before its model was known, or a model_not_found):
clients' strings never become label values. The in-flight gauges, shared by all models, carry
ALL_MODELS from the registry (kvmesh.metrics.ModelRegistry).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.metrics import MODEL_LABEL, metric_name

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """The gateway's metrics, registered in its registry (one set per registry), which its
    /metrics route serves."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            metric_name("gateway", "requests"), "Finished requests by outcome.",
            [MODEL_LABEL, "endpoint", "status", "tenant"], registry=registry)
        self.request_seconds = Histogram(
            metric_name("gateway", "request_seconds"),
            "Request duration, arrival to last byte (or error).", [MODEL_LABEL, "endpoint"],
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.ttft_seconds = Histogram(
            metric_name("gateway", "ttft_seconds"),
            "Arrival to the first generated token of a request.", [MODEL_LABEL, "endpoint"],
            buckets=_LATENCY_BUCKETS, registry=registry)
        self.inflight_requests = Gauge(
            metric_name("gateway", "inflight_requests"),
            "Upstream generations (prompts x n) admitted and not finished.", registry=registry)
        self.inflight_prompt_tokens = Gauge(
            metric_name("gateway", "inflight_prompt_tokens"),
            "Prompt tokens of the admitted, unfinished generations.", registry=registry)
        self.rejected = Counter(
            metric_name("gateway", "rejected"),
            "Requests refused before reaching the router, or for upstream overload.",
            [MODEL_LABEL, "reason"],
            registry=registry)
        self.tokens = Counter(
            metric_name("gateway", "tokens"),
            "Tokens of finished requests: prompt, completion, and cached (prompt tokens whose KV "
            "was reused).", [MODEL_LABEL, "kind"], registry=registry)

    def set_inflight(self, requests: int, prompt_tokens: int) -> None:
        """Admission's change hook: mirror the in-flight counts into the gauges."""
        self.inflight_requests.set(requests)
        self.inflight_prompt_tokens.set(prompt_tokens)
