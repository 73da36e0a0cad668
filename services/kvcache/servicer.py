"""gRPC servicer for kvmesh.kvcache.v1: protobuf <-> the tiered store, nothing else.

Store calls block (LMDB commits with fsync), so they run on one worker thread, never on the
event loop. Errors are kvmesh.errors exceptions; the shared interceptor maps them to status codes.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.kv import codec, transfer
from kvmesh.kv.keys import KEY_BYTES
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.kvcache.v1 import kvcache_pb2_grpc
from kvmesh.services.kvcache import metrics
from kvmesh.services.kvcache.store import EntryTooLarge, StoreFull, TieredStore

log = logging.getLogger(__name__)
T = TypeVar("T")


_TIERS = {"memory": pb.TIER_MEMORY, "disk": pb.TIER_DISK, "redis": pb.TIER_REDIS}


def _check_keys(keys, what: str) -> list[bytes]:
    keys = list(keys)
    bad = [i for i, k in enumerate(keys) if len(k) != KEY_BYTES]
    if bad:
        raise InvalidArgument(f"{what}: key #{bad[0]} has {len(keys[bad[0]])} bytes; chunk keys are "
                              f"{KEY_BYTES} bytes (kvmesh.kv.keys)")
    return keys


class KvcacheServicer(kvcache_pb2_grpc.KvcacheServiceServicer):
    """Thin adapter from kvmesh.kvcache.v1 to a TieredStore."""

    def __init__(self, store: TieredStore, *, max_entry_bytes: int) -> None:
        self.store = store
        self.max_entry_bytes = max_entry_bytes
        self.corrupt_entries = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-io")

    def close(self) -> None:
        """Waits for queued store work, then closes the store."""
        self._io.shutdown(wait=True)
        self.store.close()

    async def sweep_forever(self, interval_s: float) -> None:
        """Removes expired entries every `interval_s` seconds (reads already treat them as misses;
        this returns their space). Runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)  # a schedule, not synchronization
            removed = await self._run(self.store.sweep_expired)
            if removed:
                log.info("removed %d expired entries", removed)

    async def _run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        keys = _check_keys(request.keys, "Lookup")
        where = await self._run(self.store.contains_many, keys)
        tiers = [_TIERS[name] if name else pb.TIER_NONE for name in where]
        prefix = next((i for i, name in enumerate(where) if not name), len(where))
        metrics.LOOKUPS.inc()
        metrics.LOOKUP_HIT_CHUNKS.inc(prefix)
        return pb.LookupResponse(tiers=tiers, prefix_chunks=prefix,
                                 prefix_tokens=prefix * request.chunk_tokens)

    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context) -> pb.PutResponse:
        header = None
        parts: list[bytes] = []
        received = 0
        async for msg in request_iterator:
            if header is None:
                if not msg.HasField("header"):
                    raise InvalidArgument("Put: the first message must carry the header (key, total_bytes, checksum)")
                header = msg.header
                _check_keys([header.key], "Put")
                if header.total_bytes == 0:
                    raise InvalidArgument("Put: total_bytes must be >= 1")
                if header.total_bytes > self.max_entry_bytes:
                    raise ResourceExhausted(
                        f"Put: entry of {header.total_bytes} bytes exceeds the service's max entry size "
                        f"({self.max_entry_bytes}); use smaller chunks or a denser codec")
                if header.HasField("ttl_s") and header.ttl_s <= 0:
                    raise InvalidArgument(f"Put: ttl_s must be > 0 seconds, got {header.ttl_s}")
                continue
            if not msg.HasField("data"):
                raise InvalidArgument("Put: only the first message may carry a header; send data slices after it")
            received += len(msg.data)
            if received > header.total_bytes:
                raise InvalidArgument(f"Put: more data than the header's total_bytes ({header.total_bytes})")
            parts.append(msg.data)
        if header is None:
            raise InvalidArgument("Put: empty stream; send a header, then the data")
        blob = b"".join(parts)
        if len(blob) != header.total_bytes:
            raise InvalidArgument(f"Put: received {len(blob)} bytes, header announced {header.total_bytes}")
        if transfer.checksum(blob) != header.checksum:
            raise InvalidArgument("Put: checksum mismatch (blake2b-128 of the blob); the transfer was damaged, retry")
        try:
            codec.verify(blob)
        except codec.CorruptBlob as err:
            raise InvalidArgument(f"Put: not a valid KV chunk blob ({err}); encode with kvmesh.kv.codec") from err
        ttl = header.ttl_s if header.HasField("ttl_s") else None
        try:
            await self._run(lambda: self.store.put(header.key, blob, ttl_s=ttl, pinned=header.pinned))
        except (StoreFull, EntryTooLarge) as err:
            raise ResourceExhausted(f"Put: {err}") from err
        metrics.BYTES_WRITTEN.inc(len(blob))
        return pb.PutResponse(stored_bytes=len(blob))

    def _get_verified(self, keys: list[bytes]) -> list[tuple[bytes | None, str | None]]:
        """Blobs (with the tier that served them); a blob that fails verification is deleted and missed."""
        out: list[tuple[bytes | None, str | None]] = []
        for key, (blob, tier) in zip(keys, self.store.get_many_with_tier(keys)):
            if blob is not None:
                try:
                    codec.verify(blob)
                except codec.CorruptBlob as err:
                    log.warning("dropping corrupt entry %s from %s: %s", key.hex()[:16], tier, err)
                    self.store.delete(key)
                    self.corrupt_entries += 1
                    blob = None
            out.append((blob, tier if blob is not None else None))
        return out

    async def Get(self, request: pb.GetRequest, context) -> AsyncIterator[pb.GetResponse]:
        keys = _check_keys(request.keys, "Get")
        found = await self._run(self._get_verified, keys)
        for key, (blob, tier) in zip(keys, found):
            if blob is None:
                yield pb.GetResponse(header=pb.GetEntryHeader(key=key, found=False, tier=pb.TIER_NONE))
                continue
            metrics.BYTES_READ.inc(len(blob))
            yield pb.GetResponse(header=pb.GetEntryHeader(
                key=key, found=True, total_bytes=len(blob), checksum=transfer.checksum(blob), tier=_TIERS[tier]))
            for part in transfer.slices(blob):
                yield pb.GetResponse(data=part)

    async def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        keys = _check_keys(request.keys, "Delete")
        n = await self._run(lambda: sum(self.store.delete(k) for k in keys))
        return pb.DeleteResponse(deleted=n)

    async def Pin(self, request: pb.PinRequest, context) -> pb.PinResponse:
        keys = _check_keys(request.keys, "Pin")
        n = await self._run(lambda: sum(self.store.set_pinned(k, request.pinned) for k in keys))
        return pb.PinResponse(updated=n)

    async def SetTtl(self, request: pb.SetTtlRequest, context) -> pb.SetTtlResponse:
        keys = _check_keys(request.keys, "SetTtl")
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        if ttl is not None and ttl <= 0:
            raise InvalidArgument(f"SetTtl: ttl_s must be > 0 seconds (unset clears the TTL), got {ttl}")
        n = await self._run(lambda: sum(self.store.set_ttl(k, ttl) for k in keys))
        return pb.SetTtlResponse(updated=n)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = await self._run(self.store.stats)
        return pb.StatsResponse(
            tiers=[pb.TierStats(tier=_TIERS[s.name], entries=s.entries, bytes=s.bytes,
                                capacity_bytes=s.capacity_bytes, hits=s.hits, misses=s.misses,
                                evictions=s.evictions) for s in stats],
            corrupt_entries=self.corrupt_entries)
