"""Speculative decoding on the tiny model with drafts from a fake draft service: greedy output is
token for token plain decoding's, whatever the drafts; accepted counts are exact for scripted
drafts; KV of rejected drafts never counts (block accounting, prefix-cache registrations)."""
import random
import time

import pytest

from engine_utils import FakeDraftService, greedy, load_tiny, make_core, make_tiny_checkpoint, oracle_drafts, run_all
from kvmesh.draft.v1 import draft_pb2
from kvmesh.services.engine.core import EngineRequest
from kvmesh.services.engine.speculation import SpecMode
from kvmesh.services.engine.sequence import FinishReason

K = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def fake():
    service = FakeDraftService()
    yield service
    service.stop()


def _prompts(n, base=20, step=7):
    return {f"r{i}": [(7 * i + 3 * j + 1) % 256 for j in range(base + step * i)] for i in range(n)}


def _spec_core(tiny, fake, **kw):
    """Not the deployment's speculation: the drafting mechanics are under test, so requests draft
    at every step (n-gram mode: no SpecGate, which has its own tests), every sequence gets K (the
    row budget has its own test) and the deadline is never the reason a step has no drafts."""
    kw.setdefault("speculation", "ngram")
    kw.setdefault("spec_max_draft_tokens", K)
    kw.setdefault("spec_step_rows", 256)
    return make_core(tiny, draft_address=fake.address, draft_timeout_s=5.0, **kw)


def _plain(tiny, prompts, params, **kw):
    return run_all(make_core(tiny, **kw), prompts, params)


def _expected_counts(max_tokens, k, accepted_per_step):
    """(spec steps, draft tokens, accepted) when every decode step with room speculates:
    the first token comes from the prefill, then each step verifies min(k, left - 1) drafts
    and emits accepted + 1 tokens."""
    steps = drafts = accepted = 0
    left = max_tokens - 1
    while left > 0:
        n = min(k, left - 1)
        if n == 0:
            left -= 1
            continue
        a = accepted_per_step(n)
        steps, drafts, accepted, left = steps + 1, drafts + n, accepted + a, left - a - 1
    return steps, drafts, accepted


def _spec(out):
    s = out["final"].spec
    return s.steps, s.draft_tokens, s.accepted_tokens


@pytest.mark.parametrize("wrong_at, accepted", [
    (None, lambda n: n),                   # oracle: everything accepted
    ({1}, lambda n: 1),                    # the second draft is wrong: one accepted per step
    ({0, 1, 2, 3}, lambda n: 0),           # all wrong: nothing accepted
    ({2}, lambda n: min(n, 2)),
])
def test_greedy_output_is_plain_decoding_and_accepted_counts_are_exact(tiny, fake, wrong_at, accepted):
    prompts, params = _prompts(4), greedy(29, ignore_eos=True)
    plain = _plain(tiny, prompts, params)
    fake.propose = oracle_drafts(prompts, {r: v["tokens"] for r, v in plain.items()}, wrong_at)
    core = _spec_core(tiny, fake)
    got = run_all(core, prompts, params)
    for rid in prompts:
        assert got[rid]["tokens"] == plain[rid]["tokens"] and got[rid]["text"] == plain[rid]["text"]
        assert _spec(got[rid]) == _expected_counts(29, K, accepted)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert core.drafts.stats.failures == 0


def test_garbage_drafts_change_nothing(tiny, fake):
    prompts, params = _prompts(3), greedy(40)  # EOS allowed: a run can end on it
    plain = _plain(tiny, prompts, params)
    rng = random.Random(0)
    fake.propose = lambda rid, history, k: [rng.randrange(257) for _ in range(k)]
    got = run_all(_spec_core(tiny, fake), prompts, params)
    for rid in prompts:
        assert got[rid]["tokens"] == plain[rid]["tokens"]
        assert got[rid]["final"].finish_reason == plain[rid]["final"].finish_reason
        assert got[rid]["final"].spec.draft_tokens > 0


def test_out_of_vocabulary_drafts_are_cut(tiny, fake):
    prompts, params = _prompts(1), greedy(12, ignore_eos=True)
    plain = _plain(tiny, prompts, params)
    oracle = oracle_drafts(prompts, {r: v["tokens"] for r, v in plain.items()})
    fake.propose = lambda rid, history, k: oracle(rid, history, k)[:1] + [10**6, 1, 2]
    got = run_all(_spec_core(tiny, fake), prompts, params)["r0"]
    assert got["tokens"] == plain["r0"]["tokens"]
    assert _spec(got) == _expected_counts(12, 1, lambda n: 1)


def test_mixed_batches_speculating_plain_and_prefilling_sequences(tiny, fake):
    """Requests arrive while others speculate, some never speculate, a small budget chunks
    the prompts: steps mix verification, plain decodes and prefill chunks."""
    prompts = _prompts(6, base=30, step=9)
    params = greedy(24, ignore_eos=True)
    plain = _plain(tiny, prompts, params, max_num_batched_tokens=48, max_num_seqs=6)
    fake.propose = oracle_drafts(prompts, {r: v["tokens"] for r, v in plain.items()}, wrong_at={3})
    core = _spec_core(tiny, fake, max_num_batched_tokens=48, max_num_seqs=6)
    mixes = []
    schedule = core.scheduler.schedule

    def recording(drafts=None):
        out = schedule(drafts)
        mixes.append({("draft" if s.draft_token_ids else "decode" if s.num_new_tokens == 1 else "prefill")
                      for s in out.scheduled})
        return out

    core.scheduler.schedule = recording
    results = {rid: [] for rid in prompts}
    pending = list(prompts)
    finished = set()
    while len(finished) < len(prompts):
        if pending:  # one arrival per step
            rid = pending.pop(0)
            mode = SpecMode.OFF if rid in ("r1", "r4") else None
            core.add_request(EngineRequest(rid, prompts[rid], params, time.monotonic(), speculation=mode))
        for out in core.step():
            results[out.request_id] += out.token_ids
            if out.finished:
                finished.add(out.request_id)
                assert (out.spec.steps == 0) == (out.request_id in ("r1", "r4"))
    assert results == {rid: plain[rid]["tokens"] for rid in prompts}
    assert {"draft", "decode", "prefill"} in mixes
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


@pytest.mark.parametrize("block_size", [1, 2, 4])
def test_runs_across_block_boundaries_keep_exact_block_accounting(tiny, fake, block_size):
    """After every step: cached blocks hold only committed tokens, and no running sequence keeps a
    block past its last known token (rejected drafts' blocks are freed)."""
    prompts, params = _prompts(3, base=9, step=5), greedy(33, ignore_eos=True)
    plain = _plain(tiny, prompts, params, block_size=block_size, num_blocks=256)
    fake.propose = oracle_drafts(prompts, {r: v["tokens"] for r, v in plain.items()}, wrong_at={2})
    core = _spec_core(tiny, fake, block_size=block_size, num_blocks=256)
    bm = core.block_manager
    for rid, ids in prompts.items():
        core.add_request(EngineRequest(rid, ids, params, time.monotonic()))
    tokens = {rid: [] for rid in prompts}
    while core.has_work:
        for out in core.step():
            tokens[out.request_id] += out.token_ids
        for seq in core.scheduler.running:
            assert len(seq.block_table) <= -(-seq.num_tokens // block_size)
            for i, block_id in enumerate(seq.block_table):
                if bm.block_hash(block_id) is not None:
                    key = bm._blocks[block_id].key
                    assert list(key.token_ids) == seq.token_ids(i * block_size, (i + 1) * block_size)
    assert tokens == {rid: plain[rid]["tokens"] for rid in prompts}
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("cut", ["stop_string", "stop_token", "max_tokens"])
def test_stops_cut_inside_an_accepted_run(tiny, fake, cut):
    prompt = {"r0": [(5 * j + 2) % 256 for j in range(24)]}
    long_out = _plain(tiny, prompt, greedy(40, ignore_eos=True))["r0"]
    # position 7 of the output lies inside the second verification run (tokens 1..5, 6..10)
    if cut == "stop_string":
        text = tiny.tokenizer.decode(long_out["tokens"][:8])
        params = greedy(40, ignore_eos=True, stop=[text[-3:]])
    elif cut == "stop_token":
        params = greedy(40, ignore_eos=True, stop_token_ids=[long_out["tokens"][7]])
    else:
        params = greedy(8, ignore_eos=True)
    plain = _plain(tiny, prompt, params)["r0"]
    fake.propose = oracle_drafts(prompt, {"r0": long_out["tokens"]})
    core = _spec_core(tiny, fake)
    got = run_all(core, prompt, params)["r0"]
    assert got["tokens"] == plain["tokens"] and got["text"] == plain["text"]
    assert got["final"].finish_reason == plain["final"].finish_reason
    assert got["final"].stop_reason == plain["final"].stop_reason
    assert got["final"].spec.steps == 2
    if cut == "max_tokens":  # asked for at most what max_tokens leaves, less the target's own token
        assert fake.proposed_lengths() == [[4], [1]]  # 1 + 5 + 2 tokens
        assert _spec(got) == (2, 5, 5)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_logprobs_of_accepted_tokens_match_plain_decoding(tiny, fake):
    prompts, params = _prompts(2), greedy(15, ignore_eos=True, logprobs=3)
    plain = _plain(tiny, prompts, params)
    fake.propose = oracle_drafts(prompts, {r: v["tokens"] for r, v in plain.items()}, wrong_at={3})
    got = run_all(_spec_core(tiny, fake), prompts, params)
    for rid in prompts:
        want, have = plain[rid]["logprobs"], got[rid]["logprobs"]
        assert [lp.token_id for lp in have] == plain[rid]["tokens"]
        assert [lp.logprob for lp in have] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
        assert [[t for t, _ in lp.top] for lp in have] == [[t for t, _ in lp.top] for lp in want]


def test_preemption_and_abort_with_speculation_keep_block_accounting(tiny, fake):
    """A pool too small for every sequence: preemptions happen while others speculate; an abort
    lands between verification steps. Outputs stay plain decoding's; the pool comes back whole."""
    prompts, params = _prompts(4, base=20, step=4), greedy(40, ignore_eos=True)
    kw = dict(block_size=4, num_blocks=40, max_num_batched_tokens=64, max_num_seqs=4)
    plain = _plain(tiny, prompts, params, **kw)
    fake.propose = oracle_drafts(prompts, {r: v["tokens"] for r, v in plain.items()}, wrong_at={2})
    core = _spec_core(tiny, fake, **kw)
    got = run_all(core, prompts, params)
    assert {r: v["tokens"] for r, v in got.items()} == {r: v["tokens"] for r, v in plain.items()}
    assert core.scheduler.num_preemptions > 0
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks

    core = _spec_core(tiny, fake, **kw)
    for rid, ids in prompts.items():
        core.add_request(EngineRequest(rid, ids, params, time.monotonic()))
    for _ in range(6):
        core.step()
    assert core.spec_totals.steps > 0
    for rid in prompts:
        core.abort(rid)
    assert not core.has_work
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_finished_and_aborted_sequences_are_released(tiny, fake):
    prompts, params = _prompts(2), greedy(10, ignore_eos=True)
    core = _spec_core(tiny, fake)
    run_all(core, {"r0": prompts["r0"]}, params)
    core.add_request(EngineRequest("r1", prompts["r1"], params, time.monotonic()))
    for _ in range(3):
        core.step()
    core.abort("r1")
    assert fake.wait_for(lambda f: len(f.released) == 2)  # Release is sent without waiting for it
    assert fake.released == [core.drafts.sequence_id("r0"), core.drafts.sequence_id("r1")]
    assert fake.histories == {}


def test_request_mode_overrides_the_engine_default(tiny, fake):
    prompts, params = _prompts(2), greedy(10, ignore_eos=True)
    fake.propose = lambda rid, history, k: [1] * k
    core = _spec_core(tiny, fake, speculation="off")
    core.add_request(EngineRequest("r0", prompts["r0"], params, time.monotonic()))
    core.add_request(EngineRequest("r1", prompts["r1"], params, time.monotonic(), speculation=SpecMode.MODEL))
    spec = {}
    while core.has_work:
        for out in core.step():
            if out.finished:
                spec[out.request_id] = out.spec.steps
    assert spec["r0"] == 0 and spec["r1"] > 0
    drafters = {s.drafter for c in fake.calls for s in c.sequences}
    assert drafters == {draft_pb2.DRAFTER_MODEL}  # r0 never asked
    assert {s.sequence_id for c in fake.calls for s in c.sequences} == {core.drafts.sequence_id("r1")}


def test_no_draft_service_means_plain_decoding_whatever_the_request_asks(tiny):
    core = make_core(tiny)
    prompts = _prompts(1)
    core.add_request(EngineRequest("r0", prompts["r0"], greedy(6), time.monotonic(), speculation=SpecMode.NGRAM))
    outs = []
    while core.has_work:
        outs += core.step()
    assert outs[-1].finished and outs[-1].spec.steps == 0


def test_last_accepted_feeds_back_each_verification_once(tiny, fake):
    prompts, params = _prompts(1), greedy(14, ignore_eos=True)
    plain = _plain(tiny, prompts, params)
    fake.propose = oracle_drafts(prompts, {r: v["tokens"] for r, v in plain.items()}, wrong_at={1})
    run_all(_spec_core(tiny, fake), prompts, params)
    sent = [s.last_accepted if s.HasField("last_accepted") else None for c in fake.calls for s in c.sequences]
    assert sent == [None] + [1] * (len(sent) - 1)
    assert len(sent) == _expected_counts(14, K, lambda n: 1)[0]


def test_drafts_per_sequence_shrink_to_fit_the_step_rows(tiny, fake):
    """One speculating sequence gets spec_max_draft_tokens; when several speculate, each gets
    what keeps the step within spec_step_rows, but never fewer than spec_batch_draft_tokens."""
    prompts, params = _prompts(4), greedy(12, ignore_eos=True)
    plain = _plain(tiny, prompts, params)
    fake.propose = oracle_drafts(prompts, {r: v["tokens"] for r, v in plain.items()})
    core = _spec_core(tiny, fake, spec_max_draft_tokens=7, spec_batch_draft_tokens=2, spec_step_rows=8)
    got = run_all(core, prompts, params)
    assert all(got[r]["tokens"] == plain[r]["tokens"] for r in prompts)
    asked = [ks for ks in fake.proposed_lengths() if ks]
    by_batch = {}
    for ks in asked:
        by_batch[len(ks)] = max(by_batch.get(len(ks), 0), *ks)
    assert by_batch.get(4) == 2 and by_batch.get(2, 3) == 3  # 8 // 4 - 1 = 1 -> the floor 2; 8 // 2 - 1 = 3
    single = _spec_core(tiny, fake, spec_max_draft_tokens=7, spec_step_rows=8)
    fake.calls.clear()
    run_all(single, {"r0": prompts["r0"]}, greedy(20, ignore_eos=True))
    assert max(max(ks) for ks in fake.proposed_lengths() if ks) == 7
    # the default floor 0: five sequences cannot each get a draft within 8 rows, so none is asked
    five = _prompts(5)
    crowded = _spec_core(tiny, fake, spec_max_draft_tokens=7, spec_step_rows=8)
    fake.calls.clear()
    got = run_all(crowded, five, greedy(12, ignore_eos=True))
    assert all(got[r]["tokens"] == _plain(tiny, {r: five[r]}, greedy(12, ignore_eos=True))[r]["tokens"] for r in five)
    assert fake.calls == []



@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("where", ["within", "straddling"])
def test_stop_strings_count_only_when_they_end_after_min_tokens(tiny, fake, speculate, where):
    """vLLM's min_tokens: no stop condition before min_tokens tokens, stop strings included. One
    that ends within the first min_tokens tokens' text never stops the output; one that starts
    there and ends in a later token's stops it, cut at its start. Several tokens accepted per step
    (speculation) change nothing."""
    prompt = {"r0": [(5 * j + 2) % 256 for j in range(24)]}
    free = _plain(tiny, prompt, greedy(40, ignore_eos=True))["r0"]
    full, min_tokens = free["text"], 6
    boundary = len("".join(free["texts"][:min_tokens]))  # one token per output without speculation
    if where == "within":
        stop = "".join(free["texts"][:4])[-2:]
        without = _plain(tiny, prompt, greedy(40, ignore_eos=True, stop=[stop]))["r0"]
        assert without["final"].finish_reason is FinishReason.STOP_STRING and len(without["tokens"]) <= 4
        cut = full.find(stop, boundary - len(stop) + 1)  # the first occurrence ending past the boundary
    else:
        stop, cut = full[boundary - 1:boundary + 1], boundary - 1
        assert full.find(stop) == cut
    params = greedy(40, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
    if speculate:
        fake.propose = oracle_drafts(prompt, {"r0": free["tokens"]})
        got = run_all(_spec_core(tiny, fake), prompt, params)["r0"]
        assert got["final"].spec.accepted_tokens > 0
    else:
        got = _plain(tiny, prompt, params)["r0"]
    assert len(got["tokens"]) > min_tokens and got["tokens"] == free["tokens"][:len(got["tokens"])]
    if cut < 0:
        assert got["final"].finish_reason is FinishReason.LENGTH and got["text"] == full
    else:
        assert got["final"].finish_reason is FinishReason.STOP_STRING and got["text"] == full[:cut]
