"""Prometheus conventions and the /metrics endpoint.

Metric names are `kvmesh_<subsystem>_<name>`, where the subsystem is the service (`engine`,
`kvcache`, ...) or a shared library part (`rpc`); units end the name (`_seconds`, `_bytes`) and
counters get `_total` from prometheus_client. All metrics live in prometheus_client's default
registry, which `start_metrics_server` exposes.
"""

from __future__ import annotations

import re

from prometheus_client import start_http_server

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def metric_name(subsystem: str, name: str) -> str:
    """`kvmesh_<subsystem>_<name>`, checked to be lower snake case."""
    for part in (subsystem, name):
        if not _NAME.match(part):
            raise ValueError(
                f"metric name part {part!r} must be lower snake case, e.g. 'step_seconds'")
    return f"kvmesh_{subsystem}_{name}"


def start_metrics_server(host: str, port: int | None) -> int | None:
    """Serve the default registry at http://host:port/metrics from a daemon thread.

    Port 0 picks a free port; None or a negative port disables the endpoint (returns None).
    Returns the bound port. The server lives until the process exits.
    """
    if port is None or port < 0:
        return None
    server, _thread = start_http_server(port, addr=host)
    return server.server_port
