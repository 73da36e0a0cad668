"""The online guardrail of lossy KV reuse: which opted-in lossy paths (a lossy KV codec, blending
of cached documents) are served now, and the sampled shadow checks that decide it.

NOTE (how it works).
  * Paths. A path is one lossy namespace: its KvNamespace digest names the model, the tenant
    salt and the storage (e.g. "int8c-g16-r0-h1-o0" or "blend:exact:0.1500:2:deviation+deep-attention"),
    so each tenant's use of each lossy format is judged on its own. A path is disabled against
    the loosest QualityBudget any request of it declared (GuardedPath.budget): a request with a
    tighter one falls back on its own (see Decision), without turning the path off for others.
  * Sampling (`admit`, asyncio side). Deterministic, no RNG: of the lossy admissions a path
    serves, the 1st, then every ceil(1 / shadow_share)-th (default share 2%: every 50th) gets a
    GuardTicket with served_lossy=True. While the path is disabled, the 1st and then every
    ceil(1 / replay_share)-th request that asked for it (default 10%) gets a ticket with
    served_lossy=False: it is served exactly, and its check replays the lossy path offline.
  * Checks (services/engine/shadow.py, on the step loop). When a ticketed request finishes, the
    core queues a ShadowCheck: prompt, answer (at most max_tokens positions) and, if it was served
    lossy, the raw logits rows its sampler saw (such a request decodes without speculation, so
    there is exactly one row per token). Checks run only when the core has nothing else to do
    (`EngineCore.step` with an empty scheduler), one per idle turn; the queue holds `queue`
    checks (default 8) and drops the oldest (counted) while the engine stays busy. A check
    recomputes the answer's next-token logits exactly (a dense prefill of the prompt that reuses
    nothing, then teacher forcing along the answer) and compares them with the lossy ones
    (kvmesh.kv.quality.compare): mean KL(exact || lossy) per position and top-1 agreement. A
    request served lossy that reused nothing (no cached KV in its lossy namespace; for a blend,
    no document KV blended) gives no check: it would measure nothing.
  * Estimate. Per path, a window of the last `window` checks (default 32), pooled by positions:
    KL = sum of per-position KL / positions, top-1 = agreeing positions / positions (one short
    answer does not weigh as much as a long one). Once the window holds min_checks checks, each
    figure leaves out its single worst check: one unlucky prompt never decides, while a path
    that fails on a steady share of prompts still shows in the mean.
  * Decision. A path goes over a budget when its estimate's KL is above max_kl, or its top-1 is
    below min_top1 over at least MIN_TOP1_POSITIONS positions (fewer are too coarse: one flip in
    8 is 87.5%). It is disabled when
      (a) the window holds at least min_checks checks (default 8) and is over the path's
          budget, or
      (b) the last FAST_CHECKS (2) checks were each far over it: KL above fast_factor x max_kl
          (default 4x), or, over at least 8 positions, a top-1 shortfall 1 - top1 above
          fast_factor x (1 - min_top1). A clearly broken path stops after two checks: on the
          real model, int8 with gaussian noise of the KV's own scale (KL ~7 nats) was disabled
          after 110 lossy requests at 2%; one unlucky prompt never disables a good one (int8
          itself measures KL ~1e-4, top-1 100%).
    A request is served a path only while it is enabled and, once the path has min_checks
    checks, its estimate is within the request's own budget; otherwise it falls back (exact
    reuse, or its documents computed) and `Admission.fallback` says why.
  * Re-enable. Only replays decide it: once the last reenable_checks replays (default 8),
    pooled, are within the budget, the path is enabled again and its window restarts from
    those replays.
  * Export. `snapshot()` gives every path's state -- the estimate the decision uses, counts of
    checks, served requests, fallbacks and disables -- to GetGuardrail, `kvmesh status` and the
    metrics collector (services/engine/metrics.py); the request's trace gets kvmesh.guard.*
    attributes and each check an engine.guard_check span (services/engine/tracing.py).

Control plane only: no tensors (a check's logits ride through as an opaque value). Thread-safe:
`admit` runs on the asyncio side, checks on the step loop, `snapshot` on either.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from kvmesh.kv.namespace import KvNamespace
from kvmesh.kv.quality import QualityBudget

if TYPE_CHECKING:
    from kvmesh.kv.codec import CodecSpec

log = logging.getLogger(__name__)

FAST_CHECKS = 2
"""Consecutive checks far over the budget that disable a path before min_checks."""
MIN_TOP1_POSITIONS = 32
"""Pooled positions below which a top-1 estimate does not decide anything."""
FAST_TOP1_POSITIONS = 8
"""Positions a single check needs for its top-1 to count as far over the budget."""


@dataclass(frozen=True)
class GuardConfig:
    """The guardrail's knobs (EngineConfig's guard_* flags)."""

    shadow_share: float = 0.02
    """Share of lossy admissions shadow-checked (0 = none)."""
    replay_share: float = 0.1
    """While a path is disabled: share of the requests asking for it whose check replays it."""
    min_checks: int = 8
    """Checks before the window estimate can disable a path or refuse a request's budget."""
    window: int = 32
    """Checks the running estimate pools (the most recent)."""
    fast_factor: float = 4.0
    """How far over the budget FAST_CHECKS checks in a row must be to disable before min_checks."""
    reenable_checks: int = 8
    """Replays in a row, pooled within the budget, that enable a disabled path again."""
    queue: int = 8
    """Checks waiting for an idle engine; beyond it the oldest is dropped. A served check holds
    its logits rows: up to queue x max_tokens x vocab x 4 bytes (~100 MB for a 49k vocabulary)."""
    max_tokens: int = 64
    """Answer positions a check compares (and logits rows a served request keeps)."""

    def __post_init__(self) -> None:
        for name in ("shadow_share", "replay_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"GuardConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("min_checks", "window", "reenable_checks", "queue", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"GuardConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.fast_factor < 1.0:
            raise ValueError(f"GuardConfig.fast_factor must be >= 1, got {self.fast_factor}")


@dataclass(frozen=True)
class LossyPath:
    """What a request asked for: one lossy reuse path in one namespace."""

    namespace: KvNamespace
    """The lossy namespace the request would use (its storage names the path; tenant salt included)."""
    kind: str
    """"codec" or "blend"."""
    codec: Optional[CodecSpec]
    """Codec path: the lossy CodecSpec; blend: the CodecSpec the documents are stored with (None = exact)."""
    recompute_ratio: Optional[float]
    """Blend only."""
    budget: QualityBudget
    """Resolved (request over tenant over deployment); both fields set."""


@dataclass(frozen=True)
class GuardTicket:
    """Rides on EngineRequest.guard when the request is shadow-checked."""

    path: LossyPath
    served_lossy: bool
    """True: served over lossy KV (its logits are kept); False: the path was disabled and the
    request is served exactly; its check replays the lossy path offline."""
    document_spans: tuple[tuple[int, int], ...] = ()
    """Blend: the [start, end) prompt positions of its documents (for the replay)."""


@dataclass(frozen=True)
class Admission:
    serve: bool
    """False: the caller falls back to exact."""
    fallback: str
    """Why not served ("" when served): "<storage>: <reason>"."""
    ticket: Optional[GuardTicket]


@dataclass(frozen=True, eq=False)
class ShadowCheck:
    """One finished, ticketed request, waiting for an idle engine to check it."""

    ticket: GuardTicket
    prompt_token_ids: tuple[int, ...]
    answer_token_ids: tuple[int, ...]
    """The served answer's first tokens (at most GuardConfig.max_tokens), compared position by position."""
    lossy_logits: Any = None
    """served_lossy: [len(answer), vocab] float32 rows the sampler saw; None for a replay."""
    trace_context: Any = None
    """The request's OpenTelemetry context: the check's span joins its trace."""


@dataclass(frozen=True)
class GuardedPathReport:
    """One path as `snapshot` sees it (GetGuardrail's GuardedPath)."""

    namespace: KvNamespace
    kind: str
    enabled: bool
    checks: int
    """Checks recorded since start (served and replayed)."""
    kl: float
    """Window estimate: mean KL(exact || lossy) per position, nats (0 before any check)."""
    top1: float
    """Window estimate: top-1 agreement (1 before any check)."""
    positions: int
    """Answer positions in the window."""
    budget: QualityBudget
    served: int
    fallbacks: int
    disabled_count: int
    replays: int
    """Checks that replayed the path while it was disabled."""
    reason: str
    """Why it was last disabled ("" if never)."""


@dataclass(frozen=True)
class GuardReport:
    shadow_share: float
    paths: tuple[GuardedPathReport, ...]
    pending_checks: int
    dropped_checks: int
    """Checks dropped because the queue was full (the engine had no idle turn for them)."""
    failed_checks: int
    """Checks that raised (logged) or had nothing to compare."""


@dataclass(frozen=True)
class _Check:
    positions: int
    kl: float
    top1: float


@dataclass(frozen=True)
class _Estimate:
    checks: int
    positions: int
    kl: float
    top1: float

    def over(self, budget: QualityBudget) -> bool:
        """Whether the estimate is outside `budget` (top-1 judged only over enough positions)."""
        return ((budget.max_kl is not None and self.kl > budget.max_kl)
                or (budget.min_top1 is not None and self.positions >= MIN_TOP1_POSITIONS
                    and self.top1 < budget.min_top1))

    def describe(self, budget: QualityBudget) -> str:
        if budget.max_kl is not None and self.kl > budget.max_kl:
            return f"KL {self.kl:.3g} > budget {budget.max_kl:g} over {self.checks} checks"
        return f"top-1 {self.top1:.1%} < budget {budget.min_top1:.1%} over {self.checks} checks"


def _pool(checks, trim_from: int) -> _Estimate:
    """Checks pooled by positions; from `trim_from` checks on, each figure leaves out its single
    worst check (one unlucky prompt does not decide)."""
    checks = list(checks)
    positions = sum(c.positions for c in checks)
    if not positions:
        return _Estimate(0, 0, 0.0, 1.0)

    def mean(value, worst) -> float:
        kept = checks
        if len(checks) >= max(trim_from, 2):
            drop = max(range(len(checks)), key=lambda i: worst(checks[i]))
            kept = checks[:drop] + checks[drop + 1:]
        n = sum(c.positions for c in kept)
        return sum(value(c) * c.positions for c in kept) / n

    return _Estimate(len(checks), positions, mean(lambda c: c.kl, lambda c: c.kl),
                     mean(lambda c: c.top1, lambda c: 1.0 - c.top1))


def _period(share: float) -> int:
    """Every how many events one is sampled; 0 = never."""
    return max(1, math.ceil(1.0 / share - 1e-9)) if share > 0 else 0


@dataclass
class _Path:
    path: LossyPath
    budget: QualityBudget
    window: deque
    probation: deque  # replays since the path was disabled
    enabled: bool = True
    checks: int = 0
    served: int = 0
    fallbacks: int = 0
    refused: int = 0  # requests that asked while disabled, since it was disabled (replay sampling)
    disabled_count: int = 0
    replays: int = 0
    reason: str = ""
    recent: deque = field(default_factory=lambda: deque(maxlen=FAST_CHECKS))


class Guardrail:
    """Per-path state, the sampling of shadow checks and the queue of pending ones (see the NOTE)."""

    def __init__(self, config: GuardConfig = GuardConfig()) -> None:
        self.config = config
        self._shadow_period = _period(config.shadow_share)
        self._replay_period = _period(config.replay_share)
        self._paths: dict[bytes, _Path] = {}
        self._queue: deque[ShadowCheck] = deque()
        self._running = 0
        self._dropped = 0
        self._failed = 0
        self._cond = threading.Condition()

    # ---- admission (asyncio side) ----------------------------------------------------------

    def admit(self, path: LossyPath, document_spans: tuple[tuple[int, int], ...] = ()) -> Admission:
        """Whether `path` is served to this request now, and its shadow-check ticket if sampled.
        Thread-safe."""
        with self._cond:
            st = self._paths.get(path.namespace.digest())
            if st is None:
                st = _Path(path, path.budget, deque(maxlen=self.config.window),
                           deque(maxlen=self.config.reenable_checks))
                self._paths[path.namespace.digest()] = st
            else:
                st.budget = st.budget.looser(path.budget)
                st.path = path
            storage = path.namespace.storage
            if not st.enabled:
                st.fallbacks += 1
                st.refused += 1
                replay = self._replay_period and (st.refused - 1) % self._replay_period == 0
                ticket = GuardTicket(path, False, tuple(document_spans)) if replay else None
                return Admission(False, f"{storage}: disabled by the guardrail ({st.reason})", ticket)
            est = _pool(st.window, self.config.min_checks)
            if est.checks >= self.config.min_checks and est.over(path.budget):
                st.fallbacks += 1
                return Admission(False, f"{storage}: the guardrail's estimate is outside this request's budget "
                                        f"({est.describe(path.budget)})", None)
            st.served += 1
            sampled = self._shadow_period and (st.served - 1) % self._shadow_period == 0
            return Admission(True, "", GuardTicket(path, True, tuple(document_spans)) if sampled else None)

    # ---- checks (step loop) ------------------------------------------------------------------

    def submit(self, check: ShadowCheck) -> None:
        """Queues a finished request's check; drops the oldest when the queue is full."""
        with self._cond:
            if len(self._queue) >= self.config.queue:
                self._queue.popleft()
                self._dropped += 1
            self._queue.append(check)

    @property
    def pending(self) -> int:
        """Checks queued (not counting one being run)."""
        return len(self._queue)

    def next_check(self) -> Optional[ShadowCheck]:
        """The oldest queued check, now in flight until `done` is called for it."""
        with self._cond:
            if not self._queue:
                return None
            self._running += 1
            return self._queue.popleft()

    def done(self, check: ShadowCheck, positions: int = 0, kl: float = 0.0, top1: float = 1.0) -> None:
        """Records a check's result (`positions` 0: it failed or had nothing to compare)."""
        with self._cond:
            self._running -= 1
            if positions > 0:
                self.record(check.ticket, positions, kl, top1)
            else:
                self._failed += 1
            self._cond.notify_all()

    def record(self, ticket: GuardTicket, positions: int, kl: float, top1: float) -> None:
        """One check's comparison (over `positions` answer positions) into its path's estimate,
        then the decision rule (see the NOTE)."""
        with self._cond:
            st = self._paths.get(ticket.path.namespace.digest())
            if st is None:  # a ticket this guardrail did not issue (tests)
                st = _Path(ticket.path, ticket.path.budget, deque(maxlen=self.config.window),
                           deque(maxlen=self.config.reenable_checks))
                self._paths[ticket.path.namespace.digest()] = st
            c = _Check(positions, kl, top1)
            st.checks += 1
            st.window.append(c)
            st.recent.append(c)
            if not ticket.served_lossy:
                st.replays += 1
                st.probation.append(c)
            budget = st.budget
            if st.enabled:
                est = _pool(st.window, self.config.min_checks)
                if est.checks >= self.config.min_checks and est.over(budget):
                    self._disable(st, est.describe(budget))
                elif len(st.recent) == FAST_CHECKS and all(self._far_over(r, budget) for r in st.recent):
                    last, f = st.recent[-1], self.config.fast_factor
                    what = (f"KL {last.kl:.3g} > {f:g}x budget {budget.max_kl:g}"
                            if budget.max_kl is not None and last.kl > f * budget.max_kl else
                            f"top-1 {last.top1:.1%} far below budget {budget.min_top1:.1%}")
                    self._disable(st, f"{what}, {FAST_CHECKS} checks in a row")
            elif (len(st.probation) == self.config.reenable_checks
                  and not _pool(st.probation, self.config.min_checks).over(budget)):
                log.warning("guardrail: lossy path %s (%s) enabled again: its last %d replays are within %s",
                            st.path.namespace.storage, st.path.namespace.tenant_salt or "default tenant",
                            len(st.probation), budget.describe())
                st.enabled = True
                st.window.clear()
                st.window.extend(st.probation)
                st.recent.clear()

    def _far_over(self, c: _Check, budget: QualityBudget) -> bool:
        f = self.config.fast_factor
        return ((budget.max_kl is not None and c.kl > f * budget.max_kl)
                or (budget.min_top1 is not None and c.positions >= FAST_TOP1_POSITIONS
                    and 1.0 - c.top1 > f * (1.0 - budget.min_top1)))

    @staticmethod
    def _disable(st: _Path, reason: str) -> None:
        log.warning("guardrail: lossy path %s (%s) disabled, its requests are served exactly: %s",
                    st.path.namespace.storage, st.path.namespace.tenant_salt or "default tenant", reason)
        st.enabled = False
        st.disabled_count += 1
        st.reason = reason
        st.refused = 0
        st.probation.clear()

    def wait_idle(self, timeout_s: float) -> bool:
        """Blocks until no check is queued or running (tests, benchmarks); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._running, timeout_s)

    # ---- export ------------------------------------------------------------------------------

    def snapshot(self) -> GuardReport:
        """Every path's state now (GetGuardrail, `kvmesh status`, metrics)."""
        with self._cond:
            paths = []
            for st in self._paths.values():
                est = _pool(st.window, self.config.min_checks)
                paths.append(GuardedPathReport(
                    st.path.namespace, st.path.kind, st.enabled, st.checks, est.kl, est.top1, est.positions,
                    st.budget, st.served, st.fallbacks, st.disabled_count, st.replays, st.reason))
            return GuardReport(self.config.shadow_share, tuple(paths), len(self._queue), self._dropped,
                               self._failed)
