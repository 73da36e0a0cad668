"""The storage contract every KV-cache tier implements, its stats record and its errors.

Entries are opaque, immutable blobs under fixed-size keys; the service above computes keys and
verifies blobs (codec checksums), so a tier only moves bytes. Calls are batched and blocking;
a tier that cannot be reached raises :class:`TierUnavailable` so the caller degrades to a miss
(recompute), never fails a request.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass

from kvmesh.kv.keys import KEY_BYTES  # every key is a 32-byte digest (DESIGN.md, "KV chunks and keys")


class StoreFull(Exception):
    """The tier cannot make room: everything it could evict is pinned (-> RESOURCE_EXHAUSTED)."""


class EntryTooLarge(Exception):
    """One blob exceeds the tier's per-entry limit (-> RESOURCE_EXHAUSTED)."""


class TierUnavailable(Exception):
    """The tier's backend (e.g. a Redis server) cannot be reached; treat as a miss and go on."""


@dataclass(frozen=True)
class TierStats:
    """A snapshot of one tier. Counters (hits, misses, evictions) are since this process opened it."""

    name: str
    entries: int
    bytes: int
    """Sum of stored blob sizes (not the backend's own overhead)."""
    hits: int
    misses: int
    evictions: int
    """Entries dropped to make room (expired entries removed are not counted)."""
    capacity_bytes: int
    """The byte budget blobs may use; 0 when the backend reports none."""
    errors: int = 0
    """Calls that failed with TierUnavailable, as counted by the TieredStore in front."""


def check_key(key: bytes) -> None:
    """Raise ValueError unless ``key`` is a KEY_BYTES-long bytes object."""
    if not isinstance(key, bytes) or len(key) != KEY_BYTES:
        raise ValueError(f"a kvcache key is {KEY_BYTES} bytes (a digest); got {type(key).__name__} "
                         f"of length {len(key) if isinstance(key, (bytes, bytearray)) else '?'}")


def check_ttl(ttl_s: float | None) -> None:
    """Raise ValueError unless ``ttl_s`` is None (no expiry) or a positive number of seconds."""
    if ttl_s is not None and not ttl_s > 0:
        raise ValueError(f"ttl_s must be None (no expiry) or > 0 seconds; got {ttl_s!r}")


def check_put(tier: str, key: bytes, blob: bytes, ttl_s: float | None, max_entry_bytes: int) -> None:
    """The checks every tier's ``put`` makes first: key, TTL, and the per-entry size limit."""
    check_key(key)
    check_ttl(ttl_s)
    if len(blob) > max_entry_bytes:
        raise EntryTooLarge(f"{tier}: blob of {len(blob)} bytes exceeds the per-entry limit "
                            f"of {max_entry_bytes} bytes")


class Tier(abc.ABC):
    """One storage tier. All methods block; implementations are thread-safe.

    Semantics shared by every tier:
      * a pinned entry is never evicted and never expires; its TTL (if any) applies again once
        it is unpinned (an entry whose deadline passed while pinned expires on unpin);
      * an expired entry is a miss and is removed (lazily, or by the backend);
      * ``put`` of an existing key replaces blob, TTL and pin state.
    """

    name: str

    @abc.abstractmethod
    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Blobs for ``keys`` (None = miss), in order. Counts hits/misses and refreshes recency."""

    @abc.abstractmethod
    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is held (and not expired). No hit/miss accounting, no recency change."""

    @abc.abstractmethod
    def remaining_ttl_many(self, keys: list[bytes]) -> list[float | None]:
        """Seconds until each entry expires; None when absent, pinned or without expiry.

        Used by the TieredStore so a promoted copy does not outlive its original.
        """

    @abc.abstractmethod
    def put(self, key: bytes, blob: bytes, *, ttl_s: float | None = None,
            pinned: bool = False) -> None:
        """Store ``blob`` under ``key``; durable per the tier once it returns.

        Raises EntryTooLarge, StoreFull (only pinned entries left to evict) or TierUnavailable.
        """

    @abc.abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False if it was absent."""

    @abc.abstractmethod
    def set_pinned(self, key: bytes, pinned: bool) -> bool:
        """Pin (never evict, never expire) or unpin ``key``; False if absent."""

    @abc.abstractmethod
    def set_ttl(self, key: bytes, ttl_s: float | None) -> bool:
        """Expire ``key`` ``ttl_s`` seconds from now (None = never); False if absent."""

    @abc.abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of entries, bytes and counters."""

    def sweep_expired(self) -> int:
        """Remove expired entries now; returns how many. Tiers whose backend expires entries
        itself (Redis) keep this default."""
        return 0

    @abc.abstractmethod
    def close(self) -> None:
        """Flush pending state and release the backend; the tier is unusable afterwards."""
