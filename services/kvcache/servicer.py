"""gRPC servicers for kvmesh.kvcache.v1: protobuf <-> the Backend (store and catalog), nothing else.

`KvcacheServicer` serves the blob store, `KvCatalogServicer` the documents and the semantic
index; one process serves both over one Backend. A request's namespace arrives as a
kvmesh.common.v1.KvNamespace and its 16-byte digest is derived here (`KvNamespace.digest`): the
service never trusts a digest a client computed. Errors are kvmesh.errors exceptions; the shared
interceptor maps them to status codes.
"""
from __future__ import annotations

import logging
import math
import time
from typing import AsyncIterator, Union

from opentelemetry import trace

from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.kv import codec, transfer
from kvmesh.kv.keys import KEY_BYTES
from kvmesh.kv.namespace_proto import namespace_from_proto
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.kvcache.v1 import kvcache_pb2_grpc
from kvmesh.limits import MAX_SEARCH_K
from kvmesh.services.kvcache.backend import Backend
from kvmesh.services.kvcache.catalog import Document
from kvmesh.services.kvcache.index import Kind
from kvmesh.services.kvcache.store import EntryTooLarge, StoreFull

log = logging.getLogger(__name__)

_UINT32_MAX = 2**32 - 1
_TIERS = {"memory": pb.TIER_MEMORY, "disk": pb.TIER_DISK, "redis": pb.TIER_REDIS}
_KINDS = {pb.INDEX_KIND_UNSPECIFIED: (Kind.CHUNK, Kind.DOCUMENT), pb.INDEX_KIND_ANY: (Kind.CHUNK, Kind.DOCUMENT),
          pb.INDEX_KIND_CHUNK: (Kind.CHUNK,), pb.INDEX_KIND_DOCUMENT: (Kind.DOCUMENT,)}
_KIND_PB = {Kind.CHUNK: pb.INDEX_KIND_CHUNK, Kind.DOCUMENT: pb.INDEX_KIND_DOCUMENT}


def _check_keys(keys, what: str) -> list[bytes]:
    keys = list(keys)
    bad = [i for i, k in enumerate(keys) if len(k) != KEY_BYTES]
    if bad:
        raise InvalidArgument(f"{what}: key #{bad[0]} has {len(keys[bad[0]])} bytes; chunk keys are "
                              f"{KEY_BYTES} bytes (kvmesh.kv.keys)")
    return keys


NamespacedRequest = Union[pb.PutHeader, pb.SearchRequest, pb.PutDocumentRequest, pb.GetDocumentRequest,
                          pb.ListDocumentsRequest, pb.DeleteDocumentRequest, pb.PinDocumentRequest,
                          pb.SetDocumentTtlRequest]
"""The messages that carry a kvmesh.common.v1.KvNamespace in their `namespace` field."""


def namespace_digest(request: NamespacedRequest, what: str) -> bytes:
    """The 16-byte digest of `request.namespace` (a kvmesh.common.v1.KvNamespace), derived here;
    InvalidArgument saying what to fix when it is unset or incomplete."""
    if not request.HasField("namespace"):
        raise InvalidArgument(f"{what}: namespace is unset; send the KvNamespace of the KV (the engine's "
                              "GetModelInfo.kv_namespace with the tenant's salt)")
    try:
        return namespace_from_proto(request.namespace).digest()
    except ValueError as err:
        raise InvalidArgument(f"{what}: {err}") from None


class KvcacheServicer(kvcache_pb2_grpc.KvcacheServiceServicer):
    """Thin adapter from kvmesh.kvcache.v1.KvcacheService (chunks by key) to the Backend."""

    def __init__(self, backend: Backend, *, max_entry_bytes: int) -> None:
        self.backend = backend
        self.max_entry_bytes = max_entry_bytes

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:
        b = self.backend
        keys = _check_keys(request.keys, "Lookup")
        if len(keys) * request.chunk_tokens > _UINT32_MAX:  # prefix_tokens could not hold the answer
            raise InvalidArgument(f"Lookup: {len(keys)} keys of chunk_tokens {request.chunk_tokens} can be "
                                  f"more than {_UINT32_MAX} tokens; send the engine's chunk size (tokens per "
                                  "chunk), or 0 to leave prefix_tokens unreported")
        where = await b.read(b.store.contains_many, keys)
        tiers = [_TIERS[name] if name else pb.TIER_UNSPECIFIED for name in where]
        prefix = next((i for i, name in enumerate(where) if not name), len(where))
        b.metrics.record_lookup(len(keys), prefix, request.chunk_tokens)
        trace.get_current_span().set_attributes({
            "kvmesh.kv.keys": len(keys), "kvmesh.kv.found_chunks": sum(1 for w in where if w),
            "kvmesh.kv.hit_chunks": prefix, "kvmesh.kv.hit_tokens": prefix * request.chunk_tokens})
        return pb.LookupResponse(tiers=tiers, prefix_chunks=prefix,
                                 prefix_tokens=prefix * request.chunk_tokens)

    def _check_header(self, header: pb.PutHeader) -> bytes:
        """The header's namespace digest, once the header is known to be usable."""
        _check_keys([header.key], "Put")
        if header.total_bytes == 0:
            raise InvalidArgument("Put: total_bytes must be >= 1")
        if header.total_bytes > self.max_entry_bytes:
            raise ResourceExhausted(
                f"Put: entry of {header.total_bytes} bytes exceeds the service's max entry size "
                f"({self.max_entry_bytes}); use smaller chunks or a denser codec")
        if header.HasField("ttl_s") and not header.ttl_s > 0:  # NaN too
            raise InvalidArgument(f"Put: ttl_s must be > 0 seconds, got {header.ttl_s}")
        return namespace_digest(header, "Put")

    async def Put(self, request_iterator: AsyncIterator[pb.PutRequest], context) -> pb.PutResponse:
        b = self.backend
        header, namespace = None, b""
        parts: list[bytes] = []
        received = 0
        async for msg in request_iterator:
            if header is None:
                if not msg.HasField("header"):
                    raise InvalidArgument("Put: the first message must carry the header (key, total_bytes, "
                                          "checksum, namespace)")
                header = msg.header
                namespace = self._check_header(header)
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
        if blob_header.namespace != namespace:
            raise InvalidArgument(
                f"Put: the blob was encoded for namespace {blob_header.namespace.hex()} but the header's namespace "
                f"has digest {namespace.hex()}; send the KvNamespace whose digest() the chunk was encoded with "
                "(kvmesh.kv.codec.ChunkMeta.namespace), e.g. with the tenant salt and storage format it was made for")
        which = header.WhichOneof("index")
        vector = await b.vector(header.text if which == "text" else None,
                                header.embedding.values if which == "embedding" else (), "Put")
        ttl = header.ttl_s if header.HasField("ttl_s") else None
        try:
            await b.run(lambda: b.store.put(header.key, blob, ttl_s=ttl, pinned=header.pinned))
            if vector is not None:
                await b.run(b.catalog.index_chunk, header.key, namespace, vector, dict(header.metadata))
                b.update_gauges()
        except (StoreFull, EntryTooLarge) as err:
            raise ResourceExhausted(f"Put: {err}") from err
        b.metrics.record_put(len(blob))
        trace.get_current_span().set_attributes({
            "kvmesh.kv.bytes": len(blob), "kvmesh.kv.tokens": blob_header.shape[1],
            "kvmesh.kv.codec": blob_header.codec + ("+zstd" if blob_header.zstd else "")})
        return pb.PutResponse(stored_bytes=len(blob))

    def _get_verified(self, keys: list[bytes]) -> list[tuple[bytes | None, str | None]]:
        """Blobs (with the tier that served them); a blob that fails verification is deleted and missed."""
        b = self.backend
        out: list[tuple[bytes | None, str | None]] = []
        for key, (blob, tier) in zip(keys, b.store.get_many_with_tier(keys)):
            if blob is not None:
                try:
                    codec.verify(blob)
                except codec.CorruptBlob as err:
                    log.warning("dropping corrupt entry %s from %s: %s", key.hex()[:16], tier, err)
                    b.store.delete(key)
                    b.corrupt_entries += 1
                    blob = None
            out.append((blob, tier if blob is not None else None))
        return out

    async def Get(self, request: pb.GetRequest, context) -> AsyncIterator[pb.GetResponse]:
        b = self.backend
        keys = _check_keys(request.keys, "Get")
        found = await b.read(self._get_verified, keys)
        b.metrics.record_get(len(keys))
        trace.get_current_span().set_attributes({
            "kvmesh.kv.keys": len(keys), "kvmesh.kv.found_chunks": sum(1 for blob, _ in found if blob is not None),
            "kvmesh.kv.bytes": sum(len(blob) for blob, _ in found if blob is not None)})
        for key, (blob, tier) in zip(keys, found):
            if blob is None:
                yield pb.GetResponse(header=pb.GetEntryHeader(key=key, found=False))
                continue
            b.metrics.record_read(len(blob))
            yield pb.GetResponse(header=pb.GetEntryHeader(
                key=key, found=True, total_bytes=len(blob), checksum=transfer.checksum(blob), tier=_TIERS[tier]))
            for part in transfer.slices(blob):
                yield pb.GetResponse(data=part)

    async def Delete(self, request: pb.DeleteRequest, context) -> pb.DeleteResponse:
        b = self.backend
        keys = _check_keys(request.keys, "Delete")
        n = await b.run(lambda: sum(b.store.delete(k) for k in keys))
        await b.run(b.catalog.forget_chunks, keys)
        b.update_gauges()
        return pb.DeleteResponse(deleted=n)

    async def Pin(self, request: pb.PinRequest, context) -> pb.PinResponse:
        b = self.backend
        keys = _check_keys(request.keys, "Pin")
        n = await b.run(lambda: sum(b.store.set_pinned(k, request.pinned) for k in keys))
        return pb.PinResponse(updated=n)

    async def SetTtl(self, request: pb.SetTtlRequest, context) -> pb.SetTtlResponse:
        b = self.backend
        keys = _check_keys(request.keys, "SetTtl")
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        if ttl is not None and not ttl > 0:  # NaN too
            raise InvalidArgument(f"SetTtl: ttl_s must be > 0 seconds (unset clears the TTL), got {ttl}")
        n = await b.run(lambda: sum(b.store.set_ttl(k, ttl) for k in keys))
        return pb.SetTtlResponse(updated=n)

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        b = self.backend
        stats = await b.run(b.store.stats)
        return pb.StatsResponse(
            tiers=[pb.TierStats(tier=_TIERS[s.name], entries=s.entries, bytes=s.bytes,
                                capacity_bytes=s.capacity_bytes, hits=s.hits, misses=s.misses,
                                evictions=s.evictions) for s in stats],
            corrupt_entries=b.corrupt_entries, index_chunks=b.catalog.index.count(Kind.CHUNK),
            index_documents=b.catalog.document_count(), index_stale_dropped=b.catalog.stale_dropped)


class KvCatalogServicer(kvcache_pb2_grpc.KvCatalogServiceServicer):
    """Thin adapter from kvmesh.kvcache.v1.KvCatalogService (documents, search) to the Backend."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    async def Search(self, request: pb.SearchRequest, context) -> pb.SearchResponse:
        b = self.backend
        start = time.perf_counter()
        b.metrics.searches.inc()
        which = request.WhichOneof("query")
        if which is None:
            raise InvalidArgument("Search: set text (embedded by the service) or embedding (384 floats, norm 1)")
        if request.k > MAX_SEARCH_K:
            raise InvalidArgument(f"Search: k must be 1..{MAX_SEARCH_K} (0 = 10), got {request.k}")
        if request.kind not in _KINDS:  # proto3 enums are open: any int32 arrives
            known = ", ".join(pb.IndexKind.Name(v) for v in _KINDS)
            raise InvalidArgument(f"Search: kind {request.kind} is not an IndexKind; use one of {known}")
        namespace = namespace_digest(request, "Search")
        query = await b.vector(request.text if which == "text" else None,
                               request.embedding.values if which == "embedding" else (), "Search")
        if query is None:
            raise InvalidArgument("Search: embedding is empty; send 384 floats of L2 norm 1")
        hits = await b.run(b.catalog.search, namespace, query, _KINDS[request.kind], request.k or 10)
        b.update_gauges()
        b.metrics.search_seconds.observe(time.perf_counter() - start)
        return pb.SearchResponse(hits=[pb.SearchHit(
            kind=_KIND_PB[h.entry.kind], score=h.score, metadata=h.entry.metadata,
            key=h.entry.id if h.entry.kind is Kind.CHUNK else b"",
            document_id=h.entry.id.decode() if h.entry.kind is Kind.DOCUMENT else "") for h in hits])

    async def PutDocument(self, request: pb.PutDocumentRequest, context) -> pb.PutDocumentResponse:
        b = self.backend
        namespace = namespace_digest(request, "PutDocument")
        keys = _check_keys(request.chunk_keys, "PutDocument")
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        if ttl is not None and not ttl > 0:
            raise InvalidArgument(f"PutDocument: ttl_s must be > 0 seconds, got {ttl}")
        given = request.HasField("embedding")
        if not request.text.strip() and not given:
            raise InvalidArgument("PutDocument: send text (embedded by the service) or embedding (384 floats, "
                                  "norm 1); a document is found by Search through one of them")
        vector = await b.vector(None if given else request.text, request.embedding.values, "PutDocument")
        if vector is None:
            raise InvalidArgument("PutDocument: embedding is empty; send 384 floats of L2 norm 1, or leave it "
                                  "unset to embed the text")
        doc = Document(namespace, request.document_id, tuple(keys), vector, dict(request.metadata),
                       request.text, tuple(request.token_ids), request.pinned)
        await b.run(lambda: b.catalog.put_document(doc, ttl_s=ttl))
        b.update_gauges()
        return pb.PutDocumentResponse(chunks=len(keys))

    async def GetDocument(self, request: pb.GetDocumentRequest, context) -> pb.GetDocumentResponse:
        b = self.backend
        doc = await b.run(b.catalog.get_document, namespace_digest(request, "GetDocument"), request.document_id)
        return pb.GetDocumentResponse(document=_document_pb(doc, full=True))

    async def ListDocuments(self, request: pb.ListDocumentsRequest, context) -> pb.ListDocumentsResponse:
        b = self.backend
        docs, token = await b.run(b.catalog.list_documents, namespace_digest(request, "ListDocuments"),
                                  request.page_size, request.page_token)
        return pb.ListDocumentsResponse(documents=[_document_pb(d, full=False) for d in docs], next_page_token=token)

    async def DeleteDocument(self, request: pb.DeleteDocumentRequest, context) -> pb.DeleteDocumentResponse:
        b = self.backend
        n = await b.run(b.catalog.delete_document, namespace_digest(request, "DeleteDocument"), request.document_id)
        b.update_gauges()
        return pb.DeleteDocumentResponse(deleted_chunks=n)

    async def PinDocument(self, request: pb.PinDocumentRequest, context) -> pb.PinDocumentResponse:
        b = self.backend
        await b.run(b.catalog.set_document_pinned, namespace_digest(request, "PinDocument"), request.document_id,
                    request.pinned)
        return pb.PinDocumentResponse()

    async def SetDocumentTtl(self, request: pb.SetDocumentTtlRequest, context) -> pb.SetDocumentTtlResponse:
        b = self.backend
        ttl = request.ttl_s if request.HasField("ttl_s") else None
        await b.run(b.catalog.set_document_ttl, namespace_digest(request, "SetDocumentTtl"), request.document_id, ttl)
        return pb.SetDocumentTtlResponse()

    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        vectors, counts = await self.backend.embed_texts(list(request.texts))
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=v.tolist()) for v in vectors],
                                token_counts=counts, model=self.backend.embedder.name)

    async def GetEmbeddingModel(self, request: pb.GetEmbeddingModelRequest, context) -> pb.EmbeddingModel:
        name, dim, max_tokens = await self.backend.embedding_model()
        return pb.EmbeddingModel(name=name, dimensions=dim, max_tokens=max_tokens)


def _document_pb(doc: Document, *, full: bool) -> pb.Document:
    out = pb.Document(document_id=doc.id, metadata=doc.metadata, chunk_keys=list(doc.chunk_keys), pinned=doc.pinned)
    if full:
        out.text = doc.text
        out.token_ids.extend(doc.token_ids)
    if doc.expires_at != math.inf:
        out.ttl_s = max(doc.expires_at - time.time(), 0.0)
    return out
