"""VectorIndex (exact top-k per namespace) and Catalog (persistence, consistency with the store,
documents) on hand-made vectors; no embedder."""
from __future__ import annotations

import math

import numpy as np
import pytest

from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from kvmesh.services.kvcache.catalog import Catalog, Document
from kvmesh.services.kvcache.index import Entry, Kind, VectorIndex
from kvmesh.services.kvcache.store import LmdbTier, MemoryTable, MemoryTier, TieredStore

from fake_clock import FakeClock

from .factories import blob, key

DIM = 8
NS_A, NS_B = b"A" * 16, b"B" * 16
BOTH = (Kind.CHUNK, Kind.DOCUMENT)


def unit(*xs: float) -> np.ndarray:
    v = np.zeros(DIM, dtype=np.float32)
    v[:len(xs)] = xs
    return v / np.linalg.norm(v)


def test_exact_top_k_order_and_namespace_filter():
    idx = VectorIndex(DIM)
    vecs = {i: unit(1, i * 0.1) for i in range(10)}  # similarity to e0 falls with i
    for i, v in vecs.items():
        idx.put(Entry(NS_A, Kind.CHUNK, key(i), v, {"i": str(i)}))
    idx.put(Entry(NS_B, Kind.CHUNK, key(99), unit(1), {}))  # the best match, but another tenant
    hits = idx.search(NS_A, unit(1), BOTH, 3)
    assert [h.entry.id for h in hits] == [key(0), key(1), key(2)]
    assert hits[0].score == pytest.approx(1.0) and hits[1].score == pytest.approx(float(vecs[1][0]))
    assert [h.entry.id for h in idx.search(NS_B, unit(1), BOTH, 5)] == [key(99)]
    assert idx.search(b"C" * 16, unit(1), BOTH, 5) == []
    assert len(idx.search(NS_A, unit(1), BOTH, 50)) == 10


def test_remove_and_replace_keep_rows_consistent():
    idx = VectorIndex(DIM)
    for i in range(40):  # past the initial capacity
        idx.put(Entry(NS_A, Kind.CHUNK, key(i), unit(1, i), {}))
    for i in range(0, 40, 2):
        assert idx.remove(NS_A, Kind.CHUNK, key(i))
    assert not idx.remove(NS_A, Kind.CHUNK, key(0))
    idx.put(Entry(NS_A, Kind.CHUNK, key(1), unit(0, 0, 1), {}))  # replace
    assert idx.count(Kind.CHUNK) == 20
    assert idx.search(NS_A, unit(0, 0, 1), BOTH, 1)[0].entry.id == key(1)
    for h in idx.search(NS_A, unit(1, 3), BOTH, 20):
        assert h.score == pytest.approx(float(idx.get(NS_A, Kind.CHUNK, h.entry.id).vector @ unit(1, 3)))


def test_kinds_filter_and_document_ids_are_per_namespace():
    idx = VectorIndex(DIM)
    idx.put(Entry(NS_A, Kind.CHUNK, key(1), unit(1), {}))
    idx.put(Entry(NS_A, Kind.DOCUMENT, b"doc", unit(1, 0.1), {}))
    idx.put(Entry(NS_B, Kind.DOCUMENT, b"doc", unit(0, 1), {}))
    assert [h.entry.kind for h in idx.search(NS_A, unit(1), (Kind.DOCUMENT,), 5)] == [Kind.DOCUMENT]
    assert [h.entry.id for h in idx.search(NS_A, unit(1), BOTH, 5)] == [key(1), b"doc"]
    assert idx.search(NS_B, unit(0, 1), BOTH, 5)[0].score == pytest.approx(1.0)


# -- Catalog -------------------------------------------------------------------------------------

def memory_catalog(clock=None):
    store = TieredStore([MemoryTier(1 << 20)])
    return store, Catalog(store, MemoryTable(), DIM, clock=clock or FakeClock())


def doc(ns: bytes, doc_id: str, keys: list[bytes], vec=None, **kw) -> Document:
    return Document(ns, doc_id, tuple(keys), unit(1) if vec is None else vec, **kw)


def test_deleted_or_evicted_chunks_never_come_back_from_search():
    store, cat = memory_catalog()
    for i in range(3):
        store.put(key(i), blob(i, 100))
        cat.index_chunk(key(i), NS_A, unit(1, i), {"n": str(i)})
    store.delete(key(0))  # gone under the catalog (as an eviction would)
    hits = cat.search(NS_A, unit(1), BOTH, 2)
    assert [h.entry.id for h in hits] == [key(1), key(2)]  # refilled to k after dropping the stale one
    assert cat.stale_dropped == 1 and cat.index.count(Kind.CHUNK) == 2
    cat.forget_chunks([key(1)])
    assert [h.entry.id for h in cat.search(NS_A, unit(1), BOTH, 5)] == [key(2)]


def test_document_needs_all_chunks_then_owns_their_lifetime():
    clock = FakeClock()
    store, cat = memory_catalog(clock)
    store.put(key(1), blob(1, 100))
    with pytest.raises(FailedPrecondition, match="1 of 2 chunks are not stored"):
        cat.put_document(doc(NS_A, "d1", [key(1), key(2)]))
    with pytest.raises(NotFound):
        cat.get_document(NS_A, "d1")
    store.put(key(2), blob(2, 100))
    cat.put_document(doc(NS_A, "d1", [key(1), key(2)], metadata={"title": "one"}))
    cat.put_document(doc(NS_A, "d2", [key(2)]))
    assert cat.get_document(NS_A, "d1").metadata == {"title": "one"}
    with pytest.raises(NotFound):
        cat.get_document(NS_B, "d1")  # another tenant's namespace
    cat.set_document_ttl(NS_A, "d1", 10.0)
    assert cat.delete_document(NS_A, "d1") == 1  # key(1) only: d2 still references key(2)
    assert store.contains_many([key(1), key(2)]) == [None, "memory"]
    with pytest.raises(InvalidArgument, match="chunk_keys is empty"):
        cat.put_document(doc(NS_A, "d3", []))


def test_document_ttl_and_pin_apply_to_chunks_and_expire_it():
    clock = FakeClock()
    store = TieredStore([MemoryTier(1 << 20, clock=clock)])
    cat = Catalog(store, MemoryTable(), DIM, clock=clock)
    store.put(key(1), blob(1, 100))
    cat.put_document(doc(NS_A, "d", [key(1)]))
    cat.set_document_ttl(NS_A, "d", 5.0)
    cat.set_document_pinned(NS_A, "d", True)
    clock.advance(10)
    assert cat.get_document(NS_A, "d").pinned  # pinned: neither it nor its chunk expires
    cat.set_document_pinned(NS_A, "d", False)
    assert [h.entry.id for h in cat.search(NS_A, unit(1), BOTH, 5)] == []
    with pytest.raises(NotFound):
        cat.get_document(NS_A, "d")
    assert cat.document_count() == 0


def test_list_documents_pages_in_id_order():
    store, cat = memory_catalog()
    store.put(key(1), blob(1, 100))
    for i in range(5):
        cat.put_document(doc(NS_A, f"doc{i}", [key(1)]))
    cat.put_document(doc(NS_B, "other", [key(1)]))
    page, token = cat.list_documents(NS_A, 2, "")
    seen = [d.id for d in page]
    while token:
        page, token = cat.list_documents(NS_A, 2, token)
        seen += [d.id for d in page]
    assert seen == [f"doc{i}" for i in range(5)]


def test_lmdb_reopen_rebuilds_the_identical_index(tmp_path):
    def open_catalog():
        disk = LmdbTier(tmp_path, map_size_bytes=16 << 20, max_entry_bytes=1 << 20)
        store = TieredStore([MemoryTier(1 << 20), disk])
        cat = Catalog(store, disk.table("catalog"), DIM)
        cat.load()
        return store, cat

    store, cat = open_catalog()
    for i in range(6):
        store.put(key(i), blob(i, 200))
        cat.index_chunk(key(i), NS_A if i % 2 else NS_B, unit(1, i, 0.5), {"i": str(i)})
    cat.put_document(doc(NS_A, "d", [key(1), key(3)], unit(0, 1), metadata={"t": "x"}, text="hello",
                         token_ids=(5, 6), pinned=True))
    before = {(e.namespace, e.kind, e.id): (e.vector.tobytes(), e.metadata) for e in cat.index.entries()}
    searched = [(h.entry.id, h.score) for h in cat.search(NS_A, unit(1, 1), BOTH, 10)]
    store.delete(key(4))  # its blob goes while the service is down: dropped on load
    store.close()

    store, cat = open_catalog()
    after = {(e.namespace, e.kind, e.id): (e.vector.tobytes(), e.metadata) for e in cat.index.entries()}
    del before[(NS_B, Kind.CHUNK, key(4))]
    assert after == before
    assert [(h.entry.id, h.score) for h in cat.search(NS_A, unit(1, 1), BOTH, 10)] == searched
    d = cat.get_document(NS_A, "d")
    assert (d.text, d.token_ids, d.pinned, d.expires_at, d.chunk_keys) == ("hello", (5, 6), True, math.inf,
                                                                           (key(1), key(3)))
    store.close()
