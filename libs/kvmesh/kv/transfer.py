"""How a KV blob crosses kvmesh.kvcache.v1: one checksum and one slicing, for the service and
every client (engine exports, tests, tools)."""
from __future__ import annotations

import hashlib
from typing import Iterator

from kvmesh.kv.namespace import KvNamespace
from kvmesh.kv.namespace_proto import namespace_to_proto
from kvmesh.kvcache.v1 import kvcache_pb2 as pb

PART_BYTES = 1 << 20
"""Data slice per stream message: far below the gRPC message limit, large enough to be cheap."""
CHECKSUM_BYTES = 16


def checksum(blob: bytes) -> bytes:
    """The transfer checksum of Put and Get: blake2b-128 over the whole blob."""
    return hashlib.blake2b(blob, digest_size=CHECKSUM_BYTES).digest()


def slices(blob: bytes, part_bytes: int = PART_BYTES) -> Iterator[bytes]:
    """Consecutive slices of `blob`, each at most `part_bytes` long."""
    view = memoryview(blob)
    for start in range(0, len(blob), part_bytes):
        yield bytes(view[start:start + part_bytes])


def put_requests(key: bytes, blob: bytes, namespace: KvNamespace, *, ttl_s: float | None = None,
                 pinned: bool = False, part_bytes: int = PART_BYTES) -> Iterator[pb.PutRequest]:
    """The client stream of one Put: the header (size, checksum, the namespace the blob was
    encoded for, TTL, pin), then the data slices."""
    header = pb.PutHeader(key=key, total_bytes=len(blob), checksum=checksum(blob),
                          namespace=namespace_to_proto(namespace), pinned=pinned)
    if ttl_s is not None:
        header.ttl_s = ttl_s
    yield pb.PutRequest(header=header)
    for part in slices(blob, part_bytes):
        yield pb.PutRequest(data=part)
