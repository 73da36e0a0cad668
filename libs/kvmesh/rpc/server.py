"""RpcServer: an asyncio gRPC server with kvmesh's interceptor, health, reflection and drain,
and `ServerSettings`, the server flags every service shares.

The entry helper (kvmesh.rpc.entry) builds it from a service's parts and hands it to
`run_service`; tests build it directly:

    server = RpcServer("kvcache", cfg.server,
                       lambda s: kvcache_pb2_grpc.add_KvcacheServiceServicer_to_server(servicer, s),
                       [KVCACHE_SERVICE_FULL_NAME], telemetry=telemetry, on_drain=store.flush)
    await run_service(server)      # start, log, SIGTERM → drain, wait

NOTE (drain): at once, health reports NOT_SERVING (to Check and to open Watch streams) and new
calls are answered UNAVAILABLE "draining; retry on another replica" — the server keeps its port
meanwhile, so callers get that clear answer and health probes get NOT_SERVING rather than a
refused connection. Then `on_drain` runs while in-flight calls finish, both within the grace
period. As soon as both are done — or when grace runs out — every remaining call (health
watches included) is cancelled and the server stops. A second SIGTERM/SIGINT stops it immediately.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.config import setting
from kvmesh.metrics import MetricsServer, start_metrics_server
from kvmesh.rpc import DEFAULT_MAX_MESSAGE_BYTES
from kvmesh.rpc.interceptors import ServerInterceptor
from kvmesh.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    """Where a service's gRPC server listens, how it shuts down and where its metrics and traces
    go. Every service config holds one (`cfg.server`), with its own default port; its flags keep
    their short names (--port, KVMESH_<SERVICE>_PORT)."""

    host: str = setting("127.0.0.1", "Address the gRPC server binds (loopback by default).")
    port: int = setting(0, "gRPC port; 0 picks a free one (printed at start).", min=0, max=65535)
    metrics_port: int = setting(-1, "Prometheus /metrics port; 0 picks a free one, -1 disables.",
                                min=-1, max=65535)
    grace_s: float = setting(10.0, "Seconds in-flight calls get to finish on SIGTERM.", min=0.0)
    otlp_endpoint: Optional[str] = setting(
        None, "OTLP gRPC endpoint for traces (e.g. http://127.0.0.1:4317); unset disables export.")


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class RpcServer:
    """One service's gRPC server: kvmesh interceptor, health, reflection, graceful drain.

    `register(server)` adds the servicers; `service_full_names` (e.g.
    "kvmesh.engine.v1.EngineService") are announced by reflection and reported SERVING by
    health once started. `on_drain` is awaited once when a drain begins, after new calls are
    refused, alongside the in-flight calls (e.g. stop admitting work, flush, wait for jobs).
    Spans go to `telemetry`'s provider; RPC metrics are registered in its registry (so one
    server per registry), which `settings.metrics_port` serves while the server runs.
    """

    def __init__(self, name: str, settings: ServerSettings,
                 register: Callable[[grpc.aio.Server], None], service_full_names: list[str], *,
                 telemetry: Telemetry,
                 on_drain: Callable[[], Awaitable[None]] | None = None) -> None:
        self.name = name
        self.settings = settings
        self.telemetry = telemetry
        self.port: int | None = None
        self._metrics: MetricsServer | None = None
        self._register = register
        self.services = tuple(service_full_names)
        self._on_drain = on_drain
        self._interceptor = ServerInterceptor(telemetry)
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._force_task: asyncio.Task[None] | None = None
        self._closed = asyncio.Event()

    @property
    def address(self) -> str:
        """host:port the server listens on (after `start`)."""
        return _address(self.settings.host, self.port or self.settings.port)

    @property
    def metrics_port(self) -> int | None:
        """The port of the /metrics endpoint while it is served, else None."""
        return None if self._metrics is None else self._metrics.port

    async def start(self) -> int:
        """Bind, register everything, start serving and report SERVING; returns the port."""
        if self._server is not None:
            raise RuntimeError(f"{self.name} server already started")
        server = grpc.aio.server(
            interceptors=[self._interceptor],
            options=[("grpc.max_send_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                     ("grpc.max_receive_message_length", DEFAULT_MAX_MESSAGE_BYTES),
                     ("grpc.so_reuseport", 0),  # a busy port is an error, never shared
                     # Clients ping busy connections every few seconds to detect a hung server
                     # (the router's --keepalive-s): accept that, never answer it with GOAWAY.
                     ("grpc.http2.min_ping_interval_without_data_ms", 500),
                     ("grpc.http2.max_ping_strikes", 0)])
        self._register(server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            [*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        address = _address(self.settings.host, self.settings.port)
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"{self.name}: cannot listen on {address} ({e}); is another process "
                          "using the port? pick another port, or 0 for any free one") from e
        for service in ("", *self.services):
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        await server.start()
        self._server, self.port = server, port
        self._metrics = start_metrics_server(self.settings.host, self.settings.metrics_port,
                                             self.telemetry.registry)
        return port

    async def drain(self, grace_s: float | None = None) -> None:
        """Stop gracefully (see the module NOTE); `grace_s` defaults to the settings' grace.

        Idempotent: later calls wait for the drain already under way.
        """
        if self._server is None:
            raise RuntimeError(f"{self.name} server is not started")
        if self._drain_task is None:
            grace = self.settings.grace_s if grace_s is None else grace_s
            self._drain_task = asyncio.ensure_future(self._drain(grace))
        await asyncio.shield(self._drain_task)

    async def _drain(self, grace: float) -> None:
        assert self._server is not None and self._health is not None  # drain() checked
        try:
            log.info("%s: draining, %d calls in flight, grace %.1fs", self.name,
                     self._interceptor.in_flight, grace)
            self._interceptor.refuse_new_calls(
                f"{self.name} is draining for shutdown; retry on another replica")
            await self._health.enter_graceful_shutdown()
            idle = asyncio.ensure_future(self._interceptor.wait_idle())
            hook = asyncio.ensure_future(self._run_on_drain())
            await asyncio.wait([idle, hook], timeout=grace)
            if not hook.done():
                log.warning("%s: on_drain did not finish within the grace period", self.name)
            if not idle.done():
                log.warning("%s: grace period over, cancelling %d calls in flight", self.name,
                            self._interceptor.in_flight)
            idle.cancel()
            hook.cancel()
            await self._server.stop(None)  # cancels what is left, health watches included
            if self._metrics is not None:
                await asyncio.to_thread(self._metrics.close)
                self._metrics = None
            log.info("%s: stopped", self.name)
        finally:
            self._closed.set()

    async def _run_on_drain(self) -> None:
        if self._on_drain is None:
            return
        try:
            await self._on_drain()
        except Exception:
            log.exception("%s: on_drain failed; draining anyway", self.name)

    def install_signal_handlers(self) -> None:
        """On the running loop: first SIGTERM/SIGINT drains, a second one stops at once."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if self._drain_task is None:
            log.info("%s: %s received, draining (send it again to stop now)", self.name, sig.name)
            self._drain_task = asyncio.ensure_future(self._drain(self.settings.grace_s))
        elif self._server is not None and self._force_task is None:
            log.warning("%s: second %s, stopping now", self.name, sig.name)
            self._force_task = asyncio.ensure_future(self._server.stop(None))

    async def wait_closed(self) -> None:
        """Return once a drain has stopped the server (re-raising a drain failure)."""
        await self._closed.wait()
        if self._drain_task is not None:
            await self._drain_task


async def run_service(server: RpcServer) -> None:
    """Start `server`, log the address, drain on SIGTERM/SIGINT, wait until closed.

    Also prints one line `kvmesh-<name> listening on <host>:<port>` to stdout for launchers.
    """
    port = await server.start()
    server.install_signal_handlers()
    log.info("%s: serving %s on %s", server.name, ", ".join(server.services), server.address)
    if server.metrics_port is not None:
        log.info("%s: metrics on http://%s/metrics", server.name,
                 _address(server.settings.host, server.metrics_port))
    print(f"kvmesh-{server.name} listening on {_address(server.settings.host, port)}", flush=True)
    await server.wait_closed()
