"""EngineCore.probe / AsyncEngine.probe: cached prefix (read-only) and load, on a tiny model."""
import asyncio
import threading
import time

import pytest

from engine_utils import greedy, load_tiny, make_core, make_tiny_checkpoint, run_all
from kvmesh.errors import Unavailable
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.core import EngineRequest

BS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def _prompt(n, offset=0):
    return [(7 * i + offset) % 256 for i in range(n)]


def test_probe_counts_whole_cached_blocks_and_changes_nothing(tiny):
    core = make_core(tiny, num_blocks=64, block_size=BS, max_num_batched_tokens=64, max_num_seqs=4)
    prompt = _prompt(100)
    assert core.probe(prompt, b"").cached_tokens == 0
    run_all(core, {"a": prompt}, greedy(3, ignore_eos=True))
    bm = core.block_manager
    before = (bm.free_block_ids(), bm.num_queried_tokens, bm.num_hit_tokens, bm.num_cached_blocks)

    assert core.probe(prompt, b"").cached_tokens == 96           # 6 full blocks of 100 tokens
    assert core.probe(prompt[:64], b"").cached_tokens == 48      # never the last token's block
    assert core.probe(prompt + [1, 2, 3], b"").cached_tokens == 96
    assert core.probe(prompt, b"other tenant").cached_tokens == 0
    assert core.probe([255] + prompt[1:], b"").cached_tokens == 0
    assert core.probe([], b"").cached_tokens == 0
    # read-only: eviction order, ref counts and hit statistics are as they were
    assert (bm.free_block_ids(), bm.num_queried_tokens, bm.num_hit_tokens, bm.num_cached_blocks) == before
    assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


def test_probe_load_fields(tiny):
    core = make_core(tiny, num_blocks=64, block_size=BS, max_num_batched_tokens=16, max_num_seqs=1)
    idle = core.probe([1, 2, 3], b"")
    assert (idle.running, idle.waiting, idle.pending_prefill_tokens) == (0, 0, 0)
    assert idle.free_blocks == idle.num_blocks == 64
    now = time.monotonic()
    core.add_request(EngineRequest("a", _prompt(40), greedy(50, ignore_eos=True), now))
    core.add_request(EngineRequest("b", _prompt(30, 1), greedy(5, ignore_eos=True), now))
    p = core.probe([1], b"")
    assert (p.running, p.waiting, p.pending_prefill_tokens) == (0, 2, 70)
    core.step()                                   # "a" admitted: 16 of its 40 prompt tokens
    p = core.probe([1], b"")
    assert (p.running, p.waiting, p.pending_prefill_tokens) == (1, 1, 24 + 30)
    assert p.free_blocks == 63                    # one block holds a's first 16 tokens
    core.step()
    core.step()                                   # a's prefill done, first token sampled
    p = core.probe([1], b"")
    assert (p.running, p.waiting, p.pending_prefill_tokens) == (1, 1, 30)
    assert p.free_blocks == 64 - 3


def test_async_probe_answers_between_steps_from_the_step_loop(tiny):
    core = make_core(tiny, num_blocks=64, block_size=BS, max_num_batched_tokens=64, max_num_seqs=4)
    seen = []
    real_probe = core.probe

    def probe(ids, salt):
        seen.append(threading.current_thread().name)
        return real_probe(ids, salt)

    core.probe = probe
    engine = AsyncEngine(lambda: core, max_waiting=8)

    async def scenario():
        prompt = _prompt(50)
        stream = engine.generate(prompt, greedy(400, ignore_eos=True), "busy")
        await stream.__anext__()                 # running and decoding
        t0 = time.perf_counter()
        busy = await asyncio.wait_for(engine.probe(prompt, b""), 5)
        waited = time.perf_counter() - t0
        await stream.aclose()                    # cancel: abort posted
        return busy, waited

    try:
        busy, waited = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert seen == ["engine-step-loop"]
    assert busy.running == 1 and busy.cached_tokens == 48 and busy.free_blocks < busy.num_blocks
    assert waited < 1.0

    async def after_stop():
        return await engine.probe([1, 2], b"")

    with pytest.raises(Unavailable):
        asyncio.run(after_stop())


def test_async_probe_refused_while_draining(tiny):
    core = make_core(tiny, num_blocks=16, block_size=BS)
    engine = AsyncEngine(lambda: core, max_waiting=8)

    async def scenario():
        ok = await engine.probe([1, 2, 3], b"")
        await engine.drain(0.1)
        with pytest.raises(Unavailable):
            await engine.probe([1, 2, 3], b"")
        return ok

    try:
        ok = asyncio.run(scenario())
    finally:
        engine.shutdown()
    assert ok.num_blocks == 16 and ok.cached_tokens == 0
