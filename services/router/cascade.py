"""Cascade decisions: which tiers of a route run, and whether a tier's answer is kept.

Plain deterministic Python over log-probabilities; the orchestration (running tiers, holding
and relaying streams) lives in `kvmesh.services.router.relay`.

NOTE (the cascade): a route's tiers run cheapest first. Every tier but the last runs with
log-probabilities forced on and its whole answer held; its confidence signal over the generated
tokens is compared with the threshold: >= keeps it ("confident"), < escalates to the next tier
("low_confidence"), and a tier that fails escalates too ("tier_failed"). The last tier is always
kept ("last_tier") and streamed as it is generated, so it is never judged. Difficulty routing
runs first: a prompt of at least `difficulty_prompt_tokens` tokens skips every tier but the
last ("difficulty"), since a long prompt costs the most to run twice.

Signals, over the generated tokens (an empty answer has confidence -inf: nothing to keep):
  mean_logprob  mean of the chosen tokens' log-probabilities
  min_logprob   the least likely chosen token's log-probability
  neg_entropy   minus the mean entropy (nats) of each position's top-k alternatives,
                renormalized to sum to one (a position without alternatives counts as 0)
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

ENTROPY_TOP_K = 5
"""Alternatives per position requested for neg_entropy."""


@dataclass(frozen=True)
class TokenScore:
    """One generated position: the chosen token's log-probability and the top alternatives'."""

    chosen: float
    top: tuple[float, ...] = ()


@dataclass(frozen=True)
class Step:
    """One tier's turn (mirrors kvmesh.router.v1.CascadeStep)."""

    tier: str
    signal: str               # "" when the tier was not judged
    confidence: float
    threshold: float
    accepted: bool
    reason: str               # confident, low_confidence, difficulty, last_tier, tier_failed
    completion_tokens: int = 0


@dataclass(frozen=True)
class Plan:
    """The tiers a request runs, in order, and the steps of those it skips."""

    skipped: tuple[Step, ...]
    run: tuple[str, ...]


def entropy(top: Sequence[float]) -> float:
    """Entropy (nats) of the distribution the logprobs `top` give, renormalized."""
    if not top:
        return 0.0
    peak = max(top)
    weights = [math.exp(lp - peak) for lp in top]
    total = sum(weights)
    return -sum(w / total * math.log(w / total) for w in weights if w > 0)


def confidence(signal: str, tokens: Sequence[TokenScore]) -> float:
    """The named signal over `tokens` (see the module NOTE)."""
    if not tokens:
        return float("-inf")
    if signal == "mean_logprob":
        return sum(t.chosen for t in tokens) / len(tokens)
    if signal == "min_logprob":
        return min(t.chosen for t in tokens)
    if signal == "neg_entropy":
        return -sum(entropy(t.top) for t in tokens) / len(tokens)
    raise ValueError(f"unknown cascade signal {signal!r}")


def logprobs_needed(signal: str, client_logprobs: int | None) -> int:
    """Top alternatives to request from a held tier: what the signal needs, at least what the
    client asked for."""
    need = ENTROPY_TOP_K if signal == "neg_entropy" else 0
    return max(need, client_logprobs or 0)


def plan(tiers: Sequence[str], prompt_tokens: int, difficulty_prompt_tokens: int,
         threshold: float) -> Plan:
    """Which of a route's `tiers` run for a prompt of `prompt_tokens` tokens."""
    if difficulty_prompt_tokens and prompt_tokens >= difficulty_prompt_tokens:
        skipped = tuple(Step(t, "", 0.0, threshold, False, "difficulty") for t in tiers[:-1])
        return Plan(skipped, (tiers[-1],))
    return Plan((), tuple(tiers))


def judge(tier: str, signal: str, threshold: float, tokens: Sequence[TokenScore]) -> Step:
    """Keep or escalate a held (non-last) tier's answer."""
    value = confidence(signal, tokens)
    keep = value >= threshold
    return Step(tier, signal, value, threshold, keep, "confident" if keep else "low_confidence",
                len(tokens))


def last_tier(tier: str, threshold: float) -> Step:
    """The last tier's step: kept unjudged (it streams live)."""
    return Step(tier, "", 0.0, threshold, True, "last_tier")


def failed(tier: str, threshold: float, completion_tokens: int = 0) -> Step:
    """A held tier that failed: escalate."""
    return Step(tier, "", 0.0, threshold, False, "tier_failed", completion_tokens)
