"""LmdbTier: persistence across reopen, exact LRU eviction below the high-water mark, pins,
TTL on a fake clock, a long stream into a tiny map, and a SIGKILL crash test with a real child."""
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.services.kvcache.store import EntryTooLarge, LmdbTier, StoreFull, StoreInUse

from fake_clock import FakeClock

from .factories import blob, key

MiB = 1 << 20


def held(tier, n):
    return [i for i, h in enumerate(tier.contains_many([key(i) for i in range(n)])) if h]


def test_reopen_keeps_bytes_stats_and_recency(tmp_path):
    clock = FakeClock()
    sizes = [100, 3000, 200_000, 50_000]  # inline and overflow-page values
    tier = LmdbTier(tmp_path, 16 * MiB, 1 * MiB, clock=clock)
    for i, size in enumerate(sizes):
        clock.advance(1)
        tier.put(key(i), blob(i, size), pinned=(i == 3))
    clock.advance(1)
    tier.get_many([key(0)])  # buffered access time, written on close
    tier.close()
    tier.close()  # idempotent

    reopened = LmdbTier(tmp_path, 16 * MiB, 1 * MiB, clock=clock)
    assert reopened.get_many([key(i) for i in range(4)]) == [blob(i, s) for i, s in enumerate(sizes)]
    s = reopened.stats()
    assert (s.entries, s.bytes, s.hits, s.misses, s.evictions) == (4, sum(sizes), 4, 0, 0)
    reopened.close()


def test_recency_survives_reopen(tmp_path):
    clock = FakeClock()
    tier = LmdbTier(tmp_path, 4 * MiB, 1 * MiB, high_water=0.8, low_water=0.8, clock=clock)
    cost = tier.cost(200_000)
    fit = tier.stats().capacity_bytes // cost
    for i in range(fit):
        clock.advance(1)
        tier.put(key(i), blob(i, 200_000))
    clock.advance(1)
    tier.get_many([key(0)])
    tier.close()
    tier = LmdbTier(tmp_path, 4 * MiB, 1 * MiB, high_water=0.8, low_water=0.8, clock=clock)
    tier.put(key(100), blob(100, 200_000))
    assert held(tier, fit) == [0] + list(range(2, fit))  # 1 was least recent, not 0
    tier.close()


def test_lru_eviction_order_is_exact(tmp_path):
    tier = LmdbTier(tmp_path, 4 * MiB, 1 * MiB, high_water=0.8, low_water=0.8)
    fit = tier.stats().capacity_bytes // tier.cost(200_000)
    assert fit >= 5
    for i in range(fit):
        tier.put(key(i), blob(i, 200_000))
    assert tier.stats().evictions == 0
    tier.get_many([key(0)])
    tier.put(key(fit), blob(fit, 200_000))
    assert held(tier, fit + 1) == [0] + list(range(2, fit + 1))
    tier.put(key(fit + 1), blob(fit + 1, 200_000))
    assert held(tier, fit + 2) == [0] + list(range(3, fit + 2))
    assert tier.stats().evictions == 2
    tier.close()


def test_eviction_comes_in_batches_down_to_low_water(tmp_path):
    tier = LmdbTier(tmp_path, 4 * MiB, 1 * MiB, high_water=0.85, low_water=0.6)
    cost = tier.cost(200_000)
    fit = tier.stats().capacity_bytes // cost
    for i in range(fit + 1):
        tier.put(key(i), blob(i, 200_000))
    evicted = tier.stats().evictions
    assert evicted > 1
    assert held(tier, fit + 1) == list(range(evicted, fit + 1))
    assert tier._used <= int(4 * MiB * 0.6) - 64 * tier._psize  # the low-water budget
    tier.close()


def test_pinned_entries_stay_and_storefull_when_only_pins_remain(tmp_path):
    tier = LmdbTier(tmp_path, 4 * MiB, 1 * MiB)
    tier.put(key(0), blob(0, 200_000))
    pinned = []
    with pytest.raises(StoreFull):
        for i in range(1, 100):
            tier.put(key(i), blob(i, 200_000), pinned=True)
            pinned.append(i)
    assert tier.contains_many([key(0)]) == [False]  # the one unpinned entry made room first
    assert tier.get_many([key(i) for i in pinned]) == [blob(i, 200_000) for i in pinned]
    assert tier.stats().evictions == 1
    assert tier.set_pinned(key(pinned[0]), False)
    tier.put(key(500), blob(500, 200_000))
    assert held(tier, 501)[0] == pinned[1] and 500 in held(tier, 501)
    tier.close()


def test_entry_too_large_and_config_errors(tmp_path):
    tier = LmdbTier(tmp_path / "a", 4 * MiB, 1 * MiB)
    with pytest.raises(EntryTooLarge):
        tier.put(key(0), bytes(MiB + 1))
    tier.close()
    with pytest.raises(ValueError, match="quarter"):
        LmdbTier(tmp_path / "b", 4 * MiB, 2 * MiB)


def test_same_path_cannot_be_opened_twice(tmp_path):
    tier = LmdbTier(tmp_path, 4 * MiB, 1 * MiB)
    with pytest.raises(StoreInUse):
        LmdbTier(tmp_path, 4 * MiB, 1 * MiB)
    tier.close()
    LmdbTier(tmp_path, 4 * MiB, 1 * MiB).close()


def test_ttl_on_a_fake_clock_and_across_reopen(tmp_path):
    clock = FakeClock()
    tier = LmdbTier(tmp_path, 4 * MiB, 1 * MiB, clock=clock)
    tier.put(key(0), blob(0, 5000), ttl_s=10)
    tier.put(key(1), blob(1, 5000), ttl_s=10, pinned=True)
    tier.put(key(2), blob(2, 5000), ttl_s=20)
    tier.put(key(3), blob(3, 5000), ttl_s=20)
    assert tier.remaining_ttl_many([key(0), key(1), key(9)]) == [10, None, None]
    clock.advance(10)
    assert tier.get_many([key(0), key(1)]) == [None, blob(1, 5000)]
    assert tier.stats().entries == 3
    assert tier.set_ttl(key(2), None) and tier.set_ttl(key(9), 1) is False
    tier.close()
    clock.advance(10)
    tier = LmdbTier(tmp_path, 4 * MiB, 1 * MiB, clock=clock)
    assert tier.sweep_expired() == 1  # key 3; key 2's TTL was cleared, key 1 is pinned
    assert held(tier, 4) == [1, 2]
    assert tier.set_pinned(key(1), False)
    assert tier.contains_many([key(1)]) == [False]
    tier.close()


def test_a_long_stream_never_fills_a_tiny_map(tmp_path):
    rng = random.Random(7)
    tier = LmdbTier(tmp_path, 3 * MiB, 512 * 1024)
    for i in range(400):
        size = rng.choice([rng.randrange(1000, 20_000), rng.randrange(50_000, 512 * 1024)])
        tier.put(key(i), blob(i, size), pinned=(i % 97 == 0 and i < 200))
        if i % 5 == 0:
            tier.get_many([key(rng.randrange(i + 1))])
        assert tier.get_many([key(i)]) == [blob(i, size)]
    s = tier.stats()
    assert s.evictions > 200 and s.bytes <= s.capacity_bytes
    assert os.path.getsize(tmp_path / "data.mdb") <= 3 * MiB
    tier.close()


CHILD = """
import sys
sys.path.insert(0, sys.argv[2])
from factories import blob, key
from kvmesh.services.kvcache.store import LmdbTier

tier = LmdbTier(sys.argv[1], 64 << 20, 4 << 20)
for i in range(100_000):
    tier.put(key(i), blob(i, 20_000 + (i * 7919) % 180_000))
    print(i, flush=True)
"""


def test_acknowledged_puts_survive_sigkill(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), str(Path(__file__).parent)],
                             stdout=subprocess.PIPE, text=True)
    acked = []
    for line in child.stdout:
        acked.append(int(line))
        if len(acked) == 40:
            child.send_signal(signal.SIGKILL)
            break
    acked += [int(line) for line in child.stdout]  # acks already in the pipe when it died
    assert child.wait() == -signal.SIGKILL
    assert acked == list(range(len(acked)))

    expected = {key(i): blob(i, 20_000 + (i * 7919) % 180_000) for i in range(len(acked) + 1)}
    tier = LmdbTier(tmp_path, 64 << 20, 4 << 20)
    present = [k for k, h in zip(expected, tier.contains_many(list(expected))) if h]
    assert set(present) >= {key(i) for i in acked}
    assert tier.stats().entries == len(present)  # nothing but these: at most one unacked put committed
    assert tier.get_many(present) == [expected[k] for k in present]
    tier.close()


def test_concurrent_readers_and_writers_on_a_tiny_map(tmp_path):
    import threading

    tier = LmdbTier(tmp_path, 3 * MiB, 512 * 1024, access_flush_every=8)
    errors = []

    def work(worker):
        rng = random.Random(worker)
        try:
            for n in range(60):
                i = worker * 1000 + n
                size = rng.randrange(1000, 300_000)
                tier.put(key(i), blob(i, size))
                got = tier.get_many([key(i), key(worker * 1000 + rng.randrange(n + 1))])
                assert got[1] is None or len(got[1]) > 0
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    s = tier.stats()
    assert s.entries > 0 and s.bytes <= s.capacity_bytes
    tier.close()


def test_reads_go_on_while_a_put_commits(tmp_path):
    """The index lock is not held across a put's write transaction (its commit and fsync): a
    lookup or get of other keys meanwhile does not wait for it."""
    import threading

    tier = LmdbTier(tmp_path / "db", 64 * MiB, 4 * MiB)
    tier.put(key(1), blob(1, 1000))
    in_commit, release, seen = threading.Event(), threading.Event(), {}
    env = tier._env

    class SlowWriteEnv:  # the real environment, with a put's write transaction held open
        def __getattr__(self, name):
            return getattr(env, name)

        def begin(self, write=False, **kw):
            txn = env.begin(write=write, **kw)
            if not write:
                return txn

            class Held:
                def __enter__(self):
                    self.txn = txn.__enter__()
                    return self.txn

                def __exit__(self, *exc):
                    in_commit.set()
                    release.wait()
                    return txn.__exit__(*exc)
            return Held()

    tier._env = SlowWriteEnv()
    writer = threading.Thread(target=tier.put, args=(key(2), blob(2, 1000)))
    writer.start()
    in_commit.wait()
    seen["locked"] = tier._lock.locked()
    seen["contains"] = tier.contains_many([key(1), key(2)])
    seen["get"] = tier.get_many([key(1)])[0] == blob(1, 1000)
    release.set()
    writer.join()
    tier._env = env
    assert seen == {"locked": False, "contains": [True, False], "get": True}
    assert tier.contains_many([key(2)]) == [True]  # stored once its put returned
    tier.close()
