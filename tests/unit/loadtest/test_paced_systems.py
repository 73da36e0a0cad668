"""`kvmesh loadtest --compare kvmesh-paced,kvmesh-noreuse-paced`: the stacks get the engine's
--step-target-ms from the --slo's TPOT bound (the stack itself is stubbed: no processes)."""
import contextlib

import pytest

from kvmesh.loadtest.harness import systems
from kvmesh.loadtest.harness.cli import paced_step_ms
from kvmesh.loadtest.harness.stats import Slo


def test_the_step_target_is_under_the_tpot_bound():
    assert paced_step_ms(Slo.parse("ttft=2s,tpot=150ms")) == 120.0
    assert paced_step_ms(Slo.parse("tpot=0.1")) == 80.0
    assert paced_step_ms(Slo.parse("ttft=2s")) == 120.0  # no TPOT bound: the default
    assert paced_step_ms(None) == 120.0


@pytest.mark.parametrize("system, reuse", [("kvmesh-paced", True), ("kvmesh-noreuse-paced", False)])
def test_paced_stacks_pass_the_target_and_the_ablation_keeps_reuse_off(monkeypatch, system, reuse):
    started = []

    @contextlib.contextmanager
    def fake_stack(engine_args=(), gateway_args=(), up_args=()):
        started.append((tuple(engine_args), tuple(gateway_args), tuple(up_args)))
        yield "http://stub/v1"

    monkeypatch.setattr(systems, "_stack", fake_stack)
    with systems.serving(system, step_target_ms=96.0) as served:
        assert served.url == "http://stub/v1" and served.extra is None
    (engine_args, gateway_args, up_args), = started
    assert "--step-target-ms=96" in engine_args and not gateway_args and not up_args
    assert (set(systems.NOREUSE) <= set(engine_args)) is not reuse
    with systems.serving("kvmesh-noreuse"):
        pass
    assert started[-1][0] == systems.NOREUSE  # the unpaced ablation: no target
