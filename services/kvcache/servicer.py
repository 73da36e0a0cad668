"""gRPC servicer for kvmesh.kvcache.v1: protobuf <-> the tiered store, nothing else.

Store calls block (LMDB commits with fsync), so they run on one worker thread, never on the
event loop. Errors are kvmesh.errors exceptions; the shared interceptor maps them to status codes.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, TypeVar

import numpy as np
from opentelemetry import trace

from kvmesh.embed import DIM, Embedder, check_unit_vector
from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.kv import codec, transfer
from kvmesh.kv.keys import KEY_BYTES
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.kvcache.v1 import kvcache_pb2_grpc
from kvmesh.services.kvcache import metrics
from kvmesh.services.kvcache.catalog import Catalog, Document
from kvmesh.services.kvcache.index import Kind
from kvmesh.services.kvcache.store import EntryTooLarge, LmdbTier, MemoryTable, RecordTable, StoreFull, TieredStore

log = logging.getLogger(__name__)
T = TypeVar("T")


_TIERS = {"memory": pb.TIER_MEMORY, "disk": pb.TIER_DISK, "redis": pb.TIER_REDIS}
_KINDS = {pb.INDEX_KIND_UNSPECIFIED: (Kind.CHUNK, Kind.DOCUMENT), pb.INDEX_KIND_ANY: (Kind.CHUNK, Kind.DOCUMENT),
          pb.INDEX_KIND_CHUNK: (Kind.CHUNK,), pb.INDEX_KIND_DOCUMENT: (Kind.DOCUMENT,)}
_KIND_PB = {Kind.CHUNK: pb.INDEX_KIND_CHUNK, Kind.DOCUMENT: pb.INDEX_KIND_DOCUMENT}


def catalog_table(store: TieredStore) -> RecordTable:
    """Where the catalog persists: a sub-database of the first disk tier, else memory."""
    disk = next((t for t in store.tiers if isinstance(t, LmdbTier)), None)
    return disk.table("catalog") if disk is not None else MemoryTable()


def _check_keys(keys, what: str) -> list[bytes]:
    keys = list(keys)
    bad = [i for i, k in enumerate(keys) if len(k) != KEY_BYTES]
    if bad:
        raise InvalidArgument(f"{what}: key #{bad[0]} has {len(keys[bad[0]])} bytes; chunk keys are "
                              f"{KEY_BYTES} bytes (kvmesh.kv.keys)")
    return keys


class KvcacheServicer(kvcache_pb2_grpc.KvcacheServiceServicer):
    """Thin adapter from kvmesh.kvcache.v1 to a TieredStore."""

    def __init__(self, store: TieredStore, *, max_entry_bytes: int, embedder=None,
                 records: RecordTable | None = None) -> None:
        self.store = store
        self.max_entry_bytes = max_entry_bytes
        self.corrupt_entries = 0
        self.embedder = embedder if embedder is not None else Embedder()  # loads on first text
        self.catalog = Catalog(store, records if records is not None else catalog_table(store), DIM)
        self.catalog.load()
        self._gauges()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-io")
        self._embed_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-embed")

    def close(self) -> None:
        """Waits for queued store work, then closes the store."""
        self._embed_pool.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.store.close()

    def _gauges(self) -> None:
        metrics.INDEX_ENTRIES.labels(kind="chunk").set(self.catalog.index.count(Kind.CHUNK))
        metrics.INDEX_ENTRIES.labels(kind="document").set(self.catalog.index.count(Kind.DOCUMENT))

    async def _vector(self, text: str | None, values, what: str) -> np.ndarray | None:
        """The embedding of ``text`` (computed on the embedder thread), else the client's
        ``values`` checked to be a unit vector, else None."""
        if text is not None:
            if not text.strip():
                raise InvalidArgument(f"{what}: text is empty; send the text to embed or leave it unset")
            vecs = await asyncio.get_running_loop().run_in_executor(self._embed_pool, self.embedder.embed, [text])
            return vecs[0]
        if len(values):
            try:
                return check_unit_vector(list(values), DIM)
            except ValueError as err:
                raise InvalidArgument(f"{what}: {err}") from None
        return None

    async def sweep_forever(self, interval_s: float) -> None:
        """Removes expired entries every `interval_s` seconds (reads already treat them as misses;
        this returns their space). Runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)  # a schedule, not synchronization
            removed = await self._run(self.store.sweep_expired)
            if removed:
                log.info("removed %d expired entries", removed)
            if await self._run(self.catalog.prune):
                self._gauges()

    async def _run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        keys = _check_keys(request.keys, "Lookup")
        where = await self._run(self.store.contains_many, keys)
        tiers = [_TIERS[name] if name else pb.TIER_NONE for name in where]
        prefix = next((i for i, name in enumerate(where) if not name), len(where))
        metrics.record_lookup(len(keys), prefix, request.chunk_tokens)
        trace.get_current_span().set_attributes({
            "kvmesh.kv.keys": len(keys), "kvmesh.kv.found_chunks": sum(1 for w in where if w),
            "kvmesh.kv.hit_chunks": prefix, "kvmesh.kv.hit_tokens": prefix * request.chunk_tokens})
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
            blob_header = codec.verify(blob)
        except codec.CorruptBlob as err:
            raise InvalidArgument(f"Put: not a valid KV chunk blob ({err}); encode with kvmesh.kv.codec") from err
        vector = await self._vector(header.text if header.HasField("text") else None, header.embedding, "Put")
        ttl = header.ttl_s if header.HasField("ttl_s") else None
        try:
            await self._run(lambda: self.store.put(header.key, blob, ttl_s=ttl, pinned=header.pinned))
            if vector is not None:  # namespace from the blob itself: a client cannot file it elsewhere
                await self._run(self.catalog.index_chunk, header.key, blob_header.namespace, vector,
                                dict(header.metadata))
                self._gauges()
        except (StoreFull, EntryTooLarge) as err:
            raise ResourceExhausted(f"Put: {err}") from err
        metrics.record_put(len(blob))
        trace.get_current_span().set_attributes({
            "kvmesh.kv.bytes": len(blob), "kvmesh.kv.tokens": blob_header.shape[1],
            "kvmesh.kv.codec": blob_header.codec + ("+zstd" if blob_header.zstd else "")})
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
        metrics.record_get(len(keys))
        trace.get_current_span().set_attributes({
            "kvmesh.kv.keys": len(keys), "kvmesh.kv.found_chunks": sum(1 for b, _ in found if b is not None),
            "kvmesh.kv.bytes": sum(len(b) for b, _ in found if b is not None)})
        for key, (blob, tier) in zip(keys, found):
            if blob is None:
                yield pb.GetResponse(header=pb.GetEntryHeader(key=key, found=False, tier=pb.TIER_NONE))
                continue
            metrics.record_read(len(blob))
            yield pb.GetResponse(header=pb.GetEntryHeader(
                key=key, found=True, total_bytes=len(blob), checksum=transfer.checksum(blob), tier=_TIERS[tier]))
            for part in transfer.slices(blob):
                yield pb.GetResponse(data=part)

    async def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        keys = _check_keys(request.keys, "Delete")
        n = await self._run(lambda: sum(self.store.delete(k) for k in keys))
        await self._run(self.catalog.forget_chunks, keys)
        self._gauges()
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
            corrupt_entries=self.corrupt_entries, index_chunks=self.catalog.index.count(Kind.CHUNK),
            index_documents=self.catalog.document_count(), index_stale_dropped=self.catalog.stale_dropped)

    # -- semantic index and documents ------------------------------------------------------------

    async def Search(self, request: pb.SearchRequest, context) -> pb.SearchResponse:
        start = time.perf_counter()
        metrics.SEARCHES.inc()
        which = request.WhichOneof("query")
        if which is None:
            raise InvalidArgument("Search: set text (embedded by the service) or vector (384 floats, norm 1)")
        if request.k > 1000:
            raise InvalidArgument(f"Search: k must be 1..1000 (0 = 10), got {request.k}")
        query = await self._vector(request.text if which == "text" else None,
                                   request.vector.values if which == "vector" else (), "Search")
        if query is None:
            raise InvalidArgument("Search: vector is empty; send 384 floats of L2 norm 1")
        hits = await self._run(self.catalog.search, request.namespace, query, _KINDS[request.kind], request.k or 10)
        self._gauges()
        metrics.SEARCH_SECONDS.observe(time.perf_counter() - start)
        return pb.SearchResponse(hits=[pb.SearchHit(
            kind=_KIND_PB[h.entry.kind], score=h.score, metadata=h.entry.metadata,
            key=h.entry.id if h.entry.kind is Kind.CHUNK else b"",
            document_id=h.entry.id.decode() if h.entry.kind is Kind.DOCUMENT else "") for h in hits])

    async def PutDocument(self, request: pb.PutDocumentRequest, context) -> pb.PutDocumentResponse:
        keys = _check_keys(request.chunk_keys, "PutDocument")
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        if ttl is not None and not ttl > 0:
            raise InvalidArgument(f"PutDocument: ttl_s must be > 0 seconds, got {ttl}")
        if not request.text.strip() and not len(request.embedding):
            raise InvalidArgument("PutDocument: send text (embedded by the service) or embedding (384 floats, "
                                  "norm 1); a document is found by Search through one of them")
        vector = await self._vector(None if len(request.embedding) else request.text, request.embedding, "PutDocument")
        doc = Document(request.namespace, request.document_id, tuple(keys), vector, dict(request.metadata),
                       request.text, tuple(request.token_ids), request.pinned)
        await self._run(lambda: self.catalog.put_document(doc, ttl_s=ttl))
        self._gauges()
        return pb.PutDocumentResponse(chunks=len(keys))

    async def GetDocument(self, request: pb.GetDocumentRequest, context) -> pb.GetDocumentResponse:
        doc = await self._run(self.catalog.get_document, request.namespace, request.document_id)
        return pb.GetDocumentResponse(document=_document_pb(doc, full=True))

    async def ListDocuments(self, request: pb.ListDocumentsRequest, context) -> pb.ListDocumentsResponse:
        docs, token = await self._run(self.catalog.list_documents, request.namespace, request.page_size,
                                      request.page_token)
        return pb.ListDocumentsResponse(documents=[_document_pb(d, full=False) for d in docs], next_page_token=token)

    async def DeleteDocument(self, request: pb.DeleteDocumentRequest, context) -> pb.DeleteDocumentResponse:
        n = await self._run(self.catalog.delete_document, request.namespace, request.document_id)
        self._gauges()
        return pb.DeleteDocumentResponse(deleted_chunks=n)

    async def PinDocument(self, request: pb.PinDocumentRequest, context) -> pb.PinDocumentResponse:
        await self._run(self.catalog.set_document_pinned, request.namespace, request.document_id, request.pinned)
        return pb.PinDocumentResponse()

    async def SetDocumentTtl(self, request: pb.SetDocumentTtlRequest, context) -> pb.SetDocumentTtlResponse:
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        await self._run(self.catalog.set_document_ttl, request.namespace, request.document_id, ttl)
        return pb.SetDocumentTtlResponse()


def _document_pb(doc: Document, *, full: bool) -> pb.Document:
    out = pb.Document(document_id=doc.id, metadata=doc.metadata, chunk_keys=list(doc.chunk_keys), pinned=doc.pinned)
    if full:
        out.text = doc.text
        out.token_ids.extend(doc.token_ids)
    if doc.expires_at != math.inf:
        out.ttl_s = max(doc.expires_at - time.time(), 0.0)
    return out
