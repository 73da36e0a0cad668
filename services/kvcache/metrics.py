"""KV-cache service Prometheus metrics, mirroring LMCache's (README, "Metrics", has the table).

Call counters are counted by the servicer through the `record_*` helpers. Per-tier usage (entries,
bytes, capacity) and the tiers' own hit/miss/eviction counters are read from the store at scrape
time by `StoreCollector`, which `register_store` installs: the tiers count anyway, and a scrape
then shows the store as it is, not as of the last call.
"""
from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvmesh.metrics import metric_name


def _name(name: str) -> str:
    return metric_name("kvcache", name)


LOOKUPS = Counter(_name("lookup_requests"), "Lookup calls.")
LOOKUP_CHUNKS = Counter(_name("lookup_chunks"), "Chunk keys asked about by Lookup calls.")
LOOKUP_TOKENS = Counter(_name("lookup_tokens"),
                        "Tokens asked about by Lookup calls: keys x the call's chunk_tokens.")
LOOKUP_HIT_CHUNKS = Counter(_name("lookup_hit_chunks"), "Leading chunks found by Lookup calls.")
LOOKUP_HIT_TOKENS = Counter(_name("lookup_hit_tokens"),
                            "Tokens of the leading chunks found by Lookup calls (prefix_tokens).")
GETS = Counter(_name("get_requests"), "Get calls.")
GET_CHUNKS = Counter(_name("get_chunks"), "Chunk keys asked for by Get calls.")
GET_HIT_CHUNKS = Counter(_name("get_hit_chunks"), "Chunks Get served (found and verified).")
BYTES_READ = Counter(_name("read_bytes"), "Blob bytes served by Get.")
PUTS = Counter(_name("put_requests"), "Put calls that stored a chunk.")
BYTES_WRITTEN = Counter(_name("written_bytes"), "Blob bytes stored by Put.")
SEARCHES = Counter(_name("search_requests"), "Search calls.")
SEARCH_SECONDS = Histogram(_name("search_seconds"), "Search latency, query embedding included.",
                           buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
INDEX_ENTRIES = Gauge(_name("index_entries"), "Entries in the semantic index.", ["kind"])


def record_lookup(keys: int, hit_chunks: int, chunk_tokens: int) -> None:
    """One Lookup call: `keys` asked about, the leading `hit_chunks` found."""
    LOOKUPS.inc()
    LOOKUP_CHUNKS.inc(keys)
    LOOKUP_TOKENS.inc(keys * chunk_tokens)
    LOOKUP_HIT_CHUNKS.inc(hit_chunks)
    LOOKUP_HIT_TOKENS.inc(hit_chunks * chunk_tokens)


def record_get(keys: int) -> None:
    """One Get call asking for `keys` chunks (each one served is `record_read`)."""
    GETS.inc()
    GET_CHUNKS.inc(keys)


def record_read(nbytes: int) -> None:
    """One chunk served by Get."""
    GET_HIT_CHUNKS.inc()
    BYTES_READ.inc(nbytes)


def record_put(nbytes: int) -> None:
    """One chunk stored by Put."""
    PUTS.inc()
    BYTES_WRITTEN.inc(nbytes)


class StoreCollector:
    """Per-tier gauges and counters from `servicer.store.stats()` at scrape time, and the corrupt
    entries the servicer dropped. Tiers are thread-safe, so the scrape thread may ask them."""

    def __init__(self, servicer) -> None:
        self.servicer = servicer

    def collect(self):
        stats = self.servicer.store.stats()
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
                                  value=self.servicer.corrupt_entries)


def register_store(servicer, registry: CollectorRegistry = REGISTRY) -> StoreCollector:
    """Publishes the servicer's store (per-tier usage and counters) in `registry`."""
    collector = StoreCollector(servicer)
    registry.register(collector)
    return collector
