"""Gateway metrics (Prometheus, default registry; served at GET /metrics on the HTTP port).

`status` is the HTTP status of the outcome on both front ends (gRPC codes mapped by
`errors.http_status`), so one dashboard covers both; `endpoint` is the HTTP path or
`grpc:<Method>`; `tenant` is the authenticated tenant ("unauthenticated" before that).
"""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from kvmesh.metrics import metric_name

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

REQUESTS = Counter(metric_name("gateway", "requests"), "Finished requests by outcome.",
                   ["endpoint", "status", "tenant"])
REQUEST_SECONDS = Histogram(metric_name("gateway", "request_seconds"),
                            "Request duration, arrival to last byte (or error).", ["endpoint"],
                            buckets=_LATENCY_BUCKETS)
TTFT_SECONDS = Histogram(metric_name("gateway", "ttft_seconds"),
                         "Arrival to the first generated token of a request.", ["endpoint"],
                         buckets=_LATENCY_BUCKETS)
INFLIGHT_REQUESTS = Gauge(metric_name("gateway", "inflight_requests"),
                          "Upstream generations (prompts x n) admitted and not finished.")
INFLIGHT_PROMPT_TOKENS = Gauge(metric_name("gateway", "inflight_prompt_tokens"),
                               "Prompt tokens of the admitted, unfinished generations.")
REJECTED = Counter(metric_name("gateway", "rejected"),
                   "Requests refused before reaching the router, or for upstream overload.",
                   ["reason"])
TOKENS = Counter(metric_name("gateway", "tokens"),
                 "Tokens of finished requests: prompt, completion, and cached (prompt tokens "
                 "whose KV was reused).", ["kind"])


def set_inflight(requests: int, prompt_tokens: int) -> None:
    """Admission's change hook: mirror the in-flight counts into the gauges."""
    INFLIGHT_REQUESTS.set(requests)
    INFLIGHT_PROMPT_TOKENS.set(prompt_tokens)
