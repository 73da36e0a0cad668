"""A stub OpenAI endpoint that answers at once: what the harness's own overhead is measured
against, and what its tests run on. Plain asyncio HTTP/1.1 with keep-alive (no framework: the
stub must cost less than the client it measures).

    python -m kvmesh.loadtest.harness.stub PORT [CHUNKS]

POST …/chat/completions streams CHUNKS content chunks (one token each), a usage chunk and
[DONE]; a body with "max_tokens" streams that many instead. GET …/models lists "stub". A body
containing "shed-me" gets 503 with Retry-After: 1 (for tests of error accounting).
"""
from __future__ import annotations

import asyncio
import json
import sys

_MODELS = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]}).encode()


def _chunk(payload: dict) -> bytes:
    data = f"data: {json.dumps(payload)}\n\n".encode()
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, chunks: int) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, v in (l.split(":", 1) for l in lines[1:] if ":" in l)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path.endswith("/models"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(_MODELS)).encode() + b"\r\n\r\n" + _MODELS)
            elif method == "POST" and path.endswith("/chat/completions"):
                if b"shed-me" in body:
                    msg = b'{"error": {"message": "shed", "type": "overloaded"}}'
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\ncontent-type: "
                                 b"application/json\r\ncontent-length: " + str(len(msg)).encode() + b"\r\n\r\n" + msg)
                else:
                    n = json.loads(body).get("max_tokens") or chunks
                    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"]
                    for i in range(n):
                        out.append(_chunk({"id": "s", "object": "chat.completion.chunk",
                                           "choices": [{"index": 0, "delta": {"content": f" t{i}"}}]}))
                    out.append(_chunk({"id": "s", "object": "chat.completion.chunk", "choices": [],
                                       "usage": {"prompt_tokens": len(body) // 8, "completion_tokens": n,
                                                 "prompt_tokens_details": {"cached_tokens": 0}}}))
                    done = b"data: [DONE]\n\n"
                    out.append(f"{len(done):x}\r\n".encode() + done + b"\r\n0\r\n\r\n")
                    writer.write(b"".join(out))
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def serve(port: int, chunks: int = 8) -> asyncio.AbstractServer:
    """Starts the stub on 127.0.0.1:`port` (0: any free port; read it from the server's sockets)."""
    return await asyncio.start_server(lambda r, w: _handle(r, w, chunks), "127.0.0.1", port)


def main() -> None:
    port, chunks = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8

    async def forever() -> None:
        server = await serve(port, chunks)
        print("ready", flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(forever())


if __name__ == "__main__":
    main()
