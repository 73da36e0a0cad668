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
from kvmesh.services.kvcache.backend import Backend
from kvmesh.services.kvcache.build import build_store
from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.services.kvcache.metrics import KvcacheMetrics
from kvmesh.services.kvcache.servicer import KvCatalogServicer, KvcacheServicer
from kvmesh.telemetry import Telemetry

class WordEmbedder:
    """A fast, deterministic stand-in for the real embedder: a normalized bag of hashed words, so
    texts sharing words are similar. ``calls`` counts embedded texts."""

    dim = 384
    name = "word-embedder"
    max_tokens = 64
    """Texts of more words are refused by Embed, as the real model refuses too many tokens."""

    def __init__(self) -> None:
        self.calls = 0

    def token_counts(self, texts: list[str]) -> list[int]:
        return [len(t.split()) for t in texts]

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
    """The blob store (KvcacheService)."""
    catalog: kvcache_pb2_grpc.KvCatalogServiceStub
    """Documents and search (KvCatalogService), on the same server."""
    backend: Backend


@contextlib.asynccontextmanager
async def serving(cfg: KvcacheConfig, embedder=None, telemetry: Telemetry | None = None
                  ) -> AsyncIterator[Serving]:
    """Starts a KV-cache server for `cfg` (its port is ignored: port 0) with both services, yields
    it with client stubs, then drains it and closes its store. `embedder` replaces the real one
    (e.g. WordEmbedder); metrics and spans go to `telemetry` (default: a fresh one)."""
    telemetry = telemetry or Telemetry.create("kvmesh-kvcache")
    backend = Backend(build_store(cfg), metrics=KvcacheMetrics(telemetry.registry), embedder=embedder)
    blobs, catalog = KvcacheServicer(backend, max_entry_bytes=cfg.max_entry_bytes), KvCatalogServicer(backend)

    def register(server: grpc.aio.Server) -> None:
        kvcache_pb2_grpc.add_KvcacheServiceServicer_to_server(blobs, server)
        kvcache_pb2_grpc.add_KvCatalogServiceServicer_to_server(catalog, server)

    try:
        async with served("kvcache", register, SERVICE, telemetry=telemetry) as srv:
            yield Serving(srv.address, kvcache_pb2_grpc.KvcacheServiceStub(srv.channel),
                          kvcache_pb2_grpc.KvCatalogServiceStub(srv.channel), backend)
    finally:
        backend.close()
