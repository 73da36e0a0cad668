"""What the KV service's two servicers (the blob store and the catalog) share: the tiered store,
the catalog over it, the embedder, and the threads their blocking calls run on.

Store calls block (LMDB commits with fsync), so they run on threads, never on the event loop:
writes and the catalog on one I/O thread (both servicers: their writes keep one order), the
blob store's reads (Lookup, Get) on a read thread of their own, so a lookup never waits behind a
queue of Puts and their fsyncs (the tiers lock per call, and the LMDB tier takes its index lock
only around a commit, not across it). A read sees every Put whose answer was sent before the read
arrived. Embedding runs on a thread of its own, so a slow embedding never holds up the store.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence, TypeVar

import numpy as np

from kvmesh.embed import DIM, Embedder, check_unit_vector
from kvmesh.errors import InvalidArgument
from kvmesh.limits import MAX_EMBED_TEXTS
from kvmesh.services.kvcache.catalog import Catalog
from kvmesh.services.kvcache.index import Kind
from kvmesh.services.kvcache.metrics import KvcacheMetrics
from kvmesh.services.kvcache.store import LmdbTier, MemoryTable, RecordTable, TieredStore

log = logging.getLogger(__name__)
T = TypeVar("T")


def catalog_table(store: TieredStore) -> RecordTable:
    """Where the catalog persists: a sub-database of the first disk tier, else memory."""
    disk = next((t for t in store.tiers if isinstance(t, LmdbTier)), None)
    return disk.table("catalog") if disk is not None else MemoryTable()


class Backend:
    """The store and catalog of one KV service process, with the threads that serve them."""

    def __init__(self, store: TieredStore, *, metrics: KvcacheMetrics, embedder=None,
                 records: RecordTable | None = None) -> None:
        self.store = store
        self.metrics = metrics
        self.corrupt_entries = 0
        """Stored blobs that failed verification when read (and were deleted)."""
        self.embedder = embedder if embedder is not None else Embedder()  # loads on first text
        self.catalog = Catalog(store, records if records is not None else catalog_table(store), DIM)
        self.catalog.load()
        self.update_gauges()
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-io")
        self._reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-read")
        self._embed_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcache-embed")

    def close(self) -> None:
        """Waits for queued store work, then closes the store."""
        self._embed_pool.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        self._io.shutdown(wait=True)
        self.store.close()

    def update_gauges(self) -> None:
        """Publishes the semantic index's size (after every change to it)."""
        self.metrics.index_entries.labels(kind="chunk").set(self.catalog.index.count(Kind.CHUNK))
        self.metrics.index_entries.labels(kind="document").set(self.catalog.index.count(Kind.DOCUMENT))

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the I/O thread."""
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def read(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)`, a blob-store read, on the read thread (see the module docstring)."""
        return await asyncio.get_running_loop().run_in_executor(self._reads, fn, *args)

    async def vector(self, text: str | None, values: Sequence[float], what: str) -> np.ndarray | None:
        """The embedding of ``text`` (computed on the embedder thread), else the client's
        ``values`` checked to be a unit vector, else None (neither given)."""
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

    async def embed_texts(self, texts: list[str]) -> tuple[np.ndarray, list[int]]:
        """``texts`` -> (``[n, dim]`` unit vectors, tokens per text), on the embedder thread;
        InvalidArgument naming the first empty or too long text (never silently truncated)."""
        if not texts or len(texts) > MAX_EMBED_TEXTS:
            raise InvalidArgument(f"Embed: send 1..{MAX_EMBED_TEXTS} texts, got {len(texts)}")
        empty = next((i for i, t in enumerate(texts) if not t), None)
        if empty is not None:
            raise InvalidArgument(f"Embed: text {empty} is empty; send at least one character")

        def run() -> tuple[np.ndarray, list[int]]:
            counts = self.embedder.token_counts(texts)
            limit = self.embedder.max_tokens
            over = next((i for i, n in enumerate(counts) if n > limit), None)
            if over is not None:
                raise InvalidArgument(
                    f"Embed: text {over} has {counts[over]} tokens, but the embedding model "
                    f"{self.embedder.name} reads at most {limit}; shorten it or split it")
            return self.embedder.embed(texts), counts

        return await asyncio.get_running_loop().run_in_executor(self._embed_pool, run)

    async def embedding_model(self) -> tuple[str, int, int]:
        """(name, dimensions, max_tokens) of the embedder (loaded on the embedder thread)."""
        await asyncio.get_running_loop().run_in_executor(self._embed_pool, self.embedder.token_counts, [])
        return self.embedder.name, self.embedder.dim, self.embedder.max_tokens

    async def sweep_forever(self, interval_s: float) -> None:
        """Removes expired entries every `interval_s` seconds (reads already treat them as misses;
        this returns their space) and the catalog entries they left stale. Runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)  # a schedule, not synchronization
            removed = await self.run(self.store.sweep_expired)
            if removed:
                log.info("removed %d expired entries", removed)
            if await self.run(self.catalog.prune):
                self.update_gauges()
