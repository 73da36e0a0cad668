"""The gateway's domain objects: one request shape for both front ends, and what a run yields.

The HTTP schema (`openai_schema`) and the gRPC servicer each translate their wire format into a
`GenerationRequest`; `validate_request` then checks it the same way for both, with messages that
name the offending OpenAI parameter. The ranges the engine enforces too come from
`kvmesh.limits`, so a request the gateway accepts is not refused later for one of them. This is
the gateway's one range check: the front ends check only what their own wire format can get wrong
(unsupported OpenAI knobs, conflicting fields), and the engine checks again at its own edge.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from kvmesh.grammar import Constraint
from kvmesh.limits import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_RETRIEVE_K,
    MAX_SEED,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPERATURE,
)
from kvmesh.kv.quality import LossyOptIn
from kvmesh.services.gateway.errors import invalid
from kvmesh.services.gateway.structured import ToolCallOutput

# OpenAI API rules that the engine does not share, so they are the gateway's alone.
MAX_COMPLETION_LOGPROBS = 5  # legacy completions' `logprobs` (chat's `top_logprobs`: MAX_LOGPROBS)
DEFAULT_COMPLETION_MAX_TOKENS = 16  # legacy completions' default max_tokens
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class Sampling:
    """Sampling and stopping, as the client asked (None = the default applies)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    """None: no log-probabilities; k: each token's log-probability plus its top-k alternatives."""
    ignore_eos: bool = False
    """Generate past end-of-sequence tokens, up to max_tokens (load tests: fixed output lengths)."""
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs."""
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int | None = None
    constraint: Constraint | None = None
    """Structured output (checked to compile by the front end that built it)."""


@dataclass(frozen=True)
class ChatTurn:
    """One chat message (text only)."""

    role: str
    content: str
    name: str | None = None
    tool_calls: tuple[dict[str, Any], ...] = ()
    """An assistant message's earlier tool calls, as chat templates take them: {"id", "type":
    "function", "function": {"name", "arguments": the arguments as an object}}."""
    tool_call_id: str | None = None
    """A tool message: the id of the call it answers."""


@dataclass(frozen=True)
class DocumentRef:
    """One document of a chat request: a catalog id or inline text (exactly one is set)."""

    id: str | None = None
    text: str | None = None


@dataclass(frozen=True)
class Retrieval:
    """Documents to retrieve from the catalog: the `top_k` nearest to `query` (None: the last
    user message's text)."""

    top_k: int
    query: str | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """A validated-shape request from either front end.

    Completions carry `prompts` (text or token ids, one choice group each); chat carries
    `messages`. `echo` (completions only) prepends the prompt to each choice, with the prompt's
    log-probabilities when `sampling.logprobs` is set. `documents`, `retrieve` and
    `recompute_ratio` (chat only, kvmesh extensions) mark documents placed before the last user
    message's content, so that the engine can reuse their cached KV.
    """

    kind: Kind
    model: str
    sampling: Sampling
    prompts: tuple[str | tuple[int, ...], ...] = ()
    messages: tuple[ChatTurn, ...] = ()
    n: int = 1
    echo: bool = False
    user: str = ""
    documents: tuple[DocumentRef, ...] = ()
    retrieve: Retrieval | None = None
    recompute_ratio: float | None = None
    lossy: LossyOptIn | None = None
    """The request's own opt-in to lossy reuse paths (the kvmesh extension), over its tenant's."""
    tool_calls: ToolCallOutput | None = None
    """Chat with tool_choice "required" or a named function: the output becomes tool calls."""
    tools: tuple[dict[str, Any], ...] = ()
    """Chat: the request's OpenAI tool objects, rendered into the prompt by the chat template."""

    @property
    def uses_documents(self) -> bool:
        """The prompt goes upstream in parts that mark documents."""
        return bool(self.documents) or self.retrieve is not None


@dataclass(frozen=True)
class Limits:
    """Request-shape limits from the gateway config."""

    max_n: int = 16
    max_batch_prompts: int = 32


def validate_request(req: GenerationRequest, limits: Limits) -> None:
    """Raise a 400 ApiError naming the parameter when `req` cannot be served as asked."""
    s = req.sampling
    if not req.model:
        raise invalid("you must provide a model parameter", "model", "missing_required_parameter")
    if req.kind == "chat" and not req.messages:
        raise invalid("messages must contain at least one message", "messages")
    if req.kind == "completion":
        if not req.prompts:
            raise invalid("prompt must not be empty", "prompt")
        if len(req.prompts) > limits.max_batch_prompts:
            raise invalid(f"at most {limits.max_batch_prompts} prompts per request, got "
                          f"{len(req.prompts)}; split the batch", "prompt")
    for i, turn in enumerate(req.messages):
        if turn.role not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role {turn.role!r} is not supported; use one of "
                          f"{', '.join(CHAT_ROLES)}", f"messages[{i}].role")
        if turn.role == "tool" and not turn.tool_call_id:
            raise invalid(f"messages[{i}] is a tool message without tool_call_id; send the id of "
                          "the tool call it answers", f"messages[{i}].tool_call_id",
                          "missing_required_parameter")
    if not 1 <= req.n <= limits.max_n:
        raise invalid(f"n must be in 1..{limits.max_n}, got {req.n}", "n")
    if s.max_tokens is not None and s.max_tokens < 1:
        raise invalid(f"max_tokens must be at least 1, got {s.max_tokens}", "max_tokens")
    if s.temperature is not None and (math.isnan(s.temperature)
                                      or not 0.0 <= s.temperature <= MAX_TEMPERATURE):
        raise invalid(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {s.temperature}",
                      "temperature")
    if s.top_p is not None and (math.isnan(s.top_p) or not 0.0 < s.top_p <= 1.0):
        raise invalid(f"top_p must be in (0, 1], got {s.top_p}", "top_p")
    if s.seed is not None and not 0 <= s.seed <= MAX_SEED - limits.max_n:
        raise invalid(f"seed must be in 0..{MAX_SEED - limits.max_n}, got {s.seed}", "seed")
    _validate_stop(s.stop)
    _validate_extras(s)
    if s.logprobs is not None:
        top = MAX_COMPLETION_LOGPROBS if req.kind == "completion" else MAX_LOGPROBS
        param = "logprobs" if req.kind == "completion" else "top_logprobs"
        if not 0 <= s.logprobs <= top:
            raise invalid(f"{param} must be in 0..{top}, got {s.logprobs}", param)
    if req.echo and req.kind != "completion":
        raise invalid("echo is only supported by completions", "echo")
    _validate_documents(req)


def _validate_extras(s: Sampling) -> None:
    """The penalties and vLLM's sampling extensions (their engine-side twins: SamplingParams)."""
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if value is not None and (not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY):
            raise invalid(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}", name)
    r = s.repetition_penalty
    if r is not None and (not math.isfinite(r) or r <= 0):
        raise invalid(f"repetition_penalty must be > 0 (1 disables it), got {r}", "repetition_penalty")
    if s.top_k is not None and s.top_k < -1:
        raise invalid(f"top_k must be -1 or 0 (both disable it) or positive, got {s.top_k}", "top_k")
    if s.min_p is not None and (math.isnan(s.min_p) or not 0.0 <= s.min_p <= 1.0):
        raise invalid(f"min_p must be in [0, 1], got {s.min_p}", "min_p")
    for token, bias in s.logit_bias:
        if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise invalid(f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                          f"{MAX_LOGIT_BIAS:g}], got {bias}", "logit_bias")
    if any(t < 0 or t >= 2**32 for t in s.stop_token_ids):
        raise invalid("stop_token_ids must be token ids of the model's vocabulary", "stop_token_ids")
    if s.min_tokens is not None:
        if s.min_tokens < 0:
            raise invalid(f"min_tokens must be >= 0, got {s.min_tokens}", "min_tokens")
        if s.max_tokens is not None and s.min_tokens > s.max_tokens:
            raise invalid(f"min_tokens ({s.min_tokens}) must not exceed max_tokens ({s.max_tokens})",
                          "min_tokens")


def _validate_documents(req: GenerationRequest) -> None:
    if req.recompute_ratio is not None:
        r = req.recompute_ratio
        if not req.uses_documents:
            raise invalid("recompute_ratio needs documents or retrieve: it sets how much of the "
                          "documents' reused KV is recomputed", "recompute_ratio")
        if math.isnan(r) or not 0.0 <= r <= 1.0:
            raise invalid(f"recompute_ratio must be in [0, 1], got {r}", "recompute_ratio")
    if req.lossy is not None and req.lossy.recompute_ratio is not None and not req.uses_documents:
        raise invalid("kvmesh.lossy.recompute_ratio needs documents or retrieve: it opts the documents' "
                      "reused KV into blending", "kvmesh.lossy.recompute_ratio")
    if not req.uses_documents:
        return
    param = "documents" if req.documents else "retrieve"
    if req.kind != "chat":
        raise invalid(f"{param} is only supported by chat completions", param)
    user = last_user_message(req.messages)
    if user is None:
        raise invalid(f"{param} needs a user message: documents are placed before the last "
                      "user message's content", "messages")
    for i, doc in enumerate(req.documents):
        if (doc.id is None) == (doc.text is None):
            raise invalid(f"documents[{i}] must have exactly one of 'id' (a catalogued document) "
                          "or 'text' (an inline document)", f"documents[{i}]")
        name, value = ("id", doc.id) if doc.id is not None else ("text", doc.text)
        if not value:
            raise invalid(f"documents[{i}].{name} is empty", f"documents[{i}].{name}")
    if req.retrieve is not None:
        k = req.retrieve.top_k
        if not 1 <= k <= MAX_RETRIEVE_K:
            raise invalid(f"retrieve.top_k must be in 1..{MAX_RETRIEVE_K}, got {k}",
                          "retrieve.top_k")
        query = req.retrieve.query
        if query is not None and not query.strip():
            raise invalid("retrieve.query is empty; send the text to search for, or leave it "
                          "out to search for the last user message", "retrieve.query")
        if query is None and not user.content.strip():
            raise invalid("retrieve.query is needed: the last user message has no text to "
                          "search for", "retrieve.query")


def last_user_message(messages: tuple[ChatTurn, ...]) -> ChatTurn | None:
    """The last message with role user (documents go before its content)."""
    return next((m for m in reversed(messages) if m.role == "user"), None)


def _validate_stop(stop: tuple[str, ...]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stop)}",
                      "stop")
    for i, s in enumerate(stop):
        if not s:
            raise invalid(f"stop[{i}] is empty; stop sequences need at least one character", "stop")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise invalid(f"stop[{i}] is {len(s)} characters long; the limit is "
                          f"{MAX_STOP_STRING_CHARS}", "stop")


@dataclass(frozen=True)
class TopLogprob:
    """One candidate token with its log-probability."""

    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one position's token and its top alternatives.

    `logprob` is None only for the first token of an echoed prompt (nothing predicts it).
    """

    token_id: int
    token: str
    logprob: float | None
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class EchoedPrompt:
    """A completions prompt as echoed on its choices' first delta."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()
    """With logprobs requested: one per prompt token, the first with logprob None."""


@dataclass(frozen=True)
class ChoiceDelta:
    """New output of one choice; `finish_reason` ("stop" / "length") on its last delta."""

    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    echo: EchoedPrompt | None = None
    first: bool = False
    """True on the choice's first delta (chat sends the role there)."""


@dataclass(frozen=True)
class DocumentUsage:
    """How a request's documents were used, as the engine reported it."""

    document_ids: tuple[str, ...] = ()
    blended_tokens: int = 0
    recomputed_tokens: int = 0


@dataclass(frozen=True)
class KvReuse:
    """How one choice's cache hits were made, as the engine reported it (kvmesh.engine.v1.KvReuse)."""

    storage: str = "exact"
    """"exact", or the lossy path that made the reused KV (a codec, a blend)."""
    kv_service_tokens: int = 0
    """Reused prompt tokens that came from the KV-cache service (the rest: the engine's prefix cache)."""
    fallback: str = ""
    """A lossy path the request opted into and the engine did not serve, and why."""


@dataclass(frozen=True)
class ReuseReport:
    """A whole request's cache hits, as its response reports them (kvmesh.gateway.v1.KvReuse)."""

    storage: str
    """"exact" when every reused token was exact, else the lossy path(s) that made them."""
    prefix_cache_tokens: int
    kv_service_tokens: int
    fallback: str = ""
    """Lossy paths asked for and not served (the guardrail held them over budget), and why."""

    @property
    def exact(self) -> bool:
        return self.storage == "exact"


@dataclass
class Usage:
    """Token accounting of a whole request: each prompt counted once, whatever n is; its cached
    tokens are the most any of its n copies reused (they run concurrently, so they may differ)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    documents: DocumentUsage | None = None
    """Requests with documents: the report of the copy that reused the most (None otherwise)."""
    _cached: dict[int, int] = field(default_factory=dict, repr=False)
    _reuse: dict[int, KvReuse] = field(default_factory=dict, repr=False)
    _fallbacks: list[KvReuse] = field(default_factory=list, repr=False)
    _documents_reported: bool = field(default=False, repr=False)

    def add_choice(self, prompt_index: int, completion_tokens: int, cached_tokens: int,
                   reuse: KvReuse = KvReuse()) -> None:
        """Account one finished choice of prompt `prompt_index` (the copy that reused the most
        speaks for the prompt's reuse)."""
        self.completion_tokens += completion_tokens
        if reuse.fallback:
            self._fallbacks.append(reuse)
        if prompt_index not in self._cached or cached_tokens > self._cached[prompt_index]:
            self._reuse[prompt_index] = reuse
        self._cached[prompt_index] = max(self._cached.get(prompt_index, 0), cached_tokens)

    def add_documents(self, prompt_tokens: int, report: DocumentUsage) -> None:
        """Account one finished choice of a document prompt (chat: the only prompt).

        The gateway knows only the prompt's plain and inline parts; the engine counted the
        catalogued and retrieved documents too, so its count replaces the gateway's.
        """
        self.prompt_tokens = max(self.prompt_tokens, prompt_tokens)
        if (not self._documents_reported or self.documents is None
                or report.blended_tokens > self.documents.blended_tokens):
            self.documents = report
        self._documents_reported = True

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    def reuse(self) -> ReuseReport | None:
        """What the request's cache hits were, None when it reused nothing and no lossy path it
        asked for fell back."""
        fallback = "; ".join(sorted({r.fallback for r in self._fallbacks if r.fallback}))
        if not self.cached_tokens and not fallback:
            return None
        lossy = sorted({r.storage for i, r in self._reuse.items() if self._cached.get(i) and r.storage != "exact"})
        service = sum(r.kv_service_tokens for r in self._reuse.values())
        return ReuseReport(",".join(lossy) or "exact", self.cached_tokens - service, service, fallback)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
