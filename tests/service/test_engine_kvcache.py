"""Engine + KV-cache service on the real model: prefix KV leaves one engine and comes back to a
fresh one; every fault of the KV service degrades to recompute."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_utils import greedy
from kvcache_utils import serving
from kvmesh.kv import codec
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.kvcache.v1 import kvcache_pb2_grpc
from kvmesh.launcher import free_port
from kvmesh.model.perplexity import reference_text
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.build import build_core
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.kvcache.config import KvcacheConfig

pytestmark = pytest.mark.slow
CHUNK = 32


@pytest.fixture
async def kv_address(tmp_path):
    cfg = KvcacheConfig(data_dir=tmp_path / "lmdb", disk_map_bytes=256 << 20, max_entry_bytes=32 << 20)
    async with serving(cfg) as served:
        yield served.address


def engine(loaded, address: str, **overrides) -> AsyncEngine:
    """A fresh engine (empty paged cache and prefix cache) linked to the KV service at `address`."""
    settings = dict(num_blocks=256, block_size=16, max_num_batched_tokens=64, kvcache_address=address,
                    kv_chunk_tokens=CHUNK, kv_timeout_s=5.0)
    cfg = EngineConfig(**{**settings, **overrides})
    core = build_core(cfg, loaded)
    return AsyncEngine(lambda: core)


async def run(eng: AsyncEngine, prompt: list[int], max_tokens: int = 8, salt: str = ""):
    tokens, final = [], None
    async for out in eng.generate(prompt, greedy(max_tokens, ignore_eos=True), tenant_salt=salt):
        tokens += out.token_ids
        if out.finished:
            final = out
    return tokens, final


@pytest.fixture(scope="module")
def prompt(bundled_model) -> list[int]:
    return bundled_model.tokenizer.encode(reference_text())[:100]  # 3 full chunks + 4 tokens


async def flushed(eng: AsyncEngine) -> bool:
    """Waits for the engine's queued exports off the event loop (the KV server runs on it)."""
    return await asyncio.to_thread(eng.core.kv.flush)


async def close(eng: AsyncEngine) -> None:
    eng.shutdown()
    await eng.core.kv.close()


@pytest.mark.parametrize("codec_name", ["fp16", "int8"])
async def test_prefix_kv_comes_back_to_a_fresh_engine(bundled_model, kv_address, prompt, codec_name):
    first = engine(bundled_model, kv_address, kv_codec=codec_name)
    cold_tokens, cold = await run(first, prompt)
    assert cold.usage.cached_prompt_tokens == 0
    assert await flushed(first)
    assert first.core.kv.stats.exported_chunks == 3
    await close(first)

    second = engine(bundled_model, kv_address, kv_codec=codec_name)  # nothing cached locally
    warm_tokens, warm = await run(second, prompt)
    assert warm.usage.cached_prompt_tokens == 3 * CHUNK
    assert second.core.kv.stats.fetched_chunks == 3
    assert warm_tokens == cold_tokens  # lossy codecs, but these 8 greedy tokens do not move
    assert await flushed(second) and second.core.kv.stats.exported_chunks == 0  # all present already
    await close(second)


async def test_other_salt_never_reuses(bundled_model, kv_address, prompt):
    first = engine(bundled_model, kv_address)
    await run(first, prompt, salt="tenant-a")
    assert await flushed(first)
    await close(first)
    second = engine(bundled_model, kv_address)
    _, final = await run(second, prompt, salt="tenant-b")
    assert final.usage.cached_prompt_tokens == 0 and second.core.kv.stats.fetched_chunks == 0
    await close(second)


async def test_kv_service_down_means_recompute(bundled_model, prompt):
    eng = engine(bundled_model, f"127.0.0.1:{free_port()}", kv_timeout_s=1.0)  # nothing listens there
    baseline = engine(bundled_model, f"127.0.0.1:{free_port()}", kv_timeout_s=1.0)
    tokens, final = await run(eng, prompt)
    assert final.finish_reason == "length" and final.usage.cached_prompt_tokens == 0
    assert eng.core.kv.stats.fetch_failures == 1
    assert await flushed(eng) and eng.core.kv.stats.export_failures == 3
    await close(eng)
    assert tokens == (await run(baseline, prompt))[0]
    await close(baseline)


async def test_bad_blob_is_a_miss_and_is_deleted(bundled_model, kv_address, prompt):
    first = engine(bundled_model, kv_address, kv_codec="fp16")  # fp16: outputs comparable token for token
    cold_tokens, _ = await run(first, prompt)
    assert await flushed(first)
    plan = await first.core.kv.prepare(prompt, first.core.request_namespace(""))
    ns = plan.namespace.digest()
    await close(first)
    # Overwrite chunk 1 with an intact blob that claims other tokens (a bad writer / collision).
    k, v, header = codec.decode(await fetch(kv_address, plan.keys[1]), namespace=ns)
    forged = codec.encode(k, v, codec.ChunkMeta(ns, tuple(t + 1 for t in header.token_ids)),
                          codec.CodecSpec("fp16", zstd=False))
    await put(kv_address, plan.keys[1], forged, plan.namespace)

    second = engine(bundled_model, kv_address, kv_codec="fp16")
    tokens, final = await run(second, prompt)
    assert final.usage.cached_prompt_tokens == CHUNK  # chunk 0 only: the rest is recomputed
    assert second.core.kv.stats.bad_blobs == 1 and tokens == cold_tokens
    # The forged entry is gone: the second engine recomputed chunks 1-2 and stored them correctly.
    assert await flushed(second) and second.core.kv.stats.exported_chunks == 2
    _, _, header = codec.decode(await fetch(kv_address, plan.keys[1]), namespace=ns)
    assert header.token_ids == tuple(prompt[CHUNK:2 * CHUNK])
    await close(second)


async def fetch(address: str, key: bytes) -> bytes:
    async with grpc.aio.insecure_channel(address) as ch:
        parts = [m.data async for m in kvcache_pb2_grpc.KvcacheServiceStub(ch).Get(pb.GetRequest(keys=[key]), timeout=5)
                 if not m.HasField("header")]
    return b"".join(parts)


async def put(address: str, key: bytes, blob: bytes, namespace) -> None:
    from kvmesh.kv.transfer import put_requests

    async with grpc.aio.insecure_channel(address) as ch:
        await kvcache_pb2_grpc.KvcacheServiceStub(ch).Put(put_requests(key, blob, namespace), timeout=5)


async def test_per_request_codec_overrides_the_deployment(bundled_model, kv_address, prompt):
    eng = engine(bundled_model, kv_address, kv_codec="int4")
    final = None
    fp16 = eng.kv_codec("fp16", True)
    async for out in eng.generate(prompt, greedy(2), kv_codec=fp16):
        final = out
    assert final.finished and await flushed(eng) and eng.core.kv.stats.exported_chunks == 3
    assert final.reuse_storage == "fp16"  # a float32 engine's KV in fp16: lossy, and said so
    plan = await eng.core.kv.prepare(prompt, eng.core.request_namespace("", fp16))
    _, _, header = codec.decode(await fetch(kv_address, plan.keys[0]), namespace=plan.namespace.digest())
    assert (header.codec, header.zstd) == ("fp16", True)
    # the deployment's int4 namespace holds none of them: lossy formats never pass for each other
    assert not any((await eng.core.kv.client.lookup((await eng.core.kv.prepare(prompt, eng.core.request_namespace(""))).keys)).present)
    from kvmesh.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="unknown KV codec 'int3'"):
        eng.kv_codec("int3", False)
    await close(eng)


async def test_a_prefix_the_engine_holds_is_not_fetched_again(bundled_model, kv_address, prompt):
    eng = engine(bundled_model, kv_address)
    await run(eng, prompt)
    assert await flushed(eng) and eng.core.kv.stats.exported_chunks == 3
    _, final = await run(eng, prompt)  # the same engine: its own prefix cache holds the prompt
    assert final.usage.cached_prompt_tokens == 96 and eng.core.kv.stats.fetched_chunks == 0
    assert final.usage.imported_prompt_tokens == 0 and final.reuse_storage == "exact"  # the default
    longer = prompt + prompt[:40]  # 140 tokens: the local cache covers 96, the service has 3 chunks
    _, final = await run(eng, longer)
    assert final.usage.cached_prompt_tokens >= 96 and eng.core.kv.stats.fetched_chunks == 0
    await close(eng)


async def test_only_chunks_past_the_local_prefix_are_fetched(bundled_model, kv_address, prompt):
    first = engine(bundled_model, kv_address, kv_codec="fp16")
    cold_tokens, _ = await run(first, prompt)
    assert await flushed(first)
    await close(first)
    second = engine(bundled_model, kv_address, kv_codec="fp16")
    await run(second, prompt[:40])  # now positions 0..31 (chunk 0) are in the engine itself
    before = second.core.kv.stats.fetched_chunks
    tokens, final = await run(second, prompt)
    assert second.core.kv.stats.fetched_chunks - before == 2  # chunks 1 and 2, after the local hit
    assert final.usage.cached_prompt_tokens == 96 and tokens == cold_tokens
    assert final.usage.imported_prompt_tokens == 64 and final.reuse_storage == "fp16"  # 32 local, 64 fetched
    await close(second)


async def test_a_tenant_sharing_a_namespace_never_gets_lossy_kv_it_did_not_opt_into(bundled_model, kv_address,
                                                                                     prompt):
    salt = "ns:shared"
    alone = engine(bundled_model, kv_address, kvcache_address=None)
    baseline, _ = await run(alone, prompt)
    alone.shutdown()
    writer = engine(bundled_model, kv_address)  # the deployment default: exact
    int8 = writer.kv_codec("int8", True)
    async for out in writer.generate(prompt, greedy(2), tenant_salt=salt, kv_codec=int8):  # opted in
        pass
    assert await flushed(writer) and writer.core.kv.stats.exported_chunks == 3
    await close(writer)

    plain = engine(bundled_model, kv_address)  # a fresh replica: nothing in its own prefix cache
    tokens, final = await run(plain, prompt, salt=salt)
    assert final.usage.imported_prompt_tokens == 0 and final.reuse_storage == "exact"
    assert tokens == baseline
    await close(plain)

    opted = engine(bundled_model, kv_address)
    final = None
    async for out in opted.generate(prompt, greedy(2, ignore_eos=True), tenant_salt=salt, kv_codec=int8):
        final = out
    assert final.usage.imported_prompt_tokens == 3 * CHUNK and final.reuse_storage.startswith("int8")
    await close(opted)
