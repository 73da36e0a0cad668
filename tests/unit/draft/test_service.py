"""DraftService domain: the committed_len handshake and resync, last_accepted feedback, one
drafter call per Propose, adaptive planning, validation and metrics."""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from fake_clock import FakeClock
from kvmesh.errors import FailedPrecondition, InvalidArgument
from kvmesh.services.draft.adaptive import AdaptiveParams
from kvmesh.services.draft.drafters import DrafterKind, DrafterRegistry, Proposal
from kvmesh.services.draft.metrics import DraftMetrics
from kvmesh.services.draft.ngram import NgramDrafter
from kvmesh.services.draft.service import DraftService, SequenceRequest
from kvmesh.services.draft.state import StateStore

NGRAM, MODEL, ADAPTIVE = DrafterKind.NGRAM, DrafterKind.MODEL, DrafterKind.ADAPTIVE
REPEAT = [1, 2, 3, 1, 2, 3, 1, 2]


class ScriptedModel:
    """A MODEL drafter that proposes 500, 501, ... (never the same token twice) and records each
    batch it was given."""

    kind = MODEL

    def __init__(self) -> None:
        self.batches: list[list[tuple[str, int]]] = []
        self.released: list[str] = []
        self.next = 500

    def propose(self, jobs):
        self.batches.append([(job.state.sequence_id, job.max_tokens) for job in jobs])
        out = []
        for job in jobs:
            out.append(Proposal(list(range(self.next, self.next + job.max_tokens)), [-0.5] * job.max_tokens))
            self.next += job.max_tokens
        return out

    def release(self, state):
        self.released.append(state.sequence_id)

    def describe(self):
        return "scripted"


def make_service(*, model=True, ttl_s=60.0, max_sequences=16, default=ADAPTIVE, **params):
    drafters = [NgramDrafter(2, 4)] + ([ScriptedModel()] if model else [])
    registry = DrafterRegistry(drafters)
    clock = FakeClock()
    store = StateStore(ttl_s=ttl_s, max_sequences=max_sequences, on_drop=registry.release, clock=clock)
    adaptive = AdaptiveParams(draft_cost={NGRAM: 0.0, MODEL: 0.6}, **params)
    service = DraftService(registry, store, target_model="digest", max_draft_tokens=8,
                           default_drafter=default, adaptive=adaptive,
                           metrics=DraftMetrics(CollectorRegistry()), vocab_size=1000)
    return service, clock, (drafters[1] if model else None)


def req(sid, new, committed=None, k=4, drafter=NGRAM, **kw) -> SequenceRequest:
    committed = len(new) if committed is None else committed
    return SequenceRequest(sid, list(new), committed, k, drafter, **kw)


def metric(service, name, **labels):
    return service.metrics.registry.get_sample_value(name, labels) or 0.0


def test_first_call_then_increments_then_a_mismatch_asks_for_a_resync():
    service, _, _ = make_service()
    [a] = service.propose([req("a", REPEAT)])
    assert (a.token_ids, a.drafter, a.needs_resync) == ([3, 1, 2, 3], NGRAM, False)
    [a] = service.propose([req("a", [3, 1], committed=10)])
    assert a.token_ids == [2, 3, 1, 2]
    before = metric(service, "kvmesh_draft_resyncs_total")
    [a] = service.propose([req("a", [2], committed=12)])           # a call was lost
    assert (a.needs_resync, a.token_ids, a.drafter) == (True, [], NGRAM)
    assert metric(service, "kvmesh_draft_resyncs_total") == before + 1
    assert service.store.get("a").tokens == REPEAT + [3, 1]       # kept as it was
    [a] = service.propose([req("a", [], resync=[5, 6, 5, 6, 5], committed=5)])
    assert (a.needs_resync, a.token_ids) == (False, [6, 5, 6, 5])


def test_an_unknown_sequence_that_is_not_at_its_start_needs_a_resync():
    service, _, _ = make_service()
    [b] = service.propose([req("b", [7, 8], committed=40)])
    assert b.needs_resync and "b" not in service.store
    [b] = service.propose([req("b", [], resync=[7, 8, 7], committed=3)])
    assert b.token_ids == [] and not b.needs_resync and "b" in service.store


def test_expired_and_released_states_resync():
    service, clock, model = make_service(ttl_s=10)
    service.propose([req("a", REPEAT, drafter=MODEL)])
    clock.advance(11)
    service.propose([req("b", REPEAT)])
    assert service.propose([req("a", [3], committed=9)])[0].needs_resync
    assert model.released == ["a"]
    assert service.release(["b", "b", "nope"]) == 1 and model.released == ["a", "b"]
    assert service.sweep() == 0 and len(service.store) == 0


def test_each_drafter_runs_once_per_call_and_answers_keep_their_order():
    service, _, model = make_service()
    drafts = service.propose([req("m1", [9, 9], drafter=MODEL, k=2), req("n", REPEAT, k=2),
                              req("m2", [4], drafter=MODEL, k=3), req("z", [5], k=0, drafter=MODEL)])
    assert [d.sequence_id for d in drafts] == ["m1", "n", "m2", "z"]
    assert model.batches == [[("m1", 2), ("m2", 3)]]
    assert [d.token_ids for d in drafts] == [[500, 501], [3, 1], [502, 503, 504], []]
    assert drafts[0].logprobs == [-0.5, -0.5] and drafts[1].logprobs == []
    assert drafts[3].drafter is MODEL and service.store.get("z").tokens == [5]  # recorded only


def test_last_accepted_scores_the_previous_proposal_once():
    service, _, _ = make_service()
    accepted = metric(service, "kvmesh_draft_accepted_tokens_total", drafter="model")
    service.propose([req("a", [1, 2, 3], drafter=MODEL, k=4)])
    service.propose([req("a", [500, 501, 7], committed=6, drafter=MODEL, k=4, last_accepted=2)])
    assert metric(service, "kvmesh_draft_accepted_tokens_total", drafter="model") == accepted + 2
    estimate = service.store.get("a").slots
    assert "adaptive" not in estimate  # only adaptive sequences keep estimates
    service.propose([req("a", [8], committed=7, k=0, last_accepted=9)])  # clamped to 4 proposed
    assert metric(service, "kvmesh_draft_accepted_tokens_total", drafter="model") == accepted + 6
    service.propose([req("a", [9], committed=8, k=0, last_accepted=3)])  # nothing was proposed
    assert metric(service, "kvmesh_draft_accepted_tokens_total", drafter="model") == accepted + 6


def test_adaptive_uses_the_ngram_match_and_stops_when_nothing_pays():
    service, _, model = make_service(probe_every=100)
    [a] = service.propose([req("a", REPEAT, drafter=ADAPTIVE, k=8)])
    assert (a.drafter, a.token_ids) == (NGRAM, [3, 1, 2, 3, 1, 2, 3, 1])  # prior a = 0.5: the match pays
    [b] = service.propose([req("b", [1, 2, 3, 4], drafter=ADAPTIVE, k=8)])
    assert (b.drafter, b.token_ids) == (ADAPTIVE, [])   # no match; the model does not pay at 0.5
    for _ in range(4):  # the text keeps repeating 1 2 3: every draft is accepted
        committed = len(service.store.get("a").tokens) + len(a.token_ids) + 1
        new = a.token_ids + [committed % 3 or 3]
        [a] = service.propose([req("a", new, committed=committed, drafter=ADAPTIVE, k=8,
                                   last_accepted=len(a.token_ids))])
        assert a.drafter is NGRAM and len(a.token_ids) == 8
    assert model.batches == []


@pytest.mark.parametrize("k", [1, 3, 8])
def test_drafts_are_the_engines_length(k):
    """Adaptive picks the drafter, never the length (the n-gram lookup gives none only when
    nothing matches, see test_adaptive_uses_the_ngram_match_and_stops_when_nothing_pays)."""
    service, _, model = make_service(probe_every=100)
    [a] = service.propose([req("a", REPEAT, drafter=ADAPTIVE, k=k)])
    assert (a.drafter, a.token_ids) == (NGRAM, [3, 1, 2, 3, 1, 2, 3, 1][:k])
    [m] = service.propose([req("m", [9, 9], drafter=MODEL, k=k)])
    assert len(m.token_ids) == k and model.batches == [[("m", k)]]


def test_adaptive_moves_to_a_model_that_is_always_right():
    service, _, model = make_service(probe_every=2)
    tokens, choices = [1, 2, 3, 4], []
    [d] = service.propose([req("s", tokens, drafter=ADAPTIVE, k=6)])
    for bonus in range(10, 22):  # unique tokens: the n-gram drafter never matches
        choices.append((d.drafter, len(d.token_ids)))
        new = d.token_ids + [bonus]  # every draft accepted, then the engine's own token
        tokens += new
        [d] = service.propose([req("s", new, committed=len(tokens), drafter=ADAPTIVE, k=6,
                                   last_accepted=len(d.token_ids))])
    nothing, model_drafts = (ADAPTIVE, 0), (MODEL, 6)
    # probed after 2 idle calls, at the engine's length; the second probe makes it pay
    assert choices[:6] == [nothing, nothing, model_drafts, nothing, nothing, model_drafts]
    assert choices[6:] == [model_drafts] * 6 and (d.drafter, len(d.token_ids)) == model_drafts


def test_the_target_model_check():
    service, _, _ = make_service()
    with pytest.raises(FailedPrecondition, match="drafts for model digest .* target_model is other"):
        service.propose([req("a", [1])], target_model="other")
    assert service.propose([req("a", [1])], target_model="digest")[0].token_ids == []
    assert service.propose([req("b", [1])], target_model="")[0].token_ids == []


@pytest.mark.parametrize("bad, message", [
    (req("", [1]), "sequence_id is empty"),
    (req("a", [1], k=9), "max_draft_tokens 9 exceeds this service's limit of 8"),
    (req("a", [1], resync=[1, 2], committed=3), "new_token_ids or resync"),
    (req("a", [], resync=[1, 2], committed=3), "committed_len 3 != len\\(resync\\) 2"),
    (req("a", [1, 1000]), "token id 1000 is outside the vocabulary \\(0..999\\)"),
])
def test_bad_input_is_refused_before_anything_changes(bad, message):
    service, _, _ = make_service()
    with pytest.raises(InvalidArgument, match=message):
        service.propose([req("ok", [1, 2]), bad])
    assert "ok" not in service.store


def test_duplicates_oversized_batches_and_drafters_not_offered():
    service, _, _ = make_service(model=False, max_sequences=2)
    with pytest.raises(InvalidArgument, match="appears twice"):
        service.propose([req("a", [1]), req("a", [2])])
    with pytest.raises(InvalidArgument, match="3 sequences, more than .* \\(2, --max-sequences\\)"):
        service.propose([req(s, [1]) for s in "abc"])
    with pytest.raises(InvalidArgument, match="drafter model is not offered .* ngram, adaptive"):
        service.propose([req("a", [1], drafter=MODEL)])
    assert service.info().drafters == (NGRAM, ADAPTIVE) and service.info().model_drafter == ""


def test_unspecified_means_the_default_drafter_and_info_lists_the_offer():
    service, _, model = make_service(default=MODEL)
    [a] = service.propose([req("a", [1, 2], drafter=None, k=2)])
    assert (a.drafter, a.token_ids) == (MODEL, [500, 501])
    info = service.info()
    assert (info.drafters, info.target_model, info.model_drafter) == \
        ((NGRAM, MODEL, ADAPTIVE), "digest", "scripted")


def test_metrics_count_proposals_tokens_and_sequences():
    service, _, _ = make_service()
    before = (metric(service, "kvmesh_draft_proposals_total", drafter="ngram"),
              metric(service, "kvmesh_draft_proposed_tokens_total", drafter="ngram"),
              metric(service, "kvmesh_draft_propose_seconds_count"))
    service.propose([req("a", REPEAT, k=3), req("b", [1, 2, 3], k=3)])
    assert metric(service, "kvmesh_draft_proposals_total", drafter="ngram") == before[0] + 2
    assert metric(service, "kvmesh_draft_proposed_tokens_total", drafter="ngram") == before[1] + 3
    assert metric(service, "kvmesh_draft_propose_seconds_count") == before[2] + 1
    assert metric(service, "kvmesh_draft_sequences") == 2
