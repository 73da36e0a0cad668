"""The adaptive policy on scripted acceptance histories: exact choices, stopping when drafting
does not pay, probing, recovery, and the acceptance estimator."""
from __future__ import annotations

import pytest

from kvmesh.services.draft.adaptive import (Acceptance, AdaptiveParams, AdaptiveState, Choice, choose,
                                            expected_accepted, rate)
from kvmesh.services.draft.drafters import DrafterKind

NGRAM, MODEL = DrafterKind.NGRAM, DrafterKind.MODEL
ORDER = (NGRAM, MODEL)
PARAMS = AdaptiveParams(draft_cost={NGRAM: 0.0, MODEL: 0.6}, verify_cost=0.1, decay=0.8,
                        prior_alpha=0.5, prior_weight=2.0, min_gain=0.05, probe_every=4, probe_tokens=2)


def est(alpha: float, weight: float = 10.0, idle: int = 0) -> Acceptance:
    return Acceptance(alpha * weight, weight, idle)


def test_the_formulas():
    assert expected_accepted(0.5, 3) == pytest.approx(0.875)
    assert expected_accepted(0.9, 0) == 0
    assert rate(0.5, 2, 0.1) == pytest.approx(1.75 / 1.2)
    assert rate(0.3, 0, 5.0) == 1.0


def test_estimator_counts_trials_up_to_the_first_rejection():
    a = Acceptance(1.0, 2.0)
    a.observe(proposed=4, accepted=2, decay=0.8)      # 2 successes in 3 trials
    assert (a.successes, a.trials) == pytest.approx((2.8, 4.6))
    a.observe(proposed=3, accepted=3, decay=0.8)      # all accepted: no failed trial
    assert (a.successes, a.trials) == pytest.approx((0.8 * 2.8 + 3, 0.8 * 4.6 + 3))
    b = Acceptance(0.0, 1.0)
    b.observe(proposed=2, accepted=5, decay=1.0)      # more than proposed counts as all
    assert (b.successes, b.trials) == (2.0, 3.0)


def test_fresh_sequence_drafts_two_ngram_tokens_and_skips_the_costly_model():
    # a = 0.5: ngram k=1 1.364, k=2 1.458, k=3 1.442; model k=1 1.5/1.7 < 1
    state = AdaptiveState.fresh(PARAMS, ORDER)
    assert choose(state.estimates, {NGRAM: 8, MODEL: 8}, PARAMS, ORDER) == \
        Choice(NGRAM, 2, pytest.approx(1.75 / 1.2))
    assert choose(state.estimates, {NGRAM: 0, MODEL: 8}, PARAMS, ORDER).drafter is None


def test_a_good_model_beats_a_poor_ngram_and_picks_its_length():
    # model a=0.95, cost 0.7/draft: k=3 rate 3.7099/3.1 = 1.197 (k=2 1.189, k=4 1.191);
    # ngram a=0.2: k=1 1.2/1.1 = 1.091
    choice = choose({NGRAM: est(0.2), MODEL: est(0.95)}, {NGRAM: 8, MODEL: 8}, PARAMS, ORDER)
    assert (choice.drafter, choice.tokens) == (MODEL, 3)
    assert choice.rate == pytest.approx((1 + 0.95 + 0.95**2 + 0.95**3) / 3.1)


def test_ties_go_to_the_cheaper_drafter_and_the_budget_caps_the_length():
    free_model = AdaptiveParams(draft_cost={NGRAM: 0.0, MODEL: 0.0}, verify_cost=0.1)
    estimates = {NGRAM: est(0.9), MODEL: est(0.9)}
    assert choose(estimates, {NGRAM: 16, MODEL: 16}, free_model, ORDER).drafter is NGRAM
    assert choose(estimates, {NGRAM: 3, MODEL: 16}, free_model, ORDER).drafter is MODEL  # longer
    assert choose(estimates, {NGRAM: 1, MODEL: 1}, free_model, ORDER) == \
        Choice(NGRAM, 1, pytest.approx(1.9 / 1.1))


def test_nothing_is_drafted_below_min_gain():
    # a = 0.15: k=1 rate 1.15/1.1 = 1.045 < 1.05
    assert choose({NGRAM: est(0.15), MODEL: est(0.5)}, {NGRAM: 4, MODEL: 4}, PARAMS, ORDER) == \
        Choice(None, 0, 1.0)


def run(state: AdaptiveState, steps: int, accept, available=None) -> list[tuple]:
    """Drives `state` for `steps` calls; accept(step, choice) -> drafts the engine accepted."""
    out = []
    for step in range(steps):
        choice = state.decide(available or {NGRAM: 8, MODEL: 0}, PARAMS, ORDER)
        out.append((choice.drafter and choice.drafter.value, choice.tokens, choice.probe))
        if choice.drafter is not None:
            state.observe(choice.drafter, choice.tokens, accept(step, choice), PARAMS)
    return out


def test_rejections_shrink_the_draft_stop_drafting_and_probe_every_few_calls():
    # a: 0.5 -> 0.308 (k=1 1.189 beats k=2 1.169) -> 0.208 (1.098) -> 0.148 (1.044: stop)
    got = run(AdaptiveState.fresh(PARAMS, ORDER), 13, lambda step, choice: 0)
    none = (None, 0, False)
    assert got == [("ngram", 2, False), ("ngram", 1, False), ("ngram", 1, False),
                   none, none, none, none, ("ngram", 2, True),
                   none, none, none, none, ("ngram", 2, True)]


def test_a_probe_that_is_accepted_brings_drafting_back():
    state = AdaptiveState.fresh(PARAMS, ORDER)
    run(state, 12, lambda step, choice: 0)           # as above: written off, probed once
    after = run(state, 4, lambda step, choice: choice.tokens)  # the sequence turned repetitive
    assert after[0] == ("ngram", 2, True)           # the second probe, fully accepted
    assert [d for d, _, _ in after[1:]] == ["ngram"] * 3
    assert [k for _, k, _ in after[1:]] == sorted(k for _, k, _ in after[1:])  # growing


def test_the_unused_drafter_is_probed_while_the_other_one_drafts():
    state = AdaptiveState.fresh(PARAMS, ORDER)
    got = run(state, 10, lambda step, choice: choice.tokens if choice.drafter is NGRAM else 0,
              available={NGRAM: 8, MODEL: 8})
    probes = [i for i, (d, _, probe) in enumerate(got) if probe]
    assert probes == [4, 9] and all(got[i][0] == "model" for i in probes)
    assert all(got[i][0] == "ngram" for i in range(10) if i not in probes)


def test_feedback_is_ignored_without_a_proposal_or_estimate():
    state = AdaptiveState.fresh(PARAMS, (NGRAM,))
    state.observe(MODEL, 4, 4, PARAMS)
    state.observe(NGRAM, 0, 0, PARAMS)
    assert list(state.estimates) == [NGRAM] and state.estimates[NGRAM].trials == 2.0


def test_bad_params_are_refused():
    with pytest.raises(ValueError):
        AdaptiveParams(draft_cost={}, decay=0.0)
    with pytest.raises(ValueError):
        AdaptiveParams(draft_cost={}, probe_every=0)


def test_a_drafter_too_expensive_even_when_always_right_is_probed_rarely():
    from kvmesh.services.draft.adaptive import HOPELESS_PROBE_FACTOR, AdaptiveParams, AdaptiveState
    from kvmesh.services.draft.drafters import DrafterKind

    kinds = [DrafterKind.NGRAM, DrafterKind.MODEL]
    for model_cost, interval in ((0.6, 4), (5.0, 4 * HOPELESS_PROBE_FACTOR)):
        params = AdaptiveParams(draft_cost={DrafterKind.NGRAM: 0.0, DrafterKind.MODEL: model_cost},
                                probe_every=4, probe_tokens=2)
        state = AdaptiveState.fresh(params, kinds)
        probes = [i for i in range(200)
                  if state.decide({DrafterKind.NGRAM: 0, DrafterKind.MODEL: 4}, params, kinds).probe]
        gaps = {b - a for a, b in zip(probes, probes[1:])}
        assert probes and gaps == {interval + 1}, (model_cost, probes[:5])
