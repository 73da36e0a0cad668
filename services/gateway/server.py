"""The gateway's two servers in one asyncio loop: uvicorn (HTTP) and grpc.aio (gRPC).

`build_gateway` wires the domain objects from the config; `GatewayServer` runs the HTTP app and
the gRPC server (kvmesh.gateway.v1 + health + reflection) side by side: `python -m
kvmesh.services.gateway` starts the HTTP side itself and serves `GatewayServer.service` with the
entry helper (kvmesh.rpc.entry); `start`/`stop` run both, as tests do. The HTTP socket is bound
before uvicorn starts, so its port is known at once (port 0 included) and connections made
before uvicorn's first accept simply wait in the backlog. Uvicorn's own signal handling is
switched off: the RpcServer owns SIGTERM, and its drain hook stops HTTP admissions too.

NOTE (drain). SIGTERM → gRPC health NOT_SERVING and new gRPC calls UNAVAILABLE (RpcServer), new
HTTP requests 503 and /health 503 (admission draining); in-flight requests of both front ends
finish within grace_s; then the gRPC server stops and uvicorn closes its connections.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Generator

import grpc
import uvicorn

from kvmesh.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from kvmesh.model.tokenizer import Tokenizer
from kvmesh.rpc.entry import Service
from kvmesh.rpc.server import RpcServer
from kvmesh.services.gateway import embeddings
from kvmesh.services.gateway.admission import Admission, AdmissionLimits
from kvmesh.services.gateway.auth import KeyStore
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.grpc_servicer import GatewayServicer
from kvmesh.services.gateway.http_app import create_app
from kvmesh.services.gateway.metrics import GatewayMetrics
from kvmesh.services.gateway.prompts import PromptBuilder
from kvmesh.services.gateway.service import Gateway, GatewayOptions
from kvmesh.services.gateway.spec import Limits
from kvmesh.services.gateway.upstream import ModelCatalog, RouterClient
from kvmesh.telemetry import Telemetry

log = logging.getLogger(__name__)
SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def build_gateway(cfg: GatewayConfig, tokenizer: Tokenizer, channel: grpc.aio.Channel,
                  metrics: GatewayMetrics) -> Gateway:
    """The request-handling core for `cfg`, talking to the router over `channel`."""
    router = RouterClient(channel, cfg.request_timeout_s, cfg.retry_after_s)
    admission = Admission(
        AdmissionLimits(cfg.max_inflight_requests, cfg.max_inflight_prompt_tokens,
                        cfg.tenant_max_inflight_requests),
        on_change=metrics.set_inflight)
    options = GatewayOptions(default_temperature=cfg.default_temperature,
                             retry_after_s=cfg.retry_after_s, trace_content=cfg.trace_content,
                             slo_ttft_s=cfg.slo_ttft_s,
                             limits=Limits(max_n=cfg.max_n, max_batch_prompts=cfg.max_batch_prompts))
    return Gateway(router, ModelCatalog(router, cfg.models_refresh_s), PromptBuilder(tokenizer),
                   KeyStore(cfg.keys_file), admission, options, metrics)


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handlers (the gRPC server's drain owns SIGTERM/SIGINT)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    """The listening HTTP socket. Its protocol is IPPROTO_TCP, not 0 as `socket.create_server`
    leaves it: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted sockets whose
    protocol says TCP, and with it on, a response written in two pieces (uvicorn writes the head,
    then the body) waits for the client's delayed ACK, some 40 ms on every keep-alive request."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:  # the options socket.create_server sets
        if os.name not in ("nt", "cygwin"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind((host, port))
        sock.listen(2048)
        return sock
    except OSError as e:
        sock.close()
        raise OSError(f"gateway: cannot listen for HTTP on {host}:{port} ({e.strerror}); is "
                      "another process using the port? pass --http-port (0 = any free port)") from e


class GatewayServer:
    """HTTP + gRPC servers over one `Gateway` (see the module docstring); spans and metrics go to
    `telemetry` (the registry is served at GET /metrics)."""

    def __init__(self, cfg: GatewayConfig, gateway: Gateway, telemetry: Telemetry) -> None:
        self.cfg = cfg
        self.gateway = gateway
        self.telemetry = telemetry
        self.embeddings = embeddings.connect(cfg.kvcache_address, cfg.request_timeout_s, cfg.retry_after_s)
        self.app = create_app(gateway, telemetry, serve_metrics=cfg.metrics, embeddings=self.embeddings)
        servicer = GatewayServicer(gateway, self.embeddings)
        self.service = Service(
            lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
            (SERVICE,), on_drain=gateway.drain)
        self.rpc: RpcServer | None = None  # built by `start`; the entry helper builds its own
        self.http_port: int | None = None
        self._http: _Uvicorn | None = None
        self._http_task: asyncio.Task[None] | None = None

    async def start_http(self) -> int:
        """Bind and start serving HTTP; returns the port."""
        sock = _bind(self.cfg.http_host, self.cfg.http_port)
        self.http_port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                                timeout_graceful_shutdown=max(int(self.cfg.server.grace_s), 1))
        self._http = _Uvicorn(config)
        self._http_task = asyncio.ensure_future(self._http.serve(sockets=[sock]))
        return self.http_port

    async def stop_http(self) -> None:
        """Stop HTTP: close the listener and the connections (after a drain, none is busy)."""
        if self._http is None or self._http_task is None:
            return
        self._http.should_exit = True
        await self._http_task
        if self.embeddings is not None:
            await self.embeddings.close()

    async def start(self) -> tuple[int, int]:
        """Start both servers (HTTP first, so gRPC health SERVING means both are up); returns
        their ports."""
        http_port = await self.start_http()
        self.rpc = self.service.server("gateway", self.cfg.server, self.telemetry)
        return http_port, await self.rpc.start()

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain (see the module NOTE) and stop both servers."""
        if self.rpc is not None:
            await self.rpc.drain(grace_s)
        await self.stop_http()
