"""EngineService.Probe against a real server on port 0, on a tiny random-weight model."""
import asyncio

import grpc
import pytest

from engine_utils import StepGate, load_tiny, make_core, make_tiny_checkpoint, serve_engine
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2

BS = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def _ids(ids):
    return common_pb2.TokenIds(ids=ids)


def _gen(ids, max_tokens, salt=""):
    return engine_pb2.GenerateRequest(token_ids=_ids(ids), cache_salt=salt, sampling=engine_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))


async def _probe(stub, ids, salt=""):
    return await stub.Probe(engine_pb2.ProbeRequest(token_ids=_ids(ids), cache_salt=salt), timeout=5)


async def test_probe_reports_cached_prefix_per_salt_and_prompt(tiny):
    core = make_core(tiny, num_blocks=64, block_size=BS, max_num_batched_tokens=64, max_num_seqs=4)
    prompt = [(5 * i + 3) % 256 for i in range(150)]
    async with serve_engine(core) as served:
        before = await _probe(served.stub, prompt, "t1")
        assert before.cached_tokens == 0 and before.num_blocks == 64 and before.free_blocks == 64
        msgs = await served.collect(_gen(prompt, 4, "t1"))
        assert msgs[-1].final.usage.completion_tokens == 4

        same = await _probe(served.stub, prompt, "t1")
        assert same.cached_tokens == 144                      # every full block of the 150 tokens
        assert (await _probe(served.stub, prompt, "t2")).cached_tokens == 0
        assert (await _probe(served.stub, [9] + prompt[1:], "t1")).cached_tokens == 0
        assert (await _probe(served.stub, prompt[:40] + [0] * 60, "t1")).cached_tokens == 32
        assert (same.running, same.waiting, same.pending_prefill_tokens) == (0, 0, 0)
        assert same.free_blocks == 64                         # cached-but-free blocks are free

        # the probe's answer is what the next request reuses
        again = await served.collect(_gen(prompt, 2, "t1"))
        assert again[-1].final.usage.cached_prompt_tokens == 144


async def test_probe_load_reflects_running_and_waiting_requests(tiny):
    core = make_core(tiny, num_blocks=128, block_size=BS, max_num_batched_tokens=64, max_num_seqs=1)
    gate = StepGate(core)                                     # the test says when a step runs
    async with serve_engine(core) as served:
        try:
            long = served.stub.Generate(_gen(list(range(20)), 1500), timeout=60)
            gate.allow(1)
            await long.read()                                 # admitted, decoding
            busy = await _probe(served.stub, [1, 2, 3])
            assert (busy.running, busy.waiting, busy.pending_prefill_tokens) == (1, 0, 0)
            assert busy.free_blocks < busy.num_blocks

            queued = served.stub.Generate(_gen(list(range(50)), 4), timeout=60)  # max_num_seqs=1: waits
            # Each probe is a round trip, so the server takes the queued request in between; a
            # posted request counts as waiting whether or not a step boundary applied it yet.
            while (p := await _probe(served.stub, [1])).waiting == 0:
                pass
            assert (p.running, p.waiting, p.pending_prefill_tokens) == (1, 1, 50)

            # Probes never wait for the step loop (the router's deadline is shorter than a step):
            # all of them answer while it is held in a step.
            assert await asyncio.to_thread(gate.held.wait, 10)
            for _ in range(20):
                await _probe(served.stub, [1])
            assert gate.held.is_set()
            long.cancel()
            queued.cancel()
        finally:
            gate.open()


async def test_probe_rejects_unknown_fields(tiny):
    core = make_core(tiny, num_blocks=16, block_size=BS)
    async with serve_engine(core) as served:
        channel = grpc.aio.insecure_channel(served.address)
        try:
            probe = channel.unary_unary(
                "/kvmesh.engine.v1.EngineService/Probe", request_serializer=lambda b: b,
                response_deserializer=engine_pb2.ProbeResponse.FromString)
            raw = engine_pb2.ProbeRequest(token_ids=_ids([1])).SerializeToString() + bytes([0xF8, 0x06, 0x01])
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await probe(raw, timeout=5)
        finally:
            await channel.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
