"""Request preparation (asyncio side): from what an edge asked for to the EngineRequest the step
loop runs -- validated once, its KV namespace derived, its documents resolved and planned, its
cached prefix fetched. Nothing here fails a request for an optional part: a KV service that does
not answer means computing (see kv_connector's NOTE).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional

from opentelemetry import context as otel_context
from opentelemetry import trace

from kvmesh.errors import InvalidArgument
from kvmesh.kv import codec
from kvmesh.kv.blend import BlendPrefill
from kvmesh.kv.namespace import EXACT
from kvmesh.kv.quality import QualityBudget
from kvmesh.prompt_parts import Part
from kvmesh.services.engine.core import EngineCore
from kvmesh.services.engine.documents import DocumentExports, check_parts, plan_documents, resolve
from kvmesh.services.engine.guardrail import GuardTicket, LossyPath
from kvmesh.services.engine.kv_connector import KvPlan
from kvmesh.services.engine.kv_transfer import Handoff
from kvmesh.services.engine.outputs import EngineRequest
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.speculation import SpecMode
from kvmesh.telemetry import tracer


@dataclass(frozen=True)
class GenerateInput:
    """A generation request as an edge (the gRPC servicer, a test, ingest) hands it over."""

    prompt_token_ids: Optional[list[int]]
    """The prompt, or None when it comes as `parts`."""
    params: SamplingParams
    request_id: str = ""
    tenant_salt: str = ""
    """kvmesh.kv.namespace.tenant_salt of the caller's tenant (the gateway sets it)."""
    kv_codec: Optional[codec.CodecSpec] = None
    """Codec of the chunks this request stores (and the storage of those it reuses); None =
    the deployment's."""
    speculation: Optional[SpecMode] = None
    parts: Optional[list[Part]] = None
    """Prompt parts marking documents (services/engine/documents.py), instead of token ids."""
    recompute_ratio: Optional[float] = None
    """Blending: share of reused document tokens recomputed (below 1 opts into blending, a lossy
    path); None = the engine's --blend-recompute-ratio (1 by default: exact)."""
    quality_budget: QualityBudget = QualityBudget()
    """For a lossy path (a lossy kv_codec, recompute_ratio < 1): the quality the request accepts;
    undeclared fields take the engine's --quality-max-kl / --quality-min-top1."""
    doc_exports: Optional[DocumentExports] = None
    """Ingest: the document alone, its chunks stored by content key only."""
    resume_token_ids: tuple[int, ...] = ()
    """Request migration: output tokens another engine generated (and its client received);
    this engine continues after them."""
    kv_handoff: Optional[Handoff] = None
    """A P/D prefill hop (GenerateRequest.kv_handoff): the prompt's full chunks are stored in the
    KV-cache service as they are computed, and this hears when they are (failed at once when the
    prompt cannot be handed off: no KV service, no full chunk, documents)."""


class RequestPreparer:
    """Turns GenerateInputs into EngineRequests for one engine core."""

    def __init__(self, core: EngineCore, start_probe: Callable[[list[int]], BlendPrefill]) -> None:
        self.core = core
        self.start_probe = start_probe
        """Starts a blend's first stage on the step loop while the documents' KV is fetched."""

    def check(self, inp: GenerateInput) -> None:
        """InvalidArgument for what can be checked before anything is fetched."""
        if inp.recompute_ratio is not None and not 0.0 <= inp.recompute_ratio <= 1.0:
            raise InvalidArgument(f"blend.recompute_ratio must be in [0, 1] (0 = pure reuse, 1 = full prefill), "
                                  f"got {inp.recompute_ratio}")
        if inp.resume_token_ids:
            self._check_resume(inp)
        if inp.parts is not None:
            check_parts(inp.parts)
        elif inp.prompt_token_ids is not None:
            self.core.validate(inp.prompt_token_ids, inp.params)
        else:
            raise InvalidArgument("a request needs a prompt: token ids or parts")

    async def prepare(self, inp: GenerateInput, request_id: str, arrival: float) -> EngineRequest:
        """Resolves, plans and fetches (see the module docstring); `check` must have passed.

        Lossy paths are served only by contract: the request (or its tenant, or the deployment)
        opted in, and the guardrail's estimate of the path is within the request's budget; else
        the request falls back to exact reuse (codec) or computes its documents (blend), and
        EngineRequest.fallback says which path and why. A blend the model cannot compute (a
        prompt longer than its sliding window, see Blender.refusal) falls back the same way."""
        kv = self.core.kv
        fetch = inp.params.prompt_logprobs is None  # prompt logprobs: the whole prompt is computed
        budget = inp.quality_budget.over(self.core.quality_budget)
        spec, namespace = inp.kv_codec, self.core.request_namespace(inp.tenant_salt, inp.kv_codec)
        fallbacks: list[str] = []
        guard: Optional[GuardTicket] = None
        if kv is not None and fetch and namespace.storage != EXACT:  # a lossy codec
            spec = spec or kv.config.codec
            served, guard = self._admit(LossyPath(namespace, "codec", spec, None, budget), fallbacks)
            if not served:
                spec = dataclasses.replace(spec, name=codec.exact_codec(self.core.loaded.dtype))
                namespace = self.core.request_namespace(inp.tenant_salt, spec)
        fetch_span = tracer("kvmesh.engine").start_span("engine.kv_fetch") if kv is not None else None
        prompt, plan, blend, doc_exports, document_ids = inp.prompt_token_ids, None, None, inp.doc_exports, ()
        try:
            if inp.parts is not None:
                resolved = await resolve(inp.parts, kv, namespace)
                prompt, document_ids = resolved.token_ids, tuple(resolved.document_ids)
                self.core.validate(prompt, inp.params)
                if kv is not None and resolved.documents:
                    ratio = self.core.blender.config.recompute_ratio if inp.recompute_ratio is None \
                        else inp.recompute_ratio
                    if ratio < 1.0 and fetch:
                        blend_path = LossyPath(self.core.blender.config.namespace(namespace, ratio), "blend",
                                               None if namespace.storage == EXACT else spec, ratio, budget)
                        spans = tuple((d.start, d.end) for d in resolved.documents)
                        refusal = self.core.blender.refusal(len(prompt))
                        if refusal:  # not the guardrail's call: this model cannot blend this prompt
                            fallbacks.append(f"{blend_path.namespace.storage}: {refusal}")
                            ratio = 1.0
                        else:
                            served, ticket = self._admit(blend_path, fallbacks, spans)
                            guard = ticket or guard
                            if not served:
                                ratio = 1.0
                    with trace.use_span(fetch_span, end_on_exit=False):
                        blend, doc_exports = await plan_documents(resolved, kv, namespace, ratio if fetch else 1.0,
                                                                  self.start_probe, spec)
            if kv is not None and blend is None and inp.doc_exports is None:  # blended KV is not a prefix's
                local = self.core.cached_prefix_tokens(prompt, namespace) if fetch else 0
                with trace.use_span(fetch_span, end_on_exit=False):
                    plan = await kv.prepare(list(prompt), namespace, spec, local, fetch=fetch,
                                            tail=bool(inp.resume_token_ids) or inp.kv_handoff is not None)
        finally:
            if fetch_span is not None:
                fetch_span.set_attributes({"kvmesh.kv.fetched_tokens": _fetched(plan),
                                           "kvmesh.kv.document_tokens": blend.cached_tokens if blend else 0})
                fetch_span.end()
        if inp.kv_handoff is not None:
            if plan is None:
                inp.kv_handoff.fail()
            else:
                plan.handoff = inp.kv_handoff
        return EngineRequest(request_id, list(prompt), inp.params, arrival, namespace=namespace, kv_plan=plan,
                             speculation=inp.speculation, blend=blend, doc_exports=doc_exports,
                             document_ids=document_ids, trace_context=otel_context.get_current(),
                             guard=guard, fallback="; ".join(fallbacks), resume_token_ids=inp.resume_token_ids)

    def _check_resume(self, inp: GenerateInput) -> None:
        vocab = self.core.loaded.config.vocab_size
        bad = [t for t in inp.resume_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(f"resume_token_ids: token id {bad[0]} is outside the vocabulary (size {vocab}); "
                                  "send the token ids the interrupted stream carried")
        if len(inp.resume_token_ids) > inp.params.max_tokens:
            raise InvalidArgument(f"resume_token_ids: {len(inp.resume_token_ids)} tokens exceed max_tokens "
                                  f"({inp.params.max_tokens}); send the request's original max_tokens")
        if inp.params.prompt_logprobs is not None:
            raise InvalidArgument("resume_token_ids cannot be combined with prompt_logprobs (the interrupted "
                                  "stream delivered them); unset sampling.prompt_logprobs")

    def _admit(self, path: LossyPath, fallbacks: list[str],
               spans: tuple[tuple[int, int], ...] = ()) -> tuple[bool, Optional[GuardTicket]]:
        """Asks the guardrail whether `path` is served now; records the fallback reason if not."""
        guardrail = self.core.guardrail
        if guardrail is None:
            return True, None
        admission = guardrail.admit(path, spans)
        if not admission.serve:
            fallbacks.append(admission.fallback)
        return admission.serve, admission.ticket

    def codec(self, name: str, zstd: bool) -> codec.CodecSpec:
        """The deployment's codec settings with another codec name and zstd choice (a request's
        override); InvalidArgument for an unknown name."""
        base = self.core.kv.config.codec if self.core.kv is not None else codec.CodecSpec()
        if name not in codec.CODECS:
            raise InvalidArgument(f"unknown KV codec {name!r}; use one of {', '.join(codec.CODECS)}")
        return dataclasses.replace(base, name=name, zstd=zstd)


def _fetched(plan: Optional[KvPlan]) -> int:
    return plan.tokens - plan.start if plan is not None and plan.kv is not None else 0

