"""What ADAPTIVE requests do in a step: the engine's own measurement picks it.

The draft service's adaptive policy prices drafts from acceptance and from costs it is told; what
it cannot see is what verification costs in this engine at this batch size, or what its own
model drafter costs next to this engine's step. Both moved a lot between weight formats: with
fp32 weights a step of 1-8 decode rows streams the weights once, so 7 drafts cost ~1.5x a plain
step; the exact GGUF block kernel is compute-bound: one decode step of one sequence at a
600-token context took 11.05 / 13.59 / 16.62 / 19.69 ms with 0 / 1 / 2 / 3 drafts (medians of
steps alternating between them) and 34-42 ms with 4-7 (one-off, in process), so 7 drafts cost
~3.5x. A fixed price is wrong for one of them, and on a noisy 2-core
machine a comparison of a few steps is wrong half the time. So the gate measures arms.

NOTE (the rule). An arm is what ADAPTIVE requests do in one step: no drafts, n-gram drafts of at
most 1, 3 or the engine's full draft length per sequence (looked up in the engine, see
kvmesh.services.engine.speculator), or the draft service's adaptive choice (`default_arms`). Per batch-size bucket (1, 2, 3-4, 5-8, ...) and arm the gate keeps the last
`window` pure decode steps it ran: tokens emitted, and seconds from before the Propose call to
the end of the step, each capped at twice the window's median, so that a step stretched by the
machine (another process, a page fault) counts as at most twice a typical one.
- Price. An arm's rate is R = sum(tokens) / sum(seconds), with the ratio estimator's standard
  error SE (from the residuals tokens - R * seconds). The arm with the highest R - z * SE runs
  (z = `confidence`, 1), ties to the earlier arm. Plain steps emit one token each and barely
  vary, while a drafting arm's tokens per step vary from 1 to k + 1. A drafting arm therefore
  takes over only once it is faster by more than its own noise: a lucky run of a few steps
  does not switch the engine to drafting that costs more than it brings. An arm with fewer
  than 2 steps has no SE and is not chosen on price.
- Warm-up. Until every arm has `min_steps`, each step goes to the arm with the fewest; one step
  suffices for an arm whose step lasted over 8x the quickest arm's typical step (the model
  drafter here), which exploration then prices at its cost.
- Exploration, budgeted in time, not steps. Another arm is due once the bucket's measured seconds
  since it last ran reach its typical step (its window's median seconds) times (arms - 1) /
  share. The share is `plausible_share` (25%) while the arm might still be the better one (its
  R + z * SE, or 2R after a single step, reaches the running arm's R - z * SE) and
  `explore_share` (5%) once it is clearly worse. The due arm measured longest ago runs: all
  exploring of clearly worse arms together costs at most about 5% of the time, and an arm that
  may be better is learnt 5x as fast. A step-count schedule would not do: the draft service's
  model drafter costs ~30 ms per drafted token on this CPU, one 7-draft step of it lasts as long
  as ~30 plain gguf steps, and such a schedule would spend a third of the time there. A change
  (another workload, a recovered draft service) is still noticed.

Plain Python, deterministic: the seconds are the recorded ones, no clock, no randomness.
"""
from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from kvmesh.services.engine.speculation import SpecMode


@dataclass(frozen=True)
class Arm:
    """What ADAPTIVE requests do in one step: draft from `mode`'s drafter (None: no drafts), at
    most `max_draft` tokens per sequence (on top of the engine's own fit to the step)."""

    mode: Optional[SpecMode]
    max_draft: int = 0

    def __str__(self) -> str:
        return "off" if self.mode is None else f"{self.mode.value}<={self.max_draft}"


PLAIN = Arm(None, 0)


def default_arms(max_draft_tokens: int, lengths: Sequence[int] = (1, 3)) -> tuple[Arm, ...]:
    """No drafts; n-gram drafts of at most each of `lengths` and of `max_draft_tokens` per
    sequence (each length once, none above `max_draft_tokens`); the draft service's adaptive
    choice at `max_draft_tokens` (its model drafter is the expensive one to explore, so it gets
    one length). Why 1 and 3 with the default gguf weights (the module NOTE's step costs): a
    verified row costs ~23% of a plain step for the first draft and ~3x a plain step from the
    fifth row, so one draft pays from ~23% acceptance (bench spec's chat: the first n-gram draft
    right 74% of the time, later ones far less), while copying text (extractive) pays up to 3."""
    if max_draft_tokens < 1:
        return (PLAIN,)
    ks = sorted({min(k, max_draft_tokens) for k in (*lengths, max_draft_tokens) if k >= 1})
    return (PLAIN, *(Arm(SpecMode.NGRAM, k) for k in ks), Arm(SpecMode.ADAPTIVE, max_draft_tokens))


class _Samples:
    """An arm's last `window` steps and their statistics, computed once per recorded step (the
    choice of every step reads them for every arm)."""

    def __init__(self, window: int) -> None:
        self.steps: deque = deque(maxlen=window)  # (tokens, seconds)
        self.last_step = -1                       # bucket step at which the arm last ran
        self.last_seconds = 0.0                   # the bucket's measured seconds when it last ran
        self.typical = 0.0                        # median seconds of a step
        self.rate = 0.0                           # tokens per second (0.0 before any step)
        self.error = float("inf")                 # the rate's standard error (< 2 steps: inf)

    def add(self, tokens: int, seconds: float) -> None:
        self.steps.append((tokens, seconds))
        n = len(self.steps)
        self.typical = statistics.median(s for _, s in self.steps)
        steps = [(t, min(s, 2.0 * self.typical)) for t, s in self.steps]
        total = sum(s for _, s in steps)
        self.rate = sum(t for t, _ in steps) / total if total > 0 else 0.0
        if n < 2 or total <= 0:
            self.error = float("inf")
        else:  # the ratio estimator's standard error
            var = sum((t - self.rate * s) ** 2 for t, s in steps) / (n - 1)
            self.error = (var / n) ** 0.5 / (total / n)

    def lower(self, z: float) -> float:
        return self.rate - z * self.error

    def upper(self, z: float) -> float:
        """rate + z * its standard error; twice the rate after a single step (an arm left at one
        warm-up step because it is expensive), inf before any."""
        if len(self.steps) == 1:
            return 2.0 * self.rate
        return self.rate + z * self.error


@dataclass
class _Bucket:
    arms: dict[Arm, _Samples]
    step: int = 0
    seconds: float = 0.0  # every measured step


class SpecGate:
    """Picks each step's arm for ADAPTIVE requests from measured throughput (see the module NOTE)."""

    def __init__(self, arms: Sequence[Arm] = default_arms(7), *, explore_share: float = 0.05,
                 plausible_share: float = 0.25, confidence: float = 1.0, min_steps: int = 3,
                 window: int = 24) -> None:
        if not arms or len(set(arms)) != len(arms):
            raise ValueError("need at least one arm, each once")
        if (not 0 < explore_share <= plausible_share < 1 or confidence < 0 or min_steps < 1
                or window < max(min_steps, 2)):
            raise ValueError("need 0 < explore_share <= plausible_share < 1, confidence >= 0, "
                             "min_steps >= 1 and window >= max(min_steps, 2)")
        self.arms = tuple(arms)
        self.explore_share, self.plausible_share, self.confidence = explore_share, plausible_share, confidence
        self.min_steps, self.window = min_steps, window
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        """1, 2, 3-4, 5-8, ... -> 0, 1, 2, 3, ..."""
        return max(batch - 1, 0).bit_length()

    def _bucket(self, batch: int) -> _Bucket:
        key = self.bucket(batch)
        if key not in self._buckets:
            self._buckets[key] = _Bucket({arm: _Samples(self.window) for arm in self.arms})
        return self._buckets[key]

    def _best(self, b: _Bucket) -> Arm:
        return max(self.arms, key=lambda a: b.arms[a].lower(self.confidence))  # first of equals

    def choose(self, batch: int) -> Arm:
        """The arm ADAPTIVE requests follow in this step of `batch` running decodes."""
        b = self._bucket(batch)
        b.step += 1
        quick = min((b.arms[a].typical for a in self.arms if b.arms[a].steps), default=0.0)
        warming = [a for a in self.arms if len(b.arms[a].steps) < self.min_steps
                   and not (b.arms[a].steps and b.arms[a].typical > 8 * quick)]
        if warming:
            arm = min(warming, key=lambda a: len(b.arms[a].steps))
        else:
            arm = self._best(b)
            floor = b.arms[arm].lower(self.confidence)

            def spread(a: Arm) -> float:
                share = self.plausible_share if b.arms[a].upper(self.confidence) >= floor else self.explore_share
                return (len(self.arms) - 1) / share

            due = [a for a in self.arms if a != arm
                   and b.seconds - b.arms[a].last_seconds >= b.arms[a].typical * spread(a)]
            if due:
                arm = min(due, key=lambda a: b.arms[a].last_step)
        b.arms[arm].last_step = b.step
        return arm

    def current(self, batch: int) -> Arm:
        """The best-priced arm so far, for a step the gate does not measure (one with a prefill in
        it): no step counted, nothing explored; the first arm (no drafts) before any measurement."""
        b = self._buckets.get(self.bucket(batch))
        return self.arms[0] if b is None else self._best(b)

    def record(self, batch: int, arm: Arm, tokens: int, seconds: float) -> None:
        """One pure decode step that ran `arm`: `tokens` emitted in `seconds` (Propose included)."""
        b = self._bucket(batch)
        b.seconds += seconds
        samples = b.arms[arm]
        samples.last_seconds = b.seconds
        samples.add(tokens, seconds)

    def rates(self, batch: int) -> dict[Arm, float]:
        """Each arm's measured tokens per second in this batch size's bucket (0.0: not measured)."""
        b = self._buckets.get(self.bucket(batch))
        return {arm: (b.arms[arm].rate if b else 0.0) for arm in self.arms}
