"""The gRPC front end (kvmesh.gateway.v1): protobuf <-> domain only, over `service.Gateway`.

Same validation, limits, tenants and errors as the HTTP API: the API key comes from the
`authorization: Bearer <key>` metadata, and `ApiError`s reach the caller as status codes through
the shared server interceptor (with `retry-after` trailing metadata when backing off helps).
Cancelling the call cancels the generation upstream.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc

from kvmesh.common.v1 import common_pb2
from kvmesh.gateway.v1 import gateway_pb2 as pb
from kvmesh.gateway.v1 import gateway_pb2_grpc
from kvmesh.kv.quality import LossyOptIn, QualityBudget
from kvmesh.services.gateway.auth import Tenant, bearer_token
from kvmesh.services.gateway.errors import ApiError, invalid, to_api_error
from kvmesh.services.gateway.service import Gateway
from kvmesh.services.gateway.spec import (
    ChatTurn,
    ChoiceDelta,
    DocumentRef,
    GenerationRequest,
    Kind,
    Retrieval,
    Sampling,
    TokenLogprob,
    Usage,
)
from kvmesh.services.gateway.sse import CLIENT_CLOSED

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH}
_ROLES = {pb.ROLE_SYSTEM: "system", pb.ROLE_DEVELOPER: "developer", pb.ROLE_USER: "user",
          pb.ROLE_ASSISTANT: "assistant"}


def _sampling(o: pb.GenerationOptions) -> tuple[Sampling, int]:
    opt = o.HasField
    sampling = Sampling(
        max_tokens=o.max_tokens if opt("max_tokens") else None,
        temperature=o.temperature if opt("temperature") else None,
        top_p=o.top_p if opt("top_p") else None,
        seed=o.seed if opt("seed") else None,
        stop=tuple(o.stop),
        logprobs=o.logprobs if opt("logprobs") else None)
    return sampling, (o.n if opt("n") else 1)


def _lossy(o: pb.GenerationOptions) -> LossyOptIn | None:
    """GenerationOptions.lossy as the domain opt-in (400 naming the field when out of range)."""
    if not o.HasField("lossy"):
        return None
    lossy = o.lossy

    def num(x: float) -> float | None:  # a float32 field as the decimal the caller wrote (0.03, not 0.0299999)
        return float(f"{x:.7g}") if x else None

    try:
        return LossyOptIn(lossy.kv_codec or None,
                          num(lossy.recompute_ratio) or 0.0 if lossy.HasField("recompute_ratio") else None,
                          QualityBudget(num(lossy.budget.max_kl), num(lossy.budget.min_top1)))
    except ValueError as e:
        raise invalid(f"options.lossy: {e}", "options.lossy") from None


def complete_request(r: pb.CompleteRequest) -> GenerationRequest:
    """A Complete call as the domain request."""
    sampling, n = _sampling(r.options)
    which = r.WhichOneof("prompt")
    prompt: str | tuple[int, ...] = tuple(r.token_ids.ids) if which == "token_ids" else r.text
    return GenerationRequest(kind="completion", model=r.model, prompts=(prompt,),
                             sampling=sampling, n=n, echo=r.echo, user=r.user, lossy=_lossy(r.options))


def _role(value: int, index: int) -> str:
    if value not in _ROLES:
        known = ", ".join(pb.Role.Name(v) for v in _ROLES)
        raise invalid(f"messages[{index}].role must be one of {known}, got {value}", f"messages[{index}].role")
    return _ROLES[value]


def chat_request(r: pb.ChatCompleteRequest) -> GenerationRequest:
    """A ChatComplete call as the domain request."""
    sampling, n = _sampling(r.options)
    messages = tuple(ChatTurn(_role(m.role, i), m.content, m.name if m.HasField("name") else None)
                     for i, m in enumerate(r.messages))
    documents = tuple(DocumentRef(id=d.id if d.WhichOneof("source") == "id" else None,
                                  text=d.text if d.WhichOneof("source") == "text" else None)
                      for d in r.documents)
    retrieve = None
    if r.HasField("retrieve"):
        retrieve = Retrieval(r.retrieve.top_k,
                             r.retrieve.query if r.retrieve.HasField("query") else None)
    return GenerationRequest(kind="chat", model=r.model, messages=messages, sampling=sampling,
                             n=n, user=r.user, documents=documents, retrieve=retrieve,
                             recompute_ratio=(r.recompute_ratio if r.HasField("recompute_ratio")
                                              else None), lossy=_lossy(r.options))


def final_chunk(head: dict[str, Any], u: Usage) -> pb.CompletionChunk:
    """The last message: usage, and how the documents were used when the request had some."""
    chunk = pb.CompletionChunk(**head, usage=pb.Usage(
        prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
        total_tokens=u.total_tokens, cached_tokens=u.cached_tokens))
    reuse = u.reuse()
    if reuse is not None:
        chunk.reuse.CopyFrom(pb.KvReuse(storage=reuse.storage, exact=reuse.exact,
                                        prefix_cache_tokens=reuse.prefix_cache_tokens,
                                        kv_service_tokens=reuse.kv_service_tokens,
                                        fallback=reuse.fallback))
    if u.documents is not None:
        chunk.documents.CopyFrom(pb.DocumentUsage(
            document_ids=list(u.documents.document_ids),
            blended_tokens=u.documents.blended_tokens,
            recomputed_tokens=u.documents.recomputed_tokens))
    return chunk


def _logprobs(entries: tuple[TokenLogprob, ...]) -> list[common_pb2.TokenLogprobs]:
    return [common_pb2.TokenLogprobs(
        chosen=common_pb2.TokenLogprob(token_id=e.token_id, logprob=e.logprob or 0.0, text=e.token),
        top=[common_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob, text=t.token)
             for t in e.top]) for e in entries]


def delta_proto(delta: ChoiceDelta, kind: Kind) -> pb.ChoiceDelta:
    """One domain delta as the proto message."""
    msg = pb.ChoiceDelta(index=delta.index, text=delta.text, token_ids=list(delta.token_ids),
                         logprobs=_logprobs(delta.logprobs))
    if kind == "chat" and delta.first:
        msg.role = pb.ROLE_ASSISTANT
    if delta.finish_reason is not None:
        msg.finish_reason = _FINISH[delta.finish_reason]
    if delta.echo is not None:
        msg.echo.CopyFrom(pb.EchoedPrompt(text=delta.echo.text, token_ids=list(delta.echo.token_ids),
                                          logprobs=_logprobs(delta.echo.logprobs[1:])))
    return msg


def _fail(context: grpc.aio.ServicerContext, err: ApiError, cause: BaseException) -> NoReturn:
    """Raise `err` for the interceptor to turn into a status, with retry-after metadata if set."""
    if err.retry_after is not None:
        context.set_trailing_metadata((("retry-after", str(err.retry_after)),))
    if err is cause:
        raise err
    raise err from cause


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """Thin adapter from kvmesh.gateway.v1 to the Gateway."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        header = next((v for k, v in context.invocation_metadata() or ()
                       if k == "authorization" and isinstance(v, str)), None)
        return self.gateway.authenticate(bearer_token(header))

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        self._authenticate(context)
        models = await self.gateway.models()
        return pb.ListModelsResponse(models=[
            pb.Model(id=m.id, created=m.created, owned_by="kvmesh", root=m.root,
                     max_model_len=m.max_model_len) for m in models])

    async def Complete(self, request: pb.CompleteRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        async with contextlib.aclosing(self._generate(request, context, "grpc:Complete")) as out:
            async for chunk in out:
                yield chunk

    async def ChatComplete(self, request: pb.ChatCompleteRequest,
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.CompletionChunk]:
        async with contextlib.aclosing(self._generate(request, context, "grpc:ChatComplete")) as out:
            async for chunk in out:
                yield chunk

    async def _generate(self, request: pb.CompleteRequest | pb.ChatCompleteRequest,
                        context: grpc.aio.ServicerContext, endpoint: str
                        ) -> AsyncIterator[pb.CompletionChunk]:
        arrival = time.perf_counter()
        retry_after = self.gateway.options.retry_after_s
        tenant_name = "unauthenticated"
        try:
            tenant = self._authenticate(context)
            tenant_name = tenant.name
            req = (chat_request(request) if isinstance(request, pb.ChatCompleteRequest)
                   else complete_request(request))
            generation = await self.gateway.start(req, tenant, endpoint=endpoint, arrival=arrival)
        except Exception as e:
            err = to_api_error(e, retry_after=retry_after)
            self.gateway.record(endpoint, err.status, tenant_name, arrival)
            _fail(context, err, e)
        status = 200
        head = dict(id=generation.id, model=req.model, created=generation.created)
        try:
            async for delta in generation.deltas():
                yield pb.CompletionChunk(**head, choices=[delta_proto(delta, req.kind)])
            yield final_chunk(head, generation.usage)
        except (asyncio.CancelledError, GeneratorExit):
            status = CLIENT_CLOSED
            raise
        except Exception as e:
            err = to_api_error(e, retry_after=retry_after)
            status = err.status
            _fail(context, err, e)
        finally:
            await generation.aclose()
            self.gateway.record(endpoint, status, tenant_name, arrival)
