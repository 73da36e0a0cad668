"""The semantic catalog: indexed chunks and documents, persisted in a RecordTable beside the blobs.

NOTE: persistence. Records, in one table (``LmdbTier.table("catalog")`` when a disk tier exists):
  ``b"c" + chunk key``              -> a chunk's index entry (namespace, metadata, vector)
  ``b"d" + namespace + document id`` -> a document (metadata, text, token ids, chunk keys, pin,
                                        expiry, vector)
The in-memory VectorIndex, the document map and the chunk -> documents references are derived
from those records alone and rebuilt by ``load()`` on start. A document and its index entry are
one record, written in one atomic step, so a document is either fully visible or absent.

NOTE: consistency. Blobs can vanish under the catalog (LRU eviction, TTL expiry, another tier
losing them), so every read verifies: a chunk hit must still be in the store, a document must be
unexpired with all its chunks stored. Stale entries are dropped on that read (record and index
together), by ``prune()`` (the service's sweep) and by ``load()``; a search never returns an id
that points at nothing. Explicit deletes (Delete, DeleteDocument) remove entries directly.

NOTE: document lifetime. A document owns its chunks' pin and TTL: after every change each chunk
is pinned if any document referencing it is pinned, and expires with the longest-lived one
(never, if one has no TTL). DeleteDocument deletes the chunks no other document references.
"""
from __future__ import annotations

import json
import logging
import math
import struct
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.kv.namespace import NAMESPACE_BYTES
from kvmesh.services.kvcache.index import Entry, Hit, Kind, VectorIndex
from kvmesh.services.kvcache.store import RecordTable, TieredStore

log = logging.getLogger(__name__)
_LEN = struct.Struct("<I")
_CHUNK, _DOC = b"c", b"d"
MAX_DOCUMENT_ID = 256


@dataclass(frozen=True)
class Document:
    """A catalogued document: its KV lives in the chunks ``chunk_keys`` (content keys, in order)."""

    namespace: bytes
    id: str
    chunk_keys: tuple[bytes, ...]
    vector: np.ndarray  # [dim] float32, L2 norm 1
    metadata: dict[str, str] = field(default_factory=dict)
    text: str = ""
    token_ids: tuple[int, ...] = ()
    pinned: bool = False
    expires_at: float = math.inf
    created_at: float = 0.0

    @property
    def record_key(self) -> bytes:
        return _DOC + self.namespace + self.id.encode()


def _pack(head: dict, vector: np.ndarray) -> bytes:
    raw = json.dumps(head, separators=(",", ":")).encode()
    return _LEN.pack(len(raw)) + raw + vector.astype("<f4").tobytes()


def _unpack(value: bytes) -> tuple[dict, np.ndarray]:
    (n,) = _LEN.unpack_from(value)
    return json.loads(value[4:4 + n]), np.frombuffer(value[4 + n:], dtype="<f4").astype(np.float32)


def _doc_value(d: Document) -> bytes:
    head = dict(id=d.id, metadata=d.metadata, text=d.text, token_ids=list(d.token_ids),
                chunk_keys=[k.hex() for k in d.chunk_keys], pinned=d.pinned,
                expires_at=None if d.expires_at == math.inf else d.expires_at, created_at=d.created_at)
    return _pack(head, d.vector)


def _doc_from(key: bytes, value: bytes) -> Document:
    head, vec = _unpack(value)
    return Document(key[1:1 + NAMESPACE_BYTES], head["id"], tuple(bytes.fromhex(k) for k in head["chunk_keys"]),
                    vec, head["metadata"], head["text"], tuple(head["token_ids"]), head["pinned"],
                    math.inf if head["expires_at"] is None else head["expires_at"], head["created_at"])


def check_namespace(namespace: bytes, what: str) -> None:
    """InvalidArgument unless ``namespace`` is a 16-byte namespace digest."""
    if len(namespace) != NAMESPACE_BYTES:
        raise InvalidArgument(f"{what}: namespace has {len(namespace)} bytes; it is the {NAMESPACE_BYTES}-byte "
                              "digest of a kvmesh.kv.namespace.KvNamespace (KvNamespace.digest)")


class Catalog:
    """Index entries of chunks and the documents, verified against ``store`` on every read.

    Thread-safe (one lock); calls block on the table and the store, so the servicer runs them on
    its I/O thread.
    """

    def __init__(self, store: TieredStore, table: RecordTable, dim: int, *,
                 clock: Callable[[], float] = time.time) -> None:
        self.store, self.table, self.dim = store, table, dim
        self.index = VectorIndex(dim)
        self.stale_dropped = 0
        """Entries dropped because what they pointed at was gone (since start)."""
        self._clock = clock
        self._docs: dict[tuple[bytes, str], Document] = {}
        self._refs: dict[bytes, set[tuple[bytes, str]]] = {}
        self._chunk_ns: dict[bytes, bytes] = {}  # indexed chunk key -> its namespace
        self._lock = threading.RLock()

    # -- start -------------------------------------------------------------------------------

    def load(self) -> int:
        """Rebuild the index and documents from the table, dropping stale entries; returns how
        many entries are live."""
        with self._lock:
            for key, value in self.table.items(_CHUNK):
                head, vec = _unpack(value)
                self._chunk_ns[key[1:]] = ns = bytes.fromhex(head["ns"])
                self.index.put(Entry(ns, Kind.CHUNK, key[1:], vec, head["metadata"]))
            for key, value in self.table.items(_DOC):
                self._remember(_doc_from(key, value))
            self.prune()
            return len(self.index)

    # -- chunks ------------------------------------------------------------------------------

    def index_chunk(self, key: bytes, namespace: bytes, vector: np.ndarray, metadata: dict[str, str]) -> None:
        """Make the stored chunk ``key`` searchable by ``vector`` (replacing an older entry)."""
        with self._lock:
            self.table.write({_CHUNK + key: _pack(dict(ns=namespace.hex(), metadata=metadata), vector)})
            old = self._chunk_ns.pop(key, None)
            if old is not None:
                self.index.remove(old, Kind.CHUNK, key)
            self._chunk_ns[key] = namespace
            self.index.put(Entry(namespace, Kind.CHUNK, key, vector, dict(metadata)))

    def forget_chunks(self, keys: list[bytes]) -> None:
        """Drop the index entries of chunks that were deleted (documents referencing them go
        stale and are dropped when next read)."""
        with self._lock:
            gone = [k for k in keys if k in self._chunk_ns]
            for k in gone:
                self.index.remove(self._chunk_ns.pop(k), Kind.CHUNK, k)
            if gone:
                self.table.write(deletes=[_CHUNK + k for k in gone])

    # -- documents ---------------------------------------------------------------------------

    def put_document(self, doc: Document, *, ttl_s: float | None = None) -> None:
        """Catalogue ``doc`` (replacing one with the same id), expiring ``ttl_s`` seconds from now
        (None: per ``doc.expires_at``); all its chunks must be stored."""
        check_namespace(doc.namespace, "PutDocument")
        if not doc.id or len(doc.id.encode()) > MAX_DOCUMENT_ID:
            raise InvalidArgument(f"PutDocument: document_id must be 1..{MAX_DOCUMENT_ID} bytes of UTF-8, "
                                  f"got {len(doc.id.encode())}")
        if not doc.chunk_keys:
            raise InvalidArgument("PutDocument: chunk_keys is empty; Put the document's KV chunks, then list "
                                  "their content keys (kvmesh.kv.keys.content_key) in order")
        with self._lock:
            where = self.store.contains_many(list(doc.chunk_keys))
            missing = [k for k, w in zip(doc.chunk_keys, where) if w is None]
            if missing:
                raise FailedPrecondition(
                    f"PutDocument: {len(missing)} of {len(doc.chunk_keys)} chunks are not stored (first: "
                    f"{missing[0].hex()[:16]}...); Put every chunk first, the document appears only when all are")
            old = self._docs.get((doc.namespace, doc.id))
            now = self._clock()
            doc = replace(doc, created_at=now, expires_at=doc.expires_at if ttl_s is None else now + ttl_s)
            self.table.write({doc.record_key: _doc_value(doc)})
            if old is not None:
                self._forget(old)
            self._remember(doc)
            self._apply_lifetime(set(doc.chunk_keys) | set(old.chunk_keys if old else ()))

    def get_document(self, namespace: bytes, doc_id: str) -> Document:
        """The live document, or NotFound (also when it expired or lost a chunk)."""
        check_namespace(namespace, "GetDocument")
        with self._lock:
            doc = self._docs.get((namespace, doc_id))
            if doc is None or not self._live_docs([doc]):
                raise NotFound(f"no document {doc_id!r} in this namespace (never put, deleted, expired, "
                               "or one of its chunks was evicted; pin documents that must stay)")
            return doc

    def list_documents(self, namespace: bytes, page_size: int, page_token: str) -> tuple[list[Document], str]:
        """Live documents of ``namespace`` in id order after ``page_token``; returns the page and
        the next token ("" at the end)."""
        check_namespace(namespace, "ListDocuments")
        if not 0 <= page_size <= 1000:
            raise InvalidArgument(f"ListDocuments: page_size must be 0..1000 (0 = 100), got {page_size}")
        size = page_size or 100
        with self._lock:
            ids = sorted(i for ns, i in self._docs if ns == namespace and i > page_token)
            page: list[Document] = []
            while ids and len(page) < size:
                batch = [self._docs[(namespace, i)] for i in ids[:size - len(page)]]
                ids = ids[len(batch):]
                page += self._live_docs(batch)
            return page, (page[-1].id if page and ids else "")

    def delete_document(self, namespace: bytes, doc_id: str) -> int:
        """Remove the document and the chunks no other document references; returns how many
        chunks were deleted. NotFound if there is no such document."""
        check_namespace(namespace, "DeleteDocument")
        with self._lock:
            doc = self._docs.get((namespace, doc_id))
            if doc is None:
                raise NotFound(f"no document {doc_id!r} in this namespace; ListDocuments shows what exists")
            self.table.write(deletes=[doc.record_key])
            self._forget(doc)
            orphans = [k for k in dict.fromkeys(doc.chunk_keys) if not self._refs.get(k)]
            deleted = sum(self.store.delete(k) for k in orphans)
            self.forget_chunks(orphans)
            self._apply_lifetime(set(doc.chunk_keys) - set(orphans))
            return deleted

    def set_document_pinned(self, namespace: bytes, doc_id: str, pinned: bool) -> Document:
        """Pin (the document and its chunks never evicted or expired) or unpin."""
        return self._update(namespace, doc_id, "PinDocument", pinned=pinned)

    def set_document_ttl(self, namespace: bytes, doc_id: str, ttl_s: float | None) -> Document:
        """Expire the document and its chunks ``ttl_s`` seconds from now (None: never)."""
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgument(f"SetDocumentTtl: ttl_s must be > 0 seconds (unset clears the TTL), got {ttl_s}")
        expires = math.inf if ttl_s is None else self._clock() + ttl_s
        return self._update(namespace, doc_id, "SetDocumentTtl", expires_at=expires)

    def document_count(self) -> int:
        with self._lock:
            return len(self._docs)

    # -- search ------------------------------------------------------------------------------

    def search(self, namespace: bytes, query: np.ndarray, kinds: tuple[Kind, ...], k: int) -> list[Hit]:
        """The ``k`` live entries most similar to ``query`` in ``namespace``, best first; stale
        candidates are dropped and the search repeated until ``k`` live ones or none are left."""
        check_namespace(namespace, "Search")
        with self._lock:
            while True:
                hits = self.index.search(namespace, query, kinds, k)
                live = self._verify(hits)
                if len(live) == len(hits):
                    return live

    def prune(self) -> int:
        """Drop every stale entry now (the sweep); returns how many."""
        with self._lock:
            before = self.stale_dropped
            self._verify([Hit(e, 0.0) for e in self.index.entries()])
            return self.stale_dropped - before

    # -- internals; callers hold self._lock ----------------------------------------------------

    def _verify(self, hits: list[Hit]) -> list[Hit]:
        chunks = [h.entry.id for h in hits if h.entry.kind is Kind.CHUNK]
        where = dict(zip(chunks, self.store.contains_many(chunks))) if chunks else {}
        stale = [h.entry.id for h in hits if h.entry.kind is Kind.CHUNK and where[h.entry.id] is None]
        if stale:
            log.info("dropping %d index entries of chunks no longer stored", len(stale))
            self.stale_dropped += len(stale)
            self.forget_chunks(stale)
        docs = [self._docs[(h.entry.namespace, h.entry.id.decode())] for h in hits if h.entry.kind is Kind.DOCUMENT]
        live_docs = {(d.namespace, d.id) for d in self._live_docs(docs)}
        return [h for h in hits if (h.entry.kind is Kind.CHUNK and where[h.entry.id] is not None)
                or (h.entry.kind is Kind.DOCUMENT and (h.entry.namespace, h.entry.id.decode()) in live_docs)]

    def _live_docs(self, docs: list[Document]) -> list[Document]:
        """``docs`` that are unexpired with every chunk stored; the others are dropped."""
        now = self._clock()
        keys = list({k for d in docs for k in d.chunk_keys})
        held = dict(zip(keys, self.store.contains_many(keys))) if keys else {}
        live, stale = [], []
        for d in docs:
            ok = (d.pinned or now < d.expires_at) and all(held[k] is not None for k in d.chunk_keys)
            (live if ok else stale).append(d)
        if stale:
            log.info("dropping %d documents that expired or lost chunks", len(stale))
            self.stale_dropped += len(stale)
            self.table.write(deletes=[d.record_key for d in stale])
            for d in stale:
                self._forget(d)
        return live

    def _update(self, namespace: bytes, doc_id: str, what: str, **changes) -> Document:
        check_namespace(namespace, what)
        with self._lock:
            doc = self._docs.get((namespace, doc_id))
            if doc is None or not self._live_docs([doc]):
                raise NotFound(f"{what}: no document {doc_id!r} in this namespace")
            doc = replace(doc, **changes)
            self.table.write({doc.record_key: _doc_value(doc)})
            self._docs[(namespace, doc_id)] = doc
            self._apply_lifetime(set(doc.chunk_keys))
            return doc

    def _remember(self, doc: Document) -> None:
        ident = (doc.namespace, doc.id)
        self._docs[ident] = doc
        for key in doc.chunk_keys:
            self._refs.setdefault(key, set()).add(ident)
        self.index.put(Entry(doc.namespace, Kind.DOCUMENT, doc.id.encode(), doc.vector, dict(doc.metadata)))

    def _forget(self, doc: Document) -> None:
        ident = (doc.namespace, doc.id)
        self._docs.pop(ident, None)
        for key in doc.chunk_keys:
            refs = self._refs.get(key)
            if refs is not None:
                refs.discard(ident)
                if not refs:
                    del self._refs[key]
        self.index.remove(doc.namespace, Kind.DOCUMENT, doc.id.encode())

    def _apply_lifetime(self, chunk_keys: set[bytes]) -> None:
        """Pin/TTL of each chunk from the documents referencing it (see NOTE)."""
        now = self._clock()
        for key in chunk_keys:
            docs = [self._docs[i] for i in self._refs.get(key, ())]
            if not docs:
                continue
            self.store.set_pinned(key, any(d.pinned for d in docs))
            last = max(d.expires_at for d in docs)
            self.store.set_ttl(key, None if last == math.inf else max(last - now, 1e-3))
