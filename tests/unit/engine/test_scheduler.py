"""Scheduler: chunked prefill under the token budget, FCFS admission, preemption by recompute."""
import pytest

from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.services.engine.block_manager import BlockManager
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.services.engine.sequence import FinishReason, Sequence, SequenceStatus


def make_scheduler(*, num_blocks, block_size=4, budget=64, max_num_seqs=8, max_waiting=16,
                   max_model_len=4096, prefix_caching=True, solo=0):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        solo_prefill_tokens=solo,
        max_model_len=max_model_len,
        block_size=block_size,
        max_waiting=max_waiting,
    )
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching))


def make_seq(request_id, prompt, max_tokens=8):
    if isinstance(prompt, int):
        prompt = [hash((request_id, i)) % 1000 for i in range(prompt)]
    return Sequence(request_id, list(prompt), SamplingParams(max_tokens=max_tokens))


def plan(output):
    return [(item.seq.request_id, item.num_new_tokens) for item in output.scheduled]


class FakeModel:
    """Stands in for the model runner, and checks the KV cache the scheduler describes.

    A computed token writes, into its slot, a digest of the sequence up to and including it (as
    real KV depends on the whole prefix). Before sampling, every position is read back through
    the block table and compared: a wrong table, a lost block or a bad prefix-cache hit fails.
    The next token is a pure function of the sequence, so outputs can be compared across runs.
    """

    def __init__(self, scheduler):
        self.scheduler = scheduler
        bm = scheduler.block_manager
        self.block_size = bm.block_size
        self.kv = [None] * (bm.num_blocks * bm.block_size)

    def slot(self, seq, pos):
        return seq.block_table[pos // self.block_size] * self.block_size + pos % self.block_size

    @staticmethod
    def digests(tokens):
        out, d = [], 0
        for t in tokens:
            d = hash((d, t))
            out.append(d)
        return out

    def step(self):
        sched = self.scheduler
        out = sched.schedule()
        assert out.num_batched_tokens == sum(i.num_new_tokens for i in out.scheduled)
        decoding = any(i.seq.num_tokens - i.start == 1 for i in out.scheduled)
        cap = sched.config.max_num_batched_tokens
        assert out.num_batched_tokens <= (cap if decoding else max(cap, sched.config.solo_prefill_tokens))
        assert not set(out.preempted) & {item.seq for item in out.scheduled}
        assert all(s.status is SequenceStatus.WAITING for s in out.preempted)
        for item in out.scheduled:
            digests = self.digests(item.seq.all_token_ids)
            for pos in range(item.start, item.start + item.num_new_tokens):
                self.kv[self.slot(item.seq, pos)] = digests[pos]
        sched.commit(out)
        for item in out.scheduled:
            seq = item.seq
            assert item.needs_sampling == seq.needs_sampling
            if item.needs_sampling:
                digests = self.digests(seq.all_token_ids)
                assert [self.kv[self.slot(seq, p)] for p in range(seq.num_tokens)] == digests
                seq.append_token(digests[-1] % 1000)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, FinishReason.LENGTH)
        return out


def test_chunked_prefill_splits_a_long_prompt_while_decodes_get_their_token_every_step():
    sched = make_scheduler(num_blocks=200, block_size=16, budget=256)
    model = FakeModel(sched)
    d1, d2 = make_seq("d1", 5), make_seq("d2", 7)
    sched.add(d1)
    sched.add(d2)
    assert plan(model.step()) == [("d1", 5), ("d2", 7)]
    p = make_seq("p", 1000, max_tokens=4)
    sched.add(p)
    for step, chunk in enumerate([254, 254, 254, 238]):
        out = model.step()
        assert plan(out) == [("d1", 1), ("d2", 1), ("p", chunk)], f"step {step}"
        assert out.num_batched_tokens == 2 + chunk
        assert [i.needs_sampling for i in out.scheduled] == [True, True, step == 3]
        assert p.num_computed_tokens == 254 * step + chunk
        assert p.num_output_tokens == (1 if step == 3 else 0)
    assert plan(model.step()) == [("d1", 1), ("d2", 1), ("p", 1)]
    assert (d1.num_output_tokens, d2.num_output_tokens, p.num_output_tokens) == (6, 6, 2)


def test_a_prompt_alone_takes_solo_chunks_until_something_decodes():
    sched = make_scheduler(num_blocks=400, block_size=16, budget=256, solo=1024)
    model = FakeModel(sched)
    p = make_seq("p", 3000, max_tokens=10)
    sched.add(p)
    for step, chunk in enumerate([1024, 1024, 952]):  # nothing decodes: up to 1,024 tokens a step
        out = model.step()
        assert plan(out) == [("p", chunk)] and out.num_batched_tokens == chunk, f"step {step}"
    assert p.num_output_tokens == 1
    q = make_seq("q", 1000, max_tokens=2)
    sched.add(q)
    for chunk in (255, 255, 255, 235):  # p decodes now: the budget is 256 again
        assert plan(model.step()) == [("p", 1), ("q", chunk)]
    sched.finish(p, FinishReason.STOP)
    r = make_seq("r", 1500, max_tokens=1)
    sched.add(r)
    assert plan(model.step()) == [("q", 1), ("r", 255)]  # q's one decode holds the budget at 256
    assert plan(model.step()) == [("r", 1024)]  # q finished (2 tokens): r is alone
    assert plan(model.step()) == [("r", 221)]


def test_a_solo_budget_below_the_step_budget_changes_nothing():
    sched = make_scheduler(num_blocks=200, block_size=16, budget=256, solo=100)
    model = FakeModel(sched)
    sched.add(make_seq("p", 600, max_tokens=1))
    assert [plan(model.step()) for _ in range(3)] == [[("p", 256)], [("p", 256)], [("p", 88)]]
    with pytest.raises(ValueError, match="solo_prefill_tokens must be >= 0"):
        SchedulerConfig(max_model_len=128, block_size=16, solo_prefill_tokens=-1)


def test_prefill_chunk_is_capped_by_budget_left_after_decodes():
    sched = make_scheduler(num_blocks=64, budget=8)
    model = FakeModel(sched)
    sched.add(make_seq("a", 3))
    model.step()
    sched.add(make_seq("b", 20))
    sched.add(make_seq("c", 2))
    assert plan(model.step()) == [("a", 1), ("b", 7)]
    assert plan(model.step()) == [("a", 1), ("b", 7)]
    # b's last 6 tokens leave budget for c: admitted in the same step.
    assert plan(model.step()) == [("a", 1), ("b", 6), ("c", 1)]
    assert plan(model.step()) == [("a", 1), ("b", 1), ("c", 1)]


def test_admission_is_strict_fcfs_and_capped_by_max_num_seqs():
    sched = make_scheduler(num_blocks=64, max_num_seqs=2)
    model = FakeModel(sched)
    for rid in ("a", "b", "c"):
        sched.add(make_seq(rid, 3))
    assert plan(model.step()) == [("a", 3), ("b", 3)]
    assert [s.request_id for s in sched.waiting] == ["c"]
    sched.finish(sched.get("a"), FinishReason.STOP)
    assert plan(model.step()) == [("b", 1), ("c", 3)]


def test_head_of_queue_that_does_not_fit_blocks_later_requests():
    sched = make_scheduler(num_blocks=4)
    model = FakeModel(sched)
    sched.add(make_seq("a", 8, max_tokens=4))   # 2 blocks now, 3 at most
    model.step()
    sched.add(make_seq("big", 9, max_tokens=1))  # 3 blocks: only 2 free
    sched.add(make_seq("small", 2))             # 1 block would fit, but must wait its turn
    assert plan(model.step()) == [("a", 1)]
    assert sched.num_waiting == 2


def test_preemption_picks_the_newest_running_sequence_and_requeues_it_at_the_front():
    sched = make_scheduler(num_blocks=4, prefix_caching=False)
    model = FakeModel(sched)
    a, b, c = make_seq("a", 7), make_seq("b", 7), make_seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    assert plan(model.step()) == [("a", 7), ("b", 7)]  # c: no block left
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert plan(model.step()) == [("a", 1), ("b", 1)]
    b_output = list(b.output_token_ids)
    assert len(b_output) == 2

    out = model.step()  # a's 10th token needs a third block: b, the newest, gives its blocks
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert a.block_table == [0, 1, 2]
    assert b.status is SequenceStatus.WAITING
    assert (b.num_computed_tokens, b.block_table) == (0, [])
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    assert b.output_token_ids == b_output
    assert sched.num_preemptions == 1

    assert plan(model.step()) == [("a", 1)]  # b needs 3 blocks, 1 is free
    sched.finish(a, FinishReason.STOP)
    out = model.step()
    # b recomputes prompt + generated tokens in one chunk and samples its third token.
    assert plan(out) == [("b", 9), ("c", 3)]
    assert out.scheduled[0].needs_sampling
    assert b.output_token_ids[:2] == b_output and b.num_output_tokens == 3


def test_preempted_sequence_reuses_its_own_cached_blocks_on_readmission():
    sched = make_scheduler(num_blocks=4)
    model = FakeModel(sched)
    a, b = make_seq("a", 7), make_seq("b", 7)
    sched.add(a)
    sched.add(b)
    model.step()
    model.step()  # b's blocks [2, 3] are now full and cached
    out = model.step()
    assert out.preempted == [b]
    assert a.block_table == [0, 1, 3]  # b's tail block evicted first, its head survives
    sched.finish(a, FinishReason.STOP)
    out = model.step()
    assert plan(out) == [("b", 5)]
    assert (b.num_computed_tokens, b.num_cached_tokens) == (9, 4)
    assert b.block_table[0] == 2


def test_a_sequence_that_cannot_grow_preempts_itself_when_it_is_the_newest():
    sched = make_scheduler(num_blocks=2, prefix_caching=False)
    model = FakeModel(sched)
    a, b = make_seq("a", 3, max_tokens=4), make_seq("b", 4, max_tokens=4)
    sched.add(a)
    sched.add(b)
    model.step()
    out = model.step()  # a's 4th token fits its block; b's 5th needs a block and b is newest
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_prefix_cache_hit_at_admission_counts_as_computed():
    sched = make_scheduler(num_blocks=16)
    model = FakeModel(sched)
    a = make_seq("a", list(range(10)), max_tokens=1)
    sched.add(a)
    model.step()
    assert a.is_finished
    b = make_seq("b", list(range(8)) + [70, 71, 72])
    sched.add(b)
    out = model.step()
    assert plan(out) == [("b", 3)]
    assert out.scheduled[0].start == 8
    assert (b.num_cached_tokens, b.block_table[:2]) == (8, [0, 1])
    bm = sched.block_manager
    assert (bm.num_queried_tokens, bm.num_hit_tokens) == (10 + 11, 8)


def test_output_continues_identically_after_preemptions():
    def run(num_blocks, prefix_caching):
        sched = make_scheduler(num_blocks=num_blocks, budget=16, prefix_caching=prefix_caching)
        model = FakeModel(sched)
        shared = list(range(100, 108))
        prompts = [shared + [1, 2, 3], list(range(13)), shared + [4], list(range(5, 24)), [9] * 6]
        seqs = [make_seq(f"s{i}", p, max_tokens=10 + i) for i, p in enumerate(prompts)]
        for s in seqs:
            sched.add(s)
        for _ in range(500):
            if not sched.has_work:
                break
            model.step()
        assert not sched.has_work
        assert sched.block_manager.num_free_blocks == num_blocks
        return [s.output_token_ids for s in seqs], sched.num_preemptions

    reference, preemptions = run(num_blocks=64, prefix_caching=False)
    assert preemptions == 0
    for prefix_caching in (False, True):
        outputs, preemptions = run(num_blocks=9, prefix_caching=prefix_caching)
        assert preemptions > 0
        assert outputs == reference


def test_queue_cap_raises_resource_exhausted():
    sched = make_scheduler(num_blocks=8, max_waiting=2)
    sched.add(make_seq("a", 3))
    sched.add(make_seq("b", 3))
    with pytest.raises(ResourceExhausted, match="queue is full"):
        sched.add(make_seq("c", 3))
    assert sched.num_waiting == 2


def test_add_rejects_duplicate_ids_and_check_fits_requests_larger_than_the_cache():
    sched = make_scheduler(num_blocks=4)
    sched.add(make_seq("a", 3, max_tokens=4))
    with pytest.raises(InvalidArgument, match="already in use"):
        sched.add(make_seq("a", 3))
    with pytest.raises(InvalidArgument, match=r"needs 5 KV blocks but the cache holds 4"):
        sched.check_fits(10, 10)
    sched.check_fits(6, 10)  # 4 blocks: fits
    assert sched.num_waiting == 1


def test_the_engine_edge_refuses_empty_and_oversized_prompts_before_queuing(tmp_path):
    from engine_utils import greedy, load_tiny, make_core, make_tiny_checkpoint

    core = make_core(load_tiny(make_tiny_checkpoint(tmp_path)), num_blocks=4, block_size=16)
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        core.validate([], greedy(4))
    with pytest.raises(InvalidArgument, match=r"needs 5 KV blocks but the cache holds 4"):
        core.validate(list(range(40)), greedy(40))


def test_abort_frees_blocks_and_is_idempotent():
    sched = make_scheduler(num_blocks=8)
    model = FakeModel(sched)
    a, b = make_seq("a", 6), make_seq("b", 3)
    sched.add(a)
    model.step()
    sched.add(b)
    assert sched.block_manager.num_free_blocks == 6
    assert sched.abort("a") is a
    assert (a.status, a.finish_reason, a.block_table) == (SequenceStatus.FINISHED, "abort", [])
    assert sched.block_manager.num_free_blocks == 8
    assert sched.abort("b") is b  # still waiting
    assert sched.abort("a") is None
    assert sched.abort("nope") is None
    sched.finish(a, FinishReason.STOP)  # no effect on a finished sequence
    assert a.finish_reason == "abort"
    assert not sched.has_work


def test_commit_skips_sequences_aborted_during_the_forward():
    sched = make_scheduler(num_blocks=8)
    a = make_seq("a", 6)
    sched.add(a)
    out = sched.schedule()
    sched.abort("a")
    sched.commit(out)
    assert a.num_computed_tokens == 0
    assert sched.block_manager.num_free_blocks == 8


def test_config_validation_says_how_to_fix():
    with pytest.raises(ValueError, match="raise the budget or lower max_num_seqs"):
        SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=32, max_model_len=128, block_size=16)
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(max_model_len=128, block_size=16), BlockManager(8, 8))


def test_external_kv_is_imported_at_admission_without_budget():
    sched = make_scheduler(num_blocks=16, budget=8)
    seq = make_seq("a", 21)
    seq.external_kv, seq.external_tokens = "payload", 16  # 4 whole blocks fetched from the KV service
    sched.add(seq)
    out = sched.schedule()
    assert plan(out) == [("a", 5)]  # only the 5 tokens past the import use budget
    assert [(i.seq.request_id, i.payload, i.start, i.end) for i in out.imports] == [("a", "payload", 0, 16)]
    assert seq.block_table == [0, 1, 2, 3, 4, 5] and seq.num_computed_tokens == 16
    assert seq.num_cached_tokens == 16 and seq.external_kv is None  # the payload is not kept
    sched.commit(out)
    assert seq.num_computed_tokens == 21


def test_external_kv_only_fills_in_past_the_local_prefix_cache():
    sched = make_scheduler(num_blocks=32, budget=64)
    prompt = list(range(21))
    first = make_seq("first", prompt)
    sched.add(first)
    out = sched.schedule()
    sched.commit(out)
    sched.finish(first, FinishReason.LENGTH)  # its 5 full blocks stay in the prefix cache
    again = make_seq("again", prompt)
    again.external_kv, again.external_tokens = "payload", 16
    sched.add(again)
    out = sched.schedule()
    assert out.imports == [] and again.num_computed_tokens == 20  # local hits cover more than the import
    assert plan(out) == [("again", 1)] and again.num_cached_tokens == 20


def test_external_kv_starting_past_local_hits_imports_only_when_contiguous():
    sched = make_scheduler(num_blocks=32, budget=64)
    prompt = list(range(33))
    first = make_seq("first", prompt[:9])  # caches blocks 0-1 (positions 0..7) locally
    sched.add(first)
    sched.commit(sched.schedule())
    sched.finish(first, FinishReason.LENGTH)
    seq = make_seq("b", prompt)
    seq.external_kv, seq.external_start, seq.external_tokens = "payload", 8, 32  # fetched 8..31
    sched.add(seq)
    out = sched.schedule()
    assert [(i.start, i.end, i.payload_start) for i in out.imports] == [(8, 32, 8)]
    assert seq.num_computed_tokens == 32 and plan(out) == [("b", 1)]

    gap = make_scheduler(num_blocks=32, budget=64)  # nothing cached locally: positions 0..7 missing
    seq = make_seq("c", prompt)
    seq.external_kv, seq.external_start, seq.external_tokens = "payload", 8, 32
    gap.add(seq)
    out = gap.schedule()
    assert out.imports == [] and seq.num_computed_tokens == 0 and plan(out) == [("c", 33)]
