"""KV-cache service Prometheus metrics. Names mirror LMCache's (lookups, hit tokens, bytes read and
written); per-tier entries/bytes/evictions come from the store's stats at scrape time."""
from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

LOOKUPS = Counter("kvmesh_kvcache_lookup_requests", "Lookup calls.")
LOOKUP_HIT_CHUNKS = Counter("kvmesh_kvcache_lookup_hit_chunks", "Leading chunks found by Lookup calls.")
BYTES_READ = Counter("kvmesh_kvcache_read_bytes", "Blob bytes served by Get.")
BYTES_WRITTEN = Counter("kvmesh_kvcache_written_bytes", "Blob bytes stored by Put.")
SEARCHES = Counter("kvmesh_kvcache_search_requests", "Search calls.")
SEARCH_SECONDS = Histogram("kvmesh_kvcache_search_seconds", "Search latency, query embedding included.",
                           buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
INDEX_ENTRIES = Gauge("kvmesh_kvcache_index_entries", "Entries in the semantic index.", ["kind"])
