"""`python -m kvmesh.services.engine`: the engine service process (wiring only)."""
from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh.allocator import keep_freed_memory
from kvmesh.config import describe, load_config
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from kvmesh.rpc.server import RpcServer, ServerOptions, run_service
from kvmesh.services.engine import metrics
from kvmesh.services.engine.build import build_async_engine, model_info
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.servicer import EngineServicer
from kvmesh.telemetry import setup_telemetry

log = logging.getLogger("kvmesh.engine")
SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name


async def serve(cfg: EngineConfig) -> None:
    setup_telemetry("kvmesh-engine", otlp_endpoint=cfg.otlp_endpoint)
    engine = build_async_engine(cfg)
    metrics.instrument(engine)
    if engine.core.kv is not None:
        await engine.core.kv.warm_up()
    servicer = EngineServicer(engine, model_info(engine.core, cfg))
    server = RpcServer(
        "engine",
        ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s,
                      metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port),
        lambda s: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, s),
        [SERVICE],
        on_drain=lambda: engine.drain(cfg.grace_s))
    try:
        await run_service(server)
    finally:
        engine.shutdown()
        if engine.core.drafts is not None:
            engine.core.drafts.close()
        if engine.core.kv is not None:
            await engine.core.kv.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(EngineConfig, "engine", argv)
    log.info("config: %s", describe(cfg))
    keep_freed_memory()
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
