"""Scheduler and block manager with draft tokens: budget, blocks, backpressure, rollback (exact,
no model)."""
from kvmesh.services.engine.block_manager import BlockManager
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.services.engine.sequence import Sequence

BS = 4


def make_scheduler(*, num_blocks, budget=64, max_num_seqs=8):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=4096, block_size=BS)
    return Scheduler(config, BlockManager(num_blocks, BS))


def decoding(sched, **prompt_lens):
    """Running sequences that have computed everything but their first generated token."""
    seqs = [Sequence(rid, [(7 * i + ord(rid)) % 100 for i in range(n)], SamplingParams(max_tokens=8))
            for rid, n in prompt_lens.items()]
    for seq in seqs:
        sched.add(seq)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):
        sched.commit(sched.schedule())
    for seq in seqs:
        assert seq.num_computed_tokens == seq.num_prompt_tokens
        seq.append_token(200)
    return seqs


def plan(out):
    return [(s.seq.request_id, s.num_new_tokens, s.draft_token_ids) for s in out.scheduled]


def test_a_decode_with_drafts_computes_them_in_its_step():
    sched = make_scheduler(num_blocks=16)
    (seq,) = decoding(sched, a=6)
    out = sched.schedule({seq: [1, 2, 3]})
    assert plan(out) == [("a", 4, (1, 2, 3))]
    item = out.scheduled[0]
    assert item.start == 6 and item.needs_sampling
    assert len(seq.block_table) == 3                     # positions 0..9
    assert out.num_batched_tokens == 4
    sched.commit(out)
    assert seq.num_computed_tokens == 7                  # the drafts are not known tokens yet


def test_every_decode_gets_its_token_before_any_draft():
    sched = make_scheduler(num_blocks=64, budget=8, max_num_seqs=4)
    seqs = decoding(sched, a=5, b=5, c=5, d=5)
    out = sched.schedule({s: [1, 2, 3, 4] for s in seqs})
    # 8 tokens: 4 decodes, then 4 drafts, first come first served
    assert plan(out) == [("a", 5, (1, 2, 3, 4)), ("b", 1, ()), ("c", 1, ()), ("d", 1, ())]
    assert out.num_batched_tokens == 8


def test_drafts_come_before_prefill_chunks_and_unused_budget_goes_to_admission():
    sched = make_scheduler(num_blocks=64, budget=10)
    (a,) = decoding(sched, a=5)
    sched.add(Sequence("b", list(range(30)), SamplingParams(max_tokens=4)))
    out = sched.schedule({a: [1, 2, 3]})
    assert plan(out) == [("a", 4, (1, 2, 3)), ("b", 6, ())]


def test_short_blocks_mean_fewer_drafts_never_a_preemption():
    sched = make_scheduler(num_blocks=4)
    a, b = decoding(sched, a=7, b=3)                     # a: 2 blocks (position 7 in block 1), b: 1
    assert sched.block_manager.num_free_blocks == 1
    out = sched.schedule({a: [1, 2, 3, 4, 5, 6], b: [1, 2, 3, 4, 5, 6]})
    # a: positions 7..11 need block 2 (one free) -> 4 drafts fit; b: nothing left past block 0
    assert plan(out) == [("a", 5, (1, 2, 3, 4)), ("b", 1, ())]
    assert out.preempted == [] and sched.num_preemptions == 0
    assert sched.block_manager.num_free_blocks == 0


def test_accepting_drafts_keeps_their_kv_and_frees_blocks_of_rejected_ones():
    sched = make_scheduler(num_blocks=16)
    bm = sched.block_manager
    (seq,) = decoding(sched, a=6)                        # known 7, computed 6
    out = sched.schedule({seq: [1, 2, 3, 4, 5, 6]})      # positions 6..12: blocks 0..3
    assert len(seq.block_table) == 4
    sched.commit(out)
    assert bm.block_hash(seq.block_table[1]) is None      # positions 4..7: only 6 computed
    # the verifier accepted 2 drafts then emitted a correction: 3 new known tokens
    for t in (1, 2, 99):
        seq.append_token(t)
    free_before = bm.num_free_blocks
    sched.accept_drafts(seq, 2)
    assert seq.num_computed_tokens == 9 and seq.num_tokens == 10
    assert len(seq.block_table) == 3                     # block 3 held only rejected drafts
    assert bm.num_free_blocks == free_before + 1
    # blocks 0 and 1 are full of committed tokens and cached; block 2 (positions 8..11) is not
    assert [bm.block_hash(b) is not None for b in seq.block_table] == [True, True, False]
    assert bm._blocks[seq.block_table[1]].key.token_ids == tuple(seq.token_ids(4, 8))


def test_nothing_past_the_known_tokens_is_ever_registered():
    """A run of rejected drafts that filled a whole block leaves no cache entry behind."""
    sched = make_scheduler(num_blocks=16)
    bm = sched.block_manager
    (seq,) = decoding(sched, a=4)                        # known 5: position 4 starts block 1
    cached_before = bm.num_cached_blocks
    out = sched.schedule({seq: [9, 9, 9, 9, 9, 9, 9]})   # positions 4..11: blocks 1, 2
    sched.commit(out)
    seq.append_token(42)                                 # all rejected: the correction only
    sched.accept_drafts(seq, 0)
    assert seq.num_computed_tokens == 5 and len(seq.block_table) == 2
    assert bm.num_cached_blocks == cached_before
    sched.finish(seq, "stop")
    assert bm.num_free_blocks == bm.num_blocks


def test_preempted_and_finished_sequences_with_drafts_return_every_block():
    sched = make_scheduler(num_blocks=6)
    a, b = decoding(sched, a=7, b=7)
    out = sched.schedule({a: [1, 2, 3, 4], b: [1, 2, 3, 4]})
    sched.commit(out)
    sched.finish(a, "abort")                             # aborted with drafts in flight
    sched.accept_drafts(a, 3)                            # a late verdict for it changes nothing
    b.append_token(5)
    sched.accept_drafts(b, 0)
    sched._preempt(b)
    assert sched.block_manager.num_free_blocks == 6
