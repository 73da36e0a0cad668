"""`python -m kvmesh.services.router`: the router service process (wiring only; no torch)."""
from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh.config import describe, load_config
from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.rpc.server import RpcServer, ServerOptions, run_service
from kvmesh.services.router.build import build_router
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.servicer import RouterServicer
from kvmesh.telemetry import setup_telemetry

log = logging.getLogger("kvmesh.router")
SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


async def serve(cfg: RouterConfig) -> None:
    setup_telemetry("kvmesh-router", otlp_endpoint=cfg.otlp_endpoint)
    router = build_router(cfg)
    servicer = RouterServicer(router)
    server = RpcServer(
        "router",
        ServerOptions(host=cfg.host, port=cfg.port, grace_s=cfg.grace_s,
                      metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port),
        lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, s),
        [SERVICE])
    try:
        await run_service(server)
    finally:
        await router.close()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(RouterConfig, "router", argv)
    log.info("config: %s", describe(cfg))
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
