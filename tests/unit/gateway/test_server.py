"""The gateway's HTTP listening socket (kvmesh.services.gateway.server._bind)."""
from __future__ import annotations

import asyncio
import socket

from kvmesh.services.gateway.server import _bind


async def test_accepted_http_connections_send_without_nagle_delay():
    """Found by tests/fuzz: every request on a keep-alive connection took some 40 ms, because
    the listener's protocol was 0 and asyncio then leaves Nagle's algorithm on for the accepted
    sockets. Connections accepted as uvicorn accepts them (loop.create_server on the bound
    socket) have TCP_NODELAY."""
    loop = asyncio.get_running_loop()
    sock = _bind("127.0.0.1", 0)
    accepted: asyncio.Future[asyncio.BaseTransport] = loop.create_future()

    class Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.set_result(transport)

    server = await loop.create_server(Accept, sock=sock)
    async with server:
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        transport = await asyncio.wait_for(accepted, 10)
        try:
            assert transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            transport.close()
            writer.close()
