"""The gRPC front end (kvmesh.gateway.v1): protobuf <-> domain only, over `service.Gateway`.

Same validation, limits, tenants and errors as the HTTP API: the API key comes from the
`authorization: Bearer <key>` metadata, and `ApiError`s reach the caller as status codes through
the shared server interceptor (with `retry-after` trailing metadata when backing off helps).
Cancelling the call cancels the generation upstream.

Each RPC goes through the HTTP API's own code: requests become the same `GenerationRequest`
(structured output and tools through `structured.structured_request`, checked by
`spec.validate_request`), Tokenize/Detokenize/GetTokenizerInfo through `tokenization`, Embed
through `embeddings`. What is the wire format's own: JSON carried as text (a schema, a tool's
parameters) is decoded here, and a ChatComplete with a calling tool_choice holds each choice's
text back until its last delta, which carries the tool calls (`_ToolCallChoices`).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, NoReturn, TypeVar

import grpc

from kvmesh import __version__
from kvmesh.common.v1 import common_pb2
from kvmesh.gateway.v1 import gateway_pb2 as pb
from kvmesh.gateway.v1 import gateway_pb2_grpc
from kvmesh.kv.quality import LossyOptIn, QualityBudget
from kvmesh.services.gateway import tokenization
from kvmesh.services.gateway.auth import Tenant, bearer_token
from kvmesh.services.gateway.embeddings import Embeddings, require
from kvmesh.services.gateway.errors import ApiError, invalid, to_api_error
from kvmesh.services.gateway.openai_schema import replayed_tool_call
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
from kvmesh.services.gateway.upstream import ModelEntry
from kvmesh.services.gateway.structured import (
    StructuredRequest,
    ToolCallOutput,
    json_value,
    structured_request,
    tool_call_result,
)

T = TypeVar("T")

_FINISH = {"stop": common_pb2.FINISH_REASON_STOP, "length": common_pb2.FINISH_REASON_LENGTH,
           "tool_calls": common_pb2.FINISH_REASON_TOOL_CALLS}
_ROLES = {pb.ROLE_SYSTEM: "system", pb.ROLE_DEVELOPER: "developer", pb.ROLE_USER: "user",
          pb.ROLE_ASSISTANT: "assistant", pb.ROLE_TOOL: "tool"}
_FORMATS: dict[int, str | None] = {
    pb.RESPONSE_FORMAT_TYPE_UNSPECIFIED: None, pb.RESPONSE_FORMAT_TYPE_TEXT: None,
    pb.RESPONSE_FORMAT_TYPE_JSON_OBJECT: "json_object", pb.RESPONSE_FORMAT_TYPE_JSON_SCHEMA: "json_schema"}
_TOOL_CHOICES: dict[int, str | None] = {
    pb.TOOL_CHOICE_MODE_UNSPECIFIED: None, pb.TOOL_CHOICE_MODE_NONE: "none",
    pb.TOOL_CHOICE_MODE_AUTO: "auto", pb.TOOL_CHOICE_MODE_REQUIRED: "required"}


def _decimal(x: float) -> float:
    """A float32 field as the decimal the caller wrote (0.1, not 0.10000000149), so that values and
    the messages quoting them are the HTTP API's."""
    return float(f"{x:.7g}")


def _sampling(o: pb.GenerationOptions, structured: StructuredRequest) -> tuple[Sampling, int]:
    def given(name: str) -> Any:
        return getattr(o, name) if o.HasField(name) else None

    def real(name: str) -> float | None:
        return _decimal(getattr(o, name)) if o.HasField(name) else None

    sampling = Sampling(
        max_tokens=given("max_tokens"), temperature=real("temperature"), top_p=real("top_p"),
        seed=given("seed"), stop=tuple(o.stop), logprobs=given("logprobs"), ignore_eos=o.ignore_eos,
        top_k=given("top_k"), min_p=real("min_p"), presence_penalty=real("presence_penalty"),
        frequency_penalty=real("frequency_penalty"), repetition_penalty=real("repetition_penalty"),
        logit_bias=tuple(sorted((t, _decimal(b)) for t, b in o.logit_bias.items())),
        stop_token_ids=tuple(o.stop_token_ids), min_tokens=given("min_tokens"),
        constraint=structured.constraint)
    return sampling, (o.n if o.HasField("n") else 1)


def _response_format(o: pb.GenerationOptions) -> dict[str, Any] | None:
    """GenerationOptions.response_format in the HTTP API's shape (its schema text decoded)."""
    if not o.HasField("response_format"):
        return None
    f = o.response_format
    kind = _FORMATS.get(f.type, f.type)  # an unknown number: refused by name, as HTTP refuses it
    if kind is None:
        return None
    if kind != "json_schema":
        return {"type": kind}
    spec: dict[str, Any] | None = None
    if f.HasField("json_schema"):
        js = f.json_schema
        spec = {"name": js.name, "strict": js.strict}
        if js.schema:
            spec["schema"] = json_value(js.schema, "response_format.json_schema.schema")
    return {"type": kind, "json_schema": spec}


def _tool(i: int, t: pb.Tool) -> dict[str, Any]:
    """tools[i] as the OpenAI tool object (what the chat template renders)."""
    fn: dict[str, Any] = {"name": t.name}
    if t.description:
        fn["description"] = t.description
    if t.HasField("parameters"):
        fn["parameters"] = json_value(t.parameters, f"tools[{i}].parameters")
    return {"type": "function", "function": fn}


def _tool_choice(r: pb.ChatCompleteRequest) -> Any:
    """ChatCompleteRequest.tool_choice in the HTTP API's shape (None: not given)."""
    if not r.HasField("tool_choice"):
        return None
    choice = r.tool_choice
    if choice.WhichOneof("choice") == "function":
        return {"type": "function", "function": {"name": choice.function}}
    return _TOOL_CHOICES.get(choice.mode, choice.mode)  # an unknown number: refused, as HTTP does


def _structured(o: pb.GenerationOptions, chat: pb.ChatCompleteRequest | None = None,
                tools: list[dict[str, Any]] | None = None) -> StructuredRequest:
    """The request's structured output, built and checked by the HTTP API's code."""
    return structured_request(
        response_format=_response_format(o),
        guided_regex=o.guided_regex if o.HasField("guided_regex") else None,
        guided_choice=list(o.guided_choice) or None,
        guided_grammar=o.guided_grammar if o.HasField("guided_grammar") else None,
        tools=tools or None, tool_choice=_tool_choice(chat) if chat is not None else None,
        parallel_tool_calls=(chat.parallel_tool_calls if chat is not None and chat.HasField("parallel_tool_calls")
                             else None))


def _lossy(o: pb.GenerationOptions) -> LossyOptIn | None:
    """GenerationOptions.lossy as the domain opt-in (400 naming the field when out of range)."""
    if not o.HasField("lossy"):
        return None
    lossy = o.lossy

    def num(x: float) -> float | None:  # 0: unset
        return _decimal(x) if x else None

    try:
        return LossyOptIn(lossy.kv_codec or None,
                          num(lossy.recompute_ratio) or 0.0 if lossy.HasField("recompute_ratio") else None,
                          QualityBudget(num(lossy.budget.max_kl), num(lossy.budget.min_top1)))
    except ValueError as e:
        raise invalid(f"options.lossy: {e}", "options.lossy") from None


def complete_request(r: pb.CompleteRequest) -> GenerationRequest:
    """A Complete call as the domain request."""
    sampling, n = _sampling(r.options, _structured(r.options))
    which = r.WhichOneof("prompt")
    prompt: str | tuple[int, ...] = tuple(r.token_ids.ids) if which == "token_ids" else r.text
    return GenerationRequest(kind="completion", model=r.model, prompts=(prompt,),
                             sampling=sampling, n=n, echo=r.echo, user=r.user, lossy=_lossy(r.options))


def _role(value: int, index: int) -> str:
    if value not in _ROLES:
        known = ", ".join(pb.Role.Name(v) for v in _ROLES)
        raise invalid(f"messages[{index}].role must be one of {known}, got {value}", f"messages[{index}].role")
    return _ROLES[value]


def _turn(i: int, m: pb.ChatMessage) -> ChatTurn:
    calls = tuple(replayed_tool_call(i, j, {"id": c.id, "type": "function",
                                            "function": {"name": c.name, "arguments": c.arguments or "{}"}})
                  for j, c in enumerate(m.tool_calls))
    return ChatTurn(_role(m.role, i), m.content, m.name if m.HasField("name") else None, calls,
                    m.tool_call_id if m.HasField("tool_call_id") else None)


def chat_request(r: pb.ChatCompleteRequest) -> GenerationRequest:
    """A ChatComplete call as the domain request."""
    tools = [_tool(i, t) for i, t in enumerate(r.tools)]
    structured = _structured(r.options, r, tools)
    sampling, n = _sampling(r.options, structured)
    messages = tuple(_turn(i, m) for i, m in enumerate(r.messages))
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
                                              else None), lossy=_lossy(r.options),
                             tool_calls=structured.tool_calls, tools=tuple(tools))


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


class _ToolCallChoices:
    """ChatComplete with a calling tool_choice: each choice's text is held back until its last
    delta, which carries the tool calls (or the text, when it is no call: `tool_call_result`)."""

    def __init__(self, out: ToolCallOutput) -> None:
        self.out = out
        self._texts: dict[int, list[str]] = {}

    def delta(self, delta: ChoiceDelta) -> pb.ChoiceDelta:
        text = self._texts.setdefault(delta.index, [])
        text.append(delta.text)
        msg = delta_proto(dataclasses.replace(delta, text="", finish_reason=None), "chat")
        if delta.finish_reason is None:
            return msg
        content, calls, reason = tool_call_result("".join(text), delta.finish_reason, self.out)
        msg.text = content or ""
        msg.tool_calls.extend(pb.ToolCall(id=c["id"], name=c["function"]["name"],
                                          arguments=c["function"]["arguments"]) for c in calls or ())
        if reason is not None:
            msg.finish_reason = _FINISH[reason]
        return msg


def _model(m: ModelEntry) -> pb.Model:
    return pb.Model(id=m.id, created=m.created, owned_by="kvmesh", root=m.root,
                    max_model_len=m.max_model_len, kind=pb.MODEL_KIND_GENERATION)


def _fail(context: grpc.aio.ServicerContext, err: ApiError, cause: BaseException) -> NoReturn:
    """Raise `err` for the interceptor to turn into a status, with retry-after metadata if set."""
    if err.retry_after is not None:
        context.set_trailing_metadata((("retry-after", str(err.retry_after)),))
    if err is cause:
        raise err
    raise err from cause


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    """Thin adapter from kvmesh.gateway.v1 to the Gateway."""

    def __init__(self, gateway: Gateway, embeddings: Embeddings | None = None) -> None:
        self.gateway = gateway
        self.embeddings = embeddings
        """The KV service's embedding model (Embed), or None: the gateway serves none."""

    def _authenticate(self, context: grpc.aio.ServicerContext) -> Tenant:
        header = next((v for k, v in context.invocation_metadata() or ()
                       if k == "authorization" and isinstance(v, str)), None)
        return self.gateway.authenticate(bearer_token(header))

    async def _answer(self, context: grpc.aio.ServicerContext, answer: Awaitable[T]) -> T:
        """`answer`'s result; a failure becomes its status (retry-after metadata when set)."""
        try:
            return await answer
        except Exception as e:
            _fail(context, to_api_error(e, retry_after=self.gateway.options.retry_after_s), e)

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        self._authenticate(context)
        models = [_model(m) for m in await self._answer(context, self.gateway.models())]
        embedder = await self.embeddings.listed() if self.embeddings is not None else None
        if embedder is not None:
            models.append(pb.Model(id=embedder.name, created=embedder.created, owned_by="kvmesh",
                                   root=embedder.name, max_model_len=embedder.max_tokens,
                                   kind=pb.MODEL_KIND_EMBEDDING, dimensions=embedder.dimensions))
        return pb.ListModelsResponse(models=models)

    async def Tokenize(self, request: pb.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        self._authenticate(context)
        if request.messages and request.prompt:
            raise invalid("send prompt or messages, not both", "prompt")
        prompt = tuple(_turn(i, m) for i, m in enumerate(request.messages)) or request.prompt
        out = await self._answer(context, tokenization.tokenize_input(
            self.gateway, request.model or None, prompt,
            add_special_tokens=(request.add_special_tokens if request.HasField("add_special_tokens") else None),
            add_generation_prompt=(not request.HasField("add_generation_prompt")
                                   or request.add_generation_prompt),
            return_token_strs=request.return_token_strs))
        return pb.TokenizeResponse(tokens=out.tokens, count=len(out.tokens), max_model_len=out.max_model_len,
                                   token_strs=out.token_strs or ())

    async def Detokenize(self, request: pb.DetokenizeRequest,
                         context: grpc.aio.ServicerContext) -> pb.DetokenizeResponse:
        self._authenticate(context)
        text = await self._answer(context, tokenization.detokenize_ids(
            self.gateway, request.model or None, list(request.tokens)))
        return pb.DetokenizeResponse(prompt=text)

    async def GetTokenizerInfo(self, request: pb.GetTokenizerInfoRequest,
                               context: grpc.aio.ServicerContext) -> pb.GetTokenizerInfoResponse:
        self._authenticate(context)
        info = await self._answer(context, tokenization.tokenizer_info(self.gateway))
        return pb.GetTokenizerInfoResponse(**{k: v for k, v in info.items() if v is not None})

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        self._authenticate(context)
        out = await self._answer(context, require(self.embeddings).embed(
            request.model, list(request.input), request.dimensions if request.HasField("dimensions") else None))
        return pb.EmbedResponse(id=out.id, model=out.model, created=out.created,
                                embeddings=[pb.Embedding(values=v) for v in out.vectors],
                                usage=pb.Usage(prompt_tokens=out.tokens, total_tokens=out.tokens))

    async def GetVersion(self, request: pb.GetVersionRequest,
                         context: grpc.aio.ServicerContext) -> pb.GetVersionResponse:
        return pb.GetVersionResponse(version=__version__)

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
            self.gateway.record(endpoint, err.status, tenant_name, arrival, request.model)
            _fail(context, err, e)
        status = 200
        head = dict(id=generation.id, model=req.model, created=generation.created)
        tools = _ToolCallChoices(req.tool_calls) if req.tool_calls is not None else None
        try:
            async for delta in generation.deltas():
                proto = tools.delta(delta) if tools is not None else delta_proto(delta, req.kind)
                yield pb.CompletionChunk(**head, choices=[proto])
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
            self.gateway.record(endpoint, status, tenant_name, arrival, req.model)
