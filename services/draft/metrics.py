"""Draft service Prometheus metrics: what each drafter proposed and what the engines accepted."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.metrics import metric_name


class DraftMetrics:
    """The draft service's metrics, registered in its registry (one set per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.proposals = Counter(
            metric_name("draft", "proposals"),
            "Sequences that asked for drafts, by the drafter that answered (adaptive: it chose to "
            "draft nothing), empty answers included; needs_resync answers are not counted.",
            ["drafter"], registry=registry)
        self.proposed_tokens = Counter(
            metric_name("draft", "proposed_tokens"), "Draft tokens proposed, by drafter.",
            ["drafter"], registry=registry)
        self.accepted_tokens = Counter(
            metric_name("draft", "accepted_tokens"),
            "Draft tokens the engines reported accepted (last_accepted), by the drafter that "
            "proposed them.", ["drafter"], registry=registry)
        self.propose_seconds = Histogram(
            metric_name("draft", "propose_seconds"),
            "Time to answer one Propose call (all its sequences).",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=registry)
        self.sequences = Gauge(metric_name("draft", "sequences"),
                               "Sequences with state in the service.", registry=registry)
        self.resyncs = Counter(
            metric_name("draft", "resyncs"),
            "needs_resync answers: a sequence's committed_len did not match the service's state "
            "(lost call, expired or evicted state, restart).", registry=registry)
