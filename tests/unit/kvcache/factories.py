"""Deterministic keys and blobs for the store tests (also imported by the crash-test child)."""
from __future__ import annotations

import hashlib


def key(i: int) -> bytes:
    """The i-th test key: a 32-byte digest, like the service's chunk keys."""
    return hashlib.blake2b(f"key-{i}".encode(), digest_size=32).digest()


def blob(i: int, size: int) -> bytes:
    """``size`` bytes derived from ``key(i)`` alone, so any stored blob can be recomputed and checked."""
    return hashlib.shake_256(key(i)).digest(size)
