"""SLO-aware admission: refuse a request (503 + Retry-After) when the time to its first token,
predicted from the work queued ahead of it, would break the configured TTFT bound -- rather than
admit work that will miss it and make every request behind it miss it too. Off unless
--slo-ttft-s is set.

NOTE (the prediction). The gateway sees every request's admission and its first token. What
stands between a new request and its first token is, to a first approximation, the prompt
tokens admitted and still waiting for their first token (their prefill) plus its own. The rate
at which the stack gets through such tokens is measured on the requests themselves: when a
request gets its first token, (tokens that were waiting when it was admitted + its own) / (its
TTFT) is one sample, averaged exponentially (`alpha`). A request that was alone gives a rate
below the one at which a queue drains (its TTFT holds fixed costs: routing, KV fetches), so the
estimate errs on the side of refusing; its samples are what the first decisions rest on.
Prefix-cache hits, decode work sharing the steps, more or fewer replicas: all of it shows up in
the measured rate, so the model needs no knowledge of the stack behind the router. Predicted
TTFT = (waiting + own) / rate.

Two rules, each found by running it
(`kvmesh loadtest --compare kvmesh-slo`):
- **An empty queue admits.** With nothing waiting, no queueing delay can be avoided by
  refusing; a request that misses the bound on an idle stack misses it whatever the gateway
  does. Without this rule, one pessimistic estimate refused every later request, and refused
  requests never produce the samples that would correct it.
- **A margin.** A request is refused when the prediction exceeds `margin` (0.8) x the bound,
  not the bound itself: the prediction is an average, the SLO is held at the tail, and an
  admitted request also slows those ahead of it (their decodes share its prefill's steps).
With fewer than `min_samples` samples nothing is refused (no evidence yet), and a request that
ends before its first token (failed, cancelled) just leaves the queue.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import count
from typing import Optional


@dataclass
class _Waiting:
    tokens: int
    admitted: float
    ahead: int


class TtftPredictor:
    """The NOTE's model; single event loop (no locking). `clock` is injectable for tests."""

    def __init__(self, slo_s: float, *, alpha: float = 0.2, min_samples: int = 2, margin: float = 0.8,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.slo_s = slo_s
        self.margin = margin
        self.alpha = alpha
        self.min_samples = min_samples
        self._clock = clock
        self._ids = count()
        self._waiting: dict[int, _Waiting] = {}
        self.waiting_tokens = 0
        """Prompt tokens admitted that have no first token yet."""
        self.rate: Optional[float] = None
        """Measured prompt tokens per second up to a first token (EWMA), None before any sample."""
        self.samples = 0

    def predict(self, prompt_tokens: int) -> Optional[float]:
        """Seconds to the first token of a request of `prompt_tokens` admitted now; None while
        there are too few samples to say."""
        if self.rate is None or self.samples < self.min_samples:
            return None
        return (self.waiting_tokens + prompt_tokens) / self.rate

    def refuses(self, prompt_tokens: int) -> Optional[float]:
        """The predicted TTFT when it breaks the SLO with the NOTE's margin (refuse the request),
        else None; never with nothing waiting (the NOTE's first rule)."""
        if not self._waiting:
            return None
        predicted = self.predict(prompt_tokens)
        return predicted if predicted is not None and predicted > self.margin * self.slo_s else None

    def retry_after_s(self, predicted: float) -> int:
        """Seconds until the queue ahead should have drained to within the SLO (with its margin)."""
        return max(1, math.ceil(predicted - self.margin * self.slo_s))

    def admit(self, prompt_tokens: int) -> int:
        """Records an admitted request; returns its handle."""
        handle = next(self._ids)
        self._waiting[handle] = _Waiting(prompt_tokens, self._clock(), self.waiting_tokens)
        self.waiting_tokens += prompt_tokens
        return handle

    def first_token(self, handle: int) -> None:
        """The request's first token arrived: it leaves the queue and gives a rate sample."""
        w = self._waiting.pop(handle, None)
        if w is None:
            return
        self.waiting_tokens -= w.tokens
        elapsed = self._clock() - w.admitted
        if elapsed <= 0:
            return
        sample = (w.ahead + w.tokens) / elapsed
        self.rate = sample if self.rate is None else (1 - self.alpha) * self.rate + self.alpha * sample
        self.samples += 1

    def leave(self, handle: int) -> None:
        """The request ended without a first token (failed, cancelled): it leaves the queue."""
        w = self._waiting.pop(handle, None)
        if w is not None:
            self.waiting_tokens -= w.tokens
