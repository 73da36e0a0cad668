"""A step-time target for steps that carry decodes: the token budget that keeps them under it.

NOTE (why, and what is measured). With chunked prefill every step gives each running decode its
token and fills the rest of the token budget with prefill chunks (scheduler's NOTE). While
prompts wait, every step is full, so a running request's time per output token is the time of a
full step: on a CPU whose prefill runs ~2.5 ms a token (fp32 without a tile unit), a 512-token
budget makes each step ~1.2 s and no request streams faster than that. `--step-target-ms` caps
the steps that carry decodes instead: their budget is the most tokens the engine's own recent
steps say fit in the target, so decodes keep their pace and prompts wait longer (TPOT for TTFT;
Sarathi-Serve derives its token budget from the TBT SLO the same way, offline). Steps with no
decode keep the solo budget: nobody waits for their end.

The cost model is a line fitted to the last `WINDOW` steps that ran a batch: seconds = a + b *
tokens (tokens = decodes + drafts + prefill chunks), least squares, the engine's own clock. It
is rough on purpose: attention's growth with context and the step loop's Python land in a and b
as averages over the window, which moves with the load. Until the window holds steps of
different sizes the slope is the mean time per token (a line through the origin, an
overestimate for small steps, so the first budgets err short). A budget never drops below the
decodes plus `MIN_PREFILL_TOKENS`, so prompts still progress when the target is below what one
decode step costs, and never exceeds --max-num-batched-tokens. The answer does not change: a
chunk boundary elsewhere computes the same function (scheduler's NOTE).
"""
from __future__ import annotations

from collections import deque

WINDOW = 64
"""Steps the cost line is fitted to."""

MIN_PREFILL_TOKENS = 16
"""Prefill tokens a step carrying decodes may always take, whatever the target."""


class StepBudget:
    """The token budget of a step that carries decodes, from a time target and measured steps."""

    def __init__(self, target_s: float, max_tokens: int) -> None:
        if target_s <= 0:
            raise ValueError(f"step target must be > 0 seconds, got {target_s}")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.target_s = target_s
        self.max_tokens = max_tokens
        self._steps: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def observe(self, tokens: int, seconds: float) -> None:
        """Records one step that computed `tokens` tokens in `seconds` (the engine's clock)."""
        if tokens > 0 and seconds >= 0:
            self._steps.append((tokens, seconds))

    def cost(self) -> tuple[float, float] | None:
        """(a, b): seconds = a + b * tokens fitted to the window; None before any step."""
        n = len(self._steps)
        if n == 0:
            return None
        mean_x = sum(x for x, _ in self._steps) / n
        mean_y = sum(y for _, y in self._steps) / n
        sxx = sum((x - mean_x) ** 2 for x, _ in self._steps)
        if sxx > 0:
            b = sum((x - mean_x) * (y - mean_y) for x, y in self._steps) / sxx
            a = mean_y - b * mean_x
            if b > 0 and a >= 0:
                return a, b
            if b > 0:  # a negative intercept: the line through the origin is the safer guess
                return 0.0, sum(y for _, y in self._steps) / sum(x for x, _ in self._steps)
        # One step size only (or time not growing with size): the mean time per token.
        return 0.0, mean_y / mean_x

    def budget(self, num_decodes: int) -> int:
        """Tokens a step with `num_decodes` decodes may compute: what the fitted line fits in the
        target, at least the decodes plus MIN_PREFILL_TOKENS, at most max_tokens."""
        floor = min(self.max_tokens, num_decodes + MIN_PREFILL_TOKENS)
        fit = self.cost()
        if fit is None:
            return self.max_tokens
        a, b = fit
        if b <= 0:
            return self.max_tokens
        fits = int((self.target_s - a) / b)
        return max(floor, min(self.max_tokens, fits))
