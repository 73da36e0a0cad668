"""The asyncio face of the engine: requests in from gRPC handlers, the step loop on its own thread.

NOTE: threading model. Torch releases the GIL inside its kernels, and so do kvmesh's own native
kernels (kvmesh.model.native, NOTE (the GIL)), so the step loop runs on one dedicated thread while
the asyncio loop keeps serving RPCs. That thread also builds the core
(loads the model): every parallel torch op of the process then comes from one thread, so
OpenMP keeps a single team of workers. A second team (say, the model loaded on the main thread,
steps run on this one) puts more OpenMP threads than cores in the process, and libgomp then
throttles its spin-wait to ~100 iterations: workers sleep between the ~500 small ops of a
decode step and each op pays a futex wake-up. Measured on 2 cores: fp32 decode 17 tok/s with
two teams, 31 tok/s with one.

The two sides talk through a locked inbox of typed messages (Add, Abort, BlendProbe: applied
between steps, so the core stays single-threaded) and per-request asyncio queues filled with `call_soon_threadsafe`. When a
consumer goes away (client cancel, deadline), its generator's `finally` posts an abort, which
frees the request's blocks at the next step boundary.

The draft service is called from the step loop too (Speculator.propose): one synchronous
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
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Optional, Union

from kvmesh.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvmesh.kv.blend import BlendPrefill
from kvmesh.kv.codec import CodecSpec
from kvmesh.kv.quality import QualityBudget
from kvmesh.prompt_parts import Part
from kvmesh.services.engine.core import EngineCore
from kvmesh.services.engine.ingest import IngestRequest, IngestResult, ingest_document
from kvmesh.services.engine.outputs import EngineLoad, EngineRequest, ProbeResult, RequestOutput
from kvmesh.services.engine.kv_transfer import Handoff
from kvmesh.services.engine.prepare import GenerateInput, RequestPreparer
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.speculation import SpecMode
from kvmesh.services.engine.tracing import trace_request

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Add:
    """Queue a prepared request."""

    request: EngineRequest


@dataclass(frozen=True)
class Abort:
    """Abort a queued or running request."""

    request_id: str


@dataclass(frozen=True)
class BlendProbe:
    """Run a blend's first stage while its documents' KV is still being fetched."""

    job: BlendPrefill


Message = Union[Add, Abort, BlendProbe]
"""What the asyncio side posts to the step loop."""

OutputOrError = Union[RequestOutput, BaseException]


class AsyncEngine:
    """Runs an `EngineCore` on a background thread and streams outputs to asyncio consumers."""

    def __init__(self, build: Callable[[], EngineCore]) -> None:
        """Starts the step-loop thread, runs `build` on it and returns once the core is ready
        (re-raising whatever `build` raised)."""
        self._cond = threading.Condition()
        self._inbox: deque[Message] = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[OutputOrError]]] = {}
        self._stopping = False
        self._draining = False
        self._idle: Optional[asyncio.Event] = None  # set when draining and the last stream ends
        self.on_step: Optional[Callable[[EngineCore, list[RequestOutput], float], None]] = None
        """Called on the step loop after each step (metrics)."""
        self.on_abort: Optional[Callable[[RequestOutput], None]] = None
        """Called on the step loop with the final output of a request aborted between steps."""
        built: concurrent.futures.Future[EngineCore] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built),
                                        name="engine-step-loop", daemon=True)
        self._thread.start()
        self.core: EngineCore
        built.result()  # re-raises what `build` raised; the step loop has set self.core
        self.preparer = RequestPreparer(self.core, self._start_probe)
        cfg = self.core.sched_config
        self.max_requests = cfg.max_waiting + cfg.max_num_seqs
        """Requests in flight (preparing, queued or running) beyond which new ones are refused."""

    # ---- asyncio side ------------------------------------------------------------------------

    async def generate(self, prompt_token_ids: Optional[list[int]], params: SamplingParams, request_id: str = "",
                       *, tenant_salt: str = "", kv_codec: Optional[CodecSpec] = None,
                       speculation: Optional[SpecMode] = None, parts: Optional[list[Part]] = None,
                       recompute_ratio: Optional[float] = None,
                       quality_budget: QualityBudget = QualityBudget(),
                       resume_token_ids: tuple[int, ...] = (),
                       kv_handoff: Optional[Handoff] = None) -> AsyncIterator[RequestOutput]:
        """Validates and queues a request, then yields its outputs until the final one (see
        GenerateInput for the arguments). With a KV-cache service configured, the prompt's
        cached prefix or documents are fetched first, while the step loop keeps serving other
        requests; that never fails the request."""
        inp = GenerateInput(prompt_token_ids, params, request_id, tenant_salt, kv_codec, speculation, parts,
                            recompute_ratio, quality_budget=quality_budget, resume_token_ids=resume_token_ids,
                            kv_handoff=kv_handoff)
        async for out in self.submit(inp):
            yield out

    async def submit(self, inp: GenerateInput) -> AsyncIterator[RequestOutput]:
        """`generate` for a prepared GenerateInput (also used by ingest)."""
        if self._draining:
            raise Unavailable("the engine is draining for shutdown; retry on another replica")
        request_id = inp.request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidArgument(f"request_id {request_id!r} is already running; use a unique id")
        self.preparer.check(inp)
        if len(self._streams) >= self.max_requests:
            raise ResourceExhausted(f"the engine queue is full ({len(self._streams)} requests); retry later")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[OutputOrError] = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        try:
            req = await self.preparer.prepare(inp, request_id, time.monotonic())
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._post(Add(req))
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                if finished:
                    trace_request(out, len(req.prompt_token_ids))
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._post(Abort(request_id))
            if self._idle is not None and not self._streams:
                self._idle.set()

    async def ingest_document(self, req: IngestRequest) -> IngestResult:
        """Stores a document's KV by content key, then its catalog entry (services/engine/ingest)."""
        return await ingest_document(self, req)

    def kv_codec(self, name: str, zstd: bool) -> CodecSpec:
        """A request's codec override on top of the deployment's settings (RequestPreparer.codec)."""
        return self.preparer.codec(name, zstd)

    def _start_probe(self, token_ids: list[int]) -> BlendPrefill:
        """A blend whose first stage the step loop runs at its next boundary."""
        job = self.core.blender.new_job(token_ids)
        self._post(BlendProbe(job))
        return job

    def probe(self, prompt_token_ids: list[int], tenant_salt: str = "") -> ProbeResult:
        """The prompt's reusable cached prefix and the engine's load, without waiting for the
        step in flight (see the NOTE); Unavailable while draining: place requests elsewhere."""
        if self._draining or self._stopping:
            raise Unavailable("the engine is draining for shutdown; place the request on another replica")
        with self._cond:
            queued = [m.request for m in self._inbox if isinstance(m, Add)]
        load = self._load
        if queued:  # posted, not yet applied: they wait at least until the next step boundary
            load = dataclasses.replace(
                load, waiting=load.waiting + len(queued),
                pending_prefill_tokens=load.pending_prefill_tokens + sum(len(r.prompt_token_ids) for r in queued))
        cached = self.core.cached_prefix_tokens(prompt_token_ids, self.core.request_namespace(tenant_salt))
        return ProbeResult(cached, load)

    def abort(self, request_id: str) -> bool:
        """Aborts a queued or running request; the consumer receives a final 'abort' output."""
        known = request_id in self._streams
        if known:
            self._post(Abort(request_id))
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

    def _post(self, message: Message) -> None:
        with self._cond:
            self._inbox.append(message)
            self._cond.notify()

    # ---- engine thread -----------------------------------------------------------------------

    def _deliver(self, out: OutputOrError, request_id: str) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, queue = target
            loop.call_soon_threadsafe(queue.put_nowait, out)

    def _apply_inbox(self) -> None:
        """Applies every posted add and abort, then publishes the load, all under the inbox lock
        (adds and aborts are cheap): a probe sees each add either in the inbox or in the load."""
        probes: list[BlendPrefill] = []
        with self._cond:
            for message in self._inbox:
                if isinstance(message, BlendProbe):
                    probes.append(message.job)
                elif isinstance(message, Add):
                    try:
                        done = self.core.add_request(message.request)
                    except Exception as exc:  # noqa: BLE001 - delivered to the caller as its error
                        self._deliver(exc, message.request.request_id)
                    else:
                        if done is not None:  # resumed tokens that already finish the request
                            self._deliver(done, done.request_id)
                else:
                    out = self.core.abort(message.request_id)
                    if out is not None:
                        self._deliver(out, out.request_id)
                        if self.on_abort is not None:
                            self.on_abort(out)
            self._inbox.clear()
            self._load = self.core.load()
        for job in probes:  # outside the lock: a probe is a layer over the whole prompt
            self.core.blender.probe(job)

    def _run(self, build: Callable[[], EngineCore], built: concurrent.futures.Future) -> None:
        try:
            core = build()
        except BaseException as exc:  # noqa: BLE001 - re-raised by the constructor
            built.set_exception(exc)
            return
        self.core = core
        self._load: EngineLoad = core.load()  # republished at every step boundary
        built.set_result(core)
        while True:
            with self._cond:
                while not self._inbox and not core.has_work and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
            self._apply_inbox()
            if not core.has_work:
                continue
            t0 = time.perf_counter()
            try:
                outputs = core.step()
            except Exception:  # noqa: BLE001 - a failed step must not kill the engine
                log.exception("engine step failed; aborting the requests in that batch")
                self._abort_all(core, RuntimeError("engine step failed; see engine logs"))
                self._load = core.load()
                continue
            self._load = core.load()
            if self.on_step is not None:
                self.on_step(core, outputs, time.perf_counter() - t0)
            for out in outputs:
                self._deliver(out, out.request_id)
        self._abort_all(core, Unavailable("the engine stopped"))
        with self._cond:  # adds posted too late: refuse them, so no caller waits forever
            left = [m.request for m in self._inbox if isinstance(m, Add)]
            self._inbox.clear()
        for req in left:
            self._deliver(Unavailable("the engine stopped"), req.request_id)

    def _abort_all(self, core: EngineCore, error: BaseException) -> None:
        for request_id in core.request_ids():
            core.abort(request_id)
            self._deliver(error, request_id)
