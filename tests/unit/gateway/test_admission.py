"""Admission accounting: bounds on requests and prompt tokens, tenant caps, tickets returned."""
from __future__ import annotations

import asyncio

from kvmesh.services.gateway.admission import Admission, AdmissionLimits, Rejection, Ticket


def _admission(**kw) -> tuple[Admission, list]:
    seen: list[tuple[int, int]] = []
    limits = AdmissionLimits(**{"max_requests": 4, "max_prompt_tokens": 100, **kw})
    return Admission(limits, on_change=lambda r, t: seen.append((r, t))), seen


def test_requests_and_tokens_are_bounded_and_returned():
    a, seen = _admission()
    t1 = a.try_admit("x", 3, 60)
    assert isinstance(t1, Ticket)
    assert a.try_admit("x", 2, 10) is Rejection.GATEWAY_REQUESTS
    assert a.try_admit("x", 1, 41) is Rejection.GATEWAY_TOKENS
    t2 = a.try_admit("y", 1, 40)
    assert isinstance(t2, Ticket) and (a.inflight_requests, a.inflight_prompt_tokens) == (4, 100)
    t1.release()
    t1.release()  # idempotent
    assert (a.inflight_requests, a.inflight_prompt_tokens) == (1, 40)
    t2.release()
    assert (a.inflight_requests, a.inflight_prompt_tokens) == (0, 0)
    assert seen == [(3, 60), (4, 100), (1, 40), (0, 0)]


def test_too_large_is_not_retryable():
    a, _ = _admission(tenant_max_requests=2)
    assert a.try_admit("x", 5, 1) is Rejection.TOO_LARGE
    assert a.try_admit("x", 1, 101) is Rejection.TOO_LARGE
    assert a.try_admit("x", 3, 1) is Rejection.TOO_LARGE  # over the tenant cap alone


def test_tenant_caps_default_and_own():
    a, _ = _admission(tenant_max_requests=2)
    t = a.try_admit("x", 2, 1)
    assert a.try_admit("x", 1, 1) is Rejection.TENANT
    assert isinstance(a.try_admit("y", 1, 1), Ticket)  # another tenant is unaffected
    assert isinstance(a.try_admit("z", 1, 1, tenant_limit=1), Ticket)
    assert a.try_admit("z", 1, 1, tenant_limit=1) is Rejection.TENANT
    t.release()
    assert a.tenant_inflight("x") == 0
    assert isinstance(a.try_admit("x", 1, 1), Ticket)


def test_no_default_tenant_cap():
    a, _ = _admission()
    assert isinstance(a.try_admit("x", 4, 1), Ticket)


async def test_draining_refuses_and_wait_idle_returns_when_all_released():
    a, _ = _admission()
    t = a.try_admit("x", 1, 1)
    a.draining = True
    assert a.try_admit("x", 1, 1) is Rejection.DRAINING
    idle = asyncio.ensure_future(a.wait_idle())
    await asyncio.sleep(0)
    assert not idle.done()
    t.release()
    await asyncio.wait_for(idle, 1)
