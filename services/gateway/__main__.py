"""`python -m kvmesh.services.gateway`: the gateway process (wiring only)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys

from kvmesh.rpc.client import make_channel
from kvmesh.rpc.entry import Service, serve_main
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.metrics import GatewayMetrics
from kvmesh.services.gateway.prompts import load_tokenizer
from kvmesh.services.gateway.server import GatewayServer, build_gateway
from kvmesh.telemetry import Telemetry

log = logging.getLogger("kvmesh.gateway")


async def build(cfg: GatewayConfig, telemetry: Telemetry) -> Service:
    """The gateway with its HTTP server already listening (before the gRPC one, so gRPC health
    SERVING means both are up)."""
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model)
    channel = make_channel(cfg.router_address)
    gateway = build_gateway(cfg, tokenizer, channel, GatewayMetrics(telemetry.registry))
    server = GatewayServer(cfg, gateway, telemetry)
    if cfg.open_to_network_without_keys:
        log.warning("serving beyond loopback without --keys-file: anyone who can reach the "
                    "gateway can use it; create keys with `python -m kvmesh.services.gateway.keys`")
    port = await server.start_http()
    log.info("gateway: OpenAI-compatible API on http://%s:%d/v1 (router %s)",
             cfg.http_host, port, cfg.router_address)
    print(f"kvmesh-gateway http on {cfg.http_host}:{port}", flush=True)

    async def close() -> None:
        await server.stop_http()
        await channel.close()

    return dataclasses.replace(server.service, close=close)


def main(argv: list[str] | None = None) -> None:
    serve_main(GatewayConfig, "gateway", build, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
