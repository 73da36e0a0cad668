"""The engine's hot LRU of decoded document chunks.

NOTE (why). Prefix chunks come back to the engine once per prompt and then live in its paged
prefix cache; document chunks are blended at a new position in every prompt that cites them, so
without a local copy each such prompt fetches and decodes the same chunks from the KV service
again (~200 ms for ~2,000 tokens of fp16 KV here, most of a blended prompt's overhead). The
connector keeps the decoded chunks it fetched -- position-free keys and values in the engine
dtype, keyed by content key (which names the namespace) together with their token ids -- in an
LRU bounded by a byte budget, and serves them without a Get. It is a cache of what the service
holds, never the source of truth: nothing is exported from it, a chunk the service has deleted
may still be served until evicted (its content key fixes its tokens and model, so it is still
correct KV), and the tensors are shared read-only (blending copies them into its own buffers).
Used from the event-loop thread only.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import torch


class HotChunks:
    """Decoded chunks by content key, least recently used evicted first past `budget_bytes`."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._chunks: OrderedDict[bytes, tuple[tuple[int, ...], torch.Tensor, torch.Tensor, int]] = OrderedDict()
        self._bytes = 0

    def get(self, key: bytes, token_ids: list[int]) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """The chunk's (k, v) when held for exactly these token ids (shared: read, never write)."""
        hit = self._chunks.get(key)
        if hit is None or hit[0] != tuple(token_ids):
            return None
        self._chunks.move_to_end(key)
        return hit[1], hit[2]

    def put(self, key: bytes, token_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        size = k.numel() * k.element_size() + v.numel() * v.element_size()
        if size > self.budget_bytes:
            return
        old = self._chunks.pop(key, None)
        if old is not None:
            self._bytes -= old[3]
        while self._chunks and self._bytes + size > self.budget_bytes:
            self._bytes -= self._chunks.popitem(last=False)[1][3]
        self._chunks[key] = (tuple(token_ids), k, v, size)
        self._bytes += size
