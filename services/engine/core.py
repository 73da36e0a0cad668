"""Engine core: one synchronous step = schedule -> execute -> sample -> emit.

Single-threaded by design (the async wrapper runs it on its own thread); the scheduler and block
manager are plain Python, the runner is the only part that touches tensors. Features plug in as
components with typed hooks, each optional: speculation (services/engine/speculator.py), KV
transfer to and from the KV-cache service (kv_transfer.py) and blending of cached documents
(blending.py). A step, in order:

    blender.before_schedule        blend the queue head's cached documents
    speculator.propose             drafts for the running decodes
    scheduler.schedule             the step's tokens under one budget
    runner.execute                 the forward pass
    scheduler.commit, kv.after_step
    sampler / speculator.verify    next tokens, through `_emit` (stop checks, detokenization)
    speculator.end_step
A step that finds no request to schedule runs one of the guardrail's pending shadow checks instead
(services/engine/guardrail.py): checks only ever use spare capacity.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from kvmesh.errors import InvalidArgument
from kvmesh.kv.codec import CodecSpec
from kvmesh.kv.namespace import KvNamespace
from kvmesh.kv.quality import DEFAULT_BUDGET, QualityBudget
from kvmesh.model.loader import LoadedModel
from kvmesh.model.tokenizer import IncrementalDetokenizer
from kvmesh.services.engine.block_manager import BlockManager
from kvmesh.services.engine.blending import BlendConfig, Blender
from kvmesh.services.engine.draft_client import DraftClient
from kvmesh.services.engine.guardrail import Guardrail, GuardTicket, ShadowCheck
from kvmesh.services.engine.kv_connector import KvConnector
from kvmesh.services.engine.kv_transfer import KvTransfer
from kvmesh.services.engine.logits import LogitsProcessor, Processing, RowContext
from kvmesh.services.engine.outputs import (EngineLoad, EngineRequest, ProbeResult, RequestOutput, Timeline,
                                            Usage)
from kvmesh.services.engine.runner import DraftLogits, ModelRunner, PromptLogprobsChunk
from kvmesh.services.engine.sampler import Draws, Sampler, TokenLogprobs, make_draws
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.services.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvmesh.services.engine.shadow import ShadowChecker
from kvmesh.services.engine.speculation import SpecMode, SpecUsage
from kvmesh.services.engine.speculator import SpecConfig, Speculator
from kvmesh.services.engine.stop import StopStringMatcher, check_stop, stop_strings_apply
from kvmesh.services.engine.structured import GrammarState, StructuredOutput, check_grammar
from kvmesh.services.engine.tracing import trace_guard_check

log = logging.getLogger(__name__)


@dataclass
class _State:
    """Per-request bookkeeping of the core itself: text, stop strings, randomness, timing."""

    seq: Sequence
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    draws: Optional[Draws]
    """The request's randomness (None when greedy): the draw at output position p is seeded
    from (seed, p)."""
    timeline: Timeline
    storage: str
    """The request's KvNamespace.storage: how any KV it reuses was made."""
    fallback: str = ""
    """EngineRequest.fallback."""
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # collected chunk by chunk
    guard: Optional[GuardTicket] = None
    """EngineRequest.guard: the request is shadow-checked when it finishes."""
    guard_rows: Optional[list[torch.Tensor]] = None
    """guard.served_lossy: the raw logits [vocab] the sampler saw for each output token (capped)."""
    trace_context: Optional[object] = None
    """EngineRequest.trace_context: a shadow check's span joins the request's trace."""
    grammar: Optional[GrammarState] = None
    """The request's structured-output state (None: free text); advanced by `_emit`."""


class EngineCore:
    """Continuous batching over one model: add requests, call `step()` until none are left."""

    def __init__(self, loaded: LoadedModel, runner: ModelRunner, sched_config: SchedulerConfig, *,
                 namespace: KvNamespace, enable_prefix_caching: bool = True,
                 kv: Optional[KvConnector] = None, drafts: Optional[DraftClient] = None,
                 spec: SpecConfig = SpecConfig(), blend: BlendConfig = BlendConfig(),
                 quality_budget: QualityBudget = DEFAULT_BUDGET, guardrail: Optional[Guardrail] = None) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.runner = runner
        self.namespace = namespace
        """The engine's KV identity (exact, default tenant); requests derive theirs from it."""
        self.block_manager = BlockManager(runner.num_blocks, runner.block_size,
                                          enable_prefix_caching=enable_prefix_caching)
        self.scheduler = Scheduler(sched_config, self.block_manager)
        self.sched_config = sched_config
        self.sampler = Sampler()
        self.eos_token_ids = tuple(loaded.config.eos_token_ids)
        self.logits_processor = LogitsProcessor(self.eos_token_ids)
        self.structured = StructuredOutput(loaded.tokenizer, loaded.config.vocab_size, self.eos_token_ids)
        self.kv_transfer = KvTransfer(kv, runner.read_kv_to_host, runner.stage_kv) if kv is not None else None
        self.speculator = Speculator(drafts, self.scheduler, spec) if drafts is not None else None
        self.blender = Blender(loaded.model, self.scheduler, blend)
        self.quality_budget = quality_budget
        """The deployment's budget for lossy paths, under what requests and tenants declare."""
        self.guardrail = guardrail
        """Decides whether an opted-in lossy path is served, and shadow-checks a share of them."""
        self.shadow = ShadowChecker(loaded.model, block_size=runner.block_size,
                                    chunk_tokens=kv.config.chunk_tokens if kv is not None else None, blend=blend)
        """Runs the guardrail's checks on this engine's model, between steps."""
        self.last_step_checked = False
        """Whether the last `step()` ran a shadow check instead of a batch (metrics skip it)."""
        self._states: dict[str, _State] = {}

    @property
    def kv(self) -> Optional[KvConnector]:
        """The KV-cache service link, or None (in-engine prefix cache only)."""
        return self.kv_transfer.connector if self.kv_transfer is not None else None

    @property
    def drafts(self) -> Optional[DraftClient]:
        """The draft service link, or None (no speculative decoding)."""
        return self.speculator.drafts if self.speculator is not None else None

    @property
    def spec_totals(self) -> SpecUsage:
        """Speculative decoding counters over every request since start."""
        return self.speculator.totals if self.speculator is not None else SpecUsage()

    def request_namespace(self, tenant_salt: str = "", spec: Optional[CodecSpec] = None) -> KvNamespace:
        """The KV namespace of a request of this tenant that stores with `spec` (None: the
        deployment's codec; exact without a KV service): the engine's own, derived."""
        ns = self.namespace.for_tenant(tenant_salt)
        if self.kv is None:
            return ns
        return ns.with_storage((spec or self.kv.config.codec).storage(self.loaded.dtype))

    # ---- admission -------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidArgument when the request cannot run on this engine."""
        vocab = self.loaded.config.vocab_size
        params.validate(prompt_len=len(prompt_token_ids),
                        max_model_len=self.sched_config.max_model_len, vocab_size=vocab)
        bad = [t for t in prompt_token_ids if t >= vocab]
        if bad:
            raise InvalidArgument(
                f"prompt token id {bad[0]} is outside the vocabulary (size {vocab}); "
                "tokenize with this model's tokenizer")
        if params.constraint is not None:
            check_grammar(params.constraint)
        self.scheduler.check_fits(len(prompt_token_ids), params.max_tokens)

    def add_request(self, req: EngineRequest) -> Optional[RequestOutput]:
        """Queues a validated request (ResourceExhausted when the queue is full).

        A request that resumes another engine's (EngineRequest.resume_token_ids) starts with
        those tokens as its output, not yet computed -- the state a preempted sequence is in --
        and its text and stop-string state replayed from them. When they already finish it (a
        stream cut between its last token and its summary), nothing is queued and its final
        output is returned."""
        namespace = req.namespace or self.namespace
        if req.blend is not None:
            namespace = self.blender.config.namespace(namespace, req.blend.recompute_ratio)
        seq = Sequence(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                       params=req.params, arrival_time=req.arrival_time, namespace=namespace.digest(),
                       needs_prompt_logprobs=req.params.prompt_logprobs is not None)
        timeline = Timeline(req.arrival_time)
        state = _State(
            seq=seq, detok=IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
            matcher=StopStringMatcher(req.params.stop), draws=make_draws(req.params), timeline=timeline,
            storage=namespace.storage, fallback=req.fallback, guard=req.guard, trace_context=req.trace_context,
            grammar=self.structured.start(req.params.constraint) if req.params.constraint is not None else None)
        done = self._replay(state, req.resume_token_ids)
        if done is not None:
            return done
        self.scheduler.add(seq)
        self._states[req.request_id] = state
        speculation = req.speculation
        if req.guard is not None and req.guard.served_lossy and self.guardrail is not None:
            # One logits row per output token, as the sampler sees it: verified drafts come from
            # other rows, so a shadow-checked request decodes plainly (same tokens when greedy).
            self._states[req.request_id].guard_rows = []
            speculation = SpecMode.OFF
        if self.kv_transfer is not None:
            self.kv_transfer.add(seq, req.kv_plan, req.doc_exports, req.trace_context)
        if self.speculator is not None:
            self.speculator.add(req.request_id, speculation, timeline, req.trace_context)
        if req.blend is not None or req.document_ids or req.doc_exports is not None:
            self.blender.add(req.request_id, req.blend, req.document_ids, timeline)
        return None

    def _replay(self, state: _State, tokens: tuple[int, ...]) -> Optional[RequestOutput]:
        """Appends resumed tokens to a new request's output as `_emit` would, without emitting
        their text (its client has it); returns the final output if they end the request."""
        seq = state.seq
        for token in tokens:
            seq.append_token(token)
            reason, complete = self._check_stop(state, token)
            check = stop_strings_apply(seq)
            _, hit = state.matcher.feed("" if reason == "stop" else state.detok.step([token]), check)
            if hit is None and (complete or reason is not None) and reason != "stop":
                _, hit = state.matcher.feed(state.detok.flush(), check)
            if hit is not None:
                reason, stop_reason = FinishReason.STOP_STRING, hit
            elif complete:
                reason, stop_reason = FinishReason.STOP, ""
            elif reason is not None:
                reason, stop_reason = FinishReason(reason), str(token) if reason == "stop" else ""
            else:
                continue
            seq.status = SequenceStatus.FINISHED  # never queued: the scheduler has nothing to free
            return self._finish(state, RequestOutput(seq.request_id), reason, stop_reason)
        return None

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Stops a request and frees its blocks; returns its final output, or None if unknown."""
        state = self._states.get(request_id)
        if state is None:
            return None
        final = self._finish(state, RequestOutput(request_id), FinishReason.ABORT, "")
        if self.speculator is not None:
            self.speculator.flush()
        return final

    def cached_prefix_tokens(self, prompt_token_ids: list[int], namespace: Optional[KvNamespace] = None) -> int:
        """How many leading prompt tokens the engine's prefix cache holds now (what an admission
        would reuse: see ProbeResult.cached_tokens). Changes nothing: no ref count, no LRU order,
        no hit statistics.

        A hint, safe to ask from the event-loop thread while the step loop runs (see the NOTE in
        async_engine); a stale answer only misleads a placement or what the KV connector
        fetches -- admission matches the prefix again and uses what is really there.
        """
        probe = Sequence(request_id="", prompt_token_ids=list(prompt_token_ids),
                         namespace=(namespace or self.namespace).digest())
        return self.block_manager.match_prefix(probe)[1]

    def load(self) -> EngineLoad:
        """The engine's load now. Call it on the thread that steps the core (it walks the
        scheduler's queues); AsyncEngine publishes it at every step boundary."""
        sched, bm = self.scheduler, self.block_manager
        return EngineLoad(running=sched.num_running, waiting=sched.num_waiting,
                          pending_prefill_tokens=sched.num_pending_prefill_tokens,
                          free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks)

    def probe(self, prompt_token_ids: list[int], namespace: Optional[KvNamespace] = None) -> ProbeResult:
        """The prefix-cache hit a prompt would get now, and the engine's load (read-only; on
        the thread that steps the core)."""
        return ProbeResult(self.cached_prefix_tokens(prompt_token_ids, namespace), self.load())

    def request_ids(self) -> list[str]:
        """Ids of every queued or running request."""
        return list(self._states)

    @property
    def has_work(self) -> bool:
        """Requests to step, or shadow checks waiting for an idle step."""
        return self.scheduler.has_work or (self.guardrail is not None and self.guardrail.pending > 0)

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch; returns the outputs of every request that advanced (see the
        module docstring for the order of the hooks)."""
        self.last_step_checked = False
        if not self.scheduler.has_work and self.guardrail is not None and self.guardrail.pending:
            self._run_guard_check()  # spare capacity: nothing else to compute
            return []
        self.blender.before_schedule()
        drafts = self.speculator.propose() if self.speculator is not None else {}
        out = self.scheduler.schedule(drafts)
        if not out.scheduled:
            return []
        now = time.monotonic()
        for item in out.scheduled:
            timeline = self._states[item.seq.request_id].timeline
            if timeline.admitted is None:
                timeline.admitted = now
        result = self.runner.execute(out)
        self.scheduler.commit(out)
        if self.kv_transfer is not None:
            self.kv_transfer.after_step(out)
        for chunk in result.prompt_logprobs:
            self._collect_prompt_logprobs(self._states[chunk.seq.request_id], chunk)
        outputs = []
        if result.seqs:
            states = [self._states[s.request_id] for s in result.seqs]
            self._capture_guard_rows(states, result.logits)
            sampled = self.sampler(result.logits, [s.params for s in result.seqs],
                                   [st.draws.at(st.seq.num_output_tokens) if st.draws is not None else None
                                    for st in states], self._processing(states))
            lps = sampled.logprobs
            outputs += [self._emit(st.seq, [t], [lps[i]] if lps[i] is not None else [])
                        for i, (st, t) in enumerate(zip(states, sampled.token_ids))]
        if self.speculator is not None:
            draws = [self._states[d.seq.request_id].draws for d in result.drafts]
            outputs += self.speculator.verify(result.drafts, draws, self._emit, self._draft_processing(result.drafts))
            self.speculator.end_step(sum(len(o.token_ids) for o in outputs))
        return outputs

    def _processing(self, states: list[_State]) -> Optional[Processing]:
        """The logits processing of one sampled row per state (None when no request asks for any):
        each row's history, and the grammar masks of the constrained ones, computed together."""
        if not any(st.seq.params.processes_logits for st in states):
            return None
        contexts = [RowContext(st.seq.params, st.seq.prompt_token_ids, st.seq.output_token_ids) for st in states]
        return Processing(self.logits_processor, contexts, self.structured.masks([st.grammar for st in states]))

    def _draft_processing(self, rows: list[DraftLogits]) -> Optional[Processing]:
        """The logits processing of every verified row (k + 1 per sequence): row j of a sequence
        sees its output plus drafts[:j], and the grammar mask after them (structured's NOTE)."""
        if not any(r.seq.params.processes_logits for r in rows):
            return None
        contexts, masks = [], []
        for r in rows:
            seq, drafts = r.seq, list(r.draft_token_ids)
            contexts += [RowContext(seq.params, seq.prompt_token_ids, seq.output_token_ids + drafts[:j])
                         for j in range(len(drafts) + 1)]
            mask = self.structured.draft_masks(self._states[seq.request_id].grammar, drafts)
            masks.append(mask if mask is not None
                         else torch.ones(len(drafts) + 1, self.structured.vocab_size, dtype=torch.bool))
        allowed = torch.cat(masks) if any(self._states[r.seq.request_id].grammar for r in rows) else None
        return Processing(self.logits_processor, contexts, allowed)

    def _check_stop(self, state: _State, token: int) -> tuple[Optional[FinishReason], bool]:
        """(check_stop's reason, whether the token completes the request's structured output),
        for a token already appended; a constrained request's grammar advances over it."""
        reason = check_stop(state.seq, token, self.eos_token_ids)
        if state.grammar is None or reason is FinishReason.STOP:
            return reason, False
        state.grammar.advance([token])
        return reason, state.grammar.finished

    def _capture_guard_rows(self, states: list[_State], logits: torch.Tensor) -> None:
        """Keeps the logits row of each shadow-checked sequence's next token (logits [N, vocab],
        row i of states[i]), up to the guardrail's max_tokens positions."""
        for i, st in enumerate(states):
            rows = st.guard_rows
            if (rows is not None and len(rows) == st.seq.num_output_tokens
                    and len(rows) < self.guardrail.config.max_tokens):
                rows.append(logits[i].float().clone())

    def _queue_guard_check(self, state: _State) -> None:
        """A finished shadow-checked request's check, queued for an idle step. A request served
        lossy that reused nothing of the path (no cached KV in its lossy namespace; for a blend, no
        document KV blended) gives none: it would measure nothing."""
        seq, ticket = state.seq, state.guard
        n = min(seq.num_output_tokens, self.guardrail.config.max_tokens)
        logits = None
        if ticket.served_lossy:
            rows = state.guard_rows or []
            n = min(n, len(rows))
            docs = self.blender.usage(seq.request_id)
            reused = (docs.blended_tokens if docs is not None else 0) if ticket.path.kind == "blend" \
                else seq.num_cached_tokens
            if not reused or not n:
                return
            logits = torch.stack(rows[:n])  # [n, vocab]
        if n:
            self.guardrail.submit(ShadowCheck(ticket, tuple(seq.prompt_token_ids), tuple(seq.output_token_ids[:n]),
                                              logits, state.trace_context))

    def _run_guard_check(self) -> None:
        """Runs the oldest pending shadow check and records its result (a failure is logged:
        it never stops the engine)."""
        check = self.guardrail.next_check()
        if check is None:
            return
        self.last_step_checked = True
        start, result = time.monotonic(), None
        try:
            result = self.shadow.run(check)
        except Exception:  # noqa: BLE001 - a check is optional; the engine goes on
            log.exception("guardrail shadow check of %s failed", check.ticket.path.namespace.storage)
        end = time.monotonic()
        if result is None:
            self.guardrail.done(check)
        else:
            self.guardrail.done(check, result.tokens, result.kl, result.top1)
        trace_guard_check(check, result, start, end)

    @staticmethod
    def _collect_prompt_logprobs(state: _State, chunk: PromptLogprobsChunk) -> None:
        """Appends a chunk's prompt logprobs (a recompute after preemption starts over at 0)."""
        collected = state.prompt_logprobs
        if chunk.start > len(collected):
            raise RuntimeError(f"prompt logprobs of {state.seq.request_id!r} skip positions "
                               f"{len(collected)}..{chunk.start - 1}: part of its prompt was not computed")
        del collected[chunk.start:]
        collected.extend(chunk.entries)

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[TokenLogprobs]) -> RequestOutput:
        """Appends `tokens` (with their logprobs, if asked for) to the sequence one by one, each
        through the stop checks; the first stop finishes the request and drops the rest."""
        state = self._states[seq.request_id]
        if state.timeline.first_token is None:
            state.timeline.first_token = time.monotonic()
        out = RequestOutput(request_id=seq.request_id)
        if seq.needs_prompt_logprobs:  # the first token: the prompt is computed, deliver them once
            out.prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, []
            seq.needs_prompt_logprobs = False
        for i, token in enumerate(tokens):
            seq.append_token(token)
            out.token_ids.append(token)
            out.logprobs += logprobs[i:i + 1]
            reason, complete = self._check_stop(state, token)
            # Stop/eos tokens end the request but are not part of the text; stop strings count only
            # past min_tokens (StopStringMatcher's NOTE), here as on the speculative path, token by token.
            text_piece = "" if reason == "stop" else state.detok.step([token])
            check = stop_strings_apply(seq)
            emit, hit = state.matcher.feed(text_piece, check)
            out.text += emit
            if hit is not None:
                return self._finish(state, out, FinishReason.STOP_STRING, hit)
            if reason is not None or complete:
                tail = state.detok.flush() if reason != "stop" else ""
                emit_tail, hit = state.matcher.feed(tail, check)
                if hit is not None:
                    out.text += emit_tail
                    return self._finish(state, out, FinishReason.STOP_STRING, hit)
                out.text += emit_tail + state.matcher.flush()
                stop_reason = str(token) if reason == "stop" else ""
                # A completed structured output stopped on its own, even on its last allowed token.
                return self._finish(state, out, FinishReason.STOP if complete else FinishReason(reason),
                                    stop_reason)
        return out

    def _finish(self, state: _State, out: RequestOutput, reason: FinishReason, stop_reason: str) -> RequestOutput:
        """Ends the request: frees its blocks, tells every component, and returns `out` as the
        final output with the request's summary."""
        seq = state.seq
        rid = seq.request_id
        self.scheduler.finish(seq, reason)
        self._states.pop(rid, None)
        if state.guard is not None and self.guardrail is not None and reason is not FinishReason.ABORT:
            self._queue_guard_check(state)
        now = time.monotonic()
        out.finished, out.finish_reason, out.stop_reason = True, reason, stop_reason
        out.usage = Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=len(seq.output_token_ids),
                          cached_prompt_tokens=seq.num_cached_tokens, imported_prompt_tokens=seq.num_imported_tokens)
        out.reuse_storage = state.storage
        out.reuse_fallback = state.fallback
        out.guard = state.guard
        out.ttft_s = (state.timeline.first_token or now) - seq.arrival_time
        out.e2e_s = now - seq.arrival_time
        out.documents = self.blender.usage(rid)
        self.blender.release(rid)
        out.spec = self.speculator.usage(rid) if self.speculator is not None else SpecUsage()
        if self.speculator is not None:
            self.speculator.release(rid)
        if self.kv_transfer is not None:
            self.kv_transfer.release(rid)
        state.timeline.finished = now
        out.timeline = state.timeline
        return out
