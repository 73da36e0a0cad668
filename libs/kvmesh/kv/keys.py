"""Chunk keys for KV reuse: stable, namespaced, chained for prefixes, position-free for content.

A chunk is ``chunk_tokens`` consecutive tokens of one sequence (all layers of their KV). Keys:

* prefix key of chunk i = H("prefix", key of chunk i-1 ‖ namespace ‖ token ids of chunk i): equal
  only when the whole prefix up to and including the chunk is equal, so a hit on key i means the
  cached KV was computed with exactly the same preceding context;
* content key = H("content", namespace ‖ token ids): the same text anywhere (blending, later);
* tail key of a prompt = H("tail", key of its last full chunk (zeros if none) ‖ namespace ‖ token
  ids after it): its trailing partial chunk, stored only for a P/D handoff (the decode engine
  then computes none of the prompt but its last block). Its own personalization: a tail key never
  equals a chunk key.

H is blake2b (32 bytes) with a personalization per key kind, over little-endian u32 token ids: the
same on every process and machine (never Python's ``hash()``, which is salted per process).

The namespace is the 16-byte digest of a kvmesh.kv.namespace.KvNamespace (model identity, KV
layout, storage format, tenant salt), so a changed model never reads stale KV, exact and lossy KV
never mix, and tenants never share entries unless configured to.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from kvmesh.kv.namespace import NAMESPACE_BYTES

KEY_BYTES = 32
DEFAULT_CHUNK_TOKENS = 256


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
        raise ValueError("token ids must be in 0..2**32-1")
    return arr.astype("<u4").tobytes()


def prefix_keys(token_ids: Sequence[int], chunk_tokens: int, namespace: bytes) -> list[bytes]:
    """Chained keys of every full chunk of ``token_ids`` (a trailing partial chunk has none)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    keys: list[bytes] = []
    parent = b"\0" * KEY_BYTES
    for start in range(0, len(token_ids) - chunk_tokens + 1, chunk_tokens):
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvmesh-prefix")
        h.update(parent)
        h.update(namespace)
        h.update(_token_bytes(token_ids[start:start + chunk_tokens]))
        parent = h.digest()
        keys.append(parent)
    return keys


def tail_key(token_ids: Sequence[int], chunk_tokens: int, namespace: bytes,
             keys: Sequence[bytes] | None = None) -> bytes | None:
    """The key of ``token_ids``' trailing partial chunk, chained to its full chunks' keys
    (``keys``: prefix_keys of the same tokens, computed here when not given); None when the tokens
    end on a chunk boundary."""
    keys = prefix_keys(token_ids, chunk_tokens, namespace) if keys is None else keys
    start = len(keys) * chunk_tokens
    if start >= len(token_ids):
        return None
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvmesh-tail")
    h.update(keys[-1] if keys else b"\0" * KEY_BYTES)
    h.update(namespace)
    h.update(_token_bytes(token_ids[start:]))
    return h.digest()


def content_key(chunk_token_ids: Sequence[int], namespace: bytes) -> bytes:
    """Position-free key of one chunk's tokens (finds the same text cached at another position)."""
    if len(namespace) != NAMESPACE_BYTES:
        raise ValueError(f"namespace must be {NAMESPACE_BYTES} bytes, got {len(namespace)}")
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvmesh-content")
    h.update(namespace)
    h.update(_token_bytes(chunk_token_ids))
    return h.digest()


def document_chunks(doc_token_ids: Sequence[int], chunk_tokens: int, namespace: bytes) -> list[tuple[int, int, bytes]]:
    """Chunks of one document, aligned to its own start (not to the prompt's offsets):
    ``(start, end, content key)`` per chunk, offsets within the document; the last chunk may be
    shorter. The same document gives the same keys wherever a prompt places it."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    n = len(doc_token_ids)
    return [(s, min(n, s + chunk_tokens), content_key(doc_token_ids[s:s + chunk_tokens], namespace))
            for s in range(0, n, chunk_tokens)]
