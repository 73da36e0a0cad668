"""MemoryTier: exact LRU eviction order, pins, StoreFull, TTL on a fake clock, exact stats."""
import pytest

from kvmesh.services.kvcache.store import EntryTooLarge, MemoryTier, StoreFull, TierStats

from fake_clock import FakeClock

from .factories import blob, key


def held(tier, n):
    return [i for i, h in enumerate(tier.contains_many([key(i) for i in range(n)])) if h]


def test_lru_eviction_order_is_exact():
    tier = MemoryTier(100)
    for i in range(3):
        tier.put(key(i), blob(i, 30))
    assert tier.get_many([key(0)]) == [blob(0, 30)]  # 0 becomes most recent: order 1, 2, 0
    tier.put(key(3), blob(3, 30))
    assert held(tier, 5) == [0, 2, 3]
    tier.put(key(4), blob(4, 30))
    assert held(tier, 5) == [0, 3, 4]
    tier.put(key(5), blob(5, 70))  # needs 70 of 100: evicts 0 then 3, keeps 4
    assert held(tier, 6) == [4, 5]
    assert tier.stats().evictions == 4


def test_contains_many_neither_counts_nor_refreshes():
    tier = MemoryTier(60)
    tier.put(key(0), blob(0, 30))
    tier.put(key(1), blob(1, 30))
    assert tier.contains_many([key(0), key(9)]) == [True, False]
    tier.put(key(2), blob(2, 30))
    assert held(tier, 3) == [1, 2]
    s = tier.stats()
    assert (s.hits, s.misses) == (0, 0)


def test_pinned_entries_are_never_evicted_and_storefull_evicts_nothing():
    tier = MemoryTier(100)
    tier.put(key(0), blob(0, 40), pinned=True)
    tier.put(key(1), blob(1, 40), pinned=True)
    tier.put(key(2), blob(2, 20))
    with pytest.raises(StoreFull):
        tier.put(key(3), blob(3, 30))  # evicting 2 would free only 20
    assert held(tier, 4) == [0, 1, 2]
    tier.put(key(3), blob(3, 20))
    assert held(tier, 4) == [0, 1, 3]
    assert tier.set_pinned(key(0), False)
    tier.put(key(4), blob(4, 40))  # 0 is now the only unpinned LRU candidate before 3
    assert held(tier, 5) == [1, 3, 4]
    assert tier.set_pinned(key(9), True) is False


def test_failed_replace_keeps_the_old_entry():
    tier = MemoryTier(100)
    tier.put(key(0), blob(0, 50), pinned=True)
    tier.put(key(1), blob(1, 40), pinned=True)
    with pytest.raises(StoreFull):
        tier.put(key(1), blob(1, 60))
    assert tier.get_many([key(1)]) == [blob(1, 40)]
    assert tier.stats().bytes == 90


def test_entry_too_large():
    with pytest.raises(EntryTooLarge):
        MemoryTier(100).put(key(0), blob(0, 101))
    with pytest.raises(EntryTooLarge):
        MemoryTier(100, max_entry_bytes=50).put(key(0), blob(0, 51))
    with pytest.raises(ValueError, match="32 bytes"):
        MemoryTier(100).put(b"short", b"x")


def test_ttl_expiry_on_a_fake_clock():
    clock = FakeClock()
    tier = MemoryTier(1000, clock=clock)
    tier.put(key(0), blob(0, 10), ttl_s=10)
    tier.put(key(1), blob(1, 10), ttl_s=10, pinned=True)
    tier.put(key(2), blob(2, 10), ttl_s=5)
    assert tier.remaining_ttl_many([key(0), key(1), key(9)]) == [10, None, None]
    clock.advance(5)
    assert tier.sweep_expired() == 1  # key 2
    clock.advance(4.5)
    assert tier.get_many([key(0)]) == [blob(0, 10)]
    clock.advance(0.5)  # deadline reached: 0 is a miss and is dropped; 1 is pinned
    assert tier.get_many([key(0), key(1)]) == [None, blob(1, 10)]
    assert tier.stats().entries == 1
    assert tier.set_pinned(key(1), False)  # its deadline passed while pinned: expired now
    assert tier.contains_many([key(1)]) == [False]
    tier.put(key(3), blob(3, 10), ttl_s=1)
    assert tier.set_ttl(key(3), None)
    clock.advance(100)
    assert tier.contains_many([key(3)]) == [True]
    assert tier.set_ttl(key(9), 5) is False
    with pytest.raises(ValueError):
        tier.set_ttl(key(3), 0)


def test_stats_are_exact_after_a_known_sequence():
    tier = MemoryTier(100, name="memory")
    tier.put(key(0), blob(0, 40))
    tier.put(key(1), blob(1, 40))
    tier.get_many([key(0), key(1), key(2)])  # 2 hits, 1 miss; order 0, 1
    tier.put(key(2), blob(2, 50))  # evicts 0 (LRU) -> 90 bytes
    tier.put(key(1), blob(1, 10))  # replace: 60 bytes
    tier.get_many([key(0)])  # miss
    assert tier.delete(key(2)) and not tier.delete(key(2))
    assert tier.stats() == TierStats("memory", entries=1, bytes=10, hits=2, misses=2, evictions=1,
                                     capacity_bytes=100)
    tier.close()
    assert tier.stats().entries == 0
