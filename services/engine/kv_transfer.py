"""KV transfer as an engine component: fetched KV into a request's sequence, and the KV of newly
computed chunks out to the KV-cache service (the fetch itself runs on the asyncio side, in
services/engine/prepare.py; encoding and Puts on the connector's export thread).

Hooks, called by EngineCore on the step-loop thread:
  * `add` / `release`  a request with a KvPlan or DocumentExports enters / leaves;
  * `after_step`       once a prompt is fully computed, its new full chunks are copied out of the
                       paged cache and handed to the exporter (never waited on).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from opentelemetry.context import Context

from kvmesh.services.engine.documents import DocumentExports
from kvmesh.services.engine.kv_connector import ExportJob, KvConnector, KvPlan
from kvmesh.services.engine.scheduler import SchedulerOutput
from kvmesh.services.engine.sequence import Sequence

ReadKv = Callable[[Sequence, int, int], tuple[torch.Tensor, torch.Tensor]]
"""ModelRunner.read_kv: a copy of seq's KV at positions [start, end), [layers, n, kvh, hd] each."""


@dataclass
class _Request:
    seq: Sequence
    plan: Optional[KvPlan]  # set until the prompt's new chunks are exported
    doc_exports: Optional[DocumentExports]  # likewise for document chunks
    trace_context: Optional[Context]


class KvTransfer:
    """Moves one engine's KV in from fetched plans and out to the KV service."""

    def __init__(self, connector: KvConnector, read_kv: ReadKv) -> None:
        self.connector = connector
        self.read_kv = read_kv
        self._requests: dict[str, _Request] = {}

    def add(self, seq: Sequence, plan: Optional[KvPlan], doc_exports: Optional[DocumentExports],
            trace_context: Optional[Context]) -> None:
        """Hands the plan's fetched KV to the sequence (imported at admission) and remembers what
        to export once the prompt is computed."""
        if plan is not None and plan.kv is not None:
            seq.external_kv, seq.external_start, seq.external_tokens = plan.kv, plan.start, plan.tokens
            plan.kv = None  # the sequence holds it until import
        if plan is not None and all(plan.present):
            plan = None  # the service holds every chunk: nothing to export
        if plan is not None or doc_exports is not None:
            self._requests[seq.request_id] = _Request(seq, plan, doc_exports, trace_context)

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def after_step(self, out: SchedulerOutput) -> None:
        """Exports the KV of each just-computed prompt's missing full chunks and documents (a
        copy: the blocks may be freed or reused before the export thread gets to it)."""
        chunk = self.connector.config.chunk_tokens
        for item in out.scheduled:
            req = self._requests.get(item.seq.request_id)
            if req is None or req.seq.num_computed_tokens < req.seq.num_prompt_tokens:
                continue  # nothing to export, or prefill still running
            del self._requests[item.seq.request_id]
            seq, plan = req.seq, req.plan
            if req.doc_exports is not None:
                self._export_documents(seq, req.doc_exports, req.trace_context)
            if plan is None:
                continue
            first = plan.present.index(False)
            start, end = first * chunk, len(plan.keys) * chunk
            k, v = self.read_kv(seq, start, end)  # [layers, end-start, kvh, hd]
            # Exact prefix chunks keep their keys as computed: a prefix chunk never moves, and
            # un-rotating then rotating again would not give the same bits back.
            self.connector.submit_export(ExportJob(plan.namespace, plan.keys[first:], seq.prompt_token_ids[start:end],
                                                   start, k, v, plan.spec, positioned=plan.namespace.is_exact,
                                                   trace_context=req.trace_context))

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
            k, v = self.read_kv(seq, a, b)
            self.connector.submit_export(ExportJob(exports.namespace, [key], seq.prompt_token_ids[a:b], a, k, v,
                                                   exports.spec, on_done=done, trace_context=trace_context))
