"""The model drafter's paged KV pool: which blocks each sequence's draft KV lives in (no tensors).

NOTE (blocks). The pool owns `num_blocks` blocks of `block_size` token slots (the tensors live in
the model drafter; this is only the bookkeeping, as in the engine's block manager). A sequence's
KvSlot lists its blocks in position order and the tokens whose KV they hold: the committed
tokens the drafter has computed, then its own drafts fed back during the last Propose.
  * truncate(slot, n) is the rollback: KV past position n is stale (drafts the engine rejected,
    or history a resync rewrote) and whole blocks past it go back to the pool.
  * reserve(slot, n) makes room for n positions. When the pool is short it takes every block of
    the least recently used other slot (one that `protected` does not name: those are in the
    batch being drafted) until enough are free; an evicted slot just recomputes its KV the next
    time it drafts. It returns False, evicting nothing, when even that would not be enough.
  * drop(slot) returns everything (Release, TTL, LRU cap of the state store).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container
from dataclasses import dataclass, field


@dataclass(eq=False)
class KvSlot:
    """The draft KV one sequence holds (see the module NOTE)."""

    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # KV of tokens[i] at position i
    epoch: int = 0  # the sequence's history epoch `tokens` was computed for
    checked: int = 0  # leading tokens known equal to that history

    def slot_of(self, position: int, block_size: int) -> int:
        """Flat cache slot of `position`."""
        return self.blocks[position // block_size] * block_size + position % block_size


class DraftKvPool:
    """Free list of KV blocks, plus the recency of the slots holding them."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._holders: OrderedDict[KvSlot, None] = OrderedDict()  # least recently used first
        self.evictions = 0

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def touch(self, slot: KvSlot) -> None:
        """Marks `slot` as just used (last to be evicted)."""
        self._holders[slot] = None
        self._holders.move_to_end(slot)

    def truncate(self, slot: KvSlot, n_tokens: int) -> None:
        """Forgets KV past position n_tokens and frees the blocks no longer needed."""
        del slot.tokens[n_tokens:]
        slot.checked = min(slot.checked, n_tokens)
        keep = self.blocks_for(n_tokens)
        self._free.extend(reversed(slot.blocks[keep:]))
        del slot.blocks[keep:]

    def reserve(self, slot: KvSlot, n_tokens: int, protected: Container[KvSlot] = ()) -> bool:
        """Gives `slot` blocks for positions 0..n_tokens-1, evicting idle slots if needed (none when it
        cannot succeed)."""
        need = self.blocks_for(n_tokens) - len(slot.blocks)
        if need <= 0:
            return True
        victims = [s for s in self._holders if s is not slot and s not in protected and s.blocks]
        if len(self._free) + sum(len(s.blocks) for s in victims) < need:
            return False
        for victim in victims:
            if len(self._free) >= need:
                break
            self.truncate(victim, 0)
            self.evictions += 1
        slot.blocks.extend(self._free.pop() for _ in range(need))
        self.touch(slot)
        return True

    def drop(self, slot: KvSlot) -> None:
        """Returns all of `slot`'s blocks and forgets it."""
        self.truncate(slot, 0)
        self._holders.pop(slot, None)
