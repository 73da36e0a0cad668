"""GenerateResponse.prompt_logprobs over a real server on port 0, on a tiny random-weight model."""
import grpc
import pytest
import torch

from engine_utils import load_tiny, make_core, make_tiny_checkpoint, serve_engine
from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return load_tiny(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny")))


def _req(prompt, **sampling):
    return engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt),
                                      sampling=engine_pb2.SamplingParams(ignore_eos=True, **sampling))


async def test_prompt_logprobs_on_the_first_message_only(tiny):
    prompt = tiny.tokenizer.encode("echo: the prompt is scored token by token, " * 2)
    core = make_core(tiny, max_num_batched_tokens=16, max_num_seqs=4)
    with torch.inference_mode():
        ref = torch.log_softmax(tiny.model.forward_dense(torch.tensor([prompt]))[0], dim=-1)  # [T, vocab]
    async with serve_engine(core) as served:
        warm = await served.collect(_req(prompt, max_tokens=3))
        msgs = await served.collect(_req(prompt, max_tokens=3, prompt_logprobs=2))
    assert [len(m.delta.prompt_logprobs) for m in msgs if m.delta.token_ids] == [len(prompt) - 1, 0, 0]
    assert [t for m in msgs for t in m.delta.token_ids] == [t for m in warm for t in m.delta.token_ids]
    assert msgs[-1].final.usage.cached_prompt_tokens == 0 < warm[-1].final.usage.prompt_tokens
    for pos, entry in enumerate(msgs[0].delta.prompt_logprobs):
        token = prompt[pos + 1]
        assert entry.chosen.token_id == token
        assert entry.chosen.text == tiny.tokenizer.decode([token])
        assert entry.chosen.logprob == pytest.approx(ref[pos, token].item(), abs=1e-4)
        assert [t.token_id for t in entry.top] == ref[pos].topk(2).indices.tolist()


@pytest.mark.parametrize("value", [21, 1000])
async def test_out_of_range_is_invalid_argument(tiny, value):
    core = make_core(tiny, num_blocks=16)
    async with serve_engine(core) as served:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await served.collect(_req([1, 2, 3], max_tokens=2, prompt_logprobs=value))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_logprobs must be in 0..20" in err.value.details()


async def test_no_kv_service_import_but_new_chunks_are_exported(tiny, tmp_path):
    import asyncio

    from kvcache_utils import serving
    from kvmesh.services.engine.async_engine import AsyncEngine
    from kvmesh.services.engine.build import build_core
    from kvmesh.services.engine.config import EngineConfig
    from kvmesh.services.engine.sampling import SamplingParams
    from kvmesh.services.kvcache.config import KvcacheConfig

    prompt = [(13 * i + 1) % 256 for i in range(70)]  # 2 chunks of 32
    kv_cfg = KvcacheConfig(data_dir=tmp_path / "lmdb", disk_map_bytes=64 << 20, max_entry_bytes=8 << 20)

    async def run(address, params):
        core = build_core(EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=32, max_num_seqs=4, kv_codec="fp16",
                                       kvcache_address=address, kv_chunk_tokens=32), tiny)
        eng = AsyncEngine(lambda: core)
        outs = [out async for out in eng.generate(prompt, params)]
        await asyncio.to_thread(core.kv.flush)
        eng.shutdown()
        await core.kv.close()
        return outs, core.kv.stats

    asked = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=1)
    async with serving(kv_cfg) as kv:
        first, stats = await run(kv.address, asked)      # computes, scores and exports its prompt
        assert stats.exported_chunks == 2 and len(first[0].prompt_logprobs) == 69
        again, stats = await run(kv.address, asked)      # the service holds both chunks: not fetched
        assert stats.fetched_chunks == 0 and again[-1].usage.cached_prompt_tokens == 0
        assert [e.logprob for e in again[0].prompt_logprobs] == pytest.approx(
            [e.logprob for e in first[0].prompt_logprobs], abs=1e-5)
        plain, stats = await run(kv.address, SamplingParams(max_tokens=3, ignore_eos=True))
        assert stats.fetched_chunks == 2 and plain[-1].usage.cached_prompt_tokens == 64
    assert [t for o in plain for t in o.token_ids] == [t for o in first for t in o.token_ids]
