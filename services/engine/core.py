"""Engine core: one synchronous step = schedule → forward → sample → detokenize → stop checks.

Single-threaded by design (the async wrapper runs it on its own thread); the scheduler and block
manager are plain Python, the runner is the only part that touches tensors.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from opentelemetry import context as otel_context

from kvmesh.errors import InvalidArgument
from kvmesh.model.loader import LoadedModel
from kvmesh.model.tokenizer import IncrementalDetokenizer
from kvmesh.services.engine.block_manager import BlockManager
from kvmesh.kv.blend import blend_prefill
from kvmesh.kv.codec import CodecSpec
from kvmesh.services.engine.documents import BlendPlan, DocumentExports
from kvmesh.services.engine.draft_client import DraftClient, DraftQuery
from kvmesh.services.engine.kv_connector import ExportJob, KvConnector, KvPlan
from kvmesh.services.engine.runner import DraftLogits, ModelRunner, PromptLogprobsChunk
from kvmesh.services.engine.sampler import Sampler, TokenLogprobs, make_generator, token_logprobs
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.scheduler import Scheduler, SchedulerConfig
from kvmesh.services.engine.sequence import Sequence
from kvmesh.services.engine.spec_gate import SpecGate
from kvmesh.services.engine.speculation import SpecMode, SpecUsage, Verdict, verify_batch
from kvmesh.services.engine.stop import StopStringMatcher, check_stop

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRequest:
    """A validated request, as the core accepts it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    cache_salt: bytes = b""
    """Tenant salt of every KV namespace the request touches (engine prefix cache, KV service)."""
    kv_plan: Optional[KvPlan] = None
    """What the KV-cache service held for this prompt (fetched before queuing), if it is used."""
    speculation: Optional[SpecMode] = None
    """Speculative decoding for this request; None = the engine's default."""
    blend: Optional[BlendPlan] = None
    """Cached document KV to blend in before the prompt is computed (services/engine/documents)."""
    doc_exports: Optional[DocumentExports] = None
    """Document chunks to store by content key once the prompt is computed."""
    document_ids: tuple[str, ...] = ()
    """Catalogued documents the prompt holds (reported in the final output)."""
    kv_spec: Optional[CodecSpec] = None
    """Codec of the document chunks this request stores; None = the deployment's."""
    trace_context: Optional[object] = None
    """The request's OpenTelemetry context: the step loop's calls for it (drafts, KV stores)
    become spans of its trace."""


@dataclass(frozen=True)
class BlendConfig:
    """How the engine blends cached document KV (kvmesh.kv.blend)."""

    recompute_ratio: float = 0.15
    """Share of reused document tokens recomputed, for requests that set none."""
    select_layers: int = 2
    """Leading layers run over every token to choose which to recompute."""
    selection: str = "deviation+attention"
    """kvmesh.kv.blend.SELECTIONS: how the recomputed tokens are chosen."""


@dataclass(frozen=True)
class DocumentUsage:
    """What a prompt with documents reused: tokens whose KV came from cached documents, how many
    of them were recomputed, and the catalogued documents it held."""

    blended_tokens: int = 0
    recomputed_tokens: int = 0
    document_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpecConfig:
    """How the engine speculates (only with a draft service)."""

    default_mode: SpecMode = SpecMode.NGRAM
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

    def draft_tokens(self, speculating: int) -> int:
        """k for each of `speculating` sequences in one step (before each one's own cap)."""
        fit = max(self.step_rows // max(speculating, 1) - 1, 0)
        return max(min(self.max_draft_tokens, fit), min(self.batch_draft_tokens, self.max_draft_tokens))


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens/text, and the summary when finished."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    """With SamplingParams.prompt_logprobs, on the request's first output only: one TokenLogprobs
    per prompt token from the second on."""
    finished: bool = False
    finish_reason: Optional[str] = None   # stop | length | abort | stop_string
    stop_reason: str = ""
    usage: Optional[Usage] = None
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    spec: Optional[SpecUsage] = None
    """Final output only: the request's speculative decoding counters."""
    documents: Optional[DocumentUsage] = None
    """Final output only, for prompts with documents."""
    timeline: Optional[Timeline] = None
    """Final output only: when the request moved through the engine (for its trace)."""


@dataclass
class Timeline:
    """time.monotonic() instants of one request in the engine; None where it never got there."""

    arrival: float
    admitted: Optional[float] = None
    first_token: Optional[float] = None
    finished: Optional[float] = None
    blend: Optional[tuple[float, float]] = None
    spec_steps: list[tuple[float, int, int]] = field(default_factory=list)
    """(instant, drafted, accepted) of the request's first SPEC_EVENTS verification steps."""


SPEC_EVENTS = 256


@dataclass(frozen=True)
class EngineLoad:
    """How busy the engine is, as of one step boundary."""

    running: int
    waiting: int
    pending_prefill_tokens: int
    """Scheduler.num_pending_prefill_tokens: prompt (and recompute) tokens not yet computed."""
    free_blocks: int
    """Blocks no sequence owns (cached-but-free blocks included: they are reusable)."""
    num_blocks: int


@dataclass(frozen=True)
class ProbeResult:
    """What a router needs to place a request on this engine: reusable prefix and load."""

    cached_tokens: int
    """Leading prompt tokens an admission now would take from the prefix cache: whole blocks,
    never the prompt's last token (it is always computed, for its logits)."""
    load: EngineLoad


@dataclass
class _State:
    """Per-request bookkeeping the scheduler does not need: text, stop strings, randomness."""

    seq: Sequence
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher
    generator: Optional[torch.Generator]
    first_token_time: Optional[float] = None
    kv_plan: Optional[KvPlan] = None  # set until the prompt's new chunks are exported
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # collected chunk by chunk
    spec_mode: SpecMode = SpecMode.OFF
    spec: SpecUsage = field(default_factory=SpecUsage)
    blend: Optional[BlendPlan] = None  # run when the request reaches the head of the queue
    doc_exports: Optional[DocumentExports] = None  # set until the prompt is computed
    kv_spec: Optional[CodecSpec] = None
    documents: Optional[DocumentUsage] = None
    trace_context: Optional[object] = None
    timeline: Optional[Timeline] = None


class EngineCore:
    """Continuous batching over one model: add requests, call `step()` until none are left."""

    def __init__(self, loaded: LoadedModel, runner: ModelRunner, sched_config: SchedulerConfig,
                 *, enable_prefix_caching: bool = True, kv: Optional[KvConnector] = None,
                 drafts: Optional[DraftClient] = None, spec: SpecConfig = SpecConfig(),
                 blend: BlendConfig = BlendConfig()) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.runner = runner
        # Prefix-cache hashes are namespaced by model identity (weights, format, dtype, layer cut)
        # and KV layout, so a changed or truncated model can never match stale blocks.
        c = loaded.config
        namespace = (f"{loaded.identity}|{loaded.dtype}|L{c.num_layers}|H{c.num_kv_heads}"
                     f"|D{c.head_dim}|B{runner.block_size}").encode()
        self.block_manager = BlockManager(
            runner.num_blocks, runner.block_size, enable_prefix_caching=enable_prefix_caching,
            namespace=namespace)
        self.scheduler = Scheduler(sched_config, self.block_manager)
        self.sched_config = sched_config
        self.sampler = Sampler()
        self.eos_token_ids = tuple(loaded.config.eos_token_ids)
        self.kv = kv
        """The KV-cache service link, or None (in-engine prefix cache only)."""
        self.drafts = drafts
        self.gate = SpecGate()
        """Whether drafting pays at the current batch size, measured (ADAPTIVE requests)."""
        """The draft service link, or None (no speculative decoding)."""
        self.spec_config = spec
        self.blend_config = blend
        self.spec_totals = SpecUsage()
        """Speculative decoding counters over every request since start."""
        self._states: dict[str, _State] = {}

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
        needed = -(-(len(prompt_token_ids) + params.max_tokens) // self.runner.block_size)
        if needed > self.runner.num_blocks:
            raise InvalidArgument(
                f"prompt + max_tokens needs {needed} KV blocks but the engine's pool has "
                f"{self.runner.num_blocks}; lower max_tokens or raise --kv-cache-bytes")

    def add_request(self, req: EngineRequest) -> None:
        """Queues a validated request (ResourceExhausted when the queue is full)."""
        salt = req.cache_salt
        if req.blend is not None:  # blended KV is not exact: its blocks only match the same blend
            salt += (f"\0blend:{req.blend.recompute_ratio:.4f}:{self.blend_config.select_layers}:"
                     f"{self.blend_config.selection}").encode()
        seq = Sequence(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids),
                       params=req.params, arrival_time=req.arrival_time, cache_salt=salt,
                       needs_prompt_logprobs=req.params.prompt_logprobs is not None)
        plan = req.kv_plan if self.kv is not None else None
        if plan is not None and plan.kv is not None:
            seq.external_kv, seq.external_start, seq.external_tokens = plan.kv, plan.start, plan.tokens
            plan.kv = None  # the sequence holds it until import
        generator = make_generator(req.params)
        self.scheduler.add(seq)
        mode = req.speculation or self.spec_config.default_mode
        self._states[req.request_id] = _State(
            seq=seq,
            detok=IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
            matcher=StopStringMatcher(req.params.stop),
            generator=generator,
            kv_plan=plan if plan is not None and not all(plan.present) else None,
            spec_mode=mode if self.drafts is not None else SpecMode.OFF,
            blend=req.blend, doc_exports=req.doc_exports if self.kv is not None else None,
            kv_spec=req.kv_spec, trace_context=req.trace_context, timeline=Timeline(req.arrival_time),
            documents=DocumentUsage(document_ids=req.document_ids) if req.blend or req.document_ids
            or req.doc_exports else None)

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        """Stops a request and frees its blocks; returns its final output, or None if unknown."""
        state = self._states.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.finish(state.seq, "abort")
        if self.drafts is not None:
            self.drafts.release(request_id)
            self.drafts.flush()
        return self._final(state, "abort", "")

    def cached_prefix_tokens(self, prompt_token_ids: list[int], cache_salt: bytes) -> int:
        """How many leading prompt tokens the engine's prefix cache holds now (what an admission
        would reuse: see ProbeResult.cached_tokens). Changes nothing: no ref count, no LRU order,
        no hit statistics.

        A hint, safe to ask from the event-loop thread while the step loop runs (see the NOTE in
        async_engine); a stale answer only misleads a placement or what the KV connector
        fetches -- admission matches the prefix again and uses what is really there.
        """
        probe = Sequence(request_id="", prompt_token_ids=list(prompt_token_ids), cache_salt=cache_salt)
        return self.block_manager.match_prefix(probe)[1]

    def load(self) -> EngineLoad:
        """The engine's load now. Call it on the thread that steps the core (it walks the
        scheduler's queues); AsyncEngine publishes it at every step boundary."""
        sched, bm = self.scheduler, self.block_manager
        return EngineLoad(running=sched.num_running, waiting=sched.num_waiting,
                          pending_prefill_tokens=sched.num_pending_prefill_tokens,
                          free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks)

    def probe(self, prompt_token_ids: list[int], cache_salt: bytes) -> ProbeResult:
        """The prefix-cache hit a prompt would get now, and the engine's load (read-only; on
        the thread that steps the core)."""
        return ProbeResult(self.cached_prefix_tokens(prompt_token_ids, cache_salt), self.load())

    def request_ids(self) -> list[str]:
        """Ids of every queued or running request."""
        return list(self._states)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Runs one scheduled batch; returns the outputs of every request that advanced.

        With a draft service: first one Propose for every speculating decode (see
        `_propose`), whose drafts the scheduler fits into the step and the runner computes with
        everything else; then plain sampling for the other sequences and verification for those."""
        step_start = time.perf_counter()
        self._blend_head()
        gated = self._gate_step()
        drafts = self._propose(gated) if self.drafts is not None else {}
        out = self.scheduler.schedule(drafts)
        if not out.scheduled:
            return []
        started = time.perf_counter()
        now = time.monotonic()
        for item in out.scheduled:
            timeline = self._states[item.seq.request_id].timeline
            if timeline.admitted is None:
                timeline.admitted = now
        result = self.runner.execute(out)
        self.scheduler.commit(out)
        if self.kv is not None:
            self._export_new_chunks(out)
        for chunk in result.prompt_logprobs:
            self._collect_prompt_logprobs(self._states[chunk.seq.request_id], chunk)
        outputs = []
        if result.seqs:
            states = [self._states[s.request_id] for s in result.seqs]
            sampled = self.sampler(result.logits, [s.params for s in result.seqs],
                                   [st.generator for st in states])
            lps = sampled.logprobs
            outputs += [self._emit(st, [t], [lps[i]] if lps[i] is not None else [])
                        for i, (st, t) in enumerate(zip(states, sampled.token_ids))]
        if result.drafts:
            verdicts = verify_batch([d.logits for d in result.drafts], [d.draft_token_ids for d in result.drafts],
                                    [d.seq.params for d in result.drafts],
                                    [self._states[d.seq.request_id].generator for d in result.drafts])
            outputs += [self._accept(d, v) for d, v in zip(result.drafts, verdicts)]
        if self.drafts is not None:
            self.drafts.observe_step(time.perf_counter() - started, verified=bool(result.drafts))
            self.drafts.flush()
        if gated is not None:
            self.gate.record(gated[0], gated[1], sum(len(o.token_ids) for o in outputs),
                             time.perf_counter() - step_start)
        return outputs

    def _blend_head(self) -> None:
        """Blends the cached document KV of the request at the head of the queue (see the NOTE
        in services/engine/documents.py): the result waits on the sequence as imported KV, up to
        the last whole block before its last prompt token, which the step computes."""
        if not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        state = self._states.get(seq.request_id)
        if state is None or state.blend is None:
            return
        plan, state.blend = state.blend, None
        t0 = time.perf_counter()
        m0 = time.monotonic()
        if plan.job is not None:  # its probe stage ran while the KV was being fetched
            res = plan.job.finish(plan.segments, plan.recompute_ratio)
        else:
            res = blend_prefill(self.loaded.model, plan.segments, plan.recompute_ratio,
                                self.blend_config.select_layers, self.blend_config.selection)
        n = (seq.num_prompt_tokens - 1) // self.runner.block_size * self.runner.block_size
        if n:
            seq.external_kv, seq.external_start, seq.external_tokens = (res.k[:, :n], res.v[:, :n]), 0, n
        recomputed = int((~res.deviation.isnan())[res.recomputed].sum())
        state.documents = DocumentUsage(plan.cached_tokens, recomputed, state.documents.document_ids)
        state.timeline.blend = (m0, time.monotonic())
        log.info("blended %d cached of %d prompt tokens (%d recomputed) in %.0f ms", plan.cached_tokens,
                 seq.num_prompt_tokens, recomputed, 1e3 * (time.perf_counter() - t0))

    def _gate_step(self) -> tuple[int, bool] | None:
        """(batch, whether ADAPTIVE requests may draft) for a pure decode step that has ADAPTIVE
        requests in it, from the SpecGate; None for any other step (it is not measured)."""
        if self.drafts is None or self.scheduler.waiting:
            return None
        running = self.scheduler.running
        if not running or any(s.num_tokens - s.num_computed_tokens != 1 for s in running):
            return None
        if not any(self._states[s.request_id].spec_mode is SpecMode.ADAPTIVE for s in running):
            return None
        return len(running), self.gate.allow(len(running))

    def _propose(self, gated: tuple[int, bool] | None) -> dict[Sequence, list[int]]:
        """Drafts for every running decode that speculates and may still emit 2+ tokens (at
        most that many less one, so an accepted run never passes max_tokens): one Propose
        call, answered within the client's deadline or not at all. ADAPTIVE requests draft
        only when the SpecGate allows this step."""
        if not self.drafts.available:
            return {}
        adaptive_off = gated is not None and not gated[1]
        candidates = []
        for seq in self.scheduler.running:
            state = self._states[seq.request_id]
            if (state.spec_mode is SpecMode.OFF or not seq.output_token_ids
                    or seq.num_tokens - seq.num_computed_tokens != 1
                    or (adaptive_off and state.spec_mode is SpecMode.ADAPTIVE)):
                continue
            if seq.params.max_tokens - seq.num_output_tokens > 1:
                candidates.append((seq, state.spec_mode))
        per_seq = self.spec_config.draft_tokens(len(candidates))
        if not candidates or per_seq == 0:
            return {}
        queries = [DraftQuery(seq, min(per_seq, seq.params.max_tokens - seq.num_output_tokens - 1), mode)
                   for seq, mode in candidates]
        # The Propose call (one for the batch) becomes a span of the first speculating request.
        token = otel_context.attach(self._states[queries[0].seq.request_id].trace_context or otel_context.Context())
        try:
            return self.drafts.propose(queries)
        finally:
            otel_context.detach(token)

    def _accept(self, rows: DraftLogits, verdict: Verdict) -> RequestOutput:
        """Emits a verified run token by token (a stop cuts it), then keeps the accepted drafts'
        KV and drops the rejected ones'."""
        seq = rows.seq
        state = self._states[seq.request_id]
        tokens = verdict.token_ids
        lps = []
        if seq.params.logprobs is not None:
            lps = token_logprobs(rows.logits[:len(tokens)], tokens, [seq.params.logprobs] * len(tokens))
        out = self._emit(state, tokens, lps)
        accepted = min(verdict.num_accepted, len(out.token_ids))
        if len(state.timeline.spec_steps) < SPEC_EVENTS:
            state.timeline.spec_steps.append((time.monotonic(), len(rows.draft_token_ids), accepted))
        for usage in (state.spec, self.spec_totals):
            usage.steps += 1
            usage.draft_tokens += len(rows.draft_token_ids)
            usage.accepted_tokens += accepted
        if not out.finished:
            self.scheduler.accept_drafts(seq, verdict.num_accepted)
            self.drafts.accepted(seq.request_id, verdict.num_accepted)
        return out

    @staticmethod
    def _collect_prompt_logprobs(state: _State, chunk: PromptLogprobsChunk) -> None:
        """Appends a chunk's prompt logprobs (a recompute after preemption starts over at 0)."""
        collected = state.prompt_logprobs
        if chunk.start > len(collected):
            raise RuntimeError(f"prompt logprobs of {state.seq.request_id!r} skip positions "
                               f"{len(collected)}..{chunk.start - 1}: part of its prompt was not computed")
        del collected[chunk.start:]
        collected.extend(chunk.entries)

    def _export_new_chunks(self, out) -> None:
        """Hands the KV of a just-computed prompt's missing full chunks to the exporter (a copy:
        the blocks may be freed or reused before the export thread gets to it)."""
        chunk = self.kv.config.chunk_tokens
        for item in out.scheduled:
            state = self._states.get(item.seq.request_id)
            if state is None or (state.kv_plan is None and state.doc_exports is None):
                continue
            seq, plan = state.seq, state.kv_plan
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                continue  # prefill still running
            if state.doc_exports is not None:
                self._export_documents(state)
            if plan is None:
                continue
            state.kv_plan = None
            first = plan.present.index(False)
            start, end = first * chunk, len(plan.keys) * chunk
            k, v = self.runner.read_kv(seq, start, end)  # [layers, end-start, kvh, hd]
            self.kv.submit_export(ExportJob(plan.namespace, plan.keys[first:], seq.prompt_token_ids[start:end],
                                            start, k, v, plan.spec, trace_context=state.trace_context))

    def _export_documents(self, state: _State) -> None:
        """Hands the KV of the prompt's document chunks the service lacked to the exporter, one
        job per chunk (keys un-rotated from their prompt positions, stored by content key)."""
        exports, state.doc_exports = state.doc_exports, None
        seq = state.seq
        pending = len(exports.chunks)
        results: list[bool] = []

        def done(ok: bool) -> None:  # on the export thread, or here when a job is dropped
            results.append(ok)
            if len(results) == pending and exports.on_done is not None:
                exports.on_done(all(results))

        if not pending and exports.on_done is not None:
            exports.on_done(True)
        for key, a, b in exports.chunks:
            k, v = self.runner.read_kv(seq, a, b)
            self.kv.submit_export(ExportJob(exports.namespace, [key], seq.prompt_token_ids[a:b], a, k, v,
                                            state.kv_spec, on_done=done, trace_context=state.trace_context))

    def _emit(self, state: _State, tokens: list[int], logprobs: list[TokenLogprobs]) -> RequestOutput:
        """Appends `tokens` (with their logprobs, if asked for) to the sequence one by one, each
        through the stop checks; the first stop finishes the request and drops the rest."""
        seq = state.seq
        if state.first_token_time is None:
            state.first_token_time = state.timeline.first_token = time.monotonic()
        out = RequestOutput(request_id=seq.request_id)
        if seq.needs_prompt_logprobs:  # the first token: the prompt is computed, deliver them once
            out.prompt_logprobs, state.prompt_logprobs = state.prompt_logprobs, []
            seq.needs_prompt_logprobs = False
        for i, token in enumerate(tokens):
            seq.append_token(token)
            out.token_ids.append(token)
            out.logprobs += logprobs[i:i + 1]
            reason = check_stop(seq, token, self.eos_token_ids)
            # Stop/eos tokens end the request but are not part of the text.
            text_piece = "" if reason == "stop" else state.detok.step([token])
            emit, hit = state.matcher.feed(text_piece)
            out.text += emit
            if hit is not None:
                return self._finish(state, out, "stop_string", hit)
            if reason is not None:
                tail = state.detok.flush() if reason != "stop" else ""
                emit_tail, hit = state.matcher.feed(tail)
                if hit is not None:
                    out.text += emit_tail
                    return self._finish(state, out, "stop_string", hit)
                out.text += emit_tail + state.matcher.flush()
                stop_reason = str(token) if reason == "stop" else ""
                return self._finish(state, out, reason, stop_reason)
        return out

    def _finish(self, state: _State, out: RequestOutput, reason: str, stop_reason: str) -> RequestOutput:
        self.scheduler.finish(state.seq, reason)
        self._states.pop(state.seq.request_id, None)
        if self.drafts is not None:
            self.drafts.release(state.seq.request_id)
        final = self._final(state, reason, stop_reason)
        final.token_ids, final.text, final.logprobs = out.token_ids, out.text, out.logprobs
        final.prompt_logprobs = out.prompt_logprobs
        return final

    def _final(self, state: _State, reason: str, stop_reason: str) -> RequestOutput:
        seq = state.seq
        now = time.monotonic()
        ttft = (state.first_token_time or now) - seq.arrival_time
        return RequestOutput(
            request_id=seq.request_id, finished=True, finish_reason=reason,
            stop_reason=stop_reason,
            usage=Usage(prompt_tokens=seq.num_prompt_tokens,
                        completion_tokens=len(seq.output_token_ids),
                        cached_prompt_tokens=seq.num_cached_tokens),
            ttft_s=ttft, e2e_s=now - seq.arrival_time, spec=state.spec, documents=state.documents,
            timeline=dataclasses.replace(state.timeline, finished=now))
