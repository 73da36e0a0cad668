"""EngineCore.probe / AsyncEngine.probe: cached prefix (read-only) and load, on a tiny model; the
async probe answers without waiting for the step in flight."""
import asyncio
import threading
import time

import pytest

from engine_utils import greedy, load_tiny, make_core, make_tiny_checkpoint, run_all
from kvmesh.errors import Unavailable
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.core import EngineLoad, EngineRequest

BS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def _prompt(n, offset=0):
    return [(7 * i + offset) % 256 for i in range(n)]


def test_probe_counts_whole_cached_blocks_and_changes_nothing(tiny):
    core = make_core(tiny, num_blocks=64, block_size=BS, max_num_batched_tokens=64, max_num_seqs=4)
    prompt = _prompt(100)
    assert core.probe(prompt).cached_tokens == 0
    run_all(core, {"a": prompt}, greedy(3, ignore_eos=True))
    bm = core.block_manager
    before = (bm.free_block_ids(), bm.num_queried_tokens, bm.num_hit_tokens, bm.num_cached_blocks)

    assert core.probe(prompt).cached_tokens == 96           # 6 full blocks of 100 tokens
    assert core.probe(prompt[:64]).cached_tokens == 48      # never the last token's block
    assert core.probe(prompt + [1, 2, 3]).cached_tokens == 96
    assert core.probe(prompt, core.namespace.for_tenant("other tenant")).cached_tokens == 0
    assert core.probe([255] + prompt[1:]).cached_tokens == 0
    assert core.probe([]).cached_tokens == 0
    # read-only: eviction order, ref counts and hit statistics are as they were
    assert (bm.free_block_ids(), bm.num_queried_tokens, bm.num_hit_tokens, bm.num_cached_blocks) == before
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


def test_probe_load_fields(tiny):
    core = make_core(tiny, num_blocks=64, block_size=BS, max_num_batched_tokens=16, solo_prefill_tokens=0,
                     max_num_seqs=1)  # 16-token chunks even while nothing decodes
    idle = core.probe([1, 2, 3]).load
    assert idle == EngineLoad(running=0, waiting=0, pending_prefill_tokens=0, free_blocks=64, num_blocks=64)
    now = time.monotonic()
    core.add_request(EngineRequest("a", _prompt(40), greedy(50, ignore_eos=True), now))
    core.add_request(EngineRequest("b", _prompt(30, 1), greedy(5, ignore_eos=True), now))
    assert core.load() == EngineLoad(0, 2, 70, 64, 64)
    core.step()                                   # "a" admitted: 16 of its 40 prompt tokens
    assert core.load() == EngineLoad(1, 1, 24 + 30, 63, 64)
    core.step()
    core.step()                                   # a's prefill done, first token sampled
    assert core.load() == EngineLoad(1, 1, 30, 61, 64)


def test_async_probe_does_not_wait_for_the_step_in_flight(tiny):
    core = make_core(tiny, num_blocks=64, block_size=BS, max_num_batched_tokens=64, max_num_seqs=1)
    warm = _prompt(50)
    run_all(core, {"warm": warm}, greedy(2, ignore_eos=True))
    in_step, release, resumed = threading.Event(), threading.Event(), threading.Event()
    real_step = core.step

    def gated_step():                             # the first step blocks until released
        in_step.set()
        release.wait(10)
        resumed.set()
        return real_step()

    core.step = gated_step
    engine = AsyncEngine(lambda: core)

    async def scenario():
        first = engine.generate(_prompt(40, 1), greedy(300, ignore_eos=True), "first")
        second = engine.generate(_prompt(30, 2), greedy(5, ignore_eos=True), "second")
        pulls = [asyncio.ensure_future(first.__anext__())]
        assert await asyncio.to_thread(in_step.wait, 10)      # "first" applied, its step blocked
        pulls.append(asyncio.ensure_future(second.__anext__()))
        while engine.num_requests < 2:
            await asyncio.sleep(0)                # "second" posted: sits in the inbox
        during = engine.probe(warm)
        # Answered with the step still blocked: a probe that waited for it would only return once
        # the step's 10 s wait ran out, and the step would have resumed by then.
        mid_step = not resumed.is_set()
        release.set()
        await pulls[0]                            # "first" decodes now; "second" waits (1 seq max)
        after = engine.probe(warm)
        pulls[1].cancel()                         # ends "second" (its finally posts the abort)
        await asyncio.gather(pulls[1], return_exceptions=True)
        await first.aclose()
        return during, mid_step, after

    try:
        during, mid_step, after = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert mid_step and during.cached_tokens == 48
    assert (during.load.running, during.load.waiting, during.load.pending_prefill_tokens) == (0, 2, 70)
    assert (after.load.running, after.load.waiting, after.load.pending_prefill_tokens) == (1, 1, 30)
    assert after.load.free_blocks < after.load.num_blocks

    with pytest.raises(Unavailable):
        engine.probe([1, 2])                 # stopped


def test_async_probe_refused_while_draining(tiny):
    core = make_core(tiny, num_blocks=16, block_size=BS)
    engine = AsyncEngine(lambda: core)

    async def scenario():
        ok = engine.probe([1, 2, 3])
        await engine.drain(0.1)
        with pytest.raises(Unavailable):
            engine.probe([1, 2, 3])
        return ok

    try:
        ok = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert ok.load.num_blocks == 16 and ok.cached_tokens == 0
