"""`python -m kvmesh.services.kvcache`: the KV-cache service process (wiring only)."""
from __future__ import annotations

import asyncio
import sys

from kvmesh.kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc
from kvmesh.rpc.entry import Service, serve_main
from kvmesh.services.kvcache.backend import Backend
from kvmesh.services.kvcache.build import build_store
from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.services.kvcache.metrics import KvcacheMetrics
from kvmesh.services.kvcache.servicer import KvCatalogServicer, KvcacheServicer
from kvmesh.telemetry import Telemetry

SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KvcacheService"].full_name
CATALOG_SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KvCatalogService"].full_name


async def build(cfg: KvcacheConfig, telemetry: Telemetry) -> Service:
    metrics = KvcacheMetrics(telemetry.registry)
    backend = Backend(build_store(cfg), metrics=metrics)
    servicer = KvcacheServicer(backend, max_entry_bytes=cfg.max_entry_bytes)
    catalog = KvCatalogServicer(backend)
    metrics.watch_store(backend)
    sweeper = (asyncio.ensure_future(backend.sweep_forever(cfg.sweep_interval_s))
               if cfg.sweep_interval_s else None)

    async def close() -> None:
        if sweeper is not None:
            sweeper.cancel()
        backend.close()

    def register(server) -> None:
        kvcache_pb2_grpc.add_KvcacheServiceServicer_to_server(servicer, server)
        kvcache_pb2_grpc.add_KvCatalogServiceServicer_to_server(catalog, server)

    return Service(register, (SERVICE, CATALOG_SERVICE), close=close)


def main(argv: list[str] | None = None) -> None:
    serve_main(KvcacheConfig, "kvcache", build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
