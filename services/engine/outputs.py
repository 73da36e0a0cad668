"""The engine's typed values at its seams: the prepared request the core accepts, what a step
emits per request, and the load and probe answers a router reads. Plain dataclasses: every
component passes these, never each other's internals."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from opentelemetry.context import Context

from kvmesh.kv.namespace import EXACT, KvNamespace
from kvmesh.services.engine.documents import BlendPlan, DocumentExports
from kvmesh.services.engine.kv_connector import KvPlan
from kvmesh.services.engine.sampler import TokenLogprobs
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.sequence import FinishReason
from kvmesh.services.engine.speculation import SpecMode, SpecUsage

if TYPE_CHECKING:
    from kvmesh.services.engine.guardrail import GuardTicket


@dataclass(frozen=True)
class EngineRequest:
    """A validated, prepared request, as the core accepts it (services/engine/prepare.py makes
    them; tests build them directly)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    namespace: Optional[KvNamespace] = None
    """Namespace of every KV the request reads or writes (tenant and storage format included);
    None = the engine's own, exact, for the default tenant."""
    kv_plan: Optional[KvPlan] = None
    """What the KV-cache service held for this prompt (fetched before queuing), if it is used."""
    speculation: Optional[SpecMode] = None
    """Speculative decoding for this request; None = the engine's default."""
    blend: Optional[BlendPlan] = None
    """Cached document KV to blend in before the prompt is computed (services/engine/blending)."""
    doc_exports: Optional[DocumentExports] = None
    """Document chunks to store by content key once the prompt is computed."""
    document_ids: tuple[str, ...] = ()
    """Catalogued documents the prompt holds (reported in the final output)."""
    trace_context: Optional[Context] = None
    """The request's OpenTelemetry context: the step loop's calls for it (drafts, KV stores)
    become spans of its trace."""
    guard: Optional[GuardTicket] = None
    """Set when the guardrail shadow-checks this request (services/engine/guardrail.py)."""
    fallback: str = ""
    """The lossy path the request opted into and was not served, and why (its reuse is exact)."""
    resume_token_ids: tuple[int, ...] = ()
    """Request migration: the output another engine already generated and streamed. The core
    starts the request with them as its output (see EngineCore.add_request)."""


@dataclass(frozen=True)
class DocumentUsage:
    """What a prompt with documents reused: tokens whose KV came from cached documents, how many
    of them were recomputed, and the catalogued documents it held."""

    blended_tokens: int = 0
    recomputed_tokens: int = 0
    document_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    """Prompt tokens reused instead of computed: the engine's prefix cache and imported KV."""
    imported_prompt_tokens: int = 0
    """Of those, the tokens whose KV came from the KV-cache service (or a blend)."""


SPEC_EVENTS = 256
"""Verification steps recorded per request in its Timeline (the trace's spec_verify events)."""


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


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens/text, and the summary when finished."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    """With SamplingParams.prompt_logprobs, on the request's first output only: one TokenLogprobs
    per prompt token from the second on."""
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    stop_reason: str = ""
    usage: Optional[Usage] = None
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    reuse_storage: str = EXACT
    """Final output only: how the reused KV was stored (KvNamespace.storage of the request):
    "exact", a lossy codec's name, or the blend that made it."""
    reuse_fallback: str = ""
    """Final output only: EngineRequest.fallback (a lossy path asked for and not served, and why)."""
    guard: Optional[GuardTicket] = None
    """Final output only: EngineRequest.guard (the request was sampled for a shadow check)."""
    spec: Optional[SpecUsage] = None
    """Final output only: the request's speculative decoding counters."""
    documents: Optional[DocumentUsage] = None
    """Final output only, for prompts with documents."""
    timeline: Optional[Timeline] = None
    """Final output only: when the request moved through the engine (for its trace)."""


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
