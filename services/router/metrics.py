"""Router Prometheus metrics: where requests went and why, and what the cascade decided.

`model_name` is the model a series is about, as /v1/models lists it: on the per-tier series the
tier's name (a tier serves one model, listed under the tier's name; a cascade request's calls
count under the tier that ran them), on `cascade_decisions` the route's (the model the request
named). The RPC metrics carry the router's own (kvmesh.metrics.ModelRegistry): its one tier's
name, or "*" when it serves several models.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvmesh.metrics import MODEL_LABEL, metric_name


class RouterMetrics:
    """The router's metrics, registered in its registry (one set per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            metric_name("router", "requests"),
            "Engine calls the router made, by tier, replica, placement policy (failover for a "
            "retry on the next replica) and final status code.",
            [MODEL_LABEL, "tier", "replica", "policy", "code"], registry=registry)
        self.cascade_decisions = Counter(
            metric_name("router", "cascade_decisions"),
            "Cascade steps by route, tier and reason (confident, low_confidence, difficulty, "
            "last_tier, tier_failed).", [MODEL_LABEL, "route", "tier", "reason"], registry=registry)
        self.placement_cached_tokens = Histogram(
            metric_name("router", "placement_cached_tokens"),
            "Prompt tokens the chosen replica reported cached when the request was placed.",
            [MODEL_LABEL, "tier"], buckets=(0, 16, 64, 256, 1024, 4096, 16384, 65536), registry=registry)
        self.probe_seconds = Histogram(
            metric_name("router", "probe_seconds"), "Time to probe all replicas of a tier.",
            [MODEL_LABEL, "tier"], buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0),
            registry=registry)
        self.probe_failures = Counter(
            metric_name("router", "probe_failures"), "Replica probes that failed, by status code.",
            [MODEL_LABEL, "tier", "replica", "code"], registry=registry)
        self.replica_down = Counter(
            metric_name("router", "replica_marked_down"),
            "Times a replica was marked down (skipped for the back-off period).",
            [MODEL_LABEL, "tier", "replica"], registry=registry)
        self.migrations = Counter(
            metric_name("router", "migrations"),
            "Requests whose replica failed mid-stream, by outcome: migrated (continued on "
            "another replica), failed (no replica took the continuation) or limit (moved "
            "--migration-limit times already).", [MODEL_LABEL, "tier", "outcome"], registry=registry)
        self.pd_routes = Counter(
            metric_name("router", "pd_routes"),
            "Requests of P/D tiers by route: pd (a prefill hop, then a decode hop) or colocated, "
            "with why (short_prompt, one_token, not_token_ids, resumed, too_long, pool_down, "
            "prefill_failed).", [MODEL_LABEL, "tier", "route", "reason"], registry=registry)
        self.generated_tokens = Counter(
            metric_name("router", "generated_tokens"),
            "Tokens generated per tier, kept or not (a cascade's discarded answers included).",
            [MODEL_LABEL, "tier"], registry=registry)
        self.cost = Counter(
            metric_name("router", "cost"),
            "Generated tokens times the tier's cost per token, kept or not.", [MODEL_LABEL, "tier"],
            registry=registry)
