"""Does speculation pay right now? The engine's own measurement, for ADAPTIVE requests.

The draft service's adaptive policy prices drafts from acceptance and from the costs it is told;
what it cannot see is how expensive verification is in this engine at this batch size (on a
2-core CPU a step turns compute-bound at a few rows, so drafts that pay alone cost more than they
save in a batch of 8). The gate measures it: decode throughput of steps that let ADAPTIVE
requests draft against steps that did not, per batch-size bucket, and lets them draft only while
that is the faster of the two.

NOTE (the rule). Per bucket (1, 2, 3-4, 5-8, 9-16, ... running decodes), two decayed sums of
(tokens emitted, seconds from before the Propose call to the end of the step) over pure decode
steps (no prefill in them): `spec` for steps where ADAPTIVE requests could draft, `plain` where
they could not. Until each side has `min_steps`, each step goes to the side with fewer;
afterwards the faster side (tokens per second) wins and the other still gets one
step in `explore_every`, so a change (a different mix of requests, a recovered draft service)
is noticed. Plain Python, deterministic: a step counter, no clock, no randomness.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Throughput:
    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    spec: _Throughput = field(default_factory=_Throughput)
    plain: _Throughput = field(default_factory=_Throughput)
    step: int = 0


class SpecGate:
    """Decides per step whether ADAPTIVE requests may draft (see the module NOTE)."""

    def __init__(self, *, explore_every: int = 32, min_steps: int = 4, decay: float = 0.8) -> None:
        if explore_every < 2 or min_steps < 1 or not 0 < decay <= 1:
            raise ValueError("need explore_every >= 2, min_steps >= 1 and 0 < decay <= 1")
        self.explore_every, self.min_steps, self.decay = explore_every, min_steps, decay
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket(batch: int) -> int:
        """1, 2, 3-4, 5-8, ... -> 0, 1, 2, 3, ..."""
        return max(batch - 1, 0).bit_length()

    def allow(self, batch: int) -> bool:
        """Whether ADAPTIVE requests draft in this step of `batch` running decodes."""
        b = self._buckets.setdefault(self.bucket(batch), _Bucket())
        b.step += 1
        explore = b.step % self.explore_every == 0
        if b.spec.steps < self.min_steps or b.plain.steps < self.min_steps:
            return b.spec.steps <= b.plain.steps  # warming up: the side with fewer samples
        spec_wins = b.spec.rate >= b.plain.rate
        return spec_wins != explore

    def record(self, batch: int, allowed: bool, tokens: int, seconds: float) -> None:
        """One pure decode step: `tokens` emitted in `seconds` (Propose call included)."""
        b = self._buckets.setdefault(self.bucket(batch), _Bucket())
        (b.spec if allowed else b.plain).add(tokens, seconds, self.decay)

    def rates(self, batch: int) -> tuple[float, float]:
        """(speculating, plain) tokens per second measured for this batch size's bucket."""
        b = self._buckets.get(self.bucket(batch), _Bucket())
        return b.spec.rate, b.plain.rate
