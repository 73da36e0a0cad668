"""The adaptive policy on scripted acceptance histories: exact drafter choices at the length each
drafter gives (the engine's, or the n-gram match), stopping when drafting does not pay,
probing, recovery, and the acceptance estimator."""
from __future__ import annotations

import pytest

from kvmesh.services.draft.adaptive import (Acceptance, AdaptiveParams, AdaptiveState, Choice, choose,
                                            expected_accepted, rate)
from kvmesh.services.draft.drafters import DrafterKind

NGRAM, MODEL = DrafterKind.NGRAM, DrafterKind.MODEL
ORDER = (NGRAM, MODEL)
PARAMS = AdaptiveParams(draft_cost={NGRAM: 0.0, MODEL: 0.6}, verify_cost=0.1, decay=0.8,
                        prior_alpha=0.5, prior_weight=2.0, min_gain=0.05, probe_every=4)


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


def test_fresh_sequence_drafts_the_whole_ngram_match_and_skips_the_costly_model():
    # a = 0.5: ngram k=8 (1 + 0.996) / 1.8 = 1.109; model k=8 1.996 / 6.6 < 1
    state = AdaptiveState.fresh(PARAMS, ORDER)
    assert choose(state.estimates, {NGRAM: 8, MODEL: 8}, PARAMS, ORDER) == \
        Choice(NGRAM, 8, pytest.approx((1 + expected_accepted(0.5, 8)) / 1.8))
    assert choose(state.estimates, {NGRAM: 0, MODEL: 8}, PARAMS, ORDER).drafter is None


def test_a_good_model_beats_a_poor_ngram_at_the_engines_length():
    # k=3 asked: model a=0.95, cost 0.7/draft: 3.7099/3.1 = 1.197; ngram a=0.2: 1.248/1.3 < 1
    choice = choose({NGRAM: est(0.2), MODEL: est(0.95)}, {NGRAM: 3, MODEL: 3}, PARAMS, ORDER)
    assert (choice.drafter, choice.tokens) == (MODEL, 3)
    assert choice.rate == pytest.approx((1 + 0.95 + 0.95**2 + 0.95**3) / 3.1)


def test_ties_go_to_the_cheaper_drafter_and_each_is_priced_at_the_length_it_gives():
    free_model = AdaptiveParams(draft_cost={NGRAM: 0.0, MODEL: 0.0}, verify_cost=0.1)
    estimates = {NGRAM: est(0.9), MODEL: est(0.9)}
    assert choose(estimates, {NGRAM: 16, MODEL: 16}, free_model, ORDER).drafter is NGRAM
    assert choose(estimates, {NGRAM: 3, MODEL: 16}, free_model, ORDER) == \
        Choice(MODEL, 16, pytest.approx((1 + expected_accepted(0.9, 16)) / 2.6))  # the longer one
    assert choose(estimates, {NGRAM: 1, MODEL: 1}, free_model, ORDER) == \
        Choice(NGRAM, 1, pytest.approx(1.9 / 1.1))


def test_nothing_is_drafted_below_min_gain():
    # a = 0.15: ngram k=1 rate 1.15/1.1 = 1.045 < 1.05; k=4 1.176/1.4 < 1; model k=4 1.94/3.8
    for k in (1, 4):
        assert choose({NGRAM: est(0.15), MODEL: est(0.5)}, {NGRAM: k, MODEL: k}, PARAMS, ORDER) == \
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


def test_rejections_stop_drafting_and_a_probe_comes_every_few_calls():
    # a: 0.5 (k=8: 1.109) -> 0.308 (0.80: stop); idle 4 calls -> a probe at the full length
    got = run(AdaptiveState.fresh(PARAMS, ORDER), 13, lambda step, choice: 0)
    none = (None, 0, False)
    assert got == [("ngram", 8, False), none, none, none, none, ("ngram", 8, True),
                   none, none, none, none, ("ngram", 8, True), none, none]


def test_a_probe_that_is_accepted_brings_drafting_back():
    state = AdaptiveState.fresh(PARAMS, ORDER)
    run(state, 12, lambda step, choice: 0)           # as above: written off, probed twice
    after = run(state, 7, lambda step, choice: choice.tokens)  # the sequence turned repetitive
    assert after[:4] == [(None, 0, False)] * 3 + [("ngram", 8, True)]  # the third probe, all accepted
    assert after[4:] == [("ngram", 8, False)] * 3


def test_the_unused_drafter_is_probed_while_the_other_one_drafts():
    state = AdaptiveState.fresh(PARAMS, ORDER)
    got = run(state, 10, lambda step, choice: choice.tokens if choice.drafter is NGRAM else 0,
              available={NGRAM: 8, MODEL: 8})
    probes = [i for i, (d, _, probe) in enumerate(got) if probe]
    assert probes == [4, 9] and all(got[i][:2] == ("model", 8) for i in probes)
    assert all(got[i][:2] == ("ngram", 8) for i in range(10) if i not in probes)


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
                                probe_every=4)
        state = AdaptiveState.fresh(params, kinds)
        probes = [i for i in range(200)
                  if state.decide({DrafterKind.NGRAM: 0, DrafterKind.MODEL: 4}, params, kinds).probe]
        gaps = {b - a for a, b in zip(probes, probes[1:])}
        assert probes and gaps == {interval + 1}, (model_cost, probes[:5])
