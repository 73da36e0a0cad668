"""Cascade decisions: signals, keep/escalate, difficulty plans."""
from __future__ import annotations

import math

import pytest

from kvmesh.services.router.cascade import (Step, TokenScore, confidence, entropy, failed,
                                            judge, last_tier, logprobs_needed, plan)

TOKENS = [TokenScore(-0.25, (-0.1, -3.0)), TokenScore(-0.5, (-0.5, -1.0)),
          TokenScore(-1.5, (-0.7, -0.7))]


def test_mean_and_min_logprob():
    assert confidence("mean_logprob", TOKENS) == -0.75
    assert confidence("min_logprob", TOKENS) == -1.5


def test_entropy_renormalizes_the_top_k():
    assert entropy([math.log(0.25)] * 4) == pytest.approx(math.log(4))
    assert entropy([-0.7, -0.7]) == pytest.approx(math.log(2))  # any equal pair: 1 bit
    assert entropy([0.0]) == 0.0 and entropy([]) == 0.0
    expected = -(entropy([-0.1, -3.0]) + entropy([-0.5, -1.0]) + math.log(2)) / 3
    assert confidence("neg_entropy", TOKENS) == pytest.approx(expected)


def test_an_empty_answer_is_never_confident():
    assert confidence("mean_logprob", []) == float("-inf")
    assert not judge("cheap", "mean_logprob", -5.0, []).accepted


@pytest.mark.parametrize("threshold, accepted, reason", [
    (-0.75, True, "confident"),     # equal to the threshold keeps it
    (-0.74, False, "low_confidence"),
    (-2.0, True, "confident"),
])
def test_judge_compares_with_the_threshold(threshold, accepted, reason):
    step = judge("cheap", "mean_logprob", threshold, TOKENS)
    assert step == Step("cheap", "mean_logprob", -0.75, threshold, accepted, reason, 3)


def test_plan_runs_every_tier_unless_the_prompt_is_long():
    assert plan(("a", "b", "c"), 100, 0, -0.5).run == ("a", "b", "c")       # off
    assert plan(("a", "b", "c"), 99, 100, -0.5).run == ("a", "b", "c")
    long = plan(("a", "b", "c"), 100, 100, -0.5)
    assert long.run == ("c",)
    assert long.skipped == (Step("a", "", 0.0, -0.5, False, "difficulty"),
                            Step("b", "", 0.0, -0.5, False, "difficulty"))


def test_last_tier_and_failed_steps():
    assert last_tier("strong", -0.5) == Step("strong", "", 0.0, -0.5, True, "last_tier")
    assert failed("cheap", -0.5, 2) == Step("cheap", "", 0.0, -0.5, False, "tier_failed", 2)


def test_logprobs_needed_covers_the_signal_and_the_client():
    assert logprobs_needed("mean_logprob", None) == 0
    assert logprobs_needed("neg_entropy", None) == 5
    assert logprobs_needed("neg_entropy", 8) == 8
    assert logprobs_needed("min_logprob", 3) == 3
