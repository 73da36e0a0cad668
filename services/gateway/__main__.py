"""`python -m kvmesh.services.gateway`: the gateway process (wiring only)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import sys

from kvmesh.config import ConfigError, command
from kvmesh.model.tokenizer import read_chat_template
from kvmesh.rpc.client import make_channel
from kvmesh.rpc.entry import Service, serve_main
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.metrics import GatewayMetrics
from kvmesh.services.gateway.model_check import check_upstream_tokenizer
from kvmesh.services.gateway.prompts import load_tokenizer
from kvmesh.services.gateway.server import GatewayServer, build_gateway
from kvmesh.telemetry import Telemetry

log = logging.getLogger("kvmesh.gateway")


async def build(cfg: GatewayConfig, telemetry: Telemetry) -> Service:
    """The gateway with its HTTP server already listening (before the gRPC one, so gRPC health
    SERVING means both are up)."""
    tokenizer = await asyncio.to_thread(load_tokenizer, cfg.model)
    if cfg.chat_template is not None:
        try:
            tokenizer = tokenizer.with_chat_template(read_chat_template(cfg.chat_template))
        except ValueError as e:
            raise SystemExit(f"{command('gateway')}: error: {e} (KVMESH_GATEWAY_CHAT_TEMPLATE)") from None
        log.info("chat template: from --chat-template")
    # A restarted router (the supervisor restarts it in ~1 s) is reconnected within a second: calls
    # wait for it (wait_for_ready, services/gateway/upstream.py) instead of failing.
    channel = make_channel(cfg.router_address, options=[("grpc.initial_reconnect_backoff_ms", 200),
                                                        ("grpc.min_reconnect_backoff_ms", 200),
                                                        ("grpc.max_reconnect_backoff_ms", 1000)])
    try:  # refuse to serve prompts tokenized for another model than the engines'
        await check_upstream_tokenizer(channel, tokenizer, cfg.model, cfg.model_check_timeout_s)
    except ConfigError as e:
        await channel.close()
        log.error("%s", e)
        raise SystemExit(f"{command('gateway')}: error: {e}") from None
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
