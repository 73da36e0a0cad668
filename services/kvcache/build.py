"""Wiring: config -> the tiered store (fastest tier first)."""
from __future__ import annotations

from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.services.kvcache.store import LmdbTier, MemoryTier, RedisTier, Tier, TieredStore


def build_store(cfg: KvcacheConfig) -> TieredStore:
    """One tier per name in ``cfg.tiers``, in that order."""
    tiers: list[Tier] = []
    for name in cfg.tiers:
        if name == "memory":
            tiers.append(MemoryTier(cfg.memory_bytes))
        elif name == "disk":
            cfg.lmdb_path.mkdir(parents=True, exist_ok=True)
            tiers.append(LmdbTier(cfg.lmdb_path, map_size_bytes=cfg.disk_map_bytes,
                                  max_entry_bytes=cfg.max_entry_bytes))
        else:
            tiers.append(RedisTier(cfg.redis_url, prefix=cfg.redis_prefix, max_entry_bytes=cfg.max_entry_bytes))
    return TieredStore(tiers)
