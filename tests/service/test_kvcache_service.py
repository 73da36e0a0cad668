"""The KV-cache service's gRPC API against a real server on port 0 (memory + LMDB tiers)."""
from __future__ import annotations

import grpc
import pytest
import torch

from kvcache_utils import serving
from kvmesh.kv import codec
from kvmesh.kv.keys import prefix_keys
from kvmesh.kv.namespace import KvLayout, KvNamespace
from kvmesh.kv.namespace_proto import namespace_to_proto
from kvmesh.kv.transfer import checksum as blob_checksum
from kvmesh.kv.transfer import put_requests
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.services.kvcache.config import KvcacheConfig

NAMESPACE = KvNamespace("test-model", KvLayout(2, 2, 8, "float32"))
NS = NAMESPACE.digest()
MiB = 1 << 20


def make_blob(tokens: list[int], seed: int = 0, spec: codec.CodecSpec = codec.CodecSpec("fp16", zstd=False)) -> bytes:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, len(tokens), 2, 8, generator=g)
    v = torch.randn(2, len(tokens), 2, 8, generator=g)
    return codec.encode(k, v, codec.ChunkMeta(NS, tuple(tokens)), spec)


def put_stream(key: bytes, blob: bytes, part: int = 4096, namespace: KvNamespace = NAMESPACE, **header):
    """A Put stream in small slices, so that a blob spans several messages."""
    return put_requests(key, blob, namespace, part_bytes=part, **header)


def config(tmp_path, **overrides) -> KvcacheConfig:
    base = dict(data_dir=tmp_path / "lmdb", memory_bytes=4 * MiB, disk_map_bytes=64 * MiB,
                max_entry_bytes=2 * MiB)
    return KvcacheConfig(**{**base, **overrides})


@pytest.fixture
async def served(tmp_path):
    async with serving(config(tmp_path)) as s:
        yield s


@pytest.fixture
def kv(served):
    return served.stub


async def get_all(stub, keys: list[bytes]) -> dict[bytes, tuple[bytes | None, int]]:
    out, key, parts, tier = {}, None, [], pb.TIER_UNSPECIFIED
    async for msg in stub.Get(pb.GetRequest(keys=keys), timeout=10):
        if msg.HasField("header"):
            if key is not None:
                out[key] = (b"".join(parts), tier)
            key, parts, tier = msg.header.key, [], msg.header.tier
            if not msg.header.found:
                out[key], key = (None, tier), None
        else:
            parts.append(msg.data)
    if key is not None:
        out[key] = (b"".join(parts), tier)
    return out


async def test_put_get_lookup_roundtrip_across_parts(kv):
    tokens = list(range(64))
    keys = prefix_keys(tokens, 16, NS)  # 4 chained chunk keys
    blobs = [make_blob(tokens[i * 16:(i + 1) * 16], seed=i) for i in range(4)]
    for key, blob in zip(keys[:2], blobs[:2]):  # store the first two chunks only
        resp = await kv.Put(put_stream(key, blob, part=1000), timeout=10)
        assert resp.stored_bytes == len(blob)
    found = await kv.Lookup(pb.LookupRequest(keys=keys, chunk_tokens=16), timeout=10)
    assert list(found.tiers) == [pb.TIER_MEMORY, pb.TIER_MEMORY, pb.TIER_UNSPECIFIED, pb.TIER_UNSPECIFIED]
    assert (found.prefix_chunks, found.prefix_tokens) == (2, 32)
    got = await get_all(kv, [keys[1], keys[3], keys[0]])
    assert got[keys[1]] == (blobs[1], pb.TIER_MEMORY) and got[keys[0]] == (blobs[0], pb.TIER_MEMORY)
    assert got[keys[3]] == (None, pb.TIER_UNSPECIFIED)
    k, v, header = codec.decode(got[keys[0]][0], namespace=NS)
    assert header.token_ids == tuple(tokens[:16])


async def test_lookup_refuses_a_chunk_size_prefix_tokens_cannot_hold(kv):
    """Found by tests/fuzz: chunk_tokens near 2**32 made prefix_tokens (uint32) overflow, a
    ValueError building the answer: INTERNAL. Keys x chunk_tokens must fit."""
    tokens = list(range(32))
    keys = prefix_keys(tokens, 16, NS)
    for i, key in enumerate(keys):
        await kv.Put(put_stream(key, make_blob(tokens[i * 16:(i + 1) * 16], seed=i)), timeout=10)
    found = await kv.Lookup(pb.LookupRequest(keys=keys, chunk_tokens=2**31 - 1), timeout=10)
    assert (found.prefix_chunks, found.prefix_tokens) == (2, 2**32 - 2)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.Lookup(pb.LookupRequest(keys=keys, chunk_tokens=2**31), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chunk_tokens 2147483648" in err.value.details()


async def test_large_blob_streams_in_parts_and_is_byte_identical(kv):
    tokens = list(range(1024))
    blob = make_blob(tokens)  # ~130 KB; sent in 7 KB parts, served back in 1 MiB parts
    key = prefix_keys(tokens, 1024, NS)[0]
    await kv.Put(put_stream(key, blob, part=7000), timeout=10)
    assert (await get_all(kv, [key]))[key][0] == blob


@pytest.mark.parametrize("mutate, code, fragment", [
    (lambda key, blob: put_stream(key, blob[:-1] + bytes([blob[-1] ^ 1])), grpc.StatusCode.INVALID_ARGUMENT, "checksum"),
    (lambda key, blob: [pb.PutRequest(data=blob)], grpc.StatusCode.INVALID_ARGUMENT, "header"),
    (lambda key, blob: put_stream(key[:5], blob), grpc.StatusCode.INVALID_ARGUMENT, "32 bytes"),
    (lambda key, blob: iter([pb.PutRequest(header=pb.PutHeader(key=key, total_bytes=len(blob) + 10,
                                                                checksum=blob_checksum(blob),
                                                                namespace=namespace_to_proto(NAMESPACE))),
                             pb.PutRequest(data=blob)]), grpc.StatusCode.INVALID_ARGUMENT, "received"),
    (lambda key, blob: iter([pb.PutRequest(header=pb.PutHeader(key=key, total_bytes=len(blob),
                                                                checksum=blob_checksum(blob))),
                             pb.PutRequest(data=blob)]), grpc.StatusCode.INVALID_ARGUMENT, "namespace is unset"),
    (lambda key, blob: put_stream(key, blob, namespace=NAMESPACE.for_tenant("tenant:other")),
     grpc.StatusCode.INVALID_ARGUMENT, "encoded for namespace"),
    (lambda key, blob: put_stream(key, blob, namespace=NAMESPACE.with_storage("int4-g64-r0-h0-o0")),
     grpc.StatusCode.INVALID_ARGUMENT, "encoded for namespace"),
    (lambda key, blob: put_stream(key, b"not a kv blob at all"), grpc.StatusCode.INVALID_ARGUMENT, "not a valid"),
    (lambda key, blob: put_stream(key, blob, ttl_s=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "ttl_s"),
    (lambda key, blob: put_stream(key, blob, ttl_s=float("nan")), grpc.StatusCode.INVALID_ARGUMENT, "ttl_s"),
])
async def test_bad_puts_are_rejected_and_store_nothing(kv, mutate, code, fragment):
    tokens = list(range(16))
    key, blob = prefix_keys(tokens, 16, NS)[0], make_blob(tokens)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.Put(mutate(key, blob), timeout=10)
    assert err.value.code() == code and fragment in err.value.details()
    found = await kv.Lookup(pb.LookupRequest(keys=[key]), timeout=10)
    assert list(found.tiers) == [pb.TIER_UNSPECIFIED]


@pytest.mark.parametrize("where", ["header", "data"])
async def test_a_put_message_protobuf_cannot_parse_is_invalid_argument(served, where):
    """Found by tests/fuzz: in a client stream, bytes protobuf refuses were INTERNAL (grpc's
    deserializer raised DecodeError in the servicer's loop); the shared interceptor answers
    INVALID_ARGUMENT, naming the field where it can, as for a unary request."""
    tokens = list(range(16))
    key, blob = prefix_keys(tokens, 16, NS)[0], make_blob(tokens)
    stream = [m.SerializeToString() for m in put_stream(key, blob)]
    if where == "header":  # header.text holding a lone surrogate: 3 bytes for 3, lengths hold
        header = pb.PutRequest.FromString(stream[0])
        header.header.text = "XYZ"
        stream[0] = header.SerializeToString().replace(b"XYZ", "\ud800".encode("utf-8", "surrogatepass"))
        fragment = "'header.text'"
    else:
        stream.insert(1, b"\x12\xff")  # data whose length runs past the message
        fragment = "not a valid kvmesh.kvcache.v1.PutRequest"
    async with grpc.aio.insecure_channel(served.address) as channel:
        put = channel.stream_unary("/kvmesh.kvcache.v1.KvcacheService/Put", request_serializer=lambda b: b,
                                   response_deserializer=pb.PutResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await put(iter(stream), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details()
    found = await served.stub.Lookup(pb.LookupRequest(keys=[key]), timeout=10)
    assert list(found.tiers) == [pb.TIER_UNSPECIFIED]


async def test_oversized_put_is_resource_exhausted(kv):
    tokens = list(range(16))
    key = prefix_keys(tokens, 16, NS)[0]
    header = pb.PutHeader(key=key, total_bytes=3 * MiB, checksum=b"x" * 16, namespace=namespace_to_proto(NAMESPACE))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await kv.Put(iter([pb.PutRequest(header=header)]), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max entry size" in err.value.details()


async def test_delete_pin_ttl_and_stats(kv):
    tokens = list(range(48))
    keys = prefix_keys(tokens, 16, NS)
    blobs = [make_blob(tokens[i * 16:(i + 1) * 16], seed=i) for i in range(3)]
    for key, blob in zip(keys, blobs):
        await kv.Put(put_stream(key, blob), timeout=10)
    stats = await kv.Stats(pb.StatsRequest(), timeout=10)
    assert [t.tier for t in stats.tiers] == [pb.TIER_MEMORY, pb.TIER_DISK]
    assert [t.entries for t in stats.tiers] == [3, 3]
    assert stats.tiers[0].bytes == sum(map(len, blobs))
    assert (await kv.Pin(pb.PinRequest(keys=keys[:2], pinned=True), timeout=10)).updated == 2
    assert (await kv.SetTtl(pb.SetTtlRequest(keys=[keys[2]], ttl_s=60.0), timeout=10)).updated == 1
    assert (await kv.Delete(pb.DeleteRequest(keys=[keys[1], b"\0" * 32]), timeout=10)).deleted == 1
    found = await kv.Lookup(pb.LookupRequest(keys=keys, chunk_tokens=16), timeout=10)
    assert found.prefix_chunks == 1 and found.tiers[1] == pb.TIER_UNSPECIFIED
    await get_all(kv, [keys[0], keys[1]])
    stats = await kv.Stats(pb.StatsRequest(), timeout=10)
    assert [t.entries for t in stats.tiers] == [2, 2]
    assert (stats.tiers[0].hits, stats.tiers[0].misses) == (1, 1)
    for ttl in (0.0, float("nan")):  # NaN passed a `ttl <= 0` check
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await kv.SetTtl(pb.SetTtlRequest(keys=[keys[0]], ttl_s=ttl), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_two_services_share_entries_through_the_redis_tier(tmp_path, redis_server):
    """Two KV services (two machines' worth) with their own memory and disk tiers and one Redis:
    what one stores, the other serves from Redis, byte for byte, and keeps in its memory tier."""
    def shared(name: str) -> KvcacheConfig:
        return config(tmp_path, data_dir=tmp_path / name, tiers=("memory", "disk", "redis"),
                      redis_url=redis_server.url)

    async with serving(shared("a")) as a, serving(shared("b")) as b:
        stubs = [a.stub, b.stub]
        tokens = list(range(32))
        key, blob = prefix_keys(tokens, 32, NS)[0], make_blob(tokens)
        await stubs[0].Put(put_stream(key, blob), timeout=10)
        found = await stubs[1].Lookup(pb.LookupRequest(keys=[key]), timeout=10)
        assert list(found.tiers) == [pb.TIER_REDIS]
        assert (await get_all(stubs[1], [key]))[key] == (blob, pb.TIER_REDIS)
        found = await stubs[1].Lookup(pb.LookupRequest(keys=[key]), timeout=10)
        assert list(found.tiers) == [pb.TIER_MEMORY]  # promoted on read


async def test_a_stored_blob_that_went_bad_is_a_miss_and_is_deleted(served):
    tokens = list(range(16))
    key, blob = prefix_keys(tokens, 16, NS)[0], make_blob(tokens)
    await served.stub.Put(put_stream(key, blob), timeout=10)
    damaged = blob[:40] + bytes([blob[40] ^ 0x10]) + blob[41:]
    for tier in served.backend.store.tiers:  # bit rot under the service, in every tier
        tier.put(key, damaged)
    assert (await get_all(served.stub, [key]))[key] == (None, pb.TIER_UNSPECIFIED)
    found = await served.stub.Lookup(pb.LookupRequest(keys=[key]), timeout=10)
    assert list(found.tiers) == [pb.TIER_UNSPECIFIED]
    assert (await served.stub.Stats(pb.StatsRequest(), timeout=10)).corrupt_entries == 1
