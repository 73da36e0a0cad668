"""KV-cache service Prometheus metrics, mirroring LMCache's (README, "Metrics", has the table).

Call counters are counted by the servicers through the `record_*` methods. Per-tier usage
(entries, bytes, capacity) and the tiers' own hit/miss/eviction counters are read from the store
at scrape time by `StoreCollector`, which `watch_store` installs: the tiers count anyway, and a
scrape then shows the store as it is, not as of the last call.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.metrics import metric_name


def _name(name: str) -> str:
    return metric_name("kvcache", name)


class KvcacheMetrics:
    """The KV-cache service's metrics, registered in its registry (one set per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

        def counter(name: str, text: str) -> Counter:
            return Counter(_name(name), text, registry=registry)

        self.lookups = counter("lookup_requests", "Lookup calls.")
        self.lookup_chunks = counter("lookup_chunks", "Chunk keys asked about by Lookup calls.")
        self.lookup_tokens = counter(
            "lookup_tokens", "Tokens asked about by Lookup calls: keys x the call's chunk_tokens.")
        self.lookup_hit_chunks = counter("lookup_hit_chunks",
                                         "Leading chunks found by Lookup calls.")
        self.lookup_hit_tokens = counter(
            "lookup_hit_tokens",
            "Tokens of the leading chunks found by Lookup calls (prefix_tokens).")
        self.gets = counter("get_requests", "Get calls.")
        self.get_chunks = counter("get_chunks", "Chunk keys asked for by Get calls.")
        self.get_hit_chunks = counter("get_hit_chunks", "Chunks Get served (found and verified).")
        self.bytes_read = counter("read_bytes", "Blob bytes served by Get.")
        self.puts = counter("put_requests", "Put calls that stored a chunk.")
        self.bytes_written = counter("written_bytes", "Blob bytes stored by Put.")
        self.searches = counter("search_requests", "Search calls.")
        self.search_seconds = Histogram(
            _name("search_seconds"), "Search latency, query embedding included.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5), registry=registry)
        self.index_entries = Gauge(_name("index_entries"), "Entries in the semantic index.",
                                   ["kind"], registry=registry)

    def record_lookup(self, keys: int, hit_chunks: int, chunk_tokens: int) -> None:
        """One Lookup call: `keys` asked about, the leading `hit_chunks` found."""
        self.lookups.inc()
        self.lookup_chunks.inc(keys)
        self.lookup_tokens.inc(keys * chunk_tokens)
        self.lookup_hit_chunks.inc(hit_chunks)
        self.lookup_hit_tokens.inc(hit_chunks * chunk_tokens)

    def record_get(self, keys: int) -> None:
        """One Get call asking for `keys` chunks (each one served is `record_read`)."""
        self.gets.inc()
        self.get_chunks.inc(keys)

    def record_read(self, nbytes: int) -> None:
        """One chunk served by Get."""
        self.get_hit_chunks.inc()
        self.bytes_read.inc(nbytes)

    def record_put(self, nbytes: int) -> None:
        """One chunk stored by Put."""
        self.puts.inc()
        self.bytes_written.inc(nbytes)

    def watch_store(self, backend) -> StoreCollector:
        """Publishes the backend's store (per-tier usage and counters) in this registry; returns
        the collector (unregister it to stop)."""
        collector = StoreCollector(backend)
        self.registry.register(collector)
        return collector


class StoreCollector:
    """Per-tier gauges and counters from `backend.store.stats()` at scrape time, and the corrupt
    entries the service dropped (`backend.corrupt_entries`). Tiers are thread-safe, so the scrape
    thread may ask them."""

    def __init__(self, backend) -> None:
        self.backend = backend

    def collect(self):
        stats = self.backend.store.stats()
        gauges = {field: GaugeMetricFamily(_name(f"tier_{field}"), text, labels=["tier"]) for field, text in (
            ("entries", "Entries held, by tier."),
            ("bytes", "Bytes of the blobs held, by tier."),
            ("capacity_bytes", "Byte budget of the tier's blobs (0 when the backend reports none)."))}
        counters = {field: CounterMetricFamily(_name(f"tier_{field}"), text, labels=["tier"]) for field, text in (
            ("hits", "Reads the tier answered (a miss in a faster tier asks the next one)."),
            ("misses", "Reads the tier could not answer."),
            ("evictions", "Entries evicted to make room (expired ones removed are not counted)."),
            ("errors", "Calls that failed because the tier was unavailable (served as misses)."))}
        for s in stats:
            for field, family in (*gauges.items(), *counters.items()):
                family.add_metric([s.name], getattr(s, field))
        yield from gauges.values()
        yield from counters.values()
        yield CounterMetricFamily(_name("corrupt_entries"),
                                  "Stored blobs that failed verification when read, deleted (misses).",
                                  value=self.backend.corrupt_entries)
