"""The shared tier: blobs in a Redis server several kvcache machines use, with Redis expiry as TTL."""
from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvmesh.services.kvcache.store.base import (
    StoreFull, Tier, TierStats, TierUnavailable, check_put, check_ttl)

T = TypeVar("T")

# Each entry is one hash {b: blob, p: "0"/"1" pinned, x: absolute expiry in server ms or ""},
# so blob and metadata are written, expired and deleted together. Scripts run atomically and take
# "now" from the server's clock, so machines with skewed clocks agree on deadlines.
_NOW_MS = "local t = redis.call('TIME') local now_ms = t[1] * 1000 + math.floor(t[2] / 1000) "
_PUT = _NOW_MS + """
redis.call('DEL', KEYS[1])
local x = ''
if ARGV[3] ~= '' then x = string.format('%d', now_ms + tonumber(ARGV[3])) end
redis.call('HSET', KEYS[1], 'b', ARGV[1], 'p', ARGV[2], 'x', x)
if x ~= '' and ARGV[2] == '0' then redis.call('PEXPIREAT', KEYS[1], x) end
return 1
"""
_SET_PINNED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'p', ARGV[1])
if ARGV[1] == '1' then redis.call('PERSIST', KEYS[1]) return 1 end
local x = redis.call('HGET', KEYS[1], 'x')
if x and x ~= '' then redis.call('PEXPIREAT', KEYS[1], x) end
return 1
"""
_SET_TTL = _NOW_MS + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[1] == '' then redis.call('HSET', KEYS[1], 'x', '') redis.call('PERSIST', KEYS[1]) return 1 end
local x = string.format('%d', now_ms + tonumber(ARGV[1]))
redis.call('HSET', KEYS[1], 'x', x)
if redis.call('HGET', KEYS[1], 'p') ~= '1' then redis.call('PEXPIREAT', KEYS[1], x) end
return 1
"""


class RedisTier(Tier):
    """A tier in a (shared) Redis server under ``prefix``; every failure to reach it is TierUnavailable.

    Redis does its own eviction (its ``maxmemory-policy``) and expiry; ``pinned`` means the key
    has no Redis expiry (it is still subject to ``allkeys-*`` eviction policies, so configure
    ``volatile-lru`` or ``noeviction`` if pins must hold). A Redis OOM error is StoreFull.

    NOTE: failure handling. Sockets time out after ``socket_timeout_s`` and redis-py's own
    retries are off, so no call blocks for long. After a connection failure the tier answers
    TierUnavailable at once, without touching the network, for ``retry_after_s`` (by ``clock``),
    then tries again: a dead or black-holed Redis costs the request path one timeout per
    ``retry_after_s``, not one per call.
    """

    def __init__(self, url: str, *, prefix: str = "kvmesh:", max_entry_bytes: int = 64 << 20,
                 socket_timeout_s: float = 1.0, retry_after_s: float = 5.0, name: str = "redis",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.prefix = prefix
        self.max_entry_bytes = max_entry_bytes
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._down_until = float("-inf")
        pool = redis.ConnectionPool.from_url(
            url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._client = redis.Redis(connection_pool=pool)
        self._put = self._client.register_script(_PUT)
        self._set_pinned = self._client.register_script(_SET_PINNED)
        self._set_ttl = self._client.register_script(_SET_TTL)
        self._lock = threading.Lock()
        self._hits = self._misses = 0

    def _key(self, key: bytes) -> str:
        return self.prefix + key.hex()

    def _guard(self, call: Callable[[], T]) -> T:
        """Run one round trip, mapping Redis errors onto the tier errors (see the NOTE)."""
        if self._clock() < self._down_until:
            raise TierUnavailable(f"{self.name}: unreachable recently; next try in "
                                  f"{self._down_until - self._clock():.1f}s")
        try:
            return call()
        except redis.exceptions.ResponseError as err:
            if str(err).startswith("OOM"):
                raise StoreFull(f"{self.name}: Redis is out of memory ({err})") from err
            raise TierUnavailable(f"{self.name}: Redis refused the command ({err})") from err
        except (redis.exceptions.RedisError, OSError) as err:
            self._down_until = self._clock() + self._retry_after_s
            raise TierUnavailable(f"{self.name}: cannot reach Redis ({err})") from err

    def _pipelined(self, op: str, keys: list[bytes], *args: str) -> list:
        def run() -> list:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                getattr(pipe, op)(self._key(key), *args)
            return pipe.execute()
        return self._guard(run) if keys else []

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Blobs for ``keys`` in one pipelined round trip (None = miss)."""
        blobs = self._pipelined("hget", keys, "b")
        with self._lock:
            hits = sum(b is not None for b in blobs)
            self._hits += hits
            self._misses += len(blobs) - hits
        return blobs

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """Whether each key exists (Redis drops expired keys itself)."""
        return [bool(n) for n in self._pipelined("exists", keys)]

    def remaining_ttl_many(self, keys: list[bytes]) -> list[float | None]:
        """Seconds of Redis expiry left per key; None if absent, pinned or without expiry."""
        return [ms / 1000 if ms >= 0 else None for ms in self._pipelined("pttl", keys)]

    def put(self, key: bytes, blob: bytes, *, ttl_s: float | None = None, pinned: bool = False) -> None:
        """Replace ``key`` atomically (one script): blob, pin flag and deadline together."""
        check_put(self.name, key, blob, ttl_s, self.max_entry_bytes)
        ttl_ms = "" if ttl_s is None else str(max(1, round(ttl_s * 1000)))
        self._guard(lambda: self._put(keys=[self._key(key)], args=[blob, "1" if pinned else "0", ttl_ms]))

    def delete(self, key: bytes) -> bool:
        """Remove ``key``; False if absent."""
        return bool(self._guard(lambda: self._client.delete(self._key(key))))

    def set_pinned(self, key: bytes, pinned: bool) -> bool:
        """Pin (drop the Redis expiry) or unpin (restore the stored deadline); False if absent."""
        flag = "1" if pinned else "0"
        return bool(self._guard(lambda: self._set_pinned(keys=[self._key(key)], args=[flag])))

    def set_ttl(self, key: bytes, ttl_s: float | None) -> bool:
        """Expire ``key`` ``ttl_s`` seconds from now by the server's clock (None = never)."""
        check_ttl(ttl_s)
        ttl_ms = "" if ttl_s is None else str(max(1, round(ttl_s * 1000)))
        return bool(self._guard(lambda: self._set_ttl(keys=[self._key(key)], args=[ttl_ms])))

    def stats(self) -> TierStats:
        """Entries and bytes by SCAN over ``prefix`` (O(entries): for scrapes, not the hot path).

        ``evictions`` and ``capacity_bytes`` (``maxmemory``, 0 = unlimited) are server-wide.
        """
        pattern = "".join("\\" + c if c in "*?[]\\" else c for c in self.prefix) + "?" * 64

        def scan() -> tuple[int, int, dict]:
            entries = nbytes = 0
            batch: list[bytes] = []
            for name in self._client.scan_iter(match=pattern, count=1000):
                batch.append(name)
                if len(batch) == 1000:
                    nbytes += self._sizes(batch)
                    entries, batch = entries + len(batch), []
            nbytes += self._sizes(batch)
            info = self._client.info()
            return entries + len(batch), nbytes, info

        entries, nbytes, info = self._guard(scan)
        with self._lock:
            return TierStats(self.name, entries, nbytes, self._hits, self._misses,
                             int(info.get("evicted_keys", 0)), int(info.get("maxmemory", 0)))

    def _sizes(self, names: list[bytes]) -> int:
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.hstrlen(name, "b")
        return sum(pipe.execute())

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()
        self._client.connection_pool.disconnect()
