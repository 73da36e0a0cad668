"""The asyncio face of the engine: requests in from gRPC handlers, the step loop on its own thread.

NOTE: threading model. Torch releases the GIL inside its kernels, so the step loop runs on one
dedicated thread while the asyncio loop keeps serving RPCs. That thread also builds the core
(loads the model): every parallel torch op of the process then comes from one thread, so
OpenMP keeps a single team of workers. A second team (say, the model loaded on the main thread,
steps run on this one) puts more OpenMP threads than cores in the process, and libgomp then
throttles its spin-wait to ~100 iterations: workers sleep between the ~500 small ops of a
decode step and each op pays a futex wake-up. Measured on 2 cores: fp32 decode 17 tok/s with
two teams, 31 tok/s with one.

The two sides talk through a locked inbox (adds and aborts, applied between steps, so the core
stays single-threaded) and per-request asyncio queues filled with `call_soon_threadsafe`. When a
consumer goes away (client cancel, deadline), its generator's `finally` posts an abort, which
frees the request's blocks at the next step boundary.

The draft service is called from the step loop too (EngineCore._propose): one synchronous
Propose per step, blocking only that thread (gRPC releases the GIL while it waits) for at most
--draft-timeout-s, because the drafts must be known before the step is scheduled.

NOTE: probes never wait for the step loop. A router probes before placing every request, with a
deadline (~0.2 s) shorter than one prefill step can take on a CPU, so `probe` answers on the
event-loop thread from two reads that are safe while the step loop runs:
  * load: an immutable EngineLoad the step loop publishes (one reference assignment, atomic)
    after every inbox application and every step, plus the adds still in the inbox (read under
    the inbox lock). It is exact as of the last step boundary.
  * cached prefix: BlockManager.match_prefix only reads -- `_cached.get` (atomic under the GIL)
    and the found block's `key` (one attribute read), compared with the key it expects -- and
    never iterates a container the step loop mutates. The step loop registers a block's key
    before its hash (`cache_full_blocks`) and unregisters the hash before clearing the key
    (`_pop_free`), so a hit is a block that held exactly this prefix chunk at the moment it was
    read; the answer can only be stale by the step in flight (a block evicted or cached during
    it), and admission matches again anyway. (This relies on the GIL: revisit for free-threaded
    builds.)
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
import uuid
from collections import deque
from typing import AsyncIterator, Callable

from opentelemetry import context as otel_context
from opentelemetry import trace

from kvmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from kvmesh.kv.blend import BlendPrefill
from kvmesh.kv.codec import CodecSpec
from kvmesh.kv.keys import document_chunks
from kvmesh.kvcache.v1 import kvcache_pb2
from kvmesh.services.engine.core import EngineCore, EngineLoad, EngineRequest, ProbeResult, RequestOutput
from kvmesh.services.engine.documents import DocumentExports, Part, check_parts, plan_documents, resolve
from kvmesh.services.engine.kv_connector import EXPORT_TIMEOUT_S, parse_codec
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.speculation import SpecMode
from kvmesh.telemetry import tracer

log = logging.getLogger(__name__)


class AsyncEngine:
    """Runs an `EngineCore` on a background thread and streams outputs to asyncio consumers."""

    def __init__(self, build: Callable[[], EngineCore], *, max_waiting: int) -> None:
        """Starts the step-loop thread, runs `build` on it and returns once the core is ready
        (re-raising whatever `build` raised)."""
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._inbox: deque[tuple[str, object]] = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._draining = False
        self._idle: asyncio.Event | None = None  # set when draining and the last stream ends
        self.on_step = None  # optional callback(core, outputs, seconds) for metrics
        self.on_abort = None  # optional callback(final output) for requests aborted between steps
        built: concurrent.futures.Future[EngineCore] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built),
                                        name="engine-step-loop", daemon=True)
        self._thread.start()
        self.core: EngineCore  # set by the step-loop thread before it signals `built`
        self._load: EngineLoad  # likewise; then republished at every step boundary
        built.result()  # re-raises what `build` raised

    # ---- asyncio side ------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: list[int] | None, params: SamplingParams,
                       request_id: str = "", cache_salt: bytes = b"",
                       kv_codec: str = "", speculation: SpecMode | None = None, *,
                       parts: list[Part] | None = None, recompute_ratio: float | None = None,
                       doc_exports: DocumentExports | None = None) -> AsyncIterator[RequestOutput]:
        """Validates and queues a request, then yields its outputs until the final one.
        `speculation` overrides the engine's default mode (plain decoding without a draft
        service, whatever it says).

        The prompt is `prompt_token_ids`, or `parts` marking documents (see
        services/engine/documents.py: resolved, their cached KV fetched by content and blended
        with `recompute_ratio`, default the engine's). With a KV-cache service configured, a
        prompt's cached prefix is fetched first (while the step loop keeps serving other
        requests); that never fails the request."""
        if self._draining:
            raise Unavailable("the engine is draining for shutdown; retry on another replica")
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidArgument(f"request_id {request_id!r} is already running; use a unique id")
        if recompute_ratio is not None and not 0.0 <= recompute_ratio <= 1.0:
            raise InvalidArgument(f"blend.recompute_ratio must be in [0, 1] (0 = pure reuse, 1 = full prefill), "
                                  f"got {recompute_ratio}")
        kv = self.core.kv
        ingest = doc_exports is not None  # ingest_document: the document alone, stored by content only
        if parts is not None:
            check_parts(parts)
        elif prompt_token_ids is not None:
            self.core.validate(prompt_token_ids, params)
        else:
            raise InvalidArgument("a request needs a prompt: token ids or parts")
        spec = None
        if kv_codec:
            try:
                spec = parse_codec(kv_codec, kv.config.codec if kv else CodecSpec())
            except ValueError as err:
                raise InvalidArgument(str(err)) from err
        if len(self._streams) >= self.max_waiting + self.core.sched_config.max_num_seqs:
            raise ResourceExhausted(
                f"the engine queue is full ({len(self._streams)} requests); retry later")
        arrival = time.monotonic()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        try:
            fetch_span = tracer("kvmesh.engine").start_span("engine.kv_fetch") if kv is not None else None
            plan, blend, document_ids = None, None, ()
            fetch = params.prompt_logprobs is None  # prompt logprobs: the whole prompt is computed
            if parts is not None:
                namespace = kv.namespace(cache_salt) if kv is not None else None
                resolved = await resolve(parts, kv, namespace)
                prompt_token_ids, document_ids = resolved.token_ids, tuple(resolved.document_ids)
                self.core.validate(prompt_token_ids, params)
                if kv is not None and resolved.documents:
                    ratio = self.core.blend_config.recompute_ratio if recompute_ratio is None else recompute_ratio
                    with trace.use_span(fetch_span, end_on_exit=False):
                        blend, doc_exports = await plan_documents(resolved, kv, namespace, ratio if fetch else 1.0,
                                                                  self._start_probe)
            if kv is not None and blend is None and not ingest:  # blended KV is not a prefix's
                local = self.core.cached_prefix_tokens(prompt_token_ids, cache_salt) if fetch else 0
                with trace.use_span(fetch_span, end_on_exit=False):
                    plan = await kv.prepare(list(prompt_token_ids), cache_salt, spec, local, fetch=fetch)
        except BaseException:
            self._streams.pop(request_id, None)
            if fetch_span is not None:
                fetch_span.end()
            raise
        if fetch_span is not None:
            fetch_span.set_attributes({
                "kvmesh.kv.fetched_tokens": (plan.tokens - plan.start) if plan is not None and plan.kv is not None else 0,
                "kvmesh.kv.document_tokens": blend.cached_tokens if blend is not None else 0})
            fetch_span.end()
        req = EngineRequest(request_id, list(prompt_token_ids), params, arrival,
                            cache_salt=cache_salt, kv_plan=plan, speculation=speculation,
                            blend=blend, doc_exports=doc_exports, document_ids=document_ids, kv_spec=spec,
                            trace_context=otel_context.get_current())
        self._post("add", req)
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                if finished:
                    _trace_request(out, len(prompt_token_ids))
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post("abort", request_id)
            if self._idle is not None and not self._streams:
                self._idle.set()

    async def ingest_document(self, document_id: str, token_ids: list[int], text: str, *,
                              metadata: dict[str, str] | None = None, cache_salt: bytes = b"",
                              ttl_s: float | None = None, pinned: bool = False,
                              kv_codec: str = "") -> tuple[int, int, int]:
        """Stores a document's KV (computed alone, from position 0) by content key, then its
        catalog entry. Returns (tokens, chunks, chunks already stored)."""
        kv = self.core.kv
        if kv is None:
            raise FailedPrecondition("ingesting documents needs the KV-cache service; start the engine with "
                                     "--kvcache-address (kvmesh up does)")
        if not document_id:
            raise InvalidArgument("IngestDocument: document_id is empty; name the document")
        if not token_ids:
            raise InvalidArgument("IngestDocument: the document is empty; send text or token ids")
        if ttl_s is not None and not ttl_s > 0:
            raise InvalidArgument(f"IngestDocument: ttl_s must be > 0 seconds, got {ttl_s}")
        namespace = kv.namespace(cache_salt)
        chunks = document_chunks(token_ids, kv.config.chunk_tokens, namespace)
        present = await kv.lookup([key for _, _, key in chunks])
        missing = [(key, a, b) for (a, b, key), p in zip(chunks, present) if not p]
        if missing:
            loop = asyncio.get_running_loop()
            stored: asyncio.Future[bool] = loop.create_future()

            def done(ok: bool) -> None:
                loop.call_soon_threadsafe(lambda: stored.done() or stored.set_result(ok))

            exports = DocumentExports(namespace, missing, on_done=done)
            params = SamplingParams(max_tokens=1, temperature=0.0)
            last = None
            async for last in self.generate(token_ids, params, cache_salt=cache_salt, kv_codec=kv_codec,
                                            speculation=SpecMode.OFF, doc_exports=exports):
                pass
            if last is None or last.finish_reason == "abort":
                raise Unavailable("ingesting the document was aborted (engine stopping?); retry")
            if not await asyncio.wait_for(stored, EXPORT_TIMEOUT_S * len(missing)):
                raise Unavailable("storing the document's KV in the KV-cache service failed; retry")
        await kv.put_document(kvcache_pb2.PutDocumentRequest(
            namespace=namespace, document_id=document_id, metadata=metadata or {},
            text=text or self.core.tokenizer.decode(token_ids), token_ids=token_ids,
            chunk_keys=[key for _, _, key in chunks], ttl_s=ttl_s, pinned=pinned))
        return len(token_ids), len(chunks), len(chunks) - len(missing)

    def _start_probe(self, token_ids: list[int]) -> BlendPrefill:
        """A blend whose first stage the step loop runs at its next boundary (while the
        documents' KV is still being fetched here)."""
        cfg = self.core.blend_config
        job = BlendPrefill(self.core.loaded.model, token_ids, cfg.select_layers, cfg.selection)
        self._post("blend-probe", job)
        return job

    def probe(self, prompt_token_ids: list[int], cache_salt: bytes = b"") -> ProbeResult:
        """The prompt's reusable cached prefix and the engine's load, without waiting for the
        step in flight (see the NOTE); Unavailable while draining: place requests elsewhere."""
        if self._draining or self._stopping:
            raise Unavailable("the engine is draining for shutdown; place the request on another replica")
        with self._cond:
            queued = [req for kind, req in self._inbox if kind == "add"]
        load = self._load
        if queued:  # posted, not yet applied: they wait at least until the next step boundary
            load = dataclasses.replace(
                load, waiting=load.waiting + len(queued),
                pending_prefill_tokens=load.pending_prefill_tokens + sum(len(r.prompt_token_ids) for r in queued))
        return ProbeResult(self.core.cached_prefix_tokens(prompt_token_ids, cache_salt), load)

    def abort(self, request_id: str) -> bool:
        """Aborts a queued or running request; the consumer receives a final 'abort' output."""
        known = request_id in self._streams
        if known:
            self._post("abort", request_id)
        return known

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    async def drain(self, timeout_s: float) -> None:
        """Refuses new requests and waits (up to `timeout_s`) for the running ones to finish."""
        self._draining = True
        self._idle = asyncio.Event()
        if not self._streams:
            return
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            log.warning("drain timed out with %d requests still running", len(self._streams))

    def shutdown(self) -> None:
        """Stops the step loop thread (running requests are aborted)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def _post(self, kind: str, payload: object) -> None:
        with self._cond:
            self._inbox.append((kind, payload))
            self._cond.notify()

    # ---- engine thread -----------------------------------------------------------------------

    def _deliver(self, out: RequestOutput | BaseException, request_id: str) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def _apply_inbox(self) -> None:
        """Applies every posted add and abort, then publishes the load, all under the inbox lock
        (adds and aborts are cheap): a probe sees each add either in the inbox or in the load."""
        blend_probes: list[BlendPrefill] = []
        with self._cond:
            for kind, payload in self._inbox:
                if kind == "blend-probe":
                    blend_probes.append(payload)  # type: ignore[arg-type]
                elif kind == "add":
                    req: EngineRequest = payload  # type: ignore[assignment]
                    try:
                        self.core.add_request(req)
                    except Exception as exc:  # noqa: BLE001 - delivered to the caller as its error
                        self._deliver(exc, req.request_id)
                else:
                    out = self.core.abort(payload)  # type: ignore[arg-type]
                    if out is not None:
                        self._deliver(out, out.request_id)
                        if self.on_abort is not None:
                            self.on_abort(out)
            self._inbox.clear()
            self._load = self.core.load()
        for job in blend_probes:  # outside the lock: a probe is a layer over the whole prompt
            try:
                job.probe()
            except Exception:  # noqa: BLE001 - finish() probes again and reports the error there
                log.exception("blend probe failed")

    def _run(self, build: Callable[[], EngineCore], built: concurrent.futures.Future) -> None:
        try:
            core = build()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the constructor
            built.set_exception(exc)
            return
        self.core = core
        self._load = core.load()
        built.set_result(core)
        while True:
            with self._cond:
                while not self._inbox and not self.core.has_work and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
            self._apply_inbox()
            if not self.core.has_work:
                continue
            t0 = time.perf_counter()
            try:
                outputs = self.core.step()
            except Exception:  # noqa: BLE001 - a failed step must not kill the engine
                log.exception("engine step failed; aborting the requests in that batch")
                self._abort_all(RuntimeError("engine step failed; see engine logs"))
                self._load = self.core.load()
                continue
            self._load = self.core.load()
            if self.on_step is not None:
                self.on_step(self.core, outputs, time.perf_counter() - t0)
            for out in outputs:
                self._deliver(out, out.request_id)
        self._abort_all(Unavailable("the engine stopped"))
        with self._cond:  # adds posted too late: refuse them, so no caller waits forever
            left = [payload for kind, payload in self._inbox if kind == "add"]
            self._inbox.clear()
        for req in left:
            self._deliver(Unavailable("the engine stopped"), req.request_id)  # type: ignore[attr-defined]

    def _abort_all(self, error: BaseException) -> None:
        for request_id in self.core.request_ids():
            self.core.abort(request_id)
            self._deliver(error, request_id)


def _trace_request(out: RequestOutput, prompt_tokens: int) -> None:
    """The request's way through the engine as spans under the current (server) span, from its
    timeline: engine.queue (arrival to admission), engine.blend, engine.prefill (admission to the
    first token), engine.decode (first token to the end, with one `spec_verify` event per
    verification step); usage as GenAI semantic-convention attributes on the server span."""
    server = trace.get_current_span()
    usage, t = out.usage, out.timeline
    attrs = {"gen_ai.usage.input_tokens": usage.prompt_tokens if usage else prompt_tokens,
             "gen_ai.usage.output_tokens": usage.completion_tokens if usage else 0,
             "gen_ai.response.finish_reasons": [out.finish_reason or ""],
             "kvmesh.engine.cached_tokens": usage.cached_prompt_tokens if usage else 0}
    if out.spec is not None and out.spec.steps:
        attrs.update({"kvmesh.spec.steps": out.spec.steps, "kvmesh.spec.draft_tokens": out.spec.draft_tokens,
                      "kvmesh.spec.accepted_tokens": out.spec.accepted_tokens})
    if out.documents is not None:
        attrs.update({"kvmesh.blend.blended_tokens": out.documents.blended_tokens,
                      "kvmesh.blend.recomputed_tokens": out.documents.recomputed_tokens,
                      "kvmesh.documents": list(out.documents.document_ids)})
    server.set_attributes(attrs)
    if t is None or not server.get_span_context().is_valid:
        return
    offset = time.time_ns() - time.monotonic_ns()

    def ns(instant: float) -> int:
        return int(instant * 1e9) + offset

    def span(name: str, start: float | None, end: float | None, **attributes) -> trace.Span | None:
        if start is None or end is None:
            return None
        return tracer("kvmesh.engine").start_span(name, start_time=ns(start), attributes=attributes)

    queue = span("engine.queue", t.arrival, t.admitted or t.finished)
    if queue is not None:
        queue.end(end_time=ns(t.admitted or t.finished))
    if t.blend is not None:
        blend = span("engine.blend", *t.blend, **{k: v for k, v in attrs.items() if k.startswith("kvmesh.blend")})
        blend.end(end_time=ns(t.blend[1]))
    prefill = span("engine.prefill", t.admitted, t.first_token or t.finished,
                   **{"gen_ai.usage.input_tokens": attrs["gen_ai.usage.input_tokens"],
                      "kvmesh.engine.cached_tokens": attrs["kvmesh.engine.cached_tokens"]})
    if prefill is not None:
        prefill.end(end_time=ns(t.first_token or t.finished))
    decode = span("engine.decode", t.first_token, t.finished,
                  **{"gen_ai.usage.output_tokens": attrs["gen_ai.usage.output_tokens"]})
    if decode is not None:
        for instant, drafted, accepted in t.spec_steps:
            decode.add_event("spec_verify", {"kvmesh.spec.draft_tokens": drafted,
                                             "kvmesh.spec.accepted_tokens": accepted}, timestamp=ns(instant))
        decode.end(end_time=ns(t.finished))
