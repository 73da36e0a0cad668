"""The tiers in front of one another: read through with promotion, write through, degrade on failure."""
from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable, TypeVar

from kvmesh.services.kvcache.store.base import EntryTooLarge, StoreFull, Tier, TierStats, TierUnavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


class TieredStore:
    """Tiers, fastest first, used as one store.

    * ``get_many`` asks tier by tier for the keys still missing and promotes each hit into the
      faster tiers (with the remaining TTL of the copy it came from; a promotion the faster
      tier rejects as too large or full is skipped).
    * ``put`` writes through to every tier; it raises only when no tier stored the blob
      (StoreFull/EntryTooLarge before TierUnavailable), since any tier can serve it.
    * ``delete``/``set_pinned``/``set_ttl`` apply to every tier; True if any tier held the key.
    * TierUnavailable from any tier is logged, counted (``TierStats.errors``) and treated as a
      miss / absence there: a cache failure degrades to recompute, never to an error.
    """

    def __init__(self, tiers: list[Tier]) -> None:
        if not tiers:
            raise ValueError("a TieredStore needs at least one tier (fastest first)")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique; got {names}")
        self.tiers = list(tiers)
        self._errors = {name: 0 for name in names}
        self._lock = threading.Lock()

    def _unavailable(self, tier: Tier, err: TierUnavailable) -> None:
        with self._lock:
            self._errors[tier.name] += 1
            n = self._errors[tier.name]
        if n & (n - 1) == 0:  # 1st, 2nd, 4th, 8th ... failure: a down tier must not flood the log
            log.warning("kvcache tier %s unavailable (failure #%d), degrading: %s", tier.name, n, err)

    def _try(self, tier: Tier, call: Callable[[], T], default: T) -> T:
        """``call()``, or ``default`` when ``tier`` is unavailable (logged and counted)."""
        try:
            return call()
        except TierUnavailable as err:
            self._unavailable(tier, err)
            return default

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Blobs for ``keys`` (None = miss everywhere), promoting hits into faster tiers."""
        return [blob for blob, _ in self.get_many_with_tier(keys)]

    def get_many_with_tier(self, keys: list[bytes]) -> list[tuple[bytes | None, str | None]]:
        """Like ``get_many``, with the name of the tier that served each hit (None for a miss)."""
        out: list[tuple[bytes | None, str | None]] = [(None, None)] * len(keys)
        missing = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            wanted = [keys[i] for i in missing]
            blobs = self._try(tier, lambda: tier.get_many(wanted), [None] * len(wanted))
            found = [(i, b) for i, b in zip(missing, blobs) if b is not None]
            for i, blob in found:
                out[i] = (blob, tier.name)
            if found and level > 0:
                self._promote(tier, self.tiers[:level], [(keys[i], b) for i, b in found])
            missing = [i for i, b in zip(missing, blobs) if b is None]
        return out

    def _promote(self, source: Tier, faster: list[Tier], entries: list[tuple[bytes, bytes]]) -> None:
        ttls = self._try(source, lambda: source.remaining_ttl_many([k for k, _ in entries]),
                         [None] * len(entries))
        for tier in faster:
            for (key, blob), ttl in zip(entries, ttls):
                try:
                    self._try(tier, lambda: tier.put(key, blob, ttl_s=ttl), None)
                except (EntryTooLarge, StoreFull):
                    continue

    def contains_many(self, keys: list[bytes]) -> list[str | None]:
        """For each key the name of the fastest tier holding it, or None."""
        out: list[str | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for tier in self.tiers:
            if not missing:
                break
            held = self._try(tier, lambda: tier.contains_many([keys[i] for i in missing]),
                             [False] * len(missing))
            for i, h in zip(missing, held):
                if h:
                    out[i] = tier.name
            missing = [i for i, h in zip(missing, held) if not h]
        return out

    def put(self, key: bytes, blob: bytes, *, ttl_s: float | None = None, pinned: bool = False) -> None:
        """Write ``blob`` to every tier; raise only if none stored it."""
        refused: list[Exception] = []
        stored = 0
        for tier in self.tiers:
            try:
                tier.put(key, blob, ttl_s=ttl_s, pinned=pinned)
                stored += 1
            except (EntryTooLarge, StoreFull) as err:
                refused.append(err)
            except TierUnavailable as err:
                self._unavailable(tier, err)
        if not stored:
            if refused:
                raise refused[0]
            raise StoreFull("every kvcache tier is unavailable")

    def delete(self, key: bytes) -> bool:
        """Delete ``key`` from every tier; True if any held it."""
        return self._each(lambda t: t.delete(key))

    def set_pinned(self, key: bytes, pinned: bool) -> bool:
        """Pin or unpin ``key`` in every tier; True if any held it."""
        return self._each(lambda t: t.set_pinned(key, pinned))

    def set_ttl(self, key: bytes, ttl_s: float | None) -> bool:
        """Set ``key``'s TTL in every tier; True if any held it."""
        return self._each(lambda t: t.set_ttl(key, ttl_s))

    def _each(self, op: Callable[[Tier], bool]) -> bool:
        results = [self._try(tier, lambda: op(tier), False) for tier in self.tiers]
        return any(results)

    def sweep_expired(self) -> int:
        """Remove expired entries from every tier now; returns how many (summed)."""
        return sum(self._try(tier, tier.sweep_expired, 0) for tier in self.tiers)

    def stats(self) -> list[TierStats]:
        """Per-tier stats, fastest first, with ``errors`` filled in; an unreachable tier reports
        zeros besides its name and error count."""
        out = []
        for tier in self.tiers:
            snap = self._try(tier, tier.stats, TierStats(tier.name, 0, 0, 0, 0, 0, 0))
            with self._lock:
                out.append(dataclasses.replace(snap, errors=self._errors[tier.name]))
        return out

    def close(self) -> None:
        """Close every tier, even if one fails to close (the first failure is re-raised)."""
        failure: Exception | None = None
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as err:  # noqa: BLE001 - keep closing the others
                log.error("closing kvcache tier %s failed: %s", tier.name, err)
                failure = failure or err
        if failure is not None:
            raise failure

