"""One way tests serve a servicer: a real RpcServer (shared interceptors, health, reflection) on
127.0.0.1:<free port> with a client channel, drained afterwards."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from kvmesh.rpc.server import RpcServer, ServerSettings
from kvmesh.telemetry import Telemetry


@dataclass(frozen=True)
class Served:
    address: str
    channel: grpc.aio.Channel
    server: RpcServer


@contextlib.asynccontextmanager
async def served(name: str, register: Callable[[grpc.aio.Server], None], service_full_name: str,
                 *, grace_s: float = 1.0, telemetry: Telemetry | None = None
                 ) -> AsyncIterator[Served]:
    """Starts the server, yields it with an open channel, then closes the channel and drains.
    Its metrics and spans go to `telemetry` (default: a fresh one of its own)."""
    server = RpcServer(name, ServerSettings(port=0, grace_s=grace_s), register, [service_full_name],
                       telemetry=telemetry or Telemetry.create(f"kvmesh-{name}"))
    port = await server.start()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield Served(address, channel, server)
    finally:
        await channel.close()
        await server.drain(0.5)
