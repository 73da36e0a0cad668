"""RedisTier against a real redis-server: round trips, atomic entries, TTL/pin semantics, and
degrading to TierUnavailable (and to misses behind a TieredStore) when Redis is gone."""
import time

import pytest
import redis

from kvmesh.services.kvcache.store import (
    EntryTooLarge, MemoryTier, RedisTier, TieredStore, TierStats, TierUnavailable)

from fake_clock import FakeClock

from .factories import blob, key


def test_round_trip_and_exact_stats(redis_server):
    tier = RedisTier(redis_server.url, prefix="t1:", max_entry_bytes=1 << 20)
    other = redis.Redis.from_url(redis_server.url)
    other.set("unrelated", "x")  # outside the prefix: not counted
    sizes = [10, 200_000, 1 << 20]
    for i, size in enumerate(sizes):
        tier.put(key(i), blob(i, size))
    got = tier.get_many([key(0), key(1), key(2), key(9)])
    assert got == [blob(0, 10), blob(1, 200_000), blob(2, 1 << 20), None]
    assert tier.contains_many([key(1), key(9)]) == [True, False]
    assert tier.delete(key(0)) and not tier.delete(key(0))
    assert other.hgetall("t1:" + key(1).hex()) == {b"b": blob(1, 200_000), b"p": b"0", b"x": b""}
    assert tier.stats() == TierStats("redis", entries=2, bytes=200_000 + (1 << 20), hits=3, misses=1,
                                     evictions=0, capacity_bytes=0)
    with pytest.raises(EntryTooLarge):
        tier.put(key(5), bytes((1 << 20) + 1))
    tier.close()


def test_ttl_and_pin_use_redis_expiry(redis_server):
    tier = RedisTier(redis_server.url)
    tier.put(key(0), blob(0, 100), ttl_s=100)
    tier.put(key(1), blob(1, 100), ttl_s=100, pinned=True)
    ttl0, ttl1 = tier.remaining_ttl_many([key(0), key(1)])
    assert 99 < ttl0 <= 100 and ttl1 is None
    assert tier.set_pinned(key(0), True) and tier.remaining_ttl_many([key(0)]) == [None]
    assert tier.set_pinned(key(0), False) and 99 < tier.remaining_ttl_many([key(0)])[0] <= 100
    assert tier.set_pinned(key(1), False) and 99 < tier.remaining_ttl_many([key(1)])[0] <= 100
    assert tier.set_ttl(key(1), None) and tier.remaining_ttl_many([key(1)]) == [None]
    assert tier.set_ttl(key(9), 5) is False and tier.set_pinned(key(9), True) is False
    assert tier.set_ttl(key(0), 0.001)
    deadline = time.monotonic() + 5
    while tier.contains_many([key(0)]) != [False]:  # Redis expires it on its own clock
        assert time.monotonic() < deadline, "Redis did not expire the key"
    assert tier.get_many([key(0), key(1)]) == [None, blob(1, 100)]
    tier.close()


def test_a_stopped_redis_raises_tier_unavailable_fast_then_backs_off(redis_server):
    clock = FakeClock()
    tier = RedisTier(redis_server.url, retry_after_s=5, clock=clock)
    tier.put(key(0), blob(0, 100))
    redis_server.stop()
    # Fast by count, not by timing: one call finds Redis gone, the next ones answer without
    # touching the network until retry_after_s has passed on the tier's clock.
    with pytest.raises(TierUnavailable, match="cannot reach"):
        tier.get_many([key(0)])
    for call in (lambda: tier.put(key(1), b"x" * 10), lambda: tier.stats()):
        with pytest.raises(TierUnavailable, match="unreachable recently"):
            call()
    clock.advance(5)
    with pytest.raises(TierUnavailable, match="cannot reach"):
        tier.contains_many([key(0)])
    tier.close()


def test_tiered_store_degrades_to_misses_when_redis_is_gone(redis_server):
    memory = MemoryTier(1 << 20)
    shared = RedisTier(redis_server.url)
    store = TieredStore([memory, shared])
    store.put(key(0), blob(0, 1000))
    memory.delete(key(0))
    assert store.get_many([key(0)]) == [blob(0, 1000)]  # from Redis, promoted into memory
    assert store.contains_many([key(0)]) == ["memory"]
    redis_server.stop()
    assert store.get_many([key(0), key(1)]) == [blob(0, 1000), None]
    store.put(key(2), blob(2, 1000))
    assert store.contains_many([key(2), key(3)]) == ["memory", None]
    stats = store.stats()
    assert [s.name for s in stats] == ["memory", "redis"]
    assert stats[1].errors >= 3 and stats[0].errors == 0
    store.close()
