"""Paged KV-cache block allocation with a ref-counted, hash-chained prefix cache."""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass

from kvmesh.services.engine.sequence import Sequence

HASH_BYTES = 16
ROOT_HASH = bytes(HASH_BYTES)
"""Parent hash of a sequence's first block. Fixed width keeps the hash input unambiguous."""


@dataclass(frozen=True)
class BlockKey:
    """Everything a full block's KV depends on. Stored on the block to verify hash hits exactly."""

    parent_hash: bytes
    token_ids: tuple[int, ...]
    namespace: bytes
    """The sequence's KvNamespace digest (kvmesh.kv.namespace): other models, layouts, storage
    formats and tenants never match."""


def hash_block(key: BlockKey) -> bytes:
    """blake2b(parent hash ‖ token ids as little-endian uint32 ‖ namespace); stable across runs."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(key.parent_hash)
    h.update(struct.pack(f"<{len(key.token_ids)}I", *key.token_ids))
    h.update(key.namespace)
    return h.digest()


class _Block:
    __slots__ = ("block_id", "ref_count", "block_hash", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: bytes | None = None
        self.key: BlockKey | None = None


# NOTE: allocation, sharing and eviction.
#
# Each physical block is in exactly one of two states:
#   in use  ref_count > 0, owned by the block tables of ref_count sequences;
#   free    ref_count == 0, in the free queue `_free`.
# A block becomes *cached* once it is full of computed tokens: `cache_full_blocks` stores its
# BlockKey (parent hash, its token ids, namespace) and registers hash -> block id in `_cached`.
# The hash chains through the parent, so one hash names a whole prefix. A cached block keeps its
# KV and its registration when freed: a later `match_prefix` finds it, verifies the stored key
# (a hash collision is a miss, never wrong KV) and `allocate_slots` takes it out of the free queue
# again with ref_count 1 — or shares it (ref_count + 1) if it is still in use.
#
# The free queue is the eviction order. New blocks are popped from its front; a popped block
# that was cached loses its registration right then (eviction is lazy: cached KV survives until
# its slot is actually needed). `free` walks a block table from the last block to the first, so a
# sequence's tail goes before its prefix, which other requests are likelier to share:
#   - cached blocks go to the back: least recently freed is evicted first (LRU);
#   - blocks holding no registered hash (partial, or a duplicate of another cached block) go to
#     the front: reusing them first loses nothing.
# Allocation is all-or-nothing: `allocate_slots` checks the count first and returns False,
# leaving every table and ref count unchanged, when the free queue cannot cover the request
# (reused cached blocks that sit in the free queue count against it).


class BlockManager:
    """Owns the paged KV cache's blocks: free list, ref counts and the prefix cache.

    Plain deterministic Python; the model runner only reads `Sequence.block_table`.
    Blocks are handed out in id order from a fresh manager, which makes tests exact.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}; give the KV cache more memory")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.num_queried_tokens = 0
        """Prefix-cache queries, in tokens: every admitted sequence's num_tokens."""
        self.num_hit_tokens = 0
        """Tokens of those admissions served from the prefix cache."""

    # --- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence (cached-but-free blocks included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by sequences, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or free."""
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    def block_hash(self, block_id: int) -> bytes | None:
        """The chained hash of a full computed block, or None."""
        return self._blocks[block_id].block_hash

    def free_block_ids(self) -> list[int]:
        """Free blocks in the order they will be reused (front first)."""
        return list(self._free)

    # --- the prefix cache ----------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest cached prefix of seq: (block ids, number of tokens they hold).

        Never covers the whole sequence: the last token must be computed to produce logits.
        Changes no state; pass the block ids to `allocate_slots` to take them.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        namespace = seq.namespace
        parent = ROOT_HASH
        block_ids: list[int] = []
        for i in range((seq.num_tokens - 1) // bs):
            key = BlockKey(parent, tuple(seq.token_ids(i * bs, (i + 1) * bs)), namespace)
            block_hash = hash_block(key)
            block_id = self._cached.get(block_hash)
            if block_id is None or self._blocks[block_id].key != key:
                break
            block_ids.append(block_id)
            parent = block_hash
        return block_ids, len(block_ids) * bs

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of seq's blocks that became full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        table = seq.block_table
        num_full = min(seq.num_computed_tokens // bs, len(table))
        # Hashed blocks form a prefix of the table: walk back to its end.
        start = num_full
        while start > 0 and self._blocks[table[start - 1]].block_hash is None:
            start -= 1
        parent = ROOT_HASH if start == 0 else self._blocks[table[start - 1]].block_hash
        namespace = seq.namespace
        for i in range(start, num_full):
            block = self._blocks[table[i]]
            key = BlockKey(parent, tuple(seq.token_ids(i * bs, (i + 1) * bs)), namespace)
            block.key = key
            block.block_hash = parent = hash_block(key)
            # First writer wins: an identical block computed concurrently stays a private copy.
            self._cached.setdefault(block.block_hash, block.block_id)

    # --- allocation ----------------------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> bool:
        """Extend seq.block_table to hold num_computed_tokens + cached + num_new_tokens tokens.

        computed_blocks (from `match_prefix`) is passed at admission, when the table is empty; the
        admission is counted as a prefix-cache query. Returns False and changes nothing when there
        are not enough free blocks (backpressure: the caller preempts or waits).
        """
        computed = computed_blocks or []
        bs = self.block_size
        num_tokens = seq.num_computed_tokens + len(computed) * bs + num_new_tokens
        num_needed = max(0, -(-num_tokens // bs) - len(seq.block_table) - len(computed))
        num_revived = sum(1 for b in computed if self._blocks[b].ref_count == 0)
        if num_needed > len(self._free) - num_revived:
            return False
        for block_id in computed:
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
        seq.block_table.extend(computed)
        seq.block_table.extend(self._pop_free() for _ in range(num_needed))
        if computed_blocks is not None:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += len(computed) * bs
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks (tail first, see the NOTE) and empty its block table."""
        self._release(seq.block_table)
        seq.block_table = []

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release seq's blocks past the ones holding its first `num_tokens` tokens (the KV of
        rejected draft tokens: never registered, so they go to the front of the free queue)."""
        keep = -(-num_tokens // self.block_size)
        self._release(seq.block_table[keep:])
        del seq.block_table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if not self._is_registered(block):
                    self._free.move_to_end(block_id, last=False)

    def _is_registered(self, block: _Block) -> bool:
        return block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id

    def _pop_free(self) -> int:
        block_id, _ = self._free.popitem(last=False)
        block = self._blocks[block_id]
        if self._is_registered(block):
            del self._cached[block.block_hash]
        block.block_hash = None
        block.key = None
        block.ref_count = 1
        return block_id
