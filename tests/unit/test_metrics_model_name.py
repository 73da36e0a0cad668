"""Every sample a service exposes carries `model_name` (issue 21, as vLLM's metrics do): each
service's registry is built as its process builds it (kvmesh.rpc.entry.service_telemetry), holds
that service's metrics, the RPC interceptor's and a scrape-time collector, and is read the ways
Prometheus reads it: the text format, the /metrics endpoint, and the endpoint's `?name[]=` view."""
from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import PROCESS_COLLECTOR, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.config import load_config
from kvmesh.metrics import ALL_MODELS, MODEL_LABEL, ModelRegistry, start_metrics_server
from kvmesh.rpc.entry import service_telemetry
from kvmesh.rpc.interceptors import RpcMetrics
from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.draft.metrics import DraftMetrics
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.metrics import EngineMetrics
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.gateway.metrics import GatewayMetrics
from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.services.kvcache.metrics import KvcacheMetrics
from kvmesh.services.kvcache.store.base import TierStats
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.metrics import RouterMetrics


def _fake_backend() -> SimpleNamespace:
    """What kvcache's StoreCollector reads at scrape time."""
    stats = [TierStats("memory", 2, 64, 1, 0, 0, 128), TierStats("disk", 3, 96, 0, 1, 0, 0)]
    return SimpleNamespace(store=SimpleNamespace(stats=lambda: stats), corrupt_entries=0)


def _fill(service: str, registry) -> None:
    """The service's metrics in `registry`, each kind of sample present: counters (_total,
    _created), gauges, histograms (_bucket, _sum, _count), labelled children, custom collectors."""
    rpc = RpcMetrics(registry)
    rpc.handled.labels("s", "M", "OK").inc()
    rpc.handling_seconds.labels("s", "M").observe(0.01)
    if service == "engine":
        m = EngineMetrics(registry)
        m.ttft.observe(0.2)
        m.running.set(1)
        m.gen_tokens.inc(3)
    elif service == "draft":
        m = DraftMetrics(registry)
        m.proposals.labels("ngram").inc()
        m.propose_seconds.observe(0.001)
        m.sequences.set(2)
    elif service == "kvcache":
        m = KvcacheMetrics(registry)
        m.record_lookup(keys=2, hit_chunks=1, chunk_tokens=16)
        m.search_seconds.observe(0.01)
        m.index_entries.labels("chunk").set(4)
        m.watch_store(_fake_backend())
    elif service == "router":
        RouterMetrics(registry)
    else:
        GatewayMetrics(registry).set_inflight(1, 5)


def _samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


SERVICES = [
    # (service, config class, flags, the model_name its samples carry)
    ("engine", EngineConfig, [], "smollm2-135m-instruct"),
    ("engine", EngineConfig, ["--served-model-name", "tiny"], "tiny"),
    ("draft", DraftConfig, [], "smollm2-135m-instruct"),
    ("draft", DraftConfig, ["--served-model-name", "tiny"], "tiny"),
    ("draft", DraftConfig, ["--draft-model", "none", "--target-model", "ab12"], "ab12"),
    ("router", RouterConfig, ["--tiers", "tiny=127.0.0.1:50061"], "tiny"),
    ("router", RouterConfig, ["--tiers", "cheap=127.0.0.1:1;strong=127.0.0.1:2",
                              "--cascades", "auto=cheap,strong"], ALL_MODELS),
    ("kvcache", KvcacheConfig, [], ALL_MODELS),
    ("gateway", GatewayConfig, [], ALL_MODELS),
]


@pytest.mark.parametrize("service, config, flags, model", SERVICES,
                         ids=[f"{s[0]}-{s[3]}-{i}" for i, s in enumerate(SERVICES)])
def test_every_sample_of_a_service_carries_its_model_name(service, config, flags, model):
    cfg = load_config(config, service, flags, environ={})
    registry = service_telemetry(cfg, service).registry
    _fill(service, registry)
    text = generate_latest(registry).decode()
    samples = _samples(text)
    names = {s.name for s in samples}
    kind = "rpc_server_handling_seconds"
    assert {f"kvmesh_{kind}_bucket", f"kvmesh_{kind}_sum", f"kvmesh_{kind}_count",
            "kvmesh_rpc_server_handled_total", "kvmesh_rpc_server_handled_created",
            "process_cpu_seconds_total", "python_info"} <= names
    assert {s.labels.get(MODEL_LABEL) for s in samples} == {model}, text
    om = _samples(generate_openmetrics(registry).decode())
    assert om and {s.labels.get(MODEL_LABEL) for s in om} == {model}

    server = start_metrics_server("127.0.0.1", 0, registry)
    try:
        url = f"http://127.0.0.1:{server.port}/metrics"
        scraped = _samples(httpx.get(url, timeout=10).text)
        assert {s.name for s in scraped} == names
        assert {s.labels.get(MODEL_LABEL) for s in scraped} == {model}
        only = _samples(httpx.get(url, params={"name[]": "kvmesh_rpc_server_handled_total"}, timeout=10).text)
        assert [(s.name, s.labels[MODEL_LABEL]) for s in only] == [("kvmesh_rpc_server_handled_total", model)]
    finally:
        server.close()


def test_a_metric_that_names_its_model_keeps_it_and_the_others_get_the_registrys():
    registry = ModelRegistry("*")
    gateway = GatewayMetrics(registry)
    gateway.requests.labels("tiny", "/v1/completions", "200", "acme").inc()
    gateway.ttft_seconds.labels("big", "/v1/completions").observe(0.1)
    gateway.set_inflight(3, 12)
    samples = _samples(generate_latest(registry).decode())
    by_name = {}
    for s in samples:
        by_name.setdefault(s.name, set()).add(s.labels[MODEL_LABEL])
    assert by_name["kvmesh_gateway_requests_total"] == {"tiny"}
    assert by_name["kvmesh_gateway_ttft_seconds_bucket"] == by_name["kvmesh_gateway_ttft_seconds_count"] == {"big"}
    assert by_name["kvmesh_gateway_inflight_requests"] == by_name["kvmesh_gateway_inflight_prompt_tokens"] == {"*"}
    # in-process reads: no model_name means the registry's; a named one is looked up as named
    assert registry.get_sample_value("kvmesh_gateway_inflight_requests") == 3
    assert registry.get_sample_value("kvmesh_gateway_requests_total",
                                     {"endpoint": "/v1/completions", "status": "200", "tenant": "acme"}) is None
    assert registry.get_sample_value("kvmesh_gateway_requests_total",
                                     {"model_name": "tiny", "endpoint": "/v1/completions", "status": "200",
                                      "tenant": "acme"}) == 1


def test_collectors_shared_by_registries_are_labelled_per_registry_and_left_unchanged():
    one, two = ModelRegistry("a"), ModelRegistry("b")
    for registry in (one, two):
        registry.register(PROCESS_COLLECTOR)
    assert {s.labels[MODEL_LABEL] for m in one.collect() for s in m.samples} == {"a"}
    assert {s.labels[MODEL_LABEL] for m in two.collect() for s in m.samples} == {"b"}
    assert all(MODEL_LABEL not in s.labels for m in PROCESS_COLLECTOR.collect() for s in m.samples)


def test_a_registry_needs_a_model_name():
    with pytest.raises(ValueError, match="must not be empty"):
        ModelRegistry("")
