"""Chunk keys for KV reuse: stable, namespaced, chained for prefixes, position-free for content.

A chunk is ``chunk_tokens`` consecutive tokens of one sequence (all layers of their KV). Keys:

* prefix key of chunk i = H("prefix", key of chunk i-1 ‖ namespace ‖ token ids of chunk i): equal
  only when the whole prefix up to and including the chunk is equal, so a hit on key i means the
  cached KV was computed with exactly the same preceding context;
* content key = H("content", namespace ‖ token ids): the same text anywhere (blending, later).

H is blake2b (32 bytes) with a personalization per key kind, over little-endian u32 token ids: the
same on every process and machine (never Python's ``hash()``, which is salted per process).

The namespace (16 bytes) folds in the model identity (a digest of the weights, not a name), the
KV layout (layers, KV heads, head dim, dtype, how keys are rotated) and a tenant salt, so a changed
model never reads stale KV and tenants never share entries unless configured to.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

KEY_BYTES = 32
NAMESPACE_BYTES = 16
DEFAULT_CHUNK_TOKENS = 256


@dataclass(frozen=True)
class KvLayout:
    """What a KV tensor of one model looks like; part of every namespace."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the engine's KV dtype, e.g. "float32", "bfloat16"
    rope: str = "pre-rope-hf"  # how stored keys relate to RoPE (kvmesh.kv.rope: un-rotated, HF convention)

    def describe(self) -> str:
        return f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{self.dtype}-{self.rope}"


def make_namespace(model_identity: str, layout: KvLayout | str, tenant_salt: str = "") -> bytes:
    """16-byte namespace from the model identity (weights digest), KV layout (or its
    ``describe()`` string, as an engine's GetModelInfo reports it) and tenant salt."""
    h = hashlib.blake2b(digest_size=NAMESPACE_BYTES, person=b"kvmesh-ns")
    described = layout if isinstance(layout, str) else layout.describe()
    for part in (model_identity, described, tenant_salt):
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))  # length-prefixed: no ambiguity between parts
        h.update(data)
    return h.digest()


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
