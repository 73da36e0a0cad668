"""The gateway's request handling, shared by the HTTP and gRPC front ends.

`Gateway.start` takes a `GenerationRequest` from either front end and an authenticated tenant,
and runs the whole pre-flight: shape validation, model look-up (404 model_not_found), chat
template and tokenization, context-length check (400 context_length_exceeded), admission
(503 / 429 with Retry-After), then opens one router stream per choice. It returns a
`Generation`, whose `deltas()` the front end renders (SSE chunks, JSON, or proto messages).

NOTE (detokenization). The gateway tokenizes, but does not detokenize: the engine's streamed
`text` is already incrementally detokenized (UTF-8 characters split across tokens held back) and
has stop strings cut, and the engine is the only party that sees every token in order with the
stop-string state. Re-decoding ids here would duplicate that state machine and could disagree with
the engine on where a stop string cut the text. The gateway uses `text` as is and passes the ids
along for clients that want them (gRPC).
"""
from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Optional

import grpc
from opentelemetry import trace

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2
from kvmesh.errors import Unauthenticated
from kvmesh.grammar import ConstraintKind
from kvmesh.metrics import ALL_MODELS
from kvmesh.router.v1 import router_pb2
from kvmesh.services.gateway.metrics import GatewayMetrics
from kvmesh.services.gateway.admission import Admission, Rejection, Ticket
from kvmesh.services.gateway.auth import KeyStore, Tenant
from kvmesh.services.gateway.errors import ApiError, invalid, to_api_error
from kvmesh.prompt_parts import part_to_proto
from kvmesh.services.gateway.prompts import PreparedPrompt, PromptBuilder
from kvmesh.services.gateway.slo import TtftPredictor
from kvmesh.services.gateway import tracing as genai
from kvmesh.services.gateway.spec import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    ChoiceDelta,
    DocumentUsage,
    EchoedPrompt,
    GenerationRequest,
    Limits,
    Sampling,
    TokenLogprob,
    Usage,
    validate_request,
)
from kvmesh.services.gateway.upstream import (
    ChoiceFinal,
    ChoiceJob,
    ModelCatalog,
    ModelEntry,
    RouterClient,
    merge,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayOptions:
    """The config values request handling needs."""

    default_temperature: float = 1.0
    retry_after_s: int = 1
    trace_content: bool = False
    """Operators' opt-in: prompt and completion text as span attributes (never by default)."""
    limits: Limits = Limits()
    slo_ttft_s: float = 0.0
    """SLO-aware admission's TTFT bound (services/gateway/slo.py); 0 = off."""


class Generation:
    """One admitted request being generated: iterate `deltas()` once, then read `usage`.

    The admission ticket is released when the deltas end, fail, or `aclose()` runs — whichever
    comes first — and `aclose()` also cancels every upstream call still running.
    """

    def __init__(self, gateway: Gateway, *, generation_id: str, request: GenerationRequest,
                 model: ModelEntry, prompts: list[PreparedPrompt], jobs: list[ChoiceJob],
                 ticket: Ticket, endpoint: str, arrival: float, slo_handle: Optional[int] = None) -> None:
        self.id = generation_id
        self._slo_handle = slo_handle
        self.created = int(time.time())
        self.request = request
        self.model = model
        self.prompts = prompts
        self.usage = Usage(prompt_tokens=sum(p.known_tokens for p in prompts),
                           documents=DocumentUsage() if request.uses_documents else None)
        self._gateway = gateway
        self._jobs = jobs
        self._ticket = ticket
        self._endpoint = endpoint
        self._arrival = arrival
        self._stream: AsyncIterator[ChoiceDelta] | None = None

    @property
    def choices(self) -> int:
        return len(self._jobs)

    @property
    def upstream_requests(self) -> list[router_pb2.RouteRequest]:
        """The RouteRequest of every choice, in choice order."""
        return [job.request for job in self._jobs]

    def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """The choices' deltas as they arrive (single use)."""
        if self._stream is not None:
            raise RuntimeError("Generation.deltas() can be iterated only once")
        self._stream = self._run()
        return self._stream

    async def _run(self) -> AsyncIterator[ChoiceDelta]:
        first_token = True
        content = self._gateway.options.trace_content
        texts: dict[int, list[str]] = {}
        finished: dict[int, str] = {}
        try:
            async with contextlib.aclosing(merge(self._gateway.router, self._jobs)) as items:
                async for item in items:
                    if isinstance(item, ChoiceFinal):
                        self.usage.add_choice(item.prompt_index, item.completion_tokens,
                                              item.cached_tokens, item.reuse)
                        if self.usage.documents is not None:
                            self.usage.add_documents(item.prompt_tokens, item.documents)
                        continue
                    if content and item.text:
                        texts.setdefault(item.index, []).append(item.text)
                    if item.finish_reason:
                        finished[item.index] = item.finish_reason
                    if first_token and (item.token_ids or item.text):
                        first_token = False
                        if self._slo_handle is not None:
                            self._gateway.slo.first_token(self._slo_handle)
                        self._gateway.metrics.ttft_seconds.labels(self.model.id, self._endpoint).observe(
                            time.perf_counter() - self._arrival)
                    yield item
            for kind, value in (("prompt", self.usage.prompt_tokens),
                                ("completion", self.usage.completion_tokens),
                                ("cached", self.usage.cached_tokens)):
                self._gateway.metrics.tokens.labels(self.model.id, kind).inc(value)
            reasons = genai.finish_reasons(finished, len(self._jobs))
            span = trace.get_current_span()
            span.set_attributes(genai.response_attributes(self.id, self.model.id, self.usage, reasons))
            if content:
                span.set_attributes(genai.content_attributes(
                    self.request, [p.text for p in self.prompts],
                    ["".join(texts.get(i, ())) for i in range(len(self._jobs))], reasons))
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                self._gateway.metrics.rejected.labels(self.model.id, "upstream_exhausted").inc()
            raise to_api_error(e, retry_after=self._gateway.options.retry_after_s) from e
        finally:
            self._release()

    def _release(self) -> None:
        self._ticket.release()
        if self._slo_handle is not None:
            self._gateway.slo.leave(self._slo_handle)  # a no-op once its first token came

    async def aclose(self) -> None:
        """Stop: cancel the upstream calls still running and release the admission ticket."""
        if self._stream is not None:
            await self._stream.aclose()  # type: ignore[attr-defined]
        self._release()


class Gateway:
    """Authentication, models, and `start` (see the module docstring) for both front ends."""

    def __init__(self, router: RouterClient, catalog: ModelCatalog, prompts: PromptBuilder,
                 keys: KeyStore, admission: Admission, options: GatewayOptions,
                 metrics: GatewayMetrics) -> None:
        self.router = router
        self.catalog = catalog
        self.prompts = prompts
        self.keys = keys
        self.admission = admission
        self.options = options
        self.metrics = metrics
        self.slo = TtftPredictor(options.slo_ttft_s) if options.slo_ttft_s > 0 else None
        """SLO-aware admission (services/gateway/slo.py), or None when off."""

    def authenticate(self, key: str | None) -> Tenant:
        """The tenant of `key` (raises Unauthenticated; counted as a rejection)."""
        try:
            return self.keys.authenticate(key)
        except Unauthenticated:
            self.metrics.rejected.labels(ALL_MODELS, "unauthenticated").inc()
            raise

    @property
    def draining(self) -> bool:
        return self.admission.draining

    async def drain(self) -> None:
        """Refuse new requests (503) and wait for those in flight to finish."""
        self.admission.draining = True
        await self.admission.wait_idle()

    async def models(self) -> list[ModelEntry]:
        """Every model the router lists (a 503 ApiError when the router cannot be reached)."""
        try:
            return await self.catalog.models()
        except grpc.aio.AioRpcError as e:
            raise to_api_error(e, retry_after=self.options.retry_after_s) from e

    async def model(self, model_id: str) -> ModelEntry:
        """One model by id (404 ApiError when unknown)."""
        try:
            return await self.catalog.get(model_id)
        except grpc.aio.AioRpcError as e:
            raise to_api_error(e, retry_after=self.options.retry_after_s) from e

    async def health(self) -> str | None:
        """None when ready to serve, else why not (draining, router unreachable)."""
        if self.draining:
            return "draining"
        try:
            await self.models()
        except ApiError as e:
            return e.message
        return None

    def record(self, endpoint: str, status: int, tenant: str, arrival: float, model: str = "") -> None:
        """Count one finished request (called once per request by the front end). `model` is
        the one the request named ("" before it was parsed): its label when the catalog lists it,
        else ALL_MODELS, so a client's typo never becomes a series."""
        label = model if self.catalog.lists(model) else ALL_MODELS
        self.metrics.requests.labels(label, endpoint, str(status), tenant).inc()
        self.metrics.request_seconds.labels(label, endpoint).observe(time.perf_counter() - arrival)

    async def start(self, req: GenerationRequest, tenant: Tenant, *, endpoint: str,
                    arrival: float) -> Generation:
        """Validate, tokenize, admit and open the upstream streams (see the module docstring)."""
        validate_request(req, self.options.limits)
        trace.get_current_span().set_attributes({**genai.request_attributes(req), "kvmesh.tenant": tenant.name})
        model = await self.model(req.model)
        if req.uses_documents:
            prompts = [await self.prompts.chat_with_documents(req.messages, req.documents,
                                                              req.retrieve, req.tools)]
        elif req.kind == "chat":
            prompts = [await self.prompts.chat(req.messages, req.tools)]
        else:
            prompts = [await self.prompts.completion(p, i) for i, p in enumerate(req.prompts)]
        max_tokens = [self._max_tokens(req, model, p) for p in prompts]
        prompt_tokens = sum(p.known_tokens for p in prompts) * req.n
        self._check_slo(model.id, prompt_tokens)
        ticket = self._admit(model.id, tenant, len(prompts) * req.n, prompt_tokens)
        slo_handle = self.slo.admit(prompt_tokens) if self.slo is not None else None
        generation_id = ("chatcmpl-" if req.kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        jobs = [self._job(req, tenant, prompt, index=p_index * req.n + j, prompt_index=p_index,
                          copy=j, max_tokens=max_tokens[p_index],
                          request_id=f"{generation_id}-{p_index * req.n + j}")
                for p_index, prompt in enumerate(prompts) for j in range(req.n)]
        return Generation(self, generation_id=generation_id, request=req, model=model,
                          prompts=prompts, jobs=jobs, ticket=ticket, endpoint=endpoint,
                          arrival=arrival, slo_handle=slo_handle)

    def _check_slo(self, model: str, prompt_tokens: int) -> None:
        """503 + Retry-After when the predicted TTFT breaks --slo-ttft-s (slo.py's NOTE)."""
        if self.slo is None:
            return
        predicted = self.slo.refuses(prompt_tokens)
        if predicted is None:
            return
        self.metrics.rejected.labels(model, "slo_ttft").inc()
        retry = self.slo.retry_after_s(predicted)
        raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the predicted time to first token ({predicted:.1f}s: {self.slo.waiting_tokens} prompt "
                       f"tokens queued ahead at {self.slo.rate:.0f} tokens/s) exceeds {self.slo.margin:.0%} of the "
                       f"gateway's TTFT SLO ({self.slo.slo_s:g}s, --slo-ttft-s); retry after {retry}s",
                       error_code="overloaded", status=503, retry_after=retry)

    def _max_tokens(self, req: GenerationRequest, model: ModelEntry, prompt: PreparedPrompt) -> int:
        """max_tokens to send (0 = the engine's default); 400 when the prompt leaves no room.

        A prompt with catalogued or retrieved documents is longer than the tokens known here:
        the rest of the context is unknown, so the engine's default applies, and the engine
        checks the whole length.
        """
        used, limit = prompt.known_tokens, model.max_model_len
        asked = req.sampling.max_tokens
        if asked is None:
            if not limit or not prompt.all_known:  # the engine decides
                return DEFAULT_COMPLETION_MAX_TOKENS if req.kind == "completion" else 0
            room = limit - used
            asked = max(1, min(DEFAULT_COMPLETION_MAX_TOKENS, room) if req.kind == "completion"
                        else room)
        if limit and used + asked > limit:
            where = "messages" if req.kind == "chat" else "prompt"
            raise invalid(f"This model's maximum context length is {limit} tokens. However, you "
                          f"requested {used + asked} tokens ({used} in the {where}, {asked} in "
                          f"the completion). Please reduce the length of the {where} or "
                          "completion.", where, "context_length_exceeded")
        return asked

    def _admit(self, model: str, tenant: Tenant, requests: int, prompt_tokens: int) -> Ticket:
        outcome = self.admission.try_admit(tenant.name, requests, prompt_tokens,
                                           tenant.max_inflight_requests)
        if isinstance(outcome, Ticket):
            return outcome
        self.metrics.rejected.labels(model, outcome.value).inc()
        retry = self.options.retry_after_s
        a = self.admission
        if outcome is Rejection.DRAINING:
            raise ApiError(grpc.StatusCode.UNAVAILABLE, "the gateway is draining for shutdown; "
                           "retry on another replica", error_code="draining", retry_after=retry)
        if outcome is Rejection.TENANT:
            cap = a.tenant_limit(tenant.max_inflight_requests)
            raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"tenant {tenant.name!r} has {a.tenant_inflight(tenant.name)} requests in "
                           f"flight and its limit is {cap}; this request needs {requests} more. "
                           f"Retry after {retry}s.",
                           error_code="rate_limit_exceeded", retry_after=retry)
        if outcome is Rejection.TOO_LARGE:
            raise invalid(f"this request needs {requests} generations and {prompt_tokens} prompt "
                          "tokens in flight, more than the gateway admits at once "
                          f"({a.limits.max_requests} generations, {a.limits.max_prompt_tokens} "
                          "prompt tokens, or the tenant's cap); lower n or split the request",
                          None, "request_too_large")
        raise ApiError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"the gateway is at capacity ({a.inflight_requests} generations, "
                       f"{a.inflight_prompt_tokens} prompt tokens in flight); retry after {retry}s",
                       error_code="overloaded", status=503, retry_after=retry)

    def _job(self, req: GenerationRequest, tenant: Tenant, prompt: PreparedPrompt, *, index: int,
             prompt_index: int, copy: int, max_tokens: int, request_id: str) -> ChoiceJob:
        """The upstream request of choice `index` (copy `copy` of prompt `prompt_index`)."""
        s = req.sampling
        sampling = engine_pb2.SamplingParams(
            temperature=self.options.default_temperature if s.temperature is None else s.temperature,
            stop=list(s.stop))
        if max_tokens:
            sampling.max_tokens = max_tokens
        if s.top_p is not None:
            sampling.top_p = s.top_p
        if s.seed is not None:
            sampling.seed = s.seed + copy
        if s.logprobs is not None:
            sampling.logprobs = s.logprobs
        if s.ignore_eos:
            sampling.ignore_eos = True
        _extras(sampling, s)
        echo = None
        if req.echo:
            placeholders: tuple[TokenLogprob, ...] = ()
            if s.logprobs is not None:
                sampling.prompt_logprobs = s.logprobs
                placeholders = tuple(TokenLogprob(t, self.prompts.token_text(t), None)
                                     for t in prompt.token_ids)
            echo = EchoedPrompt(prompt.text, prompt.token_ids, placeholders)
        upstream = engine_pb2.GenerateRequest(request_id=request_id, sampling=sampling,
                                              cache_salt=tenant.cache_salt)
        lossy = req.lossy.over(tenant.lossy) if req.lossy is not None else tenant.lossy
        ratio = req.recompute_ratio if req.recompute_ratio is not None else (lossy and lossy.recompute_ratio)
        if prompt.parts:
            upstream.parts.parts.extend(part_to_proto(p) for p in prompt.parts)
            if ratio is not None:
                upstream.blend.recompute_ratio = ratio
        else:
            upstream.token_ids.CopyFrom(common_pb2.TokenIds(ids=prompt.token_ids))
        if lossy is not None:
            if lossy.kv_codec is not None:
                upstream.kv_storage.CopyFrom(engine_pb2.KvStorage(
                    codec=engine_pb2.KvCodec.Value("KV_CODEC_" + lossy.kv_codec.upper()), zstd=True))
            budget = lossy.budget
            if budget.max_kl is not None or budget.min_top1 is not None:
                upstream.quality_budget.CopyFrom(common_pb2.QualityBudget(max_kl=budget.max_kl or 0.0,
                                                                          min_top1=budget.min_top1 or 0.0))
        request = router_pb2.RouteRequest(request=upstream, model=req.model, tenant=tenant.name,
                                          prompt_text=prompt.text)
        return ChoiceJob(index, prompt_index, request, echo)


def _extras(sampling: engine_pb2.SamplingParams, s: Sampling) -> None:
    """The penalties, vLLM's sampling extensions and the structured output of `s`, set on the
    engine's SamplingParams only when asked for (unset fields keep the engine's defaults)."""
    for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        value = getattr(s, name)
        if value is not None:
            setattr(sampling, name, value)
    if s.top_k is not None and s.top_k > 0:  # -1 and 0 both mean off
        sampling.top_k = s.top_k
    for token, bias in s.logit_bias:
        sampling.logit_bias[token] = bias
    sampling.stop_token_ids.extend(s.stop_token_ids)
    c = s.constraint
    if c is None:
        return
    out = sampling.structured_output
    if c.kind is ConstraintKind.CHOICE:
        out.choice.choices.extend(c.choices)
    elif c.kind is ConstraintKind.JSON_OBJECT:
        out.json_object.SetInParent()
    else:
        setattr(out, str(c.kind), c.text)
