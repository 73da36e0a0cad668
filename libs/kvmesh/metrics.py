"""Prometheus conventions and the /metrics endpoint.

Metric names are `kvmesh_<subsystem>_<name>`, where the subsystem is the service (`engine`,
`kvcache`, ...) or a shared library part (`rpc`); units end the name (`_seconds`, `_bytes`) and
counters get `_total` from prometheus_client. Metrics live in the service's own registry
(`kvmesh.telemetry.Telemetry.registry`), never prometheus_client's default one, which
`start_metrics_server` exposes.

Every sample carries a `model_name` label, as vLLM's do. A metric whose model varies per request
declares `model_name` itself; every other sample gets its service's at exposition time from
`ModelRegistry`, so a new metric cannot lack it. `ALL_MODELS` is the value of a service that
serves several models (or does not know which) on the samples that belong to no single one.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import RestrictedRegistry

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")

MODEL_LABEL = "model_name"
"""The label every exposed sample carries: the served model name (vLLM's label)."""
ALL_MODELS = "*"
"""`model_name` of samples that belong to no single model (a gateway's in-flight gauges, a
KV-cache service's tiers, RPC metrics of a router over several models). Never a name clients
can ask for: router tier and cascade names are letters, digits and ._:/- only."""


def metric_name(subsystem: str, name: str) -> str:
    """`kvmesh_<subsystem>_<name>`, checked to be lower snake case."""
    for part in (subsystem, name):
        if not _NAME.match(part):
            raise ValueError(
                f"metric name part {part!r} must be lower snake case, e.g. 'step_seconds'")
    return f"kvmesh_{subsystem}_{name}"


def with_model(metric: Metric, model_name: str) -> Metric:
    """A copy of `metric` whose samples without a `model_name` label carry `model_name`; those
    with one keep theirs. `metric` itself is left as it is: collectors shared between registries
    (process, platform, GC) may hand out the same object."""
    labelled = copy.copy(metric)
    labelled.samples = [s if MODEL_LABEL in s.labels else s._replace(labels={**s.labels, MODEL_LABEL: model_name})
                        for s in metric.samples]
    return labelled


class ModelRegistry(CollectorRegistry):
    """A service's registry: every sample it exposes carries `model_name` (see the module
    docstring), in `collect()` (what generate_latest and the /metrics endpoints read), in the
    `?name[]=` restricted view the HTTP server builds, and in `get_sample_value`, where a lookup
    that names no model_name means this registry's one."""

    def __init__(self, model_name: str = ALL_MODELS) -> None:
        if not model_name:
            raise ValueError(f"a registry's model_name must not be empty; use the served model name, "
                             f"or {ALL_MODELS!r} for a service of several models")
        super().__init__()
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            yield with_model(metric, self.model_name)

    def restricted_registry(self, names: Iterable[str]) -> RestrictedRegistry:
        return _ModelView(names, self)

    def get_sample_value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        return super().get_sample_value(name, {MODEL_LABEL: self.model_name, **(labels or {})})


class _ModelView(RestrictedRegistry):
    """The view `?name[]=...` on /metrics asks for, its samples labelled as the registry's."""

    def __init__(self, names: Iterable[str], registry: ModelRegistry) -> None:
        super().__init__(names, registry)
        self._model_name = registry.model_name

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            yield with_model(metric, self._model_name)


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
