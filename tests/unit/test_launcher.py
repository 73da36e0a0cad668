"""What `kvmesh up` starts for a plan: processes, ports, flags and thread budgets (no processes)."""
from __future__ import annotations

from pathlib import Path

from kvmesh.launcher import StackPlan, StackPorts, stack_services


def _args(spec) -> dict[str, str]:
    a = list(spec.args)
    return {a[i]: a[i + 1] for i in range(0, len(a) - 1) if a[i].startswith("--")}


def test_default_plan_is_one_engine_behind_router_and_gateway(monkeypatch):
    monkeypatch.setattr("kvmesh.launcher.usable_cores", lambda: 2)
    specs = stack_services(StackPlan(), Path("/data"))
    assert [s.name for s in specs] == ["kvcache", "draft", "engine", "router", "gateway"]
    kv, draft, engine, router, gateway = specs
    assert _args(kv)["--data-dir"] == "/data/kvcache" and dict(kv.env) == {"OMP_NUM_THREADS": "1"}
    assert _args(engine)["--kvcache-address"] == "127.0.0.1:50071"
    assert _args(engine)["--draft-address"] == "127.0.0.1:50091" and draft.port == 50091
    assert _args(draft)["--threads"] == "1"
    assert _args(engine)["--threads"] == "2" and not engine.env     # the busy engine gets the cores
    assert _args(router)["--tiers"] == "smollm2-135m-instruct=127.0.0.1:50061@1.0"
    assert _args(gateway)["--router-address"] == "127.0.0.1:50081"
    assert gateway.port == 50051 and gateway.http_port == 8000
    assert dict(router.env) == dict(gateway.env) == {"OMP_NUM_THREADS": "1"}


def test_replicas_and_cascade_split_the_cores_and_configure_the_router(monkeypatch):
    monkeypatch.setattr("kvmesh.launcher.usable_cores", lambda: 4)
    plan = StackPlan(ports=StackPorts(engine=6000), replicas=2, cascade=True,
                     engine_args=("--dtype", "float32"), router_args=("--policy", "round_robin"))
    specs = {s.name: s for s in stack_services(plan, Path("/d"))}
    assert [specs[n].port for n in ("engine-0", "engine-1", "engine-cheap")] == [6000, 6001, 6002]
    assert {_args(specs[n])["--threads"] for n in ("engine-0", "engine-1", "engine-cheap")} == {"1"}
    assert _args(specs["engine-cheap"])["--weights"] == "int4"
    assert _args(specs["engine-0"])["--dtype"] == "float32"            # extra flags reach every engine
    router = _args(specs["router"])
    assert router["--tiers"] == ("smollm2-135m-instruct=127.0.0.1:6000,127.0.0.1:6001@1.0;"
                                 "cheap=127.0.0.1:6002@0.6")
    assert router["--cascades"] == "auto=cheap,smollm2-135m-instruct"
    assert router["--policy"] == "round_robin"
