"""`python -m kvmesh.services.kvcache`: the KV-cache service process (wiring only)."""
from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh.config import describe, load_config
from kvmesh.kvcache.v1 import kvcache_pb2, kvcache_pb2_grpc
from kvmesh.rpc.server import RpcServer, ServerOptions, run_service
from kvmesh.services.kvcache import metrics
from kvmesh.services.kvcache.build import build_store
from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.services.kvcache.servicer import KvcacheServicer
from kvmesh.telemetry import setup_telemetry

log = logging.getLogger("kvmesh.kvcache")
SERVICE = kvcache_pb2.DESCRIPTOR.services_by_name["KvcacheService"].full_name


async def serve(cfg: KvcacheConfig) -> None:
    setup_telemetry("kvmesh-kvcache", otlp_endpoint=cfg.otlp_endpoint)
    servicer = KvcacheServicer(build_store(cfg), max_entry_bytes=cfg.max_entry_bytes)
    metrics.register_store(servicer)
    server = RpcServer(
        "kvcache",
        ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s,
                      metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port),
        lambda s: kvcache_pb2_grpc.add_KvcacheServiceServicer_to_server(servicer, s),
        [SERVICE])
    sweeper = asyncio.ensure_future(servicer.sweep_forever(cfg.sweep_interval_s)) if cfg.sweep_interval_s else None
    try:
        await run_service(server)
    finally:
        if sweeper is not None:
            sweeper.cancel()
        servicer.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(KvcacheConfig, "kvcache", argv)
    log.info("config: %s", describe(cfg))
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
