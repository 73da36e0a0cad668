"""Admission control: bounds on upstream requests and prompt tokens in flight, per gateway and tenant.

A request asks for `requests` upstream generations (prompts x n) and `prompt_tokens` (their
prompts' tokens, each copy counted). `try_admit` returns a `Ticket` or a `Rejection` — refusal is
a value, not an exception, so the caller decides how to report it (503 + Retry-After when the
gateway is full, 429 when the tenant is at its own cap). A ticket's `release()` is idempotent and
must run on every exit path (finished, failed, client gone); the request handler does it in a
`finally`.

NOTE (one oversized request). A request that could never fit, even into an idle gateway, is
refused as `too_large` rather than left to fail forever with "retry later".
"""
from __future__ import annotations

import asyncio
import enum
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass


class Rejection(enum.Enum):
    """Why a request was not admitted (also the `reason` label of the rejection metric)."""

    GATEWAY_REQUESTS = "inflight_requests"
    GATEWAY_TOKENS = "inflight_prompt_tokens"
    TENANT = "tenant_limit"
    TOO_LARGE = "too_large"
    DRAINING = "draining"


@dataclass(frozen=True)
class AdmissionLimits:
    """Bounds on work in flight; `tenant_max_requests` 0 means no per-tenant cap by default."""

    max_requests: int
    max_prompt_tokens: int
    tenant_max_requests: int = 0


class Ticket:
    """Admitted work; give it back with `release()` (idempotent)."""

    def __init__(self, owner: Admission, tenant: str, requests: int, prompt_tokens: int) -> None:
        self._owner = owner
        self.tenant = tenant
        self.requests = requests
        self.prompt_tokens = prompt_tokens
        self.released = False

    def release(self) -> None:
        """Return this ticket's requests and tokens to the pool (only the first call counts)."""
        if not self.released:
            self.released = True
            self._owner._release(self)


class Admission:
    """Counts work in flight against `AdmissionLimits` (single event loop; no locking needed).

    `on_change(requests, prompt_tokens)` is called after every change (gauges).
    """

    def __init__(self, limits: AdmissionLimits,
                 on_change: Callable[[int, int], None] | None = None) -> None:
        self.limits = limits
        self._requests = 0
        self._tokens = 0
        self._per_tenant: Counter[str] = Counter()
        self._on_change = on_change
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = False

    @property
    def inflight_requests(self) -> int:
        return self._requests

    @property
    def inflight_prompt_tokens(self) -> int:
        return self._tokens

    def tenant_inflight(self, tenant: str) -> int:
        return self._per_tenant[tenant]

    def tenant_limit(self, tenant_limit: int | None) -> int:
        """A tenant's cap: its own when configured, else the default (0 = none)."""
        return tenant_limit if tenant_limit else self.limits.tenant_max_requests

    def try_admit(self, tenant: str, requests: int, prompt_tokens: int,
                  tenant_limit: int | None = None) -> Ticket | Rejection:
        """A Ticket when the work fits every bound now, else why not."""
        cap = self.tenant_limit(tenant_limit)
        if self.draining:
            return Rejection.DRAINING
        if (requests > self.limits.max_requests or prompt_tokens > self.limits.max_prompt_tokens
                or (cap and requests > cap)):
            return Rejection.TOO_LARGE
        if cap and self._per_tenant[tenant] + requests > cap:
            return Rejection.TENANT
        if self._requests + requests > self.limits.max_requests:
            return Rejection.GATEWAY_REQUESTS
        if self._tokens + prompt_tokens > self.limits.max_prompt_tokens:
            return Rejection.GATEWAY_TOKENS
        self._requests += requests
        self._tokens += prompt_tokens
        self._per_tenant[tenant] += requests
        self._idle.clear()
        self._changed()
        return Ticket(self, tenant, requests, prompt_tokens)

    def _release(self, ticket: Ticket) -> None:
        self._requests -= ticket.requests
        self._tokens -= ticket.prompt_tokens
        self._per_tenant[ticket.tenant] -= ticket.requests
        if self._per_tenant[ticket.tenant] <= 0:
            del self._per_tenant[ticket.tenant]
        if self._requests == 0:
            self._idle.set()
        self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self._requests, self._tokens)

    async def wait_idle(self) -> None:
        """Return once nothing is in flight."""
        await self._idle.wait()
