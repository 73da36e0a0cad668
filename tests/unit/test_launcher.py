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


def test_pd_starts_prefill_and_decode_engines_in_one_tier(monkeypatch):
    monkeypatch.setattr("kvmesh.launcher.usable_cores", lambda: 4)
    specs = {s.name: s for s in stack_services(StackPlan(ports=StackPorts(engine=6000), pd=(1, 2)), Path("/d"))}
    engines = ("engine-prefill-0", "engine-decode-1", "engine-decode-2")
    assert [specs[n].port for n in engines] == [6000, 6001, 6002]
    assert [_args(specs[n])["--role"] for n in engines] == ["prefill", "decode", "decode"]
    assert {_args(specs[n])["--threads"] for n in engines} == {"1"}  # 4 cores over 3 engines
    assert all(_args(specs[n])["--kvcache-address"] for n in engines)  # the handoff goes through it
    assert _args(specs["router"])["--tiers"] == ("smollm2-135m-instruct=127.0.0.1:6000/prefill,"
                                                 "127.0.0.1:6001/decode,127.0.0.1:6002/decode@1.0")


def test_pinned_engines_get_their_own_cpus(monkeypatch):
    monkeypatch.setattr("kvmesh.launcher.usable_cores", lambda: 4)
    monkeypatch.setattr("kvmesh.launcher.os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    specs = {s.name: s for s in stack_services(StackPlan(pd=(1, 1), pin_engines=True), Path("/d"))}
    pinned = [_args(specs[n]) for n in ("engine-prefill-0", "engine-decode-1")]
    assert [(a["--cpus"], a["--threads"]) for a in pinned] == [("0,1", "2"), ("2,3", "2")]


def test_every_service_but_the_gateway_gets_a_metrics_port(monkeypatch):
    monkeypatch.setattr("kvmesh.launcher.usable_cores", lambda: 2)
    plan = StackPlan(replicas=2, ports=StackPorts(metrics=9400))
    specs = stack_services(plan, Path("/d"))
    ported = [(s.name, s.metrics_port, _args(s).get("--metrics-port")) for s in specs]
    assert ported == [("kvcache", 9400, "9400"), ("draft", 9401, "9401"), ("engine-0", 9402, "9402"),
                      ("engine-1", 9403, "9403"), ("router", 9404, "9404"), ("gateway", None, None)]
    free = stack_services(StackPlan(), Path("/d"))  # the default, 0: a free port each
    ports = [s.metrics_port for s in free if s.name != "gateway"]
    assert len(set(ports)) == 4 and all(p > 0 for p in ports)
    off = stack_services(StackPlan(ports=StackPorts(metrics=-1)), Path("/d"))
    assert all(s.metrics_port is None and "--metrics-port" not in s.args for s in off)
