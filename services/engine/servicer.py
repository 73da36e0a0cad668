"""gRPC servicer for kvmesh.engine.v1: protobuf <-> domain objects only.

Errors are raised as kvmesh.errors exceptions; the shared interceptor turns them into status codes.
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Callable, Iterator

import grpc
from google.protobuf import unknown_fields
from opentelemetry import trace

from kvmesh.common.v1 import common_pb2
from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from kvmesh.errors import InvalidArgument
from kvmesh.prompt_parts import Part, part_from_proto
from kvmesh.kv.codec import CodecSpec
from kvmesh.kv.quality import QualityBudget
from kvmesh.kv.namespace_proto import dtype_to_proto, namespace_to_proto
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.core import EngineCore
from kvmesh.services.engine.ingest import IngestRequest
from kvmesh.services.engine.kv_transfer import Handoff, HandoffResult
from kvmesh.services.engine.outputs import RequestOutput
from kvmesh.services.engine.sampler import TokenLogprobs
from kvmesh.services.engine.sampling import Constraint, ConstraintKind, SamplingParams
from kvmesh.services.engine.speculation import SpecMode

log = logging.getLogger(__name__)
from kvmesh.services.engine.tracing import request_attributes

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "stop_string": common_pb2.FINISH_REASON_STOP_STRING,
}


_SPECULATION = {
    engine_pb2.SPECULATION_UNSPECIFIED: None,
    engine_pb2.SPECULATION_OFF: SpecMode.OFF,
    engine_pb2.SPECULATION_NGRAM: SpecMode.NGRAM,
    engine_pb2.SPECULATION_MODEL: SpecMode.MODEL,
    engine_pb2.SPECULATION_ADAPTIVE: SpecMode.ADAPTIVE,
}


_CODECS = {
    engine_pb2.KV_CODEC_FP16: "fp16",
    engine_pb2.KV_CODEC_BF16: "bf16",
    engine_pb2.KV_CODEC_INT8: "int8",
    engine_pb2.KV_CODEC_INT4: "int4",
    engine_pb2.KV_CODEC_INT2: "int2",
    engine_pb2.KV_CODEC_FP32: "fp32",
}

_WEIGHT_FORMATS = {
    "fp32": engine_pb2.WEIGHT_FORMAT_FP32,
    "bf16": engine_pb2.WEIGHT_FORMAT_BF16,
    "int8": engine_pb2.WEIGHT_FORMAT_INT8,
    "int4": engine_pb2.WEIGHT_FORMAT_INT4,
    "int4-w8a8": engine_pb2.WEIGHT_FORMAT_INT4_W8A8,
    "gguf": engine_pb2.WEIGHT_FORMAT_GGUF,
    "gguf-a8": engine_pb2.WEIGHT_FORMAT_GGUF_A8,
}


def weight_format_to_proto(name: str) -> int:
    """GetModelInfoResponse.weights of a resolved weight format (kvmesh.model.loader.WEIGHT_FORMATS)."""
    return _WEIGHT_FORMATS[name]


def budget_from_proto(budget: common_pb2.QualityBudget) -> QualityBudget:
    """A request's QualityBudget (0 = undeclared); InvalidArgument for a value out of range."""
    _reject_unknown_fields(budget, "quality_budget")
    try:
        return QualityBudget(budget.max_kl or None, budget.min_top1 or None)
    except ValueError as e:
        raise InvalidArgument(f"quality_budget: {e}") from None


def codec_from_proto(storage: engine_pb2.KvStorage) -> tuple[str, bool]:
    """A request's KvStorage as (kvmesh.kv.codec codec name, zstd); InvalidArgument for an
    unspecified or unknown codec."""
    if storage.codec not in _CODECS:
        known = ", ".join(engine_pb2.KvCodec.Name(v) for v in _CODECS)
        raise InvalidArgument(f"kv_storage.codec {storage.codec} is not a KV codec; use one of {known}, "
                              "or leave kv_storage unset for the engine's --kv-codec")
    return _CODECS[storage.codec], storage.zstd


def speculation_from_proto(value: int) -> SpecMode | None:
    """GenerateRequest.speculation as a SpecMode (None: the engine's default)."""
    if value not in _SPECULATION:
        raise InvalidArgument(f"speculation {value} is not a kvmesh.engine.v1.Speculation value; "
                              "use SPECULATION_OFF, _NGRAM, _MODEL or _ADAPTIVE")
    return _SPECULATION[value]


def _reject_unknown_fields(msg, path: str) -> None:
    """Unknown field numbers mean client and server disagree on the API: say so, don't guess."""
    numbers = [f.field_number for f in unknown_fields.UnknownFieldSet(msg)]
    if numbers:
        raise InvalidArgument(
            f"{path} has unknown field number(s) {numbers}; this engine speaks kvmesh.engine.v1 "
            "as of its protos/ — regenerate the client stubs or upgrade the engine")


def sampling_from_proto(sp: engine_pb2.SamplingParams) -> SamplingParams:
    """Maps proto sampling fields (with presence) onto SamplingParams defaults."""
    _reject_unknown_fields(sp, "sampling")
    sampled = any(sp.HasField(f) for f in ("top_k", "top_p", "seed"))
    temperature = sp.temperature if sp.HasField("temperature") else (1.0 if sampled else 0.0)
    kwargs = dict(
        temperature=float(temperature),
        top_k=int(sp.top_k) if sp.HasField("top_k") else 0,
        top_p=float(sp.top_p) if sp.HasField("top_p") else 1.0,
        seed=int(sp.seed) if sp.HasField("seed") else None,
        stop=tuple(sp.stop),
        stop_token_ids=tuple(int(t) for t in sp.stop_token_ids),
        ignore_eos=bool(sp.ignore_eos),
        logprobs=int(sp.logprobs) if sp.HasField("logprobs") else None,
        prompt_logprobs=int(sp.prompt_logprobs) if sp.HasField("prompt_logprobs") else None,
        presence_penalty=float(sp.presence_penalty) if sp.HasField("presence_penalty") else 0.0,
        frequency_penalty=float(sp.frequency_penalty) if sp.HasField("frequency_penalty") else 0.0,
        repetition_penalty=float(sp.repetition_penalty) if sp.HasField("repetition_penalty") else 1.0,
        logit_bias=tuple((int(t), float(b)) for t, b in sp.logit_bias.items()),
        min_p=float(sp.min_p) if sp.HasField("min_p") else 0.0,
        min_tokens=int(sp.min_tokens) if sp.HasField("min_tokens") else 0,
        constraint=constraint_from_proto(sp.structured_output) if sp.HasField("structured_output") else None,
    )
    if sp.HasField("max_tokens"):
        kwargs["max_tokens"] = int(sp.max_tokens)
    return SamplingParams(**kwargs)


def constraint_from_proto(so: engine_pb2.StructuredOutput) -> Constraint:
    """StructuredOutput as a domain Constraint (INVALID_ARGUMENT when no kind is set)."""
    _reject_unknown_fields(so, "sampling.structured_output")
    kind = so.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument("sampling.structured_output has no kind; set one of json_schema, "
                              "json_object, regex, choice or grammar")
    if kind == "choice":
        return Constraint(ConstraintKind.CHOICE, choices=tuple(so.choice.choices))
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    return Constraint(ConstraintKind(kind), text=getattr(so, kind))


def parts_from_proto(prompt: engine_pb2.Prompt) -> list[Part]:
    """GenerateRequest.parts as domain parts (checked by documents.check_parts)."""
    _reject_unknown_fields(prompt, "parts")
    out: list[Part] = []
    for i, p in enumerate(prompt.parts):
        part = part_from_proto(p)
        if part is None:
            raise InvalidArgument(f"parts[{i}] is empty; set tokens, document, document_id or retrieve")
        out.append(part)
    return out


def _logprobs_to_proto(lp: TokenLogprobs, tokenizer) -> common_pb2.TokenLogprobs:
    def entry(token_id: int, logprob: float) -> common_pb2.TokenLogprob:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob, text=text)

    return common_pb2.TokenLogprobs(chosen=entry(lp.token_id, lp.logprob),
                                    top=[entry(t, v) for t, v in lp.top])


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Thin adapter from kvmesh.engine.v1 to the AsyncEngine."""

    def __init__(self, engine: AsyncEngine, info: engine_pb2.GetModelInfoResponse,
                 on_handoff: Callable[[HandoffResult], None] = lambda result: None) -> None:
        self.engine = engine
        self.info = info
        self.on_handoff = on_handoff
        """Called with each P/D prefill hop's handoff (metrics)."""

    async def Generate(self, request: engine_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[engine_pb2.GenerateResponse]:
        _reject_unknown_fields(request, "GenerateRequest")
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("GenerateRequest needs a prompt: set `text`, `token_ids` or `parts`")
        tokenizer = self.engine.core.tokenizer
        ids, parts = None, None
        if which == "text":
            ids = tokenizer.encode(request.text)
        elif which == "token_ids":
            _reject_unknown_fields(request.token_ids, "token_ids")
            ids = list(request.token_ids.ids)
        else:
            parts = parts_from_proto(request.parts)
        ratio = None
        if request.HasField("blend"):
            _reject_unknown_fields(request.blend, "blend")
            if request.blend.HasField("recompute_ratio"):
                if parts is None:
                    raise InvalidArgument("blend.recompute_ratio applies to prompts given as `parts` with documents; "
                                          "send the prompt as parts or drop blend")
                ratio = float(request.blend.recompute_ratio)
        params = sampling_from_proto(request.sampling)
        speculation = speculation_from_proto(request.speculation)
        kv_codec = self._codec(request)
        trace.get_current_span().set_attributes(request_attributes(self.info.model, params, request.request_id))
        budget = budget_from_proto(request.quality_budget) if request.HasField("quality_budget") else QualityBudget()
        resume = ()
        if request.HasField("resume_token_ids"):
            _reject_unknown_fields(request.resume_token_ids, "resume_token_ids")
            resume = tuple(request.resume_token_ids.ids)
            trace.get_current_span().set_attribute("kvmesh.resumed_tokens", len(resume))
        handoff, handed = None, None
        if request.kv_handoff:
            if resume:
                raise InvalidArgument("kv_handoff (a P/D prefill hop) cannot resume a stream: unset "
                                      "resume_token_ids or kv_handoff")
            loop = asyncio.get_running_loop()
            handed = loop.create_future()
            handoff = Handoff(lambda result: loop.call_soon_threadsafe(_resolve, handed, result))
        async for out in self.engine.generate(ids, params, request.request_id, tenant_salt=request.cache_salt,
                                              kv_codec=kv_codec, speculation=speculation,
                                              parts=parts, recompute_ratio=ratio, quality_budget=budget,
                                              resume_token_ids=resume, kv_handoff=handoff):
            for msg in self._to_proto(out, tokenizer):
                if handed is not None and msg.HasField("final"):
                    # the first token is out; the decode hop starts on this message, so it waits
                    # until the prompt's chunks are stored (each Put has --kv-timeout-s)
                    kv = self.engine.core.kv
                    wait = 2 * kv.config.timeout_s if kv is not None else 1.0
                    try:  # past the wait, the decode hop computes what is not stored yet
                        async with asyncio.timeout(wait):
                            result = await asyncio.shield(handed)
                    except TimeoutError:
                        result = HandoffResult(False, 0, 0, wait)
                    msg.final.handoff.CopyFrom(engine_pb2.KvHandoff(ok=result.ok, tokens=result.tokens,
                                                                    bytes=result.bytes, wait_s=result.wait_s))
                    self.on_handoff(result)
                    log.info("request %s: P/D handoff %s: %d prompt tokens, %.1f MB stored, the last %.0f ms after "
                             "the prompt's last token", request.request_id, "ok" if result.ok else "incomplete",
                             result.tokens, result.bytes / 1e6, 1e3 * result.wait_s)
                    trace.get_current_span().set_attributes({
                        "kvmesh.pd.role": "prefill", "kvmesh.pd.handoff_ok": result.ok,
                        "kvmesh.pd.handoff_tokens": result.tokens, "kvmesh.pd.handoff_bytes": result.bytes,
                        "kvmesh.pd.handoff_wait_s": result.wait_s})
                yield msg

    async def IngestDocument(self, request: engine_pb2.IngestDocumentRequest,
                             context: grpc.aio.ServicerContext) -> engine_pb2.IngestDocumentResponse:
        _reject_unknown_fields(request, "IngestDocumentRequest")
        which = request.WhichOneof("content")
        if which is None:
            raise InvalidArgument("IngestDocument needs the document: set `text` or `token_ids`")
        text = request.text if which == "text" else ""
        if which == "text":
            ids = await asyncio.to_thread(self.engine.core.tokenizer.encode, text, False)
        else:
            ids = list(request.token_ids.ids)
        result = await self.engine.ingest_document(IngestRequest(
            request.document_id, ids, text, metadata=dict(request.metadata), tenant_salt=request.cache_salt,
            ttl_s=request.ttl_s if request.HasField("ttl_s") else None, pinned=request.pinned,
            kv_codec=self._codec(request)))
        return engine_pb2.IngestDocumentResponse(tokens=result.tokens, chunks=result.chunks,
                                                 reused_chunks=result.reused_chunks)

    def _codec(self, request: engine_pb2.GenerateRequest | engine_pb2.IngestDocumentRequest) -> CodecSpec | None:
        """The request's kv_storage over the deployment's codec settings; None when unset."""
        if not request.HasField("kv_storage"):
            return None
        _reject_unknown_fields(request.kv_storage, "kv_storage")
        return self.engine.kv_codec(*codec_from_proto(request.kv_storage))

    def _to_proto(self, out: RequestOutput, tokenizer) -> Iterator[engine_pb2.GenerateResponse]:
        """A delta with the output's new tokens (always while running: the stream shows progress;
        at the end only when there is output), then, when it finished, the final message."""
        delta = engine_pb2.Delta(token_ids=out.token_ids, text=out.text)
        delta.logprobs.extend(_logprobs_to_proto(lp, tokenizer) for lp in out.logprobs)
        delta.prompt_logprobs.extend(_logprobs_to_proto(lp, tokenizer) for lp in out.prompt_logprobs)
        if not out.finished or delta.ByteSize():
            yield engine_pb2.GenerateResponse(request_id=out.request_id, delta=delta)
        if not out.finished:
            return
        u = out.usage
        final = engine_pb2.Final(
            finish_reason=_FINISH[out.finish_reason],
            usage=common_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                   cached_prompt_tokens=u.cached_prompt_tokens),
            stop_reason=out.stop_reason, ttft_s=out.ttft_s, e2e_s=out.e2e_s,
            reuse=engine_pb2.KvReuse(storage=out.reuse_storage, kv_service_tokens=u.imported_prompt_tokens,
                                     fallback=out.reuse_fallback))
        if out.documents is not None:
            final.blended_tokens = out.documents.blended_tokens
            final.recomputed_tokens = out.documents.recomputed_tokens
            final.document_ids.extend(out.documents.document_ids)
        if out.spec is not None:
            final.spec_steps = out.spec.steps
            final.draft_tokens = out.spec.draft_tokens
            final.accepted_draft_tokens = out.spec.accepted_tokens
        yield engine_pb2.GenerateResponse(request_id=out.request_id, final=final)

    async def Abort(self, request: engine_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.AbortResponse:
        return engine_pb2.AbortResponse(aborted=self.engine.abort(request.request_id))

    async def Probe(self, request: engine_pb2.ProbeRequest,
                    context: grpc.aio.ServicerContext) -> engine_pb2.ProbeResponse:
        _reject_unknown_fields(request, "ProbeRequest")
        r = self.engine.probe(list(request.token_ids.ids), request.cache_salt)
        load = r.load
        return engine_pb2.ProbeResponse(
            cached_tokens=r.cached_tokens, running=load.running, waiting=load.waiting,
            pending_prefill_tokens=load.pending_prefill_tokens, free_blocks=load.free_blocks,
            num_blocks=load.num_blocks)

    async def GetModelInfo(self, request: engine_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.GetModelInfoResponse:
        return self.info

    async def GetGuardrail(self, request: engine_pb2.GetGuardrailRequest,
                           context: grpc.aio.ServicerContext) -> engine_pb2.GetGuardrailResponse:
        guardrail = self.engine.core.guardrail
        if guardrail is None:
            return engine_pb2.GetGuardrailResponse()
        report = guardrail.snapshot()
        out = engine_pb2.GetGuardrailResponse(shadow_share=report.shadow_share, pending_checks=report.pending_checks)
        for p in report.paths:
            out.paths.add(
                namespace=namespace_to_proto(p.namespace),
                state=engine_pb2.GUARD_STATE_ENABLED if p.enabled else engine_pb2.GUARD_STATE_DISABLED,
                checks=p.checks, kl=p.kl, top1=p.top1,
                budget=common_pb2.QualityBudget(max_kl=p.budget.max_kl or 0.0, min_top1=p.budget.min_top1 or 0.0),
                served=p.served, fallbacks=p.fallbacks, disabled_count=p.disabled_count)
        return out


def model_info(core: EngineCore, cfg: EngineConfig) -> engine_pb2.GetModelInfoResponse:
    """The GetModelInfo answer for this engine."""
    mc = core.loaded.config
    return engine_pb2.GetModelInfoResponse(
        model=cfg.model_name, weights_digest=core.loaded.weights_digest,
        max_model_len=core.sched_config.max_model_len, vocab_size=mc.vocab_size,
        dtype=dtype_to_proto(cfg.dtype), weights=weight_format_to_proto(cfg.weight_format),
        block_size=core.runner.block_size, num_blocks=core.runner.num_blocks,
        eos_token_ids=list(mc.eos_token_ids), device=str(core.runner.device),
        kv_namespace=namespace_to_proto(core.request_namespace()),
        tokenizer_fingerprint=core.loaded.tokenizer.fingerprint() if core.loaded.tokenizer is not None else "",
        model_source=core.loaded.source, role=cfg.role)


def _resolve(future: asyncio.Future, result: HandoffResult) -> None:
    if not future.done():
        future.set_result(result)
