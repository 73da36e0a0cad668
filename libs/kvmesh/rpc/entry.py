"""`serve_main`: the one way a service process starts, serves and stops.

Every `services/<service>/__main__.py` is a factory and one call:

    async def build(cfg: RouterConfig, telemetry: Telemetry) -> Service:
        router = build_router(cfg, RouterMetrics(telemetry.registry))
        servicer = RouterServicer(router)
        return Service(lambda s: add_RouterServiceServicer_to_server(servicer, s), (SERVICE,),
                       close=router.close)

    def main(argv: list[str] | None = None) -> None:
        serve_main(RouterConfig, "router", build, argv)

`serve_main` sets up logging, loads the config (flags > KVMESH_<SERVICE>_* > defaults; a bad one
is its message on stderr and exit status 2, as argparse does, never a traceback) and logs it,
creates the process's `Telemetry` (its metrics registry and tracer provider) from `cfg.server`
and `cfg.metrics_model_name` (`service_telemetry`), awaits the factory, serves what it built on an
`RpcServer` with `cfg.server`'s settings until SIGTERM/SIGINT has drained it, then awaits `close`
and flushes the spans.
"""
from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import grpc

from kvmesh.config import ConfigError, command, describe, load_config
from kvmesh.rpc.server import RpcServer, ServerSettings, run_service
from kvmesh.telemetry import Telemetry

log = logging.getLogger(__name__)


class ServiceConfig(Protocol):
    """A service config: any frozen settings dataclass holding the shared server settings."""

    @property
    def server(self) -> ServerSettings: ...

    @property
    def metrics_model_name(self) -> str:
        """The `model_name` label of the service's metrics that name no model of their own: its
        served model's name, or kvmesh.metrics.ALL_MODELS when it serves several."""


C = TypeVar("C", bound=ServiceConfig)


@dataclass(frozen=True)
class Service:
    """What a service's factory built for `serve_main` to serve.

    `register(server)` adds the servicers and `names` are their full names (health,
    reflection); `on_drain` runs when a drain begins (see RpcServer); `close` releases the
    service's resources once the server has stopped (or failed to start).
    """

    register: Callable[[grpc.aio.Server], None]
    names: Sequence[str]
    on_drain: Callable[[], Awaitable[None]] | None = None
    close: Callable[[], Awaitable[None]] | None = None

    def server(self, name: str, settings: ServerSettings, telemetry: Telemetry) -> RpcServer:
        """The (not yet started) RpcServer that serves this service."""
        return RpcServer(name, settings, self.register, list(self.names), telemetry=telemetry,
                         on_drain=self.on_drain)


def serve_main(config: type[C], name: str, build: Callable[[C, Telemetry], Awaitable[Service]],
               argv: list[str] | None = None) -> None:
    """Run the `name` service process (see the module docstring); returns once it has stopped.
    `argv` defaults to sys.argv[1:]."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(config, name, argv)
    except ConfigError as e:  # a bad flag or variable: its message, as argparse prints, no traceback
        print(f"{command(name)}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    log.info("config: %s", describe(cfg))
    asyncio.run(_serve(cfg, name, build))


def service_telemetry(cfg: ServiceConfig, name: str) -> Telemetry:
    """The `name` service process's telemetry: its spans named kvmesh-<name>, its metrics labelled
    with `cfg.metrics_model_name`."""
    return Telemetry.create(f"kvmesh-{name}", model_name=cfg.metrics_model_name,
                            otlp_endpoint=cfg.server.otlp_endpoint)


async def _serve(cfg: C, name: str, build: Callable[[C, Telemetry], Awaitable[Service]]) -> None:
    telemetry = service_telemetry(cfg, name)
    try:
        with telemetry.activated():  # the service's own tasks (sweepers, warm-up calls) trace too
            service = await build(cfg, telemetry)
            try:
                await run_service(service.server(name, cfg.server, telemetry))
            finally:
                if service.close is not None:
                    await service.close()
                log.info("%s: closed", name)  # a stop that got here was not cut short by a SIGKILL
    finally:
        telemetry.shutdown()
