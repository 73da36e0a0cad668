"""BlockManager: exact block ids, ref counts, prefix-cache hits and eviction order."""
import hashlib
import struct

import pytest

from kvmesh.services.engine import block_manager as bm_module
from kvmesh.services.engine.block_manager import ROOT_HASH, BlockKey, BlockManager, hash_block
from kvmesh.services.engine.sequence import Sequence

BS = 4


def make_seq(tokens, request_id="r", namespace=b""):
    return Sequence(request_id=request_id, prompt_token_ids=list(tokens), namespace=namespace)


def compute_all(bm, seq):
    """What the scheduler does for a whole prompt in one step: allocate, compute, cache."""
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_fresh_allocation_hands_out_blocks_in_id_order():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert [bm.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5
    assert bm.usage == pytest.approx(3 / 8)
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]


def test_allocation_extends_only_across_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(6))
    assert bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    assert a.block_table == [0, 1]
    assert bm.allocate_slots(a, 2)  # tokens 6, 7 fit in block 1
    assert a.block_table == [0, 1]
    a.num_computed_tokens = 8
    assert bm.allocate_slots(a, 1)  # token 8 opens block 2
    assert a.block_table == [0, 1, 2]


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    a = make_seq(range(13))  # needs 4 blocks
    assert not bm.allocate_slots(a, 13)
    assert a.block_table == []
    assert bm.num_free_blocks == 3
    assert bm.allocate_slots(a, 12)  # a chunk that fits
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 12
    assert not bm.allocate_slots(a, 1)
    assert a.block_table == [0, 1, 2]


def test_free_returns_tail_first_with_partial_blocks_in_front():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq(range(10))  # blocks 0, 1 full and cached, block 2 partial
    compute_all(bm, a)
    assert bm.free_block_ids() == [3, 4, 5]
    bm.free(a)
    assert a.block_table == []
    # Partial block 2 holds nothing reusable: reused first. Cached blocks go to the back, tail
    # (1) before head (0), so the prefix outlives the rest.
    assert bm.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert bm.num_free_blocks == 6
    assert bm.usage == 0.0


def test_prefix_hit_reuses_exact_block_ids_and_shares_them():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10), "a")
    compute_all(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97], "b")
    blocks, num_tokens = bm.match_prefix(b)
    assert (blocks, num_tokens) == ([0, 1], 8)
    assert bm.allocate_slots(b, 3, blocks)
    assert b.block_table == [0, 1, 3]
    assert [bm.ref_count(i) for i in range(4)] == [2, 2, 1, 1]
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (11, 8)
    bm.free(b)
    assert [bm.ref_count(i) for i in range(4)] == [1, 1, 1, 0]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]  # shared blocks stay with a
    bm.free(a)
    assert bm.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]


def test_match_never_covers_the_last_token():
    bm = BlockManager(num_blocks=8, block_size=BS)
    compute_all(bm, make_seq(range(12), "a"))
    assert bm.match_prefix(make_seq(range(8), "b")) == ([0], 4)
    assert bm.match_prefix(make_seq(range(9), "c")) == ([0, 1], 8)
    assert bm.match_prefix(make_seq(range(4), "d")) == ([], 0)


def test_freed_cached_blocks_are_revived_from_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(8), "a")
    compute_all(bm, a)
    bm.free(a)
    assert bm.free_block_ids() == [2, 3, 1, 0]
    b = make_seq(list(range(8)) + [50] * 8, "b")  # 16 tokens: 4 blocks, 2 of them cached
    blocks, num_tokens = bm.match_prefix(b)
    assert (blocks, num_tokens) == ([0, 1], 8)
    assert bm.allocate_slots(b, 8, blocks)
    assert b.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0


def test_revived_blocks_count_against_free_blocks():
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = make_seq(range(8), "a")
    compute_all(bm, a)
    bm.free(a)
    b = make_seq(list(range(8)) + [50] * 9, "b")  # 17 tokens: needs 5 blocks, only 4 exist
    blocks, _ = bm.match_prefix(b)
    assert not bm.allocate_slots(b, 9, blocks)
    assert b.block_table == []
    assert bm.free_block_ids() == [2, 3, 1, 0]
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (0, 0)  # failed admissions not counted


def test_eviction_is_lazy_and_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=BS)
    a = make_seq([1] * 8, "a")
    b = make_seq([2] * 8, "b")
    compute_all(bm, a)  # blocks 0, 1
    compute_all(bm, b)  # blocks 2, 3
    bm.free(a)
    bm.free(b)
    assert bm.free_block_ids() == [4, 5, 1, 0, 3, 2]
    assert bm.num_cached_blocks == 4
    c = make_seq([3] * 12, "c")
    assert bm.allocate_slots(c, 12)
    assert c.block_table == [4, 5, 1]  # never-used blocks first, then a's tail
    assert bm.num_cached_blocks == 3
    assert bm.block_hash(1) is None
    # a's first block survived; b is untouched.
    assert bm.match_prefix(make_seq([1] * 9, "a2")) == ([0], 4)
    assert bm.match_prefix(make_seq([2] * 9, "b2")) == ([2, 3], 8)


def test_hash_collision_is_a_miss_not_wrong_kv(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda key: b"\x00" * 16)
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(12), "a")
    compute_all(bm, a)
    # Every block hashes alike: the first registration wins, the others stay private.
    assert bm.num_cached_blocks == 1
    assert bm.match_prefix(make_seq([7, 7, 7, 7, 7], "x")) == ([], 0)
    assert bm.match_prefix(make_seq(range(12), "y")) == ([0], 4)  # block 1's key differs
    bm.free(a)
    assert bm.free_block_ids() == [1, 2, 3, 4, 5, 6, 7, 0]  # unregistered 2, then 1, to the front


def test_namespaces_separate_caches():
    """Sequences share blocks only within one KvNamespace digest (model, layout, storage, tenant)."""
    from kvmesh.kv.namespace import KvLayout, KvNamespace

    base = KvNamespace("model-A", KvLayout(2, 2, 8, "float32"))
    t1, t2 = base.for_tenant("tenant-1").digest(), base.for_tenant("tenant-2").digest()
    lossy = base.for_tenant("tenant-1").with_storage("int4").digest()
    other_model = KvNamespace("model-B", base.layout, tenant_salt="tenant-1").digest()
    bm = BlockManager(num_blocks=8, block_size=BS)
    compute_all(bm, make_seq(range(8), "a", namespace=t1))
    assert bm.match_prefix(make_seq(range(9), "b", namespace=t1)) == ([0, 1], 8)
    for i, ns in enumerate((t2, lossy, other_model, b"")):
        assert bm.match_prefix(make_seq(range(9), f"c{i}", namespace=ns)) == ([], 0)


def test_hash_is_stable_blake2b_over_little_endian_uint32():
    key = BlockKey(ROOT_HASH, (1, 2, 3, 0x01020304), b"ns")
    expected = hashlib.blake2b(
        bytes(16) + struct.pack("<4I", 1, 2, 3, 0x01020304) + b"ns", digest_size=16
    ).digest()
    assert hash_block(key) == expected
    assert struct.pack("<I", 0x01020304) == b"\x04\x03\x02\x01"
    # The chain: block 1's hash depends on block 0's.
    bm = BlockManager(num_blocks=4, block_size=BS)
    compute_all(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8], namespace=b"ns"))
    h0 = hash_block(BlockKey(ROOT_HASH, (1, 2, 3, 4), b"ns"))
    assert bm.block_hash(0) == h0
    assert bm.block_hash(1) == hash_block(BlockKey(h0, (5, 6, 7, 8), b"ns"))


def test_cache_full_blocks_only_hashes_computed_full_blocks_incrementally():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = make_seq(range(10))
    assert bm.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    bm.cache_full_blocks(a)
    assert [bm.block_hash(b) is not None for b in a.block_table] == [True, False]
    assert bm.allocate_slots(a, 4)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert [bm.block_hash(b) is not None for b in a.block_table] == [True, True, False]
    a.append_token(10)
    a.append_token(11)
    assert bm.allocate_slots(a, 2)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)  # generated tokens fill block 2: cached like prompt blocks
    assert bm.match_prefix(make_seq(range(13), "b")) == ([0, 1, 2], 12)


def test_identical_prompts_computed_together_keep_one_cached_copy():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a, b = make_seq(range(8), "a"), make_seq(range(8), "b")
    assert bm.allocate_slots(a, 8, []) and bm.allocate_slots(b, 8, [])
    a.num_computed_tokens = b.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert bm.num_cached_blocks == 2
    bm.free(b)  # b's duplicates are worth nothing: front of the queue
    assert bm.free_block_ids() == [2, 3, 4, 5, 6, 7]
    assert bm.match_prefix(make_seq(range(9), "c")) == ([0, 1], 8)


def test_prefix_caching_disabled():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    a = make_seq(range(8))
    compute_all(bm, a)
    assert bm.num_cached_blocks == 0
    assert bm.match_prefix(make_seq(range(9), "b")) == ([], 0)
    bm.free(a)
    assert bm.free_block_ids() == [0, 1, 2, 3]


def test_constructor_rejects_empty_cache():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=BS)
