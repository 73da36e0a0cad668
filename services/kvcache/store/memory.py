"""The in-process tier: an LRU of blobs within a byte budget."""
from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

from kvmesh.services.kvcache.store.base import (
    StoreFull, Tier, TierStats, check_put, check_ttl)


@dataclass
class _Entry:
    blob: bytes
    expires_at: float  # math.inf = no expiry
    pinned: bool

    def expired(self, now: float) -> bool:
        return not self.pinned and now >= self.expires_at


class MemoryTier(Tier):
    """An LRU dict of blobs, bounded by ``capacity_bytes`` of blob data; thread-safe (one lock).

    NOTE: eviction. ``_entries`` is ordered least- to most-recently used; a hit or a put moves a
    key to the end. To fit a new blob, ``put`` first drops expired entries, then picks unpinned
    entries from the front until the blob fits. If even evicting every candidate would not make
    room it raises StoreFull *before* evicting anything, so a failed put never costs entries.
    Expired entries are misses and are dropped when met (``get_many``, ``put``, ``sweep_expired``).
    """

    def __init__(self, capacity_bytes: int, *, max_entry_bytes: int | None = None,
                 name: str = "memory", clock: Callable[[], float] = time.time) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0; got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes
        limit = capacity_bytes if max_entry_bytes is None else max_entry_bytes
        self.max_entry_bytes = min(capacity_bytes, limit)
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes = 0
        self._hits = self._misses = self._evictions = 0

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Blobs for ``keys`` (None = miss); hits become most recently used."""
        out: list[bytes | None] = []
        with self._lock:
            now = self._clock()
            for key in keys:
                entry = self._live(key, now)
                if entry is None:
                    self._misses += 1
                    out.append(None)
                else:
                    self._hits += 1
                    self._entries.move_to_end(key)
                    out.append(entry.blob)
        return out

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is held and unexpired; changes neither counters nor recency."""
        with self._lock:
            now = self._clock()
            return [(e := self._entries.get(k)) is not None and not e.expired(now) for k in keys]

    def remaining_ttl_many(self, keys: list[bytes]) -> list[float | None]:
        """Seconds left per key; None if absent, pinned, expired-and-dropped or without expiry."""
        with self._lock:
            now = self._clock()
            out: list[float | None] = []
            for key in keys:
                e = self._entries.get(key)
                live = e is not None and not e.expired(now) and not e.pinned
                out.append(e.expires_at - now if live and e.expires_at != math.inf else None)
            return out

    def put(self, key: bytes, blob: bytes, *, ttl_s: float | None = None, pinned: bool = False) -> None:
        """Insert or replace ``key`` as most recently used, evicting LRU unpinned entries."""
        check_put(self.name, key, blob, ttl_s, self.max_entry_bytes)
        with self._lock:
            now = self._clock()
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= len(old.blob)
            try:
                self._make_room(len(blob), now)
            except StoreFull:
                if old is not None:
                    self._entries[key] = old
                    self._bytes += len(old.blob)
                raise
            expires_at = math.inf if ttl_s is None else now + ttl_s
            self._entries[key] = _Entry(bytes(blob), expires_at, pinned)
            self._bytes += len(blob)

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False if absent."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._bytes -= len(entry.blob)
            return entry is not None

    def set_pinned(self, key: bytes, pinned: bool) -> bool:
        """Pin or unpin ``key``; False if absent (or already expired)."""
        with self._lock:
            entry = self._live(key, self._clock())
            if entry is None:
                return False
            entry.pinned = pinned
            return True

    def set_ttl(self, key: bytes, ttl_s: float | None) -> bool:
        """Expire ``key`` ``ttl_s`` seconds from now (None = never); False if absent."""
        check_ttl(ttl_s)
        with self._lock:
            now = self._clock()
            entry = self._live(key, now)
            if entry is None:
                return False
            entry.expires_at = math.inf if ttl_s is None else now + ttl_s
            return True

    def sweep_expired(self) -> int:
        """Drop every expired entry now; returns how many."""
        with self._lock:
            return self._drop_expired(self._clock())

    def stats(self) -> TierStats:
        """Entries and blob bytes held, and counters since construction."""
        with self._lock:
            return TierStats(self.name, len(self._entries), self._bytes, self._hits, self._misses,
                             self._evictions, self.capacity_bytes)

    def close(self) -> None:
        """Drop every entry (an in-process tier keeps nothing across restarts)."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def _live(self, key: bytes, now: float) -> _Entry | None:
        """The unexpired entry for ``key``, dropping it if it has expired. Caller holds the lock."""
        entry = self._entries.get(key)
        if entry is not None and entry.expired(now):
            del self._entries[key]
            self._bytes -= len(entry.blob)
            return None
        return entry

    def _drop_expired(self, now: float) -> int:
        expired = [k for k, e in self._entries.items() if e.expired(now)]
        for key in expired:
            self._bytes -= len(self._entries.pop(key).blob)
        return len(expired)

    def _make_room(self, size: int, now: float) -> None:
        """Evict until ``size`` more bytes fit, or raise StoreFull having evicted nothing."""
        if self._bytes + size <= self.capacity_bytes:
            return
        self._drop_expired(now)
        excess = self._bytes + size - self.capacity_bytes
        victims: list[bytes] = []
        for key, entry in self._entries.items():
            if excess <= 0:
                break
            if not entry.pinned:
                victims.append(key)
                excess -= len(entry.blob)
        if excess > 0:
            raise StoreFull(f"{self.name}: cannot fit {size} bytes: {self._bytes} of "
                            f"{self.capacity_bytes} bytes held, the rest of it pinned")
        for key in victims:
            self._bytes -= len(self._entries.pop(key).blob)
        self._evictions += len(victims)
