"""The model drafter's block bookkeeping: rollback frees whole blocks, reservations evict the least
recently used unprotected slots, and a reservation that cannot succeed evicts nothing."""
from __future__ import annotations

from kvmesh.services.draft.kv_pool import DraftKvPool, KvSlot


def slot_with(pool: DraftKvPool, n_tokens: int, protected=()) -> KvSlot:
    slot = KvSlot()
    assert pool.reserve(slot, n_tokens, protected)
    slot.tokens = list(range(n_tokens))
    return slot


def test_reserve_truncate_and_drop():
    pool = DraftKvPool(num_blocks=8, block_size=4)
    slot = slot_with(pool, 9)                      # 3 blocks
    assert slot.blocks == [0, 1, 2] and pool.free_blocks == 5
    assert slot.slot_of(9, 4) == 2 * 4 + 1
    assert pool.reserve(slot, 12) and slot.blocks == [0, 1, 2]  # still fits
    slot.checked = 9
    pool.truncate(slot, 5)                         # rollback to 5 tokens: 2 blocks
    assert slot.blocks == [0, 1] and slot.tokens == [0, 1, 2, 3, 4] and slot.checked == 5
    assert pool.free_blocks == 6
    pool.drop(slot)
    assert slot.blocks == [] and pool.free_blocks == 8


def test_eviction_takes_the_least_recently_used_unprotected_slots():
    pool = DraftKvPool(num_blocks=6, block_size=4)
    a, b, c = (slot_with(pool, 8) for _ in range(3))  # the pool is full
    pool.touch(a)                                       # b is now the least recently used
    d = KvSlot()
    assert pool.reserve(d, 4, protected={d})
    assert b.blocks == [] and b.tokens == [] and a.blocks and c.blocks
    assert pool.evictions == 1
    e = KvSlot()
    assert pool.reserve(e, 8, protected={c, e})         # c protected: a goes
    assert a.blocks == [] and c.blocks and pool.evictions == 2


def test_a_reservation_that_cannot_succeed_evicts_nothing():
    pool = DraftKvPool(num_blocks=4, block_size=4)
    a, b = slot_with(pool, 8), slot_with(pool, 8)
    big = KvSlot()
    assert not pool.reserve(big, 12, protected={a, big})  # b alone frees 2 of the 3 needed
    assert a.blocks and b.blocks and big.blocks == [] and pool.evictions == 0
