"""Blending as an engine component: cached document KV blended into a prompt before the step that
computes the rest of it (the whole flow is the NOTE in services/engine/documents.py).

Hooks, called by EngineCore on the step-loop thread:
  * `add` / `release`     a request with a BlendPlan (or catalogued documents) enters / leaves;
  * `before_schedule`     the request at the head of the queue is blended: the result waits on
                          its sequence as imported KV, which admission writes into its blocks;
  * `probe`               a blend's first stage, posted by the asyncio side while the documents'
                          KV is still being fetched (AsyncEngine's BlendProbe message).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Optional

from kvmesh.kv.blend import DEFAULT_SELECTION, BlendPrefill, blend_prefill
from kvmesh.kv.namespace import KvNamespace
from kvmesh.model.config import ModelConfig
from kvmesh.model.llama import LlamaForCausalLM
from kvmesh.services.engine.documents import BlendPlan
from kvmesh.services.engine.outputs import DocumentUsage, Timeline
from kvmesh.services.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlendConfig:
    """How the engine blends cached document KV (kvmesh.kv.blend)."""

    recompute_ratio: float = 1.0
    """Share of reused document tokens recomputed, for requests that set none: 1 (the default)
    computes documents in place (exact; no blending), below 1 the deployment opts every prompt
    with documents into blending (lossy)."""
    select_layers: int = 2
    """Leading layers run over every token to choose which to recompute."""
    selection: str = DEFAULT_SELECTION
    """kvmesh.kv.blend.SELECTIONS: how the recomputed tokens are chosen."""

    def namespace(self, base: KvNamespace, recompute_ratio: float) -> KvNamespace:
        """The namespace of KV blended this way from documents stored in `base`: blended KV is
        not what a full prefill gives, so its blocks only ever match the same prompt blended
        with the same settings from the same stored format."""
        return base.with_storage(f"blend:{base.storage}:{recompute_ratio:.4f}:{self.select_layers}:{self.selection}")

    def for_model(self, num_layers: int) -> BlendConfig:
        """These settings on a `num_layers`-layer model: select_layers capped at num_layers - 1
        (kvmesh.kv.blend needs at least one layer after the probe), so a shallower model than the
        default's runs with what it has. Every user of a BlendConfig on a model derives it here."""
        return dataclasses.replace(self, select_layers=min(self.select_layers, max(1, num_layers - 1)))


def attention_window(config: ModelConfig) -> Optional[int]:
    """The narrowest sliding attention window among the model's layers; None when every layer
    attends to the whole sequence. kvmesh.kv.blend (and the guardrail's dense recomputes, see
    shadow.py) attend fully: on such a model they compute what the model computes only for
    sequences of at most this many tokens."""
    windows = [w for w in (config.window_of(layer) for layer in range(config.num_layers)) if w is not None]
    return min(windows) if windows else None


@dataclass
class _Request:
    plan: Optional[BlendPlan]  # None once blended
    usage: DocumentUsage
    timeline: Timeline


class Blender:
    """Runs each request's blend when it reaches the head of the queue."""

    def __init__(self, model: LlamaForCausalLM, scheduler: Scheduler, config: BlendConfig = BlendConfig()) -> None:
        self.model = model
        self.scheduler = scheduler
        self.config = config.for_model(model.config.num_layers)
        self.window = attention_window(model.config)
        """The model's narrowest sliding window (None: full attention): see `refusal`."""
        self._requests: dict[str, _Request] = {}

    def add(self, request_id: str, plan: Optional[BlendPlan], document_ids: tuple[str, ...],
            timeline: Timeline) -> None:
        self._requests[request_id] = _Request(plan, DocumentUsage(document_ids=document_ids), timeline)

    def usage(self, request_id: str) -> Optional[DocumentUsage]:
        req = self._requests.get(request_id)
        return req.usage if req is not None else None

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def refusal(self, prompt_tokens: int) -> str:
        """Why a prompt of `prompt_tokens` tokens cannot be blended on this model ("" when it can).
        Blending's selective recompute attends to every earlier token, a sliding-window layer
        only to the last `window`: past the window the blend would compute another model's KV,
        so the request computes its documents instead (exact)."""
        if self.window is None or prompt_tokens <= self.window:
            return ""
        return (f"the model attends through a sliding window of {self.window} tokens and blending attends "
                f"fully, so a {prompt_tokens}-token prompt is computed exactly")

    def new_job(self, token_ids: list[int]) -> BlendPrefill:
        """A blend for `token_ids` whose first stage (`probe`) may run before its KV is here."""
        return BlendPrefill(self.model, token_ids, self.config.select_layers, self.config.selection)

    @staticmethod
    def probe(job: BlendPrefill) -> None:
        """Runs a blend's first stage (a failure is reported again by its `finish`)."""
        try:
            job.probe()
        except Exception:  # noqa: BLE001 - finish() probes again and raises there
            log.exception("blend probe failed")

    def before_schedule(self) -> None:
        """Blends the cached document KV of the request at the head of the queue: the result
        waits on the sequence as imported KV, up to the last whole block before its last prompt
        token, which the step computes."""
        if not self.scheduler.waiting:
            return
        seq = self.scheduler.waiting[0]
        req = self._requests.get(seq.request_id)
        if req is None or req.plan is None:
            return
        plan, req.plan = req.plan, None
        t0, m0 = time.perf_counter(), time.monotonic()
        if plan.job is not None:  # its probe stage ran while the KV was being fetched
            res = plan.job.finish(plan.segments, plan.recompute_ratio)
        else:
            res = blend_prefill(self.model, plan.segments, plan.recompute_ratio,
                                self.config.select_layers, self.config.selection)
        bs = self.scheduler.config.block_size
        n = (seq.num_prompt_tokens - 1) // bs * bs
        if n:
            seq.external_kv, seq.external_start, seq.external_tokens = (res.k[:, :n], res.v[:, :n]), 0, n
        recomputed = int((~res.deviation.isnan())[res.recomputed].sum())
        req.usage = DocumentUsage(plan.cached_tokens, recomputed, req.usage.document_ids)
        req.timeline.blend = (m0, time.monotonic())
        log.info("blended %d cached of %d prompt tokens (%d recomputed) in %.0f ms", plan.cached_tokens,
                 seq.num_prompt_tokens, recomputed, 1e3 * (time.perf_counter() - t0))
