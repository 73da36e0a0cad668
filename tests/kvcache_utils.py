"""Test helper: a real KV-cache gRPC server on port 0, in this process."""
from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass
from typing import AsyncIterator

import grpc
import numpy as np

from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.kvcache.v1 import kvcache_pb2_grpc
from rpc_utils import served
from kvmesh.services.kvcache.build import build_store
from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.services.kvcache.servicer import KvcacheServicer

class WordEmbedder:
    """A fast, deterministic stand-in for the real embedder: a normalized bag of hashed words, so
    texts sharing words are similar. ``calls`` counts embedded texts."""

    dim = 384

    def __init__(self) -> None:
        self.calls = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for word in text.lower().split():
                out[row, int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "little") % self.dim] += 1
            out[row] /= max(float(np.linalg.norm(out[row])), 1e-9)
        self.calls += len(texts)
        return out


SERVICE = pb.DESCRIPTOR.services_by_name["KvcacheService"].full_name


@dataclass
class Serving:
    address: str
    stub: kvcache_pb2_grpc.KvcacheServiceStub
    servicer: KvcacheServicer


@contextlib.asynccontextmanager
async def serving(cfg: KvcacheConfig, embedder=None) -> AsyncIterator[Serving]:
    """Starts a KV-cache server for `cfg` (its port is ignored: port 0), yields it with a client
    stub, then drains it and closes its store. `embedder` replaces the real one (e.g. WordEmbedder)."""
    servicer = KvcacheServicer(build_store(cfg), max_entry_bytes=cfg.max_entry_bytes, embedder=embedder)
    try:
        async with served("kvcache", lambda s: kvcache_pb2_grpc.add_KvcacheServiceServicer_to_server(servicer, s),
                          SERVICE) as srv:
            yield Serving(srv.address, kvcache_pb2_grpc.KvcacheServiceStub(srv.channel), servicer)
    finally:
        servicer.close()
