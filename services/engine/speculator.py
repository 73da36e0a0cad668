"""Speculative decoding as an engine component: the one place that decides who drafts, how many
tokens, and what the verification of a step's drafts emits.

NOTE (who decides what). The engine owns the draft length: `SpecConfig` bounds it by what a step
can verify cheaply (`draft_tokens`), and the `SpecGate` picks, per step, what ADAPTIVE requests
do -- no drafts, n-gram drafts of at most 1, 3 or the full length, or the draft service's
adaptive choice -- from the throughput it measured for each at the current batch size. The draft service
only proposes, up to the length asked, with the drafter named (ADAPTIVE: the one whose
acceptance it has seen pay). Verification itself is kvmesh.services.engine.speculation.

NOTE (in-process n-gram arms). The gate's n-gram arms look their drafts up in the engine
(kvmesh.ngram, the draft service's own index, one per request), not through a Propose call:
the lookup costs microseconds, a Propose round trip ~1.25 ms, and a plain decode step of the
default gguf weights ~10 ms here, so the call alone cost an n-gram arm 12% before any draft was
verified: on chat, where the history offers a draft at about one step in three, that was more
than the accepted drafts gained (bench spec: adaptive 0.92-0.99x no drafts). Requests that name a drafter
(`ngram`, `model`) and the gate's service arm still ask the draft service, and a step with only
in-process drafts makes no call (`SpecConfig.local_ngram` False: every draft from the service).
Drafts looked up in-process are not reported to the service (`accepted`), whose adaptive
estimates score only its own proposals.

Hooks, called by EngineCore on the step-loop thread:
  * `add` / `release`  a request enters / leaves the engine;
  * `propose`          before scheduling: drafts for the running decodes, fitted to the step;
  * `verify`           after the forward: the tokens each verified sequence emits;
  * `end_step`         after sampling: the step's outcome, for the gate.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

from opentelemetry import context as otel_context
from opentelemetry.context import Context

from kvmesh.ngram import NGRAM_MAX, NGRAM_MIN, NgramIndex
from kvmesh.services.engine.draft_client import DraftClient, DraftQuery
from kvmesh.services.engine.logits import Processing
from kvmesh.services.engine.outputs import SPEC_EVENTS, RequestOutput, Timeline
from kvmesh.services.engine.runner import DraftLogits
from kvmesh.services.engine.sampler import Draws, TokenLogprobs, token_logprobs
from kvmesh.services.engine.scheduler import Scheduler
from kvmesh.services.engine.sequence import Sequence
from kvmesh.services.engine.spec_gate import Arm, SpecGate, default_arms
from kvmesh.services.engine.speculation import SpecMode, SpecUsage, verify_batch


@dataclass(frozen=True)
class SpecConfig:
    """How the engine speculates (only with a draft service)."""

    default_mode: SpecMode = SpecMode.ADAPTIVE
    """Mode of requests that name none."""
    max_draft_tokens: int = 7
    """Most drafts verified per sequence and step (k), given while the step stays within
    `step_rows` decode rows (a token plus its drafts per speculating sequence)."""
    batch_draft_tokens: int = 0
    """Drafts per sequence at least, even when that passes `step_rows` (0: a step that cannot
    give each speculating sequence a draft within `step_rows` verifies none; on this CPU 8
    sequences with 2 drafts each made chat 0.68x as fast as plain decoding)."""
    step_rows: int = 8
    """Decode rows a step may give to drafts at full length: up to kvmesh.model.native's
    LINEAR_ROWS a step's matmuls stream the weights once (a 7-draft step costs ~1.5x a plain
    decode here); past that MKL's matrix-matrix code makes every extra row cost more."""
    local_ngram: bool = True
    """ADAPTIVE requests' n-gram arms look drafts up in the engine (see the module NOTE); False:
    from the draft service, like every other draft."""
    ngram_min: int = NGRAM_MIN
    ngram_max: int = NGRAM_MAX
    """The suffix n-gram lengths the in-process lookup matches (the draft service's own
    --ngram-min/--ngram-max are its settings, not these)."""

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}..{self.ngram_max}")

    def draft_tokens(self, speculating: int) -> int:
        """k for each of `speculating` sequences in one step (before each one's own cap)."""
        fit = max(self.step_rows // max(speculating, 1) - 1, 0)
        return max(min(self.max_draft_tokens, fit), min(self.batch_draft_tokens, self.max_draft_tokens))


class LocalNgram:
    """One request's n-gram index over its committed tokens, for the in-process n-gram arms."""

    def __init__(self, n_min: int = NGRAM_MIN, n_max: int = NGRAM_MAX) -> None:
        self.tokens: list[int] = []
        self.index = NgramIndex(n_min, n_max)

    def propose(self, seq: Sequence, max_tokens: int) -> list[int]:
        """Up to `max_tokens` drafts continuing `seq`'s committed tokens."""
        n = seq.num_tokens
        if n < len(self.tokens):  # committed tokens only grow; were they rewritten, start over
            self.tokens, self.index = [], NgramIndex(self.index.n_min, self.index.n_max)
        self.tokens += seq.token_ids(len(self.tokens), n)
        self.index.update(self.tokens)
        return self.index.lookup(self.tokens, max_tokens)


@dataclass
class _Request:
    mode: SpecMode
    usage: SpecUsage
    timeline: Timeline
    trace_context: Optional[Context]
    ngram: Optional[LocalNgram] = None
    """The request's in-process n-gram index (created at its first in-process lookup)."""


Emit = Callable[[Sequence, list[int], list[TokenLogprobs]], RequestOutput]
"""EngineCore's emission: appends tokens through the stop checks, returns the request's output."""


class Speculator:
    """Drafts from the draft service, fitted to each step, and their verification."""

    def __init__(self, drafts: DraftClient, scheduler: Scheduler, config: SpecConfig = SpecConfig(),
                 gate: Optional[SpecGate] = None) -> None:
        self.drafts = drafts
        self.scheduler = scheduler
        self.config = config
        self.gate = gate or SpecGate(default_arms(config.max_draft_tokens))
        self._local: set[Sequence] = set()  # sequences whose drafts this step were looked up here
        self.totals = SpecUsage()
        """Counters over every request since start."""
        self._requests: dict[str, _Request] = {}
        self._gated: Optional[tuple[int, Arm]] = None  # this step's (batch, arm), when measured
        self._step_start = 0.0

    def add(self, request_id: str, mode: Optional[SpecMode], timeline: Timeline,
            trace_context: Optional[Context]) -> None:
        self._requests[request_id] = _Request(mode or self.config.default_mode, SpecUsage(), timeline, trace_context)

    def usage(self, request_id: str) -> SpecUsage:
        req = self._requests.get(request_id)
        return req.usage if req is not None else SpecUsage()

    def release(self, request_id: str) -> None:
        """The request left the engine: its draft-service state goes at the next flush."""
        if self._requests.pop(request_id, None) is not None:
            self.drafts.release(request_id)

    def flush(self) -> None:
        self.drafts.flush()

    # ---- before scheduling -------------------------------------------------------------------

    def propose(self) -> dict[Sequence, list[int]]:
        """Drafts for every running decode that speculates and may still emit 2+ tokens (at
        most that many less one, so an accepted run never passes max_tokens): one Propose call,
        answered within the client's deadline or not at all. ADAPTIVE requests follow the arm
        the gate picks for this step (a step it does not measure: the best one it measured)."""
        self._step_start = time.perf_counter()
        self._gated = self._gate_step()
        self._local = set()
        arm = self._gated[1] if self._gated is not None else self.gate.current(len(self.scheduler.running))
        candidates = []
        for seq in self.scheduler.running:
            req = self._requests[seq.request_id]
            mode, cap, local = req.mode, self.config.max_draft_tokens, False
            if mode is SpecMode.ADAPTIVE:
                mode, cap = arm.mode, arm.max_draft
                local = mode is SpecMode.NGRAM and self.config.local_ngram
            if (mode is None or mode is SpecMode.OFF or not seq.output_token_ids
                    or seq.num_tokens - seq.num_computed_tokens != 1):
                continue
            if (local or self.drafts.available) and seq.params.max_tokens - seq.num_output_tokens > 1:
                candidates.append((seq, mode, cap, local))
        per_seq = self.config.draft_tokens(len(candidates))
        if not candidates or per_seq == 0:
            return {}
        drafts: dict[Sequence, list[int]] = {}
        queries = []
        for seq, mode, cap, local in candidates:
            k = min(per_seq, cap, seq.params.max_tokens - seq.num_output_tokens - 1)
            if not local:
                queries.append(DraftQuery(seq, k, mode))
                continue
            req = self._requests[seq.request_id]
            req.ngram = req.ngram or LocalNgram(self.config.ngram_min, self.config.ngram_max)
            tokens = req.ngram.propose(seq, k)
            if tokens:
                drafts[seq] = tokens
                self._local.add(seq)
        if not queries:
            return drafts
        # The Propose call (one for the batch) becomes a span of the first speculating request.
        first = self._requests[queries[0].seq.request_id]
        token = otel_context.attach(first.trace_context or Context())
        try:
            drafts.update(self.drafts.propose(queries))
        finally:
            otel_context.detach(token)
        return drafts

    def _gate_step(self) -> Optional[tuple[int, Arm]]:
        """(batch, what ADAPTIVE requests do) for a pure decode step that has ADAPTIVE requests
        in it, from the gate; None for any other step (it is not measured)."""
        sched = self.scheduler
        if sched.waiting or not sched.running:
            return None
        if any(s.num_tokens - s.num_computed_tokens != 1 for s in sched.running):
            return None
        if not any(self._requests[s.request_id].mode is SpecMode.ADAPTIVE for s in sched.running):
            return None
        return len(sched.running), self.gate.choose(len(sched.running))

    # ---- after the forward -------------------------------------------------------------------

    def verify(self, rows: list[DraftLogits], draws: list[Optional[Draws]],
               emit: Emit, processing: Optional[Processing] = None) -> list[RequestOutput]:
        """Emits each verified run token by token (a stop cuts it), then keeps the accepted
        drafts' KV and drops the rejected ones'. processing: the logits processing of every
        verified row (speculation.verify_batch), when a request asks for any."""
        if not rows:
            return []
        verdicts = verify_batch([r.logits for r in rows], [r.draft_token_ids for r in rows],
                                [r.seq.params for r in rows], draws,
                                [r.seq.num_output_tokens for r in rows], processing)
        outputs = []
        for r, verdict in zip(rows, verdicts):
            seq, tokens = r.seq, verdict.token_ids
            req = self._requests[seq.request_id]
            lps = []
            if seq.params.logprobs is not None:
                lps = token_logprobs(r.logits[:len(tokens)], tokens, [seq.params.logprobs] * len(tokens))
            out = emit(seq, tokens, lps)
            accepted = min(verdict.num_accepted, len(out.token_ids))
            if len(req.timeline.spec_steps) < SPEC_EVENTS:
                req.timeline.spec_steps.append((time.monotonic(), len(r.draft_token_ids), accepted))
            for usage in (req.usage, self.totals):
                usage.steps += 1
                usage.draft_tokens += len(r.draft_token_ids)
                usage.accepted_tokens += accepted
            if not out.finished:
                self.scheduler.accept_drafts(seq, verdict.num_accepted)
                if seq not in self._local:
                    self.drafts.accepted(seq.request_id, verdict.num_accepted)
            outputs.append(out)
        return outputs

    def end_step(self, emitted_tokens: int) -> None:
        """Feeds a measured step's throughput to the gate, and sends pending releases."""
        if self._gated is not None:
            self.gate.record(self._gated[0], self._gated[1], emitted_tokens, time.perf_counter() - self._step_start)
            self._gated = None
        self.drafts.flush()
