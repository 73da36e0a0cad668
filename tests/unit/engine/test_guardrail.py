"""The guardrail's policy with made-up check results (services/engine/guardrail.py): which lossy
admissions are sampled, when a path is disabled (fast for a clearly broken path, never for one
unlucky prompt), the per-request budget, re-enabling after passing replays, the bounded queue.
Exact and counted: no model, no clock."""
from __future__ import annotations

import pytest

from kvmesh.kv.namespace import KvLayout, KvNamespace
from kvmesh.kv.quality import DEFAULT_BUDGET, QualityBudget
from kvmesh.services.engine.guardrail import GuardConfig, Guardrail, GuardTicket, LossyPath, ShadowCheck

NS = KvNamespace("model", KvLayout(2, 1, 4, "float32"), "int8c-g16-r0-h1-o0", "tenant:a")


def path(budget: QualityBudget = DEFAULT_BUDGET, ns: KvNamespace = NS) -> LossyPath:
    return LossyPath(ns, "codec", None, None, budget)


def served_ticket(p: LossyPath = None) -> GuardTicket:
    return GuardTicket(p or path(), served_lossy=True)


def report(g: Guardrail, ns: KvNamespace = NS):
    (p,) = [p for p in g.snapshot().paths if p.namespace == ns]
    return p


GOOD = dict(positions=16, kl=0.001, top1=1.0)
BAD = dict(positions=16, kl=2.0, top1=0.2)  # 40x the default KL budget


def test_every_fiftieth_lossy_admission_is_sampled_at_the_default_share():
    g = Guardrail()
    admissions = [g.admit(path()) for _ in range(200)]
    assert all(a.serve and a.fallback == "" for a in admissions)
    sampled = [i for i, a in enumerate(admissions) if a.ticket is not None]
    assert sampled == [0, 50, 100, 150]
    assert all(admissions[i].ticket.served_lossy for i in sampled)
    assert report(g).served == 200
    assert all(a.ticket is None for a in (Guardrail(GuardConfig(shadow_share=0.0)).admit(path()) for _ in range(99)))


def test_document_spans_ride_on_the_ticket():
    ticket = Guardrail().admit(path(), ((3, 40), (41, 90))).ticket
    assert ticket.document_spans == ((3, 40), (41, 90))


def test_two_checks_far_over_budget_disable_the_path_and_requests_fall_back():
    g = Guardrail()
    g.admit(path())
    g.record(served_ticket(), **BAD)
    assert report(g).enabled  # one bad prompt is not enough
    g.record(served_ticket(), **BAD)
    r = report(g)
    assert not r.enabled and r.disabled_count == 1 and r.checks == 2
    assert r.kl == pytest.approx(2.0) and r.top1 == pytest.approx(0.2)
    a = g.admit(path())
    assert not a.serve
    assert a.fallback.startswith("int8c-g16-r0-h1-o0: disabled by the guardrail (")
    assert report(g).fallbacks == 1


def test_one_unlucky_prompt_among_good_ones_never_disables():
    g = Guardrail()
    for i in range(100):  # a prompt 40x over budget now and then, never two in one window
        g.record(served_ticket(), **(BAD if i in (3, 40, 80) else GOOD))
        assert report(g).enabled, f"disabled at check {i + 1}"
    assert report(g).kl == pytest.approx(0.001)  # the estimate leaves the worst check out


def test_a_path_that_fails_a_steady_share_of_prompts_is_disabled():
    g = Guardrail()
    for i in range(20):  # every fifth prompt 40x over: the mean is far over budget
        g.record(served_ticket(), **(BAD if i % 5 == 4 else GOOD))
    assert not report(g).enabled and report(g).disabled_count == 1


def test_a_moderate_excess_disables_only_once_min_checks_agree():
    g = Guardrail(GuardConfig(min_checks=8))
    for i in range(7):
        g.record(served_ticket(), positions=16, kl=0.08, top1=1.0)  # 1.6x the budget: not far over
        assert report(g).enabled, f"disabled after {i + 1} checks"
    g.record(served_ticket(), positions=16, kl=0.08, top1=1.0)
    r = report(g)
    assert not r.enabled and "KL 0.08 > budget 0.05 over 8 checks" in r.reason


def test_top1_counts_only_over_enough_positions():
    g = Guardrail()
    for _ in range(20):  # 20 one-token answers, every one's argmax flipped, KL within budget
        g.record(served_ticket(), positions=1, kl=0.01, top1=0.0)
    assert report(g).enabled  # 20 positions are too few to judge top-1
    for _ in range(3):
        g.record(served_ticket(), positions=4, kl=0.01, top1=0.5)
    r = report(g)
    assert not r.enabled and "top-1" in r.reason  # 32 positions: now it counts


def test_a_request_with_a_tighter_budget_falls_back_while_the_path_stays_enabled():
    g = Guardrail()
    for _ in range(8):
        g.record(served_ticket(), positions=16, kl=0.02, top1=1.0)
    assert g.admit(path()).serve
    tight = g.admit(path(QualityBudget(0.01, 0.95)))
    assert not tight.serve and tight.ticket is None
    assert "outside this request's budget" in tight.fallback and "KL 0.02 > budget 0.01" in tight.fallback
    assert report(g).enabled
    # The path stays held to the loosest budget declared: the next check leaves it on for others.
    assert report(g).budget == path().budget
    g.record(served_ticket(), positions=16, kl=0.02, top1=1.0)
    assert report(g).enabled and g.admit(path()).serve


def test_a_request_is_served_before_the_path_has_enough_checks_whatever_its_budget():
    g = Guardrail()
    for _ in range(7):
        g.record(served_ticket(), positions=16, kl=0.02, top1=1.0)
    assert g.admit(path(QualityBudget(0.01, 0.95))).serve


def disable(g: Guardrail) -> None:
    g.admit(path())
    g.record(served_ticket(), **BAD)
    g.record(served_ticket(), **BAD)
    assert not report(g).enabled


def test_while_disabled_one_in_ten_requests_gets_a_replay_ticket():
    g = Guardrail()
    disable(g)
    admissions = [g.admit(path()) for _ in range(30)]
    assert not any(a.serve for a in admissions)
    replays = [i for i, a in enumerate(admissions) if a.ticket is not None]
    assert replays == [0, 10, 20]
    assert all(not admissions[i].ticket.served_lossy for i in replays)


def test_passing_replays_enable_the_path_again_and_restart_its_estimate():
    g = Guardrail(GuardConfig(reenable_checks=8))
    disable(g)
    replay = GuardTicket(path(), served_lossy=False)
    for i in range(7):
        g.record(replay, **GOOD)
        assert not report(g).enabled, f"enabled after {i + 1} replays"
    g.record(served_ticket(), **GOOD)  # a late check of a request served before: not a replay
    assert not report(g).enabled
    g.record(replay, **GOOD)
    r = report(g)
    assert r.enabled and r.replays == 8 and r.disabled_count == 1
    assert r.kl == pytest.approx(0.001) and r.top1 == 1.0  # the window restarted from the replays
    a = g.admit(path())
    assert a.serve and a.fallback == ""


def test_failing_replays_keep_the_path_disabled_until_the_last_ones_pass():
    g = Guardrail(GuardConfig(reenable_checks=4))
    disable(g)
    replay = GuardTicket(path(), served_lossy=False)
    for _ in range(10):
        g.record(replay, **BAD)
    assert not report(g).enabled
    for i in range(3):
        g.record(replay, **GOOD)
        assert not report(g).enabled, f"enabled with a failing replay among the last 4 ({i + 1} good)"
    g.record(replay, **GOOD)
    assert report(g).enabled


def test_paths_of_other_namespaces_are_judged_apart():
    other = NS.for_tenant("tenant:b")
    g = Guardrail()
    disable(g)
    assert g.admit(path(ns=other)).serve
    assert report(g, other).enabled and not report(g, NS).enabled


def check() -> ShadowCheck:
    return ShadowCheck(served_ticket(), (1, 2, 3), (4,))


def test_the_check_queue_is_bounded_and_drops_the_oldest():
    g = Guardrail(GuardConfig(queue=3))
    checks = [check() for _ in range(5)]
    for c in checks:
        g.submit(c)
    assert g.pending == 3 and g.snapshot().dropped_checks == 2
    assert [g.next_check() for _ in range(3)] == checks[2:]
    assert g.next_check() is None


def test_done_records_results_and_counts_failures():
    g = Guardrail()
    g.submit(check())
    g.submit(check())
    first, second = g.next_check(), g.next_check()
    assert not g.wait_idle(0)  # two in flight
    g.done(first, positions=4, kl=0.002, top1=1.0)
    g.done(second)  # nothing compared
    assert g.wait_idle(0)
    snap = g.snapshot()
    assert snap.failed_checks == 1 and snap.pending_checks == 0
    assert report(g).checks == 1 and report(g).positions == 4


def test_request_spans_say_which_path_was_asked_for_and_what_happened():
    from kvmesh.services.engine.outputs import RequestOutput
    from kvmesh.services.engine.tracing import guard_attributes

    assert guard_attributes(RequestOutput("exact")) == {}
    served = RequestOutput("a", reuse_storage=NS.storage, guard=served_ticket())
    assert guard_attributes(served) == {"kvmesh.guard.path": NS.storage, "kvmesh.guard.state": "served",
                                        "kvmesh.guard.shadow": True}
    text = f"{NS.storage}: disabled by the guardrail (KL 2 > budget 0.05 over 8 checks)"
    fallback = RequestOutput("b", reuse_fallback=text)
    assert guard_attributes(fallback) == {"kvmesh.guard.path": NS.storage, "kvmesh.guard.state": "fallback",
                                          "kvmesh.guard.shadow": False, "kvmesh.guard.fallback": text}
