"""Small keyed records beside the blobs (the semantic index and the document catalog).

A RecordTable is a durable map bytes -> bytes with atomic batches: ``write(puts, deletes)`` is all
or nothing. LmdbTier.table() gives one in a named sub-database of the tier's own environment
(durable, fsynced like a put); MemoryTable is the stand-in when no disk tier is configured
(records then live as long as the process, like the blobs of a memory-only store).
"""
from __future__ import annotations

import abc
import threading


class RecordTable(abc.ABC):
    """A map bytes -> bytes whose batches are atomic. Thread-safe; calls block."""

    durable: bool = False

    @abc.abstractmethod
    def items(self, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        """Every (key, value) whose key starts with ``prefix``, in key order."""

    @abc.abstractmethod
    def write(self, puts: dict[bytes, bytes] | None = None, deletes: list[bytes] | None = None) -> None:
        """Apply ``deletes`` then ``puts`` in one atomic step."""

    def get(self, key: bytes) -> bytes | None:
        """The value under ``key`` or None."""
        return dict(self.items(key)).get(key)


class MemoryTable(RecordTable):
    """RecordTable in a dict (not persisted)."""

    def __init__(self) -> None:
        self._rows: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def items(self, prefix: bytes = b"") -> list[tuple[bytes, bytes]]:
        with self._lock:
            return sorted((k, v) for k, v in self._rows.items() if k.startswith(prefix))

    def write(self, puts: dict[bytes, bytes] | None = None, deletes: list[bytes] | None = None) -> None:
        with self._lock:
            for key in deletes or ():
                self._rows.pop(key, None)
            self._rows.update(puts or {})

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            return self._rows.get(key)
