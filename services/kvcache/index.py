"""The semantic index's vectors: exact (brute-force) cosine top-k per namespace and kind, in memory.

Pure data structure, no I/O: the catalog (catalog.py) persists entries and rebuilds this on start.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class Kind(enum.Enum):
    """What an index entry points at."""

    CHUNK = "chunk"
    """A stored KV chunk; the entry id is its 32-byte key."""
    DOCUMENT = "document"
    """A catalogued document; the entry id is its document id (UTF-8)."""


@dataclass(frozen=True)
class Entry:
    """One indexed item: where it lives (namespace, kind, id), its unit vector and metadata."""

    namespace: bytes
    kind: Kind
    id: bytes
    vector: np.ndarray  # [dim] float32, L2 norm 1
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Hit:
    """A search result: the entry and its cosine similarity to the query."""

    entry: Entry
    score: float


class _Matrix:
    """Rows of unit vectors with ids; removal swaps the last row in (O(1)), capacity doubles."""

    def __init__(self, dim: int) -> None:
        self.vecs = np.zeros((16, dim), dtype=np.float32)  # [capacity, dim]
        self.ids: list[bytes] = []
        self.rows: dict[bytes, int] = {}

    def put(self, id_: bytes, vec: np.ndarray) -> None:
        row = self.rows.get(id_)
        if row is None:
            row = len(self.ids)
            if row == len(self.vecs):
                self.vecs = np.concatenate([self.vecs, np.zeros_like(self.vecs)])
            self.ids.append(id_)
            self.rows[id_] = row
        self.vecs[row] = vec

    def remove(self, id_: bytes) -> bool:
        row = self.rows.pop(id_, None)
        if row is None:
            return False
        last = len(self.ids) - 1
        if row != last:
            moved = self.ids[last]
            self.vecs[row] = self.vecs[last]
            self.ids[row] = moved
            self.rows[moved] = row
        self.ids.pop()
        return True

    def top(self, query: np.ndarray, k: int) -> list[tuple[bytes, float]]:
        n = len(self.ids)
        if n == 0 or k <= 0:
            return []
        scores = self.vecs[:n] @ query  # [n]
        if k < n:
            best = np.argpartition(-scores, k - 1)[:k]
        else:
            best = np.arange(n)
        best = best[np.lexsort((best, -scores[best]))]  # score desc, then insertion row: deterministic
        return [(self.ids[i], float(scores[i])) for i in best]


class VectorIndex:
    """Entries grouped by (namespace, kind); a search only ever reads its namespace's matrices.

    NOTE: state. ``_entries`` maps (namespace, kind, id) to the Entry (a put with the same
    triple replaces it); ``_mats`` holds the vectors of each (namespace, kind)
    with row <-> id maps. Both change together in ``put``/``remove`` and nowhere else. Not
    thread-safe: the catalog serializes calls.
    """

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self._entries: dict[tuple[bytes, Kind, bytes], Entry] = {}
        self._mats: dict[tuple[bytes, Kind], _Matrix] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def count(self, kind: Kind) -> int:
        """Entries of ``kind`` in all namespaces."""
        return sum(len(m.ids) for (_, k), m in self._mats.items() if k is kind)

    def get(self, namespace: bytes, kind: Kind, id_: bytes) -> Entry | None:
        return self._entries.get((namespace, kind, id_))

    def entries(self) -> list[Entry]:
        """Every entry (for consistency sweeps and tests)."""
        return list(self._entries.values())

    def put(self, entry: Entry) -> None:
        """Add or replace ``entry`` (its vector must be a unit ``[dim]`` float32 vector)."""
        if entry.vector.shape != (self.dim,):
            raise ValueError(f"vector of shape {entry.vector.shape}, the index holds [{self.dim}]")
        self.remove(entry.namespace, entry.kind, entry.id)
        self._entries[(entry.namespace, entry.kind, entry.id)] = entry
        self._mats.setdefault((entry.namespace, entry.kind), _Matrix(self.dim)).put(entry.id, entry.vector)

    def remove(self, namespace: bytes, kind: Kind, id_: bytes) -> bool:
        """Drop the entry; False if there was none."""
        if self._entries.pop((namespace, kind, id_), None) is None:
            return False
        mat = self._mats[(namespace, kind)]
        mat.remove(id_)
        if not mat.ids:
            del self._mats[(namespace, kind)]
        return True

    def search(self, namespace: bytes, query: np.ndarray, kinds: tuple[Kind, ...], k: int) -> list[Hit]:
        """The ``k`` entries of ``namespace`` and ``kinds`` most similar to the unit ``query``,
        best first (ties: chunks before documents, then in insertion order)."""
        hits: list[Hit] = []
        for kind in kinds:
            mat = self._mats.get((namespace, kind))
            if mat is not None:
                hits += [Hit(self._entries[(namespace, kind, i)], s) for i, s in mat.top(query, k)]
        hits.sort(key=lambda h: -h.score)  # stable: keeps the per-kind order on ties
        return hits[:k]
