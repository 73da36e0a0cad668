"""`python -m kvmesh.services.router`: the router service process (wiring only; no torch)."""
from __future__ import annotations

import sys

from kvmesh.router.v1 import router_pb2, router_pb2_grpc
from kvmesh.rpc.entry import Service, serve_main
from kvmesh.services.router.build import build_router
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.servicer import RouterServicer
from kvmesh.telemetry import Telemetry

SERVICE = router_pb2.DESCRIPTOR.services_by_name["RouterService"].full_name


async def build(cfg: RouterConfig, telemetry: Telemetry) -> Service:
    router = build_router(cfg, RouterMetrics(telemetry.registry))
    servicer = RouterServicer(router)
    return Service(lambda s: router_pb2_grpc.add_RouterServiceServicer_to_server(servicer, s),
                   (SERVICE,), close=router.close)


def main(argv: list[str] | None = None) -> None:
    serve_main(RouterConfig, "router", build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
