"""KV transfer as an engine component: fetched KV into a request's sequence, and the KV of newly
computed chunks out to the KV-cache service (the fetch itself runs on the asyncio side, in
services/engine/prepare.py; encoding and Puts on the connector's export thread).

Hooks, called by EngineCore on the step-loop thread:
  * `add` / `release`  a request with a KvPlan or DocumentExports enters / leaves;
  * `after_step`       once a prompt is fully computed, its new full chunks are copied out of the
                       paged cache and handed to the exporter (never waited on by the step loop).
                       A P/D prefill hop (a request with a Handoff) exports chunk by chunk instead,
                       each full chunk as soon as the prefill has computed it, so the Puts overlap
                       with the prefill of the chunks after it; its Handoff hears when every chunk
                       is stored, which the gRPC edge waits for before the final message (the
                       router starts the decode hop on that message).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from opentelemetry.context import Context

from kvmesh.services.engine.documents import DocumentExports
from kvmesh.services.engine.kv_connector import ExportJob, KvConnector, KvPlan
from kvmesh.services.engine.scheduler import SchedulerOutput
from kvmesh.services.engine.sequence import Sequence

ReadKv = Callable[[Sequence, int, int], tuple[torch.Tensor, torch.Tensor, Optional[Callable[[], None]]]]
"""ModelRunner.read_kv_to_host: a host copy of seq's KV at positions [start, end), [layers, n, kvh,
hd] each, and a wait() for the copy (None when it is complete; services/engine/kv_copies.py)."""
Stage = Callable[[tuple[torch.Tensor, torch.Tensor]], object]
"""ModelRunner.stage_kv: starts copying a fetched payload to the engine's device."""


@dataclass
class HandoffResult:
    """What a P/D prefill hop stored for its decode hop."""

    ok: bool
    """Every chunk it tried to store was stored (False: the decode hop computes the rest)."""
    tokens: int
    """Prompt tokens whose KV the KV-cache service holds for the decode hop (whole chunks)."""
    bytes: int
    """Bytes this engine Put (chunks the service already held cost nothing)."""
    wait_s: float
    """From the prompt's last computed token to the last chunk stored: what the hop adds to the
    prefill (the Puts of earlier chunks overlapped with it)."""


class Handoff:
    """A P/D prefill hop's export, as one result the request's edge can await.

    Chunk jobs are counted on the step-loop thread, their completions arrive on the export thread;
    once the prompt is computed (`seal`) and every job has answered, `on_result` is called (on the
    export thread, or the step loop's when nothing was pending)."""

    def __init__(self, on_result: Callable[[HandoffResult], None], clock: Callable[[], float] = time.monotonic):
        self._on_result = on_result
        self._clock = clock
        self._lock = threading.Lock()
        self._pending = 0
        self._sealed_at: Optional[float] = None
        self._ok = True
        self._tokens = 0
        self._bytes = 0
        self._held = 0  # tokens the service held already (never exported)
        self._reported = False

    def hold(self, tokens: int) -> None:
        """Chunks the service already holds (present at lookup): counted as handed off."""
        with self._lock:
            self._held += tokens

    def job(self, tokens: int) -> tuple[Callable[[bool], None], Callable[[int], None]]:
        """Registers one export job of `tokens`; returns its on_done and on_stored callbacks."""
        with self._lock:
            self._pending += 1

        def done(ok: bool) -> None:
            with self._lock:  # jobs answer in order (one export thread): count the stored prefix
                self._pending -= 1
                self._ok = self._ok and ok
                if self._ok:
                    self._tokens += tokens
            self._maybe_report()

        def stored(nbytes: int) -> None:
            with self._lock:
                self._bytes += nbytes

        return done, stored

    def fail(self) -> None:
        """Nothing (more) will be exported: the request ended early, or has no KV service."""
        with self._lock:
            self._ok = False
        self.seal()

    def seal(self) -> None:
        """Every job is registered (the prompt is computed)."""
        with self._lock:
            if self._sealed_at is None:
                self._sealed_at = self._clock()
        self._maybe_report()

    def _maybe_report(self) -> None:
        with self._lock:
            if self._reported or self._sealed_at is None or self._pending:
                return
            self._reported = True
            result = HandoffResult(self._ok, self._held + self._tokens, self._bytes,
                                   self._clock() - self._sealed_at)
        self._on_result(result)


@dataclass
class _Request:
    seq: Sequence
    plan: Optional[KvPlan]  # set until the prompt's new chunks are exported
    doc_exports: Optional[DocumentExports]  # likewise for document chunks
    trace_context: Optional[Context]
    handoff: Optional[Handoff] = None
    next_chunk: int = 0  # a handoff's first chunk not yet exported


class KvTransfer:
    """Moves one engine's KV in from fetched plans and out to the KV service."""

    def __init__(self, connector: KvConnector, read_kv: ReadKv, stage: Optional[Stage] = None) -> None:
        self.connector = connector
        self.read_kv = read_kv
        self.stage = stage
        self._requests: dict[str, _Request] = {}

    def add(self, seq: Sequence, plan: Optional[KvPlan], doc_exports: Optional[DocumentExports],
            trace_context: Optional[Context]) -> None:
        """Hands the plan's fetched KV to the sequence (imported at admission) and remembers what
        to export once the prompt is computed (a handoff's: as its chunks are computed)."""
        if plan is not None and plan.kv is not None:
            kv = plan.kv if self.stage is None else self.stage(plan.kv)  # on CUDA: copying from now on
            seq.external_kv, seq.external_start, seq.external_tokens = kv, plan.start, plan.tokens
            plan.kv = None  # the sequence holds it until import
        handoff = plan.handoff if plan is not None else None
        chunk = self.connector.config.chunk_tokens
        if plan is not None and all(plan.present) and handoff is None:
            plan = None  # the service holds every chunk: nothing to export
        if plan is not None or doc_exports is not None:
            first = plan.present.index(False) if plan is not None and not all(plan.present) else \
                len(plan.keys) if plan is not None else 0
            if handoff is not None:
                handoff.hold(first * chunk)
            self._requests[seq.request_id] = _Request(seq, plan, doc_exports, trace_context, handoff, first)

    def release(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None and req.handoff is not None:
            req.handoff.fail()  # ended before its prompt was computed: nothing more is coming

    def after_step(self, out: SchedulerOutput) -> None:
        """Exports the KV of each just-computed prompt's missing full chunks and documents (a
        copy: the blocks may be freed or reused before the export thread gets to it); a handoff's
        chunks as soon as each is computed."""
        chunk = self.connector.config.chunk_tokens
        for item in out.scheduled:
            req = self._requests.get(item.seq.request_id)
            if req is None:
                continue
            if req.handoff is not None:
                self._export_computed(req, chunk)
            if req.seq.num_computed_tokens < req.seq.num_prompt_tokens:
                continue  # prefill still running
            del self._requests[item.seq.request_id]
            seq, plan = req.seq, req.plan
            if req.doc_exports is not None:
                self._export_documents(seq, req.doc_exports, req.trace_context)
            if req.handoff is not None:
                self._export_tail(req, chunk)
                req.handoff.seal()
                continue
            if plan is None:
                continue
            first = plan.present.index(False)
            start, end = first * chunk, len(plan.keys) * chunk
            k, v, ready = self.read_kv(seq, start, end)  # [layers, end-start, kvh, hd]
            # Exact prefix chunks keep their keys as computed: a prefix chunk never moves, and
            # un-rotating then rotating again would not give the same bits back.
            self.connector.submit_export(ExportJob(plan.namespace, plan.keys[first:], seq.prompt_token_ids[start:end],
                                                   start, k, v, plan.spec, positioned=plan.namespace.is_exact,
                                                   trace_context=req.trace_context, ready=ready))

    def _export_computed(self, req: _Request, chunk: int) -> None:
        """A handoff's full chunks computed since the last step, one job each (in order)."""
        seq, plan, handoff = req.seq, req.plan, req.handoff
        computed = min(seq.num_computed_tokens, seq.num_prompt_tokens) // chunk
        for i in range(req.next_chunk, min(computed, len(plan.keys))):
            start, end = i * chunk, (i + 1) * chunk
            k, v, ready = self.read_kv(seq, start, end)
            on_done, on_stored = handoff.job(chunk)
            self.connector.submit_export(ExportJob(plan.namespace, [plan.keys[i]], seq.prompt_token_ids[start:end],
                                                   start, k, v, plan.spec, positioned=plan.namespace.is_exact,
                                                   on_done=on_done, trace_context=req.trace_context,
                                                   on_stored=on_stored, urgent=True, ready=ready))
            req.next_chunk = i + 1

    def _export_tail(self, req: _Request, chunk: int) -> None:
        """A handoff's trailing partial chunk (its own key, kvmesh.kv.keys.tail_key): with it the
        decode engine computes only the prompt's last block, not up to a chunk of it."""
        seq, plan, handoff = req.seq, req.plan, req.handoff
        if plan.tail_key is None or req.next_chunk < len(plan.keys):
            return  # no tail, or a full chunk before it was not exported: a lookup would not reach the tail
        start, end = len(plan.keys) * chunk, seq.num_prompt_tokens
        if plan.tail_present:
            handoff.hold(end - start)
            return
        k, v, ready = self.read_kv(seq, start, end)
        on_done, on_stored = handoff.job(end - start)
        self.connector.submit_export(ExportJob(plan.namespace, [plan.tail_key], seq.prompt_token_ids[start:end], start,
                                               k, v, plan.spec, positioned=plan.namespace.is_exact, on_done=on_done,
                                               trace_context=req.trace_context, on_stored=on_stored, urgent=True,
                                               ready=ready))

    def _export_documents(self, seq: Sequence, exports: DocumentExports, trace_context: Optional[Context]) -> None:
        """One job per document chunk the service lacked (keys un-rotated from their prompt
        positions, stored by content key); `exports.on_done` hears once about all of them."""
        pending = len(exports.chunks)
        results: list[bool] = []

        def done(ok: bool) -> None:  # on the export thread, or here when a job is dropped
            results.append(ok)
            if len(results) == pending and exports.on_done is not None:
                exports.on_done(all(results))

        if not pending and exports.on_done is not None:
            exports.on_done(True)
        for key, a, b in exports.chunks:
            k, v, ready = self.read_kv(seq, a, b)
            self.connector.submit_export(ExportJob(exports.namespace, [key], seq.prompt_token_ids[a:b], a, k, v,
                                                   exports.spec, on_done=done, trace_context=trace_context,
                                                   urgent=exports.urgent, ready=ready))
