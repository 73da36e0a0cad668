"""Replica placement: which replica of a tier runs a request, and in which order the others
are tried if it fails. Plain deterministic Python: probes come in as values, time as a clock.

NOTE (the kv_aware score): a request's time to first token on a replica is dominated by the
prefill work queued ahead of and including it. With chunked prefill a replica spends each step's
token budget on its running decodes and on prompt tokens in arrival order, so the work before
this request's first token is estimated, in prompt tokens, as

    score = (prompt_tokens - cached_tokens)      # our own prefill; cached prefix is free
          + pending_prefill_tokens               # prompts admitted or queued before ours
          + load_weight * (running + waiting)    # decode work those requests interleave

and the lowest score wins. A long cached prefix therefore attracts a request exactly as long as
the tokens it saves outweigh the extra queue on that replica. Equal scores are broken
round-robin (the candidate list is rotated by a per-tier cursor before a stable sort), so a
burst of cold requests spreads instead of piling onto the first replica.

NOTE (down replicas): a replica that answers a probe or a call UNAVAILABLE (refused connection,
draining, stopped) is marked down for the back-off period: it is neither probed nor tried until
then, after which it is a normal candidate again (one more failure puts it back). No probe
answer at all (every probe failed or was late, or the prompt is text so there is nothing to
probe with) falls back to least_loaded over this router's own in-flight counts; replicas without
an answer (late, or OpenAI-compatible ones that cannot be probed) rank after the probed ones, by
in-flight count.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """What one replica's probe reported (kvmesh.engine.v1.ProbeResponse, as a value)."""

    cached_tokens: int = 0
    running: int = 0
    waiting: int = 0
    pending_prefill_tokens: int = 0


@dataclass(frozen=True)
class Candidate:
    """A healthy replica the request could go to, with what is known about its load."""

    replica: str
    in_flight: int = 0            # this router's requests on it right now
    probe: Load | None = None     # None: not probed, or it cannot be probed


@dataclass(frozen=True)
class Ranked:
    """One candidate's place in a Choice."""

    replica: str
    score: float | None           # kv_aware score; None when ranked without a probe
    cached_tokens: int            # prompt tokens the replica reported cached (0 unprobed)


@dataclass(frozen=True)
class Choice:
    """Candidates best first (failover walks the order) and the policy that ranked them."""

    ranked: tuple[Ranked, ...]
    policy: str

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(r.replica for r in self.ranked)


def score(prompt_tokens: int, load: Load, load_weight: float) -> float:
    """Estimated work (prompt tokens) before this request's first token; see the module NOTE."""
    uncached = max(prompt_tokens - load.cached_tokens, 0)
    return uncached + load.pending_prefill_tokens + load_weight * (load.running + load.waiting)


def _rotate(candidates: Sequence[Candidate], cursor: int) -> list[Candidate]:
    if not candidates:
        return []
    k = cursor % len(candidates)
    return list(candidates[k:]) + list(candidates[:k])


def _by_in_flight(candidates: Iterable[Candidate]) -> list[Ranked]:
    return [Ranked(c.replica, None, 0) for c in sorted(candidates, key=lambda c: c.in_flight)]


def rank(policy: str, candidates: Sequence[Candidate], *, prompt_tokens: int,
         load_weight: float, cursor: int) -> Choice:
    """Order `candidates` (healthy replicas, in config order) for one request.

    `cursor` is the tier's round-robin position (the caller advances it once per request);
    the same inputs always give the same Choice.
    """
    rotated = _rotate(candidates, cursor)
    if len(rotated) == 1:  # nothing to choose: the policy's pick, probed or not
        c = rotated[0]
        cached = min(c.probe.cached_tokens, prompt_tokens) if c.probe else 0
        value = score(prompt_tokens, c.probe, load_weight) if c.probe else None
        return Choice((Ranked(c.replica, value, cached),), policy)
    if policy == "round_robin":
        return Choice(tuple(Ranked(c.replica, None, 0) for c in rotated), "round_robin")
    probed = [c for c in rotated if c.probe is not None]
    if policy == "least_loaded" or not probed:
        return Choice(tuple(_by_in_flight(rotated)), "least_loaded")
    if policy != "kv_aware":
        raise ValueError(f"unknown placement policy {policy!r}")
    scored = sorted(((score(prompt_tokens, c.probe, load_weight), c) for c in probed),
                    key=lambda pair: pair[0])  # stable: ties keep the rotated order
    ranked = [Ranked(c.replica, s, min(c.probe.cached_tokens, prompt_tokens)) for s, c in scored]
    ranked += _by_in_flight(c for c in rotated if c.probe is None)
    return Choice(tuple(ranked), "kv_aware")


class TierState:
    """Per-tier bookkeeping placement reads: the round-robin cursor, this router's requests in
    flight per replica, and replicas marked down until a time (see the module NOTE)."""

    def __init__(self, replicas: Sequence[str], backoff_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.replicas = tuple(replicas)
        self.backoff_s = backoff_s
        self._clock = clock
        self._cursor = 0
        self._down_until: dict[str, float] = {}
        self._why: dict[str, str] = {}
        self.in_flight = {r: 0 for r in self.replicas}

    def next_cursor(self) -> int:
        """The cursor for this request; the next request gets the following one."""
        cursor, self._cursor = self._cursor, self._cursor + 1
        return cursor

    def mark_down(self, replica: str, why: str) -> None:
        """Skip `replica` for the back-off period."""
        self._down_until[replica] = self._clock() + self.backoff_s
        self._why[replica] = why

    def is_down(self, replica: str) -> bool:
        return self._down_until.get(replica, float("-inf")) > self._clock()

    def healthy(self) -> list[str]:
        """Replicas not marked down, in config order."""
        return [r for r in self.replicas if not self.is_down(r)]

    def describe_down(self) -> str:
        """Why each down replica is down and for how much longer (for error messages)."""
        now = self._clock()
        return "; ".join(f"{r} down for {self._down_until[r] - now:.1f}s more ({self._why[r]})"
                         for r in self.replicas if self.is_down(r))

    def begin(self, replica: str) -> None:
        self.in_flight[replica] += 1

    def end(self, replica: str) -> None:
        self.in_flight[replica] -= 1
