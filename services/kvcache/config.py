"""KV-cache service configuration: flags and KVMESH_KVCACHE_* environment variables, frozen after start."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvmesh.config import ConfigError, setting
from kvmesh.metrics import ALL_MODELS
from kvmesh.rpc.server import ServerSettings

MiB = 1 << 20


def default_data_dir() -> Path:
    """``$KVMESH_DATA_DIR/kvcache`` (default ``~/.kvmesh/kvcache``): where LMDB lives."""
    import os

    return Path(os.environ.get("KVMESH_DATA_DIR", Path.home() / ".kvmesh")) / "kvcache"


@dataclass(frozen=True)
class KvcacheConfig:
    """Everything the kvcache service needs to start; see `python -m kvmesh.services.kvcache --help`."""

    server: ServerSettings = ServerSettings(port=50071)
    tiers: tuple[str, ...] = setting(("memory", "disk"), "Storage tiers, fastest first.",
                                     choices=("memory", "disk", "redis"))
    data_dir: Optional[Path] = setting(None, "Directory of the LMDB environment; unset = $KVMESH_DATA_DIR/kvcache.")
    memory_bytes: int = setting(512 * MiB, "Byte budget of the in-process LRU tier.", min=0)
    disk_map_bytes: int = setting(8192 * MiB, "LMDB map size (the disk tier's hard limit; eviction keeps usage below it).", min=MiB)
    max_entry_bytes: int = setting(64 * MiB, "Largest blob one Put may store; larger ones get RESOURCE_EXHAUSTED.", min=1024)
    redis_url: Optional[str] = setting(None, "redis://host:port/db of the shared tier (needed when tiers has 'redis').")
    redis_prefix: str = setting("kvmesh:", "Key prefix in Redis, to share a Redis with other data.")
    sweep_interval_s: float = setting(60.0, "Seconds between sweeps that remove expired entries; 0 disables (expired entries are still misses).", min=0.0)

    def validate(self) -> None:
        if len(set(self.tiers)) != len(self.tiers):
            raise ConfigError(f"--tiers {','.join(self.tiers)} names a tier twice; list each once, fastest first")
        if "redis" in self.tiers and not self.redis_url:
            raise ConfigError("--tiers includes redis but --redis-url is unset (KVMESH_KVCACHE_REDIS_URL=redis://127.0.0.1:6379/0)")
        if self.max_entry_bytes > self.disk_map_bytes // 4:
            raise ConfigError(
                f"--max-entry-bytes ({self.max_entry_bytes}) must be at most a quarter of --disk-map-bytes "
                f"({self.disk_map_bytes}) so eviction can always make room; lower it or raise the map size")

    @property
    def lmdb_path(self) -> Path:
        return self.data_dir if self.data_dir is not None else default_data_dir()

    @property
    def metrics_model_name(self) -> str:
        """ALL_MODELS: the store is shared by every model (its keys' namespaces hold weights
        digests, not served names)."""
        return ALL_MODELS
