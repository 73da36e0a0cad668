"""The adaptive policy: per sequence, which drafter pays for itself. The engine owns the draft
length: the chosen drafter proposes the `max_draft_tokens` the engine asked for, fewer only when
it has no more (an n-gram lookup that matched a shorter continuation).

NOTE (the rule). Time is counted in target decode steps. A verification step with k drafts costs
the target 1 + k * verify_cost (verifying extra positions is not free), and drafting them costs
k * draft_cost[d] (n-gram: ~0; model: its per-token time over the target's, `model_cost`). The
step yields 1 token of its own plus the accepted drafts. With a per-token acceptance probability
a (each draft accepted only if all before it were), E[accepted] = a + a^2 + ... + a^k, so

    rate(d, k) = (1 + a_d + ... + a_d^k) / (1 + k * (verify_cost + draft_cost[d]))

tokens per step-equivalent (Leviathan et al.'s speedup with the verification cost added); no
drafting has rate 1. Each drafter that can propose now is priced at the length it would give,
k_d (the engine's length, or what the n-gram lookup matched), and the policy picks the one with
the highest rate(d, k_d), or none unless that rate reaches 1 + min_gain: "stop drafting when it
does not pay". Ties go to the cheaper drafter (registration order).

a_d is estimated from the engine's `last_accepted` feedback. A step that accepted `acc` of `k`
drafts saw acc successes in acc + (1 if acc < k else 0) Bernoulli trials (the first rejection
ends the run), so a_d = S/T with S, T exponentially decayed sums of successes and trials
(S <- decay*S + acc, T <- decay*T + trials; a prior of prior_alpha over prior_weight trials
seeds them). Unlike an average of acc/k, this estimate does not depend on k, so it stays right
whatever length the engine asks for from step to step.

Probing: a drafter left unused for probe_every calls (that asked for drafts) drafts once -- the
one idle longest first -- so a drafter that was written off (or a sequence that changed
character, e.g. started repeating itself) can win again. Everything here is plain arithmetic on
the counters: deterministic, no randomness, no clock.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvmesh.services.draft.drafters import DrafterKind


@dataclass(frozen=True)
class AdaptiveParams:
    """Costs and estimator settings of the adaptive policy (see the module NOTE)."""

    draft_cost: Mapping[DrafterKind, float]  # per drafted token, in target decode steps
    verify_cost: float = 0.1
    decay: float = 0.8
    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    min_gain: float = 0.05
    probe_every: int = 16

    def __post_init__(self) -> None:
        if not 0 < self.decay <= 1 or not 0 <= self.prior_alpha < 1 or self.prior_weight <= 0:
            raise ValueError("need 0 < decay <= 1, 0 <= prior_alpha < 1 and prior_weight > 0")
        if self.probe_every < 1 or self.verify_cost < 0 or self.min_gain < 0:
            raise ValueError("need probe_every >= 1, verify_cost >= 0, min_gain >= 0")


def expected_accepted(alpha: float, k: int) -> float:
    """E[accepted drafts] of k drafts with per-token acceptance `alpha`: alpha + ... + alpha^k."""
    return sum(alpha ** i for i in range(1, k + 1))


def rate(alpha: float, k: int, cost_per_draft: float) -> float:
    """Expected tokens per target-step-equivalent of a step with k drafts (1.0 for k = 0)."""
    return (1 + expected_accepted(alpha, k)) / (1 + k * cost_per_draft)


@dataclass
class Acceptance:
    """Decayed acceptance evidence of one drafter for one sequence."""

    successes: float
    trials: float
    idle: int = 0  # calls asking for drafts since this drafter last drafted

    @property
    def alpha(self) -> float:
        return self.successes / self.trials

    def observe(self, proposed: int, accepted: int, decay: float) -> None:
        """Scores one step: `accepted` of `proposed` drafts (accepted is clamped to proposed)."""
        accepted = min(accepted, proposed)
        self.successes = decay * self.successes + accepted
        self.trials = decay * self.trials + accepted + (1 if accepted < proposed else 0)


@dataclass(frozen=True)
class Choice:
    """Which drafter proposes for one sequence now, and how many tokens it gives (`available`
    of it); `drafter` None (and tokens 0) = draft nothing."""

    drafter: DrafterKind | None
    tokens: int
    rate: float
    probe: bool = False


HOPELESS_PROBE_FACTOR = 16
"""A drafter that could not pay even if every draft were accepted (its measured price is too
high) is probed this many times less often: a probe costs a model forward (and the catch-up of
the sequence's context), and is only worth it to notice that the price has changed."""


def _cost(kind: DrafterKind, params: AdaptiveParams) -> float:
    return params.verify_cost + params.draft_cost[kind]


def _probe_factor(kind: DrafterKind, available: int, params: AdaptiveParams) -> int:
    return HOPELESS_PROBE_FACTOR if rate(1.0, available, _cost(kind, params)) < 1 + params.min_gain else 1


def choose(estimates: Mapping[DrafterKind, Acceptance], available: Mapping[DrafterKind, int],
           params: AdaptiveParams, order: Sequence[DrafterKind]) -> Choice:
    """The rule of the module NOTE (no side effects). `available[d]` is how many tokens drafter d
    would propose now (the engine's length, or fewer when it has no more; 0: none), `order` the
    drafters cheapest first."""
    best = Choice(None, 0, 1.0)
    for kind in order:
        k = available.get(kind, 0)
        if k <= 0:
            continue
        r = rate(estimates[kind].alpha, k, _cost(kind, params))
        if r > best.rate:
            best = Choice(kind, k, r)
    if best.rate < 1 + params.min_gain:
        best = Choice(None, 0, 1.0)
    due = [kind for kind in order if available.get(kind, 0) > 0 and kind != best.drafter
           and estimates[kind].idle >= params.probe_every * _probe_factor(kind, available[kind], params)]
    if due:
        kind = max(due, key=lambda d: estimates[d].idle)  # first of the longest idle
        k = available[kind]
        return Choice(kind, k, rate(estimates[kind].alpha, k, _cost(kind, params)), probe=True)
    return best


@dataclass
class AdaptiveState:
    """One sequence's acceptance estimates, per drafter it may use."""

    estimates: dict[DrafterKind, Acceptance] = field(default_factory=dict)

    @classmethod
    def fresh(cls, params: AdaptiveParams, kinds: Sequence[DrafterKind]) -> AdaptiveState:
        prior = (params.prior_alpha * params.prior_weight, params.prior_weight)
        return cls({kind: Acceptance(*prior) for kind in kinds})

    def observe(self, drafter: DrafterKind, proposed: int, accepted: int, params: AdaptiveParams) -> None:
        """Feedback for the previous step's drafts (ignored for a drafter this state has no
        estimate of, or when nothing was proposed)."""
        if proposed > 0 and drafter in self.estimates:
            self.estimates[drafter].observe(proposed, accepted, params.decay)

    def decide(self, available: Mapping[DrafterKind, int], params: AdaptiveParams,
               order: Sequence[DrafterKind]) -> Choice:
        """`choose`, then advance the idle counters (the chosen drafter's restarts at 0)."""
        choice = choose(self.estimates, available, params, order)
        for kind, estimate in self.estimates.items():
            estimate.idle = 0 if kind == choice.drafter else estimate.idle + 1
        return choice
