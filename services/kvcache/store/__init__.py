"""Storage tiers of the KV-cache service: memory LRU -> LMDB on disk -> shared Redis, in one TieredStore."""
from kvmesh.services.kvcache.store.base import (
    KEY_BYTES, EntryTooLarge, StoreFull, Tier, TierStats, TierUnavailable)
from kvmesh.services.kvcache.store.lmdb_tier import LmdbTier, StoreInUse
from kvmesh.services.kvcache.store.memory import MemoryTier
from kvmesh.services.kvcache.store.records import MemoryTable, RecordTable
from kvmesh.services.kvcache.store.redis_tier import RedisTier
from kvmesh.services.kvcache.store.tiered import TieredStore

__all__ = ["KEY_BYTES", "EntryTooLarge", "LmdbTier", "MemoryTable", "MemoryTier", "RecordTable", "RedisTier", "StoreFull", "StoreInUse",
           "Tier", "TierStats", "TierUnavailable", "TieredStore"]
