"""The draft service's domain: validates a Propose batch, keeps each sequence's state in step with
the engine, picks a drafter per sequence and runs each drafter once for its sequences.

NOTE (consistency). The engine sends, per sequence, the tokens committed since its last call and
`committed_len`, the length after them. The service appends only when its own count plus the new
tokens equals `committed_len`; otherwise (a lost call, an expired or evicted state, a restart)
it answers `needs_resync`, proposes nothing and keeps the state, and the engine's next call
brings the whole history in `resync`, which replaces it (drafters keep what the old and new
histories share, e.g. the model's KV of the common prefix). A first call is a state-less one
whose new tokens are the whole sequence. `last_accepted` scores the previous call's proposal
for that sequence (metrics and the adaptive estimates); it is ignored when that call proposed
nothing. Validation of the whole batch comes before any change, so a rejected call changes
nothing.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvmesh.errors import FailedPrecondition, InvalidArgument
from kvmesh.services.draft.metrics import DraftMetrics
from kvmesh.services.draft.adaptive import AdaptiveParams, AdaptiveState
from kvmesh.services.draft.drafters import DraftJob, DrafterKind, DrafterRegistry, Proposal
from kvmesh.services.draft.state import LastProposal, SequenceState, StateStore

ADAPTIVE_SLOT = "adaptive"


@dataclass(frozen=True)
class SequenceRequest:
    """One sequence of a Propose call (kvmesh.draft.v1.SequenceDraftRequest)."""

    sequence_id: str
    new_token_ids: list[int]
    committed_len: int
    max_draft_tokens: int
    drafter: DrafterKind | None = None  # None: the service's default
    resync: list[int] | None = None
    last_accepted: int | None = None


@dataclass(frozen=True)
class SequenceDraft:
    """The answer for one sequence; `drafter` is the one that answered (ADAPTIVE: it drafted nothing)."""

    sequence_id: str
    token_ids: list[int]
    logprobs: list[float]
    drafter: DrafterKind
    needs_resync: bool = False


@dataclass(frozen=True)
class DraftInfo:
    """What GetInfo reports."""

    drafters: tuple[DrafterKind, ...]
    target_model: str
    model_drafter: str


@dataclass(frozen=True)
class _Plan:
    """Which concrete drafter drafts how many tokens for one sequence (`ready`: already drafted)."""

    drafter: DrafterKind | None
    tokens: int
    ready: Proposal | None = None


class DraftService:
    """Propose / Release / GetInfo over a state store and a registry of drafters (thread-safe:
    one call at a time)."""

    def __init__(self, registry: DrafterRegistry, store: StateStore, *, target_model: str,
                 max_draft_tokens: int, default_drafter: DrafterKind, adaptive: AdaptiveParams,
                 metrics: DraftMetrics, vocab_size: int | None = None) -> None:
        if default_drafter is not DrafterKind.ADAPTIVE and default_drafter not in registry:
            raise ValueError(f"default drafter {default_drafter.value} is not registered")
        self.registry, self.store = registry, store
        self.target_model = target_model
        self.max_draft_tokens = max_draft_tokens
        self.default_drafter = default_drafter
        self.adaptive = adaptive
        self.vocab_size = vocab_size
        self.metrics = metrics
        self.offered = (*registry.kinds, DrafterKind.ADAPTIVE)
        self._planners: dict[DrafterKind, Callable[[SequenceState, int], _Plan]] = {
            kind: (lambda state, budget, kind=kind: _Plan(kind, budget)) for kind in registry.kinds}
        self._planners[DrafterKind.ADAPTIVE] = self._plan_adaptive
        self._lock = threading.Lock()

    def info(self) -> DraftInfo:
        model = self.registry[DrafterKind.MODEL].describe() if DrafterKind.MODEL in self.registry else ""
        return DraftInfo(self.offered, self.target_model, model)

    def release(self, sequence_ids: Sequence[str]) -> int:
        """Drops these sequences' state now; returns how many had some."""
        with self._lock:
            released = self.store.release(sequence_ids)
            self.metrics.sequences.set(len(self.store))
            return released

    def sweep(self) -> int:
        """Drops the states idle past the TTL; returns how many."""
        with self._lock:
            dropped = self.store.sweep()
            self.metrics.sequences.set(len(self.store))
            return dropped

    def propose(self, requests: Sequence[SequenceRequest], target_model: str = "") -> list[SequenceDraft]:
        """Drafts for every sequence of one call, in order (see the module NOTE): each of up to
        its `max_draft_tokens`, fewer only when the drafter has no more."""
        start = time.perf_counter()
        self._validate(requests, target_model)
        with self._lock:
            answers: list[SequenceDraft | None] = [None] * len(requests)
            plans: dict[int, tuple[SequenceState, DrafterKind, _Plan]] = {}
            for i, req in enumerate(requests):
                kind = req.drafter or self.default_drafter
                state = self._ingest(req)
                if state is None:
                    self.metrics.resyncs.inc()
                    answers[i] = SequenceDraft(req.sequence_id, [], [], kind, needs_resync=True)
                    continue
                self._score(state, req.last_accepted)
                if req.max_draft_tokens == 0:  # only recording the new tokens
                    answers[i] = SequenceDraft(req.sequence_id, [], [], kind)
                    continue
                plans[i] = (state, kind, self._planners[kind](state, req.max_draft_tokens))
            proposals = self._run({i: (state, plan) for i, (state, _, plan) in plans.items()})
            for i, (state, kind, plan) in plans.items():
                proposal = proposals.get(i, Proposal([]))
                drafter = plan.drafter or kind  # ADAPTIVE when it chose to draft nothing
                answers[i] = SequenceDraft(requests[i].sequence_id, proposal.token_ids,
                                           proposal.logprobs, drafter)
                proposed = len(proposal.token_ids)
                state.last_proposal = LastProposal(drafter, proposed) if proposed else None
                self.metrics.proposals.labels(drafter.value).inc()
                self.metrics.proposed_tokens.labels(drafter.value).inc(proposed)
            self.metrics.sequences.set(len(self.store))
        self.metrics.propose_seconds.observe(time.perf_counter() - start)
        return answers  # type: ignore[return-value]  # every entry is set above

    def _run(self, plans: dict[int, tuple[SequenceState, _Plan]]) -> dict[int, Proposal]:
        """Runs each concrete drafter once over its sequences; returns the proposals by index."""
        out = {i: plan.ready for i, (_, plan) in plans.items() if plan.ready is not None}
        for kind in self.registry.kinds:
            batch = [(i, DraftJob(state, plan.tokens)) for i, (state, plan) in plans.items()
                     if plan.drafter is kind and plan.ready is None]
            if batch:
                drafted = self.registry[kind].propose([job for _, job in batch])
                out.update((i, proposal) for (i, _), proposal in zip(batch, drafted))
        return out

    def _plan_adaptive(self, state: SequenceState, budget: int) -> _Plan:
        """The drafter that pays for this sequence (adaptive.choose), drafting `budget` tokens:
        the model all of them, the n-gram lookup what it matched (already drafted here, to
        know how many)."""
        estimates = state.slots.get(ADAPTIVE_SLOT)
        if estimates is None:
            estimates = state.slots[ADAPTIVE_SLOT] = AdaptiveState.fresh(self.adaptive, self.registry.kinds)
        available = {kind: budget for kind in self.registry.kinds}
        ngram = None
        if DrafterKind.NGRAM in self.registry:
            [ngram] = self.registry[DrafterKind.NGRAM].propose([DraftJob(state, budget)])
            available[DrafterKind.NGRAM] = len(ngram.token_ids)
        choice = estimates.decide(available, self.adaptive, self.registry.kinds)
        if choice.drafter is DrafterKind.NGRAM and ngram is not None:
            return _Plan(choice.drafter, choice.tokens, ngram)
        return _Plan(choice.drafter, choice.tokens)

    def _score(self, state: SequenceState, last_accepted: int | None) -> None:
        """Feeds `last_accepted` back against the previous proposal (metrics, adaptive estimates)."""
        last, state.last_proposal = state.last_proposal, None
        if last is None or last_accepted is None:
            return
        accepted = min(last_accepted, last.tokens)
        self.metrics.accepted_tokens.labels(last.drafter.value).inc(accepted)
        estimates = state.slots.get(ADAPTIVE_SLOT)
        if estimates is not None:
            estimates.observe(last.drafter, last.tokens, accepted, self.adaptive)

    def _ingest(self, req: SequenceRequest) -> SequenceState | None:
        """The sequence's state with the new tokens committed, or None when it needs a resync."""
        if req.resync is not None:
            state = self.store.get(req.sequence_id)
            if state is None:
                return self.store.create(req.sequence_id, req.resync)
            state.replace(req.resync)
            return state
        state = self.store.get(req.sequence_id)
        if state is None:
            if req.committed_len != len(req.new_token_ids):
                return None
            return self.store.create(req.sequence_id, req.new_token_ids)
        if len(state.tokens) + len(req.new_token_ids) != req.committed_len:
            return None
        state.append(req.new_token_ids)
        return state

    def _validate(self, requests: Sequence[SequenceRequest], target_model: str) -> None:
        if target_model and target_model != self.target_model:
            raise FailedPrecondition(
                f"this draft service drafts for model {self.target_model} (weights digest) but the "
                f"request's target_model is {target_model}: its drafts would use another tokenizer. "
                "Point the engine at a draft service started with --target-model set to its weights "
                "digest (and a drafter for that model), or send an empty target_model to skip the check")
        if len(requests) > self.store.max_sequences:
            raise InvalidArgument(
                f"Propose carries {len(requests)} sequences, more than the service keeps state for "
                f"({self.store.max_sequences}, --max-sequences); split the batch")
        seen: set[str] = set()
        for req in requests:
            self._validate_one(req, seen)

    def _validate_one(self, req: SequenceRequest, seen: set[str]) -> None:
        sid = req.sequence_id
        if not sid:
            raise InvalidArgument("sequence_id is empty; give every sequence a unique id such as "
                                  "'<engine id>/<request id>'")
        if sid in seen:
            raise InvalidArgument(f"sequence {sid!r} appears twice in one Propose; send each "
                                  "sequence once per call")
        seen.add(sid)
        if req.max_draft_tokens > self.max_draft_tokens:
            raise InvalidArgument(
                f"sequence {sid!r}: max_draft_tokens {req.max_draft_tokens} exceeds this service's "
                f"limit of {self.max_draft_tokens} (--max-draft-tokens); ask for at most "
                f"{self.max_draft_tokens}")
        kind = req.drafter or self.default_drafter
        if kind not in self.offered:
            offered = ", ".join(k.value for k in self.offered)
            raise InvalidArgument(
                f"sequence {sid!r}: drafter {kind.value} is not offered by this service (it offers "
                f"{offered}); start it with --draft-model to get the model drafter, or ask for one "
                "it offers")
        if req.resync is not None:
            if req.new_token_ids:
                raise InvalidArgument(f"sequence {sid!r}: send either new_token_ids or resync (the "
                                      "whole committed sequence), not both")
            if req.committed_len != len(req.resync):
                raise InvalidArgument(
                    f"sequence {sid!r}: committed_len {req.committed_len} != len(resync) "
                    f"{len(req.resync)}; resync carries the whole committed sequence")
        if self.vocab_size is not None:
            tokens = req.resync if req.resync is not None else req.new_token_ids
            if tokens and max(tokens) >= self.vocab_size:
                raise InvalidArgument(
                    f"sequence {sid!r}: token id {max(tokens)} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1}); is the engine serving another model?")
