"""TieredStore over memory + LMDB: promotion (with TTL), write-through, fastest-tier lookups,
and degradation when a tier is unavailable."""
import pytest

from kvmesh.services.kvcache.store import (
    EntryTooLarge, LmdbTier, MemoryTier, StoreFull, TieredStore, TierUnavailable)
from kvmesh.services.kvcache.store.base import Tier

from fake_clock import FakeClock

from .factories import blob, key

MiB = 1 << 20


class DownTier(Tier):
    """A tier whose backend is always unreachable."""

    name = "redis"

    def _down(self, *args, **kwargs):
        raise TierUnavailable("down")

    get_many = contains_many = remaining_ttl_many = put = delete = set_pinned = set_ttl = stats = _down

    def close(self):
        pass


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def store(tmp_path, clock):
    memory = MemoryTier(250_000, max_entry_bytes=100_000, clock=clock)
    disk = LmdbTier(tmp_path, 8 * MiB, 1 * MiB, clock=clock)
    store = TieredStore([memory, disk])
    yield store
    store.close()


def test_disk_hits_are_promoted_into_memory(store):
    memory, disk = store.tiers
    disk.put(key(0), blob(0, 50_000))
    assert store.contains_many([key(0), key(1)]) == ["disk", None]
    assert store.get_many([key(0), key(1)]) == [blob(0, 50_000), None]
    assert store.contains_many([key(0)]) == ["memory"]
    assert store.get_many([key(0)]) == [blob(0, 50_000)]
    mem, dsk = store.stats()
    assert (mem.hits, mem.misses, mem.entries) == (1, 2, 1)
    assert (dsk.hits, dsk.misses, dsk.entries) == (1, 1, 1)


def test_promoted_copy_keeps_the_remaining_ttl(store, clock):
    memory, disk = store.tiers
    disk.put(key(0), blob(0, 1000), ttl_s=10)
    clock.advance(4)
    store.get_many([key(0)])
    assert memory.remaining_ttl_many([key(0)]) == [6]
    clock.advance(6)
    assert store.get_many([key(0)]) == [None]


def test_promotion_that_does_not_fit_is_skipped(store):
    memory, disk = store.tiers
    disk.put(key(0), blob(0, 300_000))  # over memory's 100 KB entry limit
    assert store.get_many([key(0)]) == [blob(0, 300_000)]
    assert store.contains_many([key(0)]) == ["disk"]
    for i in (1, 2):
        memory.put(key(i), blob(i, 100_000), pinned=True)
    disk.put(key(3), blob(3, 80_000))  # memory is full of pins: StoreFull on promotion
    assert store.get_many([key(3)]) == [blob(3, 80_000)]
    assert store.contains_many([key(3)]) == ["disk"]


def test_put_writes_through_and_raises_only_if_no_tier_stored(store):
    store.put(key(0), blob(0, 1000), ttl_s=5, pinned=True)
    assert [t.contains_many([key(0)]) for t in store.tiers] == [[True], [True]]
    store.put(key(1), blob(1, 300_000))  # too large for memory, fine for disk
    assert store.contains_many([key(1)]) == ["disk"]
    with pytest.raises(EntryTooLarge):
        store.put(key(2), bytes(MiB + 1))
    assert store.set_pinned(key(0), False) and store.set_ttl(key(0), None)
    assert [t.remaining_ttl_many([key(0)]) for t in store.tiers] == [[None], [None]]
    assert store.delete(key(0)) and store.contains_many([key(0)]) == [None]
    assert not store.delete(key(0)) and not store.set_pinned(key(0), True) and not store.set_ttl(key(0), 1)


def test_unavailable_tier_degrades_to_misses(tmp_path, clock):
    memory = MemoryTier(1000, clock=clock)
    store = TieredStore([memory, DownTier()])
    store.put(key(0), blob(0, 100))
    assert store.get_many([key(0), key(1)]) == [blob(0, 100), None]
    assert store.contains_many([key(1)]) == [None]
    assert store.delete(key(0)) is True
    stats = store.stats()
    assert stats[1].name == "redis" and stats[1].errors == 5 and stats[1].entries == 0
    only_down = TieredStore([DownTier()])
    with pytest.raises(StoreFull, match="unavailable"):
        only_down.put(key(0), b"x")
    store.close()


def test_names_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        TieredStore([MemoryTier(10), MemoryTier(10)])


def test_sweep_removes_expired_entries_from_every_tier(store, clock):
    memory, disk = store.tiers
    store.put(key(0), blob(0, 1000), ttl_s=5)
    store.put(key(1), blob(1, 1000), ttl_s=50)
    store.put(key(2), blob(2, 1000))
    clock.advance(10)
    assert store.sweep_expired() == 2  # key 0 in memory and on disk
    assert [t.entries for t in store.stats()] == [2, 2]
    assert store.contains_many([key(0), key(1), key(2)]) == [None, "memory", "memory"]
