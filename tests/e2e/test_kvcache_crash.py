"""SIGKILL the KV-cache service during a write load, restart it on the same data directory:
every acknowledged entry is readable and byte-identical, nothing half-written is visible."""
from __future__ import annotations

import hashlib
import os
import signal
import threading

import grpc
import torch

from kvmesh import launcher
from kvmesh.kv import codec
from kvmesh.kv.keys import prefix_keys
from kvmesh.kv.namespace import KvLayout, KvNamespace
from kvmesh.kv.transfer import put_requests
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.kvcache.v1 import kvcache_pb2_grpc

NAMESPACE = KvNamespace("crash-test", KvLayout(4, 2, 64, "float32"))
NS = NAMESPACE.digest()
CHUNK = 64


def blob_for(i: int) -> tuple[bytes, bytes]:
    """Entry i: its chained key and a ~100 KB blob, both reproducible from i."""
    tokens = [(i * 7919 + t) % 50000 for t in range(CHUNK)]
    g = torch.Generator().manual_seed(i)
    k, v = torch.randn(4, CHUNK, 2, 64, generator=g), torch.randn(4, CHUNK, 2, 64, generator=g)
    return prefix_keys(tokens, CHUNK, NS)[0], codec.encode(k, v, codec.ChunkMeta(NS, tuple(tokens)),
                                                           codec.CodecSpec("fp16", zstd=False))


def start(tmp_path, port: int) -> launcher.ServiceProc:
    return launcher.start_service(
        "crash-kvcache", "kvmesh.services.kvcache",
        ["--data-dir", str(tmp_path / "data"), "--tiers", "memory,disk", "--disk-map-bytes", str(256 << 20),
         "--max-entry-bytes", str(16 << 20)], port, ready_timeout_s=60)


def test_sigkill_during_writes_loses_no_acknowledged_entry(tmp_path):
    port = launcher.free_port()
    svc = start(tmp_path, port)
    acked: list[int] = []
    enough = threading.Event()

    def writer() -> None:
        with grpc.insecure_channel(svc.address) as ch:
            stub = kvcache_pb2_grpc.KvcacheServiceStub(ch)
            for i in range(10_000):
                key, blob = blob_for(i)
                try:
                    stub.Put(put_requests(key, blob, NAMESPACE), timeout=10)
                except grpc.RpcError:
                    return  # the service died under this Put: not acknowledged
                acked.append(i)
                if len(acked) == 40:
                    enough.set()

    thread = threading.Thread(target=writer)
    thread.start()
    assert enough.wait(120), "the writer never got 40 entries acknowledged"
    os.kill(svc.pid, signal.SIGKILL)  # mid-stream: the writer is inside its next Put
    thread.join(60)
    assert not thread.is_alive()

    svc = start(tmp_path, port)
    try:
        with grpc.insecure_channel(svc.address) as ch:
            stub = kvcache_pb2_grpc.KvcacheServiceStub(ch)
            attempted = list(range(len(acked) + 1))  # + the Put that was cut off
            keys = [blob_for(i)[0] for i in attempted]
            found = stub.Lookup(pb.LookupRequest(keys=keys), timeout=10)
            got, current = {}, None
            for msg in stub.Get(pb.GetRequest(keys=keys), timeout=30):
                if msg.HasField("header"):
                    current = msg.header.key if msg.header.found else None
                    if current is not None:
                        got[current] = (b"", msg.header.checksum)
                else:
                    data, checksum = got[current]
                    got[current] = (data + msg.data, checksum)
    finally:
        launcher.stop_service(svc)
    for i in acked:
        key, blob = blob_for(i)
        assert found.tiers[i] == pb.TIER_DISK, f"acknowledged entry {i} lost"
        assert got[key][0] == blob, f"acknowledged entry {i} changed"
    # The interrupted Put is either absent or complete, never partial.
    key, blob = blob_for(len(acked))
    assert key not in got or got[key][0] == blob
    for data, checksum in got.values():
        assert hashlib.blake2b(data, digest_size=16).digest() == checksum
