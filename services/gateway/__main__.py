"""`python -m kvmesh.services.gateway`: the gateway process (wiring only)."""
from __future__ import annotations

import asyncio
import logging
import sys

from kvmesh.config import describe, load_config
from kvmesh.rpc.client import make_channel
from kvmesh.rpc.server import run_service
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.prompts import load_tokenizer
from kvmesh.services.gateway.server import GatewayServer, build_gateway
from kvmesh.telemetry import setup_telemetry

log = logging.getLogger("kvmesh.gateway")


async def serve(cfg: GatewayConfig) -> None:
    provider = setup_telemetry("kvmesh-gateway", otlp_endpoint=cfg.otlp_endpoint)
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model)
    channel = make_channel(cfg.router_address)
    server = GatewayServer(cfg, build_gateway(cfg, tokenizer, channel))
    if cfg.open_to_network_without_keys:
        log.warning("serving beyond loopback without --keys-file: anyone who can reach the "
                    "gateway can use it; create keys with `python -m kvmesh.services.gateway.keys`")
    try:
        port = await server.start_http()
        log.info("gateway: OpenAI-compatible API on http://%s:%d/v1 (router %s)",
                 cfg.http_host, port, cfg.router_address)
        print(f"kvmesh-gateway http on {cfg.http_host}:{port}", flush=True)
        await run_service(server.rpc)
    finally:
        await server.stop_http()
        await channel.close()
        provider.shutdown()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_config(GatewayConfig, "gateway", argv)
    log.info("config: %s", describe(cfg))
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main(sys.argv[1:])
