"""A real redis-server per test (127.0.0.1, free port, no persistence), skipped when not installed.

The `redis_server` fixture is registered in tests/conftest.py."""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass

import pytest


@dataclass
class RedisServer:
    """A running redis-server child; ``stop()`` kills it (the fixture also does, at teardown)."""

    url: str
    proc: subprocess.Popen

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def redis_server(tmp_path):
    """Start redis-server and wait (bounded) until it answers PING."""
    import redis

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = RedisServer(f"redis://127.0.0.1:{port}/0", proc)
    client = redis.Redis(port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                pytest.fail(f"redis-server on port {port} did not answer PING within 10 s")
            time.sleep(0.01)  # poll interval, not synchronization
    client.close()
    yield server
    server.stop()
