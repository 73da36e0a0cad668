"""Prometheus conventions and the /metrics endpoint.

Metric names are `kvmesh_<subsystem>_<name>`, where the subsystem is the service (`engine`,
`kvcache`, ...) or a shared library part (`rpc`); units end the name (`_seconds`, `_bytes`) and
counters get `_total` from prometheus_client. Metrics live in the service's own registry
(`kvmesh.telemetry.Telemetry.registry`), never prometheus_client's default one, which
`start_metrics_server` exposes.
"""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, start_http_server

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def metric_name(subsystem: str, name: str) -> str:
    """`kvmesh_<subsystem>_<name>`, checked to be lower snake case."""
    for part in (subsystem, name):
        if not _NAME.match(part):
            raise ValueError(
                f"metric name part {part!r} must be lower snake case, e.g. 'step_seconds'")
    return f"kvmesh_{subsystem}_{name}"


class MetricsServer:
    """One registry served at http://host:port/metrics from a daemon thread, until `close()`."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        self.port: int = self._server.server_port

    def close(self) -> None:
        """Stop serving and release the port (blocks up to half a second)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> MetricsServer | None:
    """Serve `registry` at http://host:port/metrics; port 0 picks a free port, a negative port
    disables the endpoint (returns None)."""
    if port < 0:
        return None
    return MetricsServer(host, port, registry)
