"""The disk tier: blobs and their metadata in one LMDB environment, evicted LRU below a high-water mark."""
from __future__ import annotations

import fcntl
import logging
import math
import os
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import lmdb

from kvmesh.services.kvcache.store.base import (
    KEY_BYTES, StoreFull, Tier, TierStats, check_put, check_ttl)
from kvmesh.services.kvcache.store.records import RecordTable

log = logging.getLogger(__name__)

_META = struct.Struct("<Qdd?")  # blob size, last access (clock seconds), expires at (inf = never), pinned
_PAGE_HEADER = 16  # LMDB's PAGEHDRSZ
_NODE_HEADER = 8 + 2  # LMDB node header + its slot in the page's index
_RESERVED_PAGES = 64  # meta pages, roots, branch pages, free-list pages
_SETTLE_KEY = b"kvmesh.evictions"  # in LMDB's main DB, beside the two named DBs


class StoreInUse(RuntimeError):
    """Another LmdbTier (in this process or another) already has this path open."""


@dataclass(frozen=True)
class _Meta:
    size: int
    last_access: float
    expires_at: float
    pinned: bool

    def pack(self) -> bytes:
        return _META.pack(self.size, self.last_access, self.expires_at, self.pinned)

    @classmethod
    def unpack(cls, raw: bytes) -> _Meta:
        return cls(*_META.unpack(raw))

    def expired(self, now: float) -> bool:
        return not self.pinned and now >= self.expires_at


class LmdbTier(Tier):
    """A persistent LRU tier in an LMDB environment at ``path`` (a directory).

    NOTE: crash safety. Every put is one write transaction holding both the blob (DB ``blobs``)
    and its metadata (DB ``meta``); LMDB commits copy-on-write and flips one of two meta pages,
    and with sync/metasync on, ``put`` returns only after fsync. A SIGKILL at any instant thus
    leaves exactly the committed puts, each complete. The kernel drops the owner lock
    (``flock`` on ``owner.lock``) with the process, and stale reader slots are cleared on open.

    NOTE: eviction. LMDB cannot grow past ``map_size_bytes`` and even a delete needs free pages,
    so the tier keeps an estimate of pages used (``_used``: overflow pages per blob plus the
    B-tree nodes of both records, at half fill) under ``high_water * map_size``. When a put
    would cross it, expired entries go first, then least-recently-used unpinned entries, down to
    ``low_water`` so that evictions come in batches (one transaction each). Freed pages are only
    reusable two commits after the transaction that freed them (LMDB keeps the previous snapshot
    intact), so eviction is its own transaction followed by a tiny "settle" commit (this process's
    eviction count under ``kvmesh.evictions``) before the put's transaction. If the estimate is
    still short (fragmented free pages, a long reader pinning old pages) and LMDB
    raises MapFullError, the put is aborted cleanly, another eighth of the budget is evicted and
    the put retried; with nothing unpinned left it raises StoreFull.

    NOTE: recency. The LRU order lives in memory (``_index``, rebuilt from ``meta`` on open,
    oldest access first). Hits update it in memory and mark the key dirty; dirty access times
    are written in one transaction every ``access_flush_every`` hits, with any eviction, and on
    close. A crash loses only those unflushed times, i.e. a slightly stale LRU order.
    The in-memory index is authoritative because one process owns the path (the owner lock).
    """

    def __init__(self, path: str | os.PathLike, map_size_bytes: int, max_entry_bytes: int, *,
                 high_water: float = 0.85, low_water: float = 0.75, access_flush_every: int = 256,
                 name: str = "disk", clock: Callable[[], float] = time.time) -> None:
        if max_entry_bytes > map_size_bytes // 4:
            raise ValueError(f"max_entry_bytes ({max_entry_bytes}) must be at most a quarter of "
                             f"map_size_bytes ({map_size_bytes}) so eviction can make room")
        if not 0 < low_water <= high_water <= 0.95:
            raise ValueError(f"need 0 < low_water <= high_water <= 0.95; got {low_water}, {high_water}")
        self.name = name
        self.path = Path(path)
        self.map_size_bytes = map_size_bytes
        self.max_entry_bytes = max_entry_bytes
        self.map_full_events = 0
        """MapFullErrors absorbed by evicting more (the page estimate fell short)."""
        self._clock = clock
        self._flush_every = access_flush_every
        self._lock = threading.Lock()
        self._put_lock = threading.Lock()
        self.path.mkdir(parents=True, exist_ok=True)
        self._owner_fd = _lock_owner(self.path)
        try:
            self._env = lmdb.open(str(self.path), map_size=map_size_bytes, subdir=True, max_dbs=4,
                                  sync=True, metasync=True, readahead=False)
        except BaseException:
            os.close(self._owner_fd)
            raise
        self._env.reader_check()
        self._blobs = self._env.open_db(b"blobs")
        self._meta = self._env.open_db(b"meta")
        self._psize = self._env.stat()["psize"]
        self._node_max = ((self._psize - _PAGE_HEADER) // 2 & ~1) - 2  # LMDB's me_nodemax
        reserve = _RESERVED_PAGES * self._psize
        self._budget = int(map_size_bytes * high_water) - reserve
        self._low_budget = int(map_size_bytes * low_water) - reserve
        self._index: OrderedDict[bytes, _Meta] = OrderedDict()
        self._dirty: set[bytes] = set()
        self._used = self._bytes = 0
        self._hits = self._misses = self._evictions = 0
        self._closed = False
        self._load_index()

    def _load_index(self) -> None:
        """Rebuild the LRU index and the byte counts from the ``meta`` DB."""
        with self._env.begin(db=self._meta) as txn:
            rows = [(bytes(k), _Meta.unpack(v)) for k, v in txn.cursor()]
        rows.sort(key=lambda row: row[1].last_access)
        self._index = OrderedDict(rows)
        self._bytes = sum(m.size for m in self._index.values())
        self._used = sum(self.cost(m.size) for m in self._index.values())

    def cost(self, size: int) -> int:
        """Estimated bytes of map one entry with a ``size``-byte blob occupies (both records)."""
        meta_node = 2 * (KEY_BYTES + _META.size + _NODE_HEADER)
        if KEY_BYTES + size + _NODE_HEADER <= self._node_max:
            return 2 * (KEY_BYTES + size + _NODE_HEADER) + meta_node
        overflow = math.ceil((size + _PAGE_HEADER) / self._psize) * self._psize
        return overflow + 2 * (KEY_BYTES + 8 + _NODE_HEADER) + meta_node

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Blobs for ``keys`` (None = miss), read in one short read transaction."""
        out: list[bytes | None] = [None] * len(keys)
        with self._lock:
            now = self._clock()
            expired = [k for k in dict.fromkeys(keys)
                       if (m := self._index.get(k)) is not None and m.expired(now)]
            if expired:
                self._remove(expired, evicted=False)
            wanted = [i for i, k in enumerate(keys) if k in self._index]
        if wanted:
            with self._env.begin(db=self._blobs) as txn:
                for i in wanted:
                    out[i] = txn.get(keys[i])
        with self._lock:
            now = self._clock()
            for key, blob in zip(keys, out):
                meta = self._index.get(key) if blob is not None else None
                if meta is None:
                    self._misses += 1
                    continue
                self._hits += 1
                self._index[key] = replace(meta, last_access=now)
                self._index.move_to_end(key)
                self._dirty.add(key)
            if len(self._dirty) >= self._flush_every:
                self._flush_access()
        return out

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key is held and unexpired (from the in-memory index; no LMDB read)."""
        with self._lock:
            now = self._clock()
            return [(m := self._index.get(k)) is not None and not m.expired(now) for k in keys]

    def remaining_ttl_many(self, keys: list[bytes]) -> list[float | None]:
        """Seconds left per key; None if absent, pinned, expired or without expiry."""
        with self._lock:
            now = self._clock()
            out: list[float | None] = []
            for key in keys:
                m = self._index.get(key)
                live = m is not None and not m.pinned and not m.expired(now) and m.expires_at != math.inf
                out.append(m.expires_at - now if live else None)
            return out

    def put(self, key: bytes, blob: bytes, *, ttl_s: float | None = None, pinned: bool = False) -> None:
        """Durably store ``blob`` (fsynced before returning), evicting LRU entries as needed."""
        check_put(self.name, key, blob, ttl_s, self.max_entry_bytes)
        cost = self.cost(len(blob))
        # One put at a time (_put_lock); the index lock (_lock) only around the index and the
        # evictions, not across the blob's commit and fsync, so reads of other keys go on. Until
        # the index has it, the new entry reads as absent (its put has not returned yet).
        with self._put_lock:
            with self._lock:
                now = self._clock()
                meta = _Meta(len(blob), now, math.inf if ttl_s is None else now + ttl_s, pinned)
                self._make_room(cost, now, keep=key)
            while True:
                try:
                    with self._env.begin(write=True) as txn:
                        txn.put(key, blob, db=self._blobs)
                        txn.put(key, meta.pack(), db=self._meta)
                    break
                except lmdb.MapFullError:
                    self.map_full_events += 1
                    with self._lock:
                        if not self._evict_lru(max(cost, self._budget // 8), keep=key):
                            raise StoreFull(f"{self.name}: LMDB map full, every other entry pinned") from None
            with self._lock:
                old = self._index.pop(key, None)
                if old is not None:
                    self._bytes -= old.size
                    self._used -= self.cost(old.size)
                self._dirty.discard(key)
                self._index[key] = meta
                self._bytes += meta.size
                self._used += cost

    def delete(self, key: bytes) -> bool:
        """Remove ``key`` (one write transaction); False if absent."""
        with self._lock:
            if key not in self._index:
                return False
            self._remove([key], evicted=False)
            return True

    def set_pinned(self, key: bytes, pinned: bool) -> bool:
        """Pin or unpin ``key`` (a metadata write); False if absent or expired."""
        with self._lock:
            meta = self._live(key)
            return meta is not None and self._write_meta(key, replace(meta, pinned=pinned))

    def set_ttl(self, key: bytes, ttl_s: float | None) -> bool:
        """Expire ``key`` ``ttl_s`` seconds from now (None = never); False if absent or expired."""
        check_ttl(ttl_s)
        with self._lock:
            meta = self._live(key)
            expires_at = math.inf if ttl_s is None else self._clock() + ttl_s
            return meta is not None and self._write_meta(key, replace(meta, expires_at=expires_at))

    def sweep_expired(self) -> int:
        """Remove every expired entry in one transaction; returns how many."""
        with self._lock:
            return self._sweep(self._clock())

    def stats(self) -> TierStats:
        """Counts from the index; ``capacity_bytes`` is the high-water budget, not the map size."""
        with self._lock:
            return TierStats(self.name, len(self._index), self._bytes, self._hits, self._misses,
                             self._evictions, self._budget)

    def table(self, name: str) -> RecordTable:
        """A RecordTable in the named sub-database ``name`` of this environment (not the blobs'
        DBs, not counted in the entry/byte stats; shares the map, so keep records small)."""
        if name in ("blobs", "meta"):
            raise ValueError(f"{name!r} is the tier's own sub-database; pick another table name")
        return _LmdbTable(self, self._env.open_db(name.encode()))

    def close(self) -> None:
        """Flush buffered access times, close the environment and release the path. Idempotent."""
        with self._put_lock, self._lock:
            if self._closed:
                return
            self._closed = True
            self._flush_access()
            self._env.close()
            os.close(self._owner_fd)

    # -- internals; callers hold self._lock --------------------------------------------------

    def _live(self, key: bytes) -> _Meta | None:
        meta = self._index.get(key)
        if meta is not None and meta.expired(self._clock()):
            self._remove([key], evicted=False)
            return None
        return meta

    def _write_meta(self, key: bytes, meta: _Meta) -> bool:
        try:
            with self._env.begin(write=True, db=self._meta) as txn:
                txn.put(key, meta.pack())
        except lmdb.MapFullError:
            raise StoreFull(f"{self.name}: LMDB map too full to update metadata") from None
        self._index[key] = meta
        self._dirty.discard(key)
        return True

    def _flush_access(self) -> None:
        """Write buffered access times in one transaction; on a full map, drop them (advisory)."""
        if not self._dirty:
            return
        try:
            with self._env.begin(write=True, db=self._meta) as txn:
                self._put_dirty(txn)
        except lmdb.MapFullError:
            log.warning("%s: map full, dropping %d buffered access times", self.name, len(self._dirty))
        self._dirty.clear()

    def _put_dirty(self, txn: lmdb.Transaction) -> None:
        for key in self._dirty:
            meta = self._index.get(key)
            if meta is not None:
                txn.put(key, meta.pack(), db=self._meta)

    def _sweep(self, now: float) -> int:
        expired = [k for k, m in self._index.items() if m.expired(now)]
        if expired:
            self._remove(expired, evicted=False)
        return len(expired)

    def _make_room(self, cost: int, now: float, *, keep: bytes) -> None:
        """Keep ``_used + cost`` under the budget, or raise StoreFull having evicted nothing."""
        if self._used + cost <= self._budget:
            return
        self._sweep(now)
        victims, freed = [], 0
        for key, meta in self._index.items():
            if self._used - freed + cost <= self._low_budget:
                break
            if not meta.pinned and key != keep:
                victims.append(key)
                freed += self.cost(meta.size)
        if self._used - freed + cost > self._budget:
            raise StoreFull(f"{self.name}: cannot fit {cost} bytes under the {self._budget}-byte budget; "
                            f"{self._used - freed} bytes are pinned")
        if victims:
            self._remove(victims, evicted=True)
            self._settle()

    def _evict_lru(self, nbytes: int, *, keep: bytes) -> int:
        """Evict unpinned LRU entries worth at least ``nbytes`` (or all of them); returns how many."""
        victims, freed = [], 0
        for key, meta in self._index.items():
            if freed >= nbytes:
                break
            if not meta.pinned and key != keep:
                victims.append(key)
                freed += self.cost(meta.size)
        if victims:
            self._remove(victims, evicted=True)
            self._settle()
        return len(victims)

    def _remove(self, keys: list[bytes], *, evicted: bool) -> None:
        """Delete ``keys`` in one transaction (flushing access times with it); one by one if the
        map is too full for that. Raises StoreFull if not even one delete fits."""
        try:
            with self._env.begin(write=True) as txn:
                for key in keys:
                    txn.delete(key, db=self._blobs)
                    txn.delete(key, db=self._meta)
                self._put_dirty(txn)
            self._dirty.clear()
        except lmdb.MapFullError:
            if len(keys) == 1:
                raise StoreFull(f"{self.name}: LMDB map too full to delete an entry") from None
            self._dirty.clear()  # access times are advisory; deletes are not
            for key in keys:
                self._remove([key], evicted=evicted)
            return
        for key in keys:
            meta = self._index.pop(key)
            self._dirty.discard(key)
            self._bytes -= meta.size
            self._used -= self.cost(meta.size)
        if evicted:
            self._evictions += len(keys)

    def _settle(self) -> None:
        """Commit one tiny transaction so the pages the last one freed become reusable (see NOTE)."""
        try:
            with self._env.begin(write=True) as txn:
                txn.put(_SETTLE_KEY, struct.pack("<Q", self._evictions))
        except lmdb.MapFullError:
            log.warning("%s: map full while settling an eviction", self.name)


class _LmdbTable(RecordTable):
    """A named sub-database of an LmdbTier's environment, under the tier's lock."""

    durable = True

    def __init__(self, tier: LmdbTier, db) -> None:
        self._tier, self._db = tier, db

    def items(self, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        with self._tier._lock, self._tier._env.begin(db=self._db) as txn:
            cur = txn.cursor()
            if not cur.set_range(prefix):
                return []
            out = []
            for k, v in cur:
                if not k.startswith(prefix):
                    break
                out.append((bytes(k), bytes(v)))
            return out

    def get(self, key: bytes) -> bytes | None:
        with self._tier._lock, self._tier._env.begin(db=self._db) as txn:
            return txn.get(key)

    def write(self, puts: dict[bytes, bytes] | None = None, deletes: list[bytes] | None = None) -> None:
        with self._tier._lock:
            try:
                with self._tier._env.begin(write=True, db=self._db) as txn:
                    for key in deletes or ():
                        txn.delete(key)
                    for key, value in (puts or {}).items():
                        txn.put(key, value)
            except lmdb.MapFullError:
                raise StoreFull(f"{self._tier.name}: LMDB map too full to write catalog records") from None


def _lock_owner(path: Path) -> int:
    """Take an exclusive, non-blocking flock on ``path/owner.lock``; the fd holds it until closed.

    flock conflicts between separate opens even within one process, so this also guards
    against opening the same path twice in this process (which LMDB forbids).
    """
    fd = os.open(path / "owner.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StoreInUse(f"{path} is already open by another LmdbTier (this or another process); "
                         "one process owns a kvcache directory") from None
    return fd
