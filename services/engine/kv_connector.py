"""The engine's link to the KV-cache service: fetch a prompt's cached prefix, export new chunks.

NOTE (where the work happens, and why nothing here can fail a request).
  * Fetch runs on the asyncio side when a request arrives, before it is queued: Lookup the
    prompt's chained chunk keys, Get the leading present ones, decode them on the `kv-codec`
    thread. The step loop keeps computing other requests meanwhile, so the fetch overlaps with
    work. The fetched KV rides on the request; the scheduler imports it into paged blocks at
    admission (see scheduler.KvImport).
  * Export: once a prompt is fully computed the step loop copies the KV of its new full chunks
    out of the paged cache (one index_select per layer) and hands them to an export thread,
    which encodes and Puts them. The step loop never waits on it; a full export queue drops the
    job (counted).
  * Export priority. Most exports are an investment in later hits that nobody waits for; those
    run on the `kv-export` thread in Linux's idle scheduling class (KvConnectorConfig.
    export_priority), so they use only CPU the step loop leaves. Measured on the 2-core Xeon,
    RAG prompts of ~800 tokens one at a time: at normal priority, encoding fp32 chunks (~70 ms
    of CPU each) took a core from the step loop's OpenMP team, and TPOT went from 11 to 22 ms
    and TTFT from 0.77 to 0.94 s; at idle priority both are back at the no-export figures.
    Under sustained load the background queue waits for idle time and, once full
    (max_export_queue jobs or max_export_bytes of KV), drops new jobs (counted). Jobs someone
    waits for -- a P/D handoff's chunks, an ingested document -- are urgent and run on the
    `kv-export-urgent` thread at normal priority.
  * Every failure -- service down, slow (deadline), a blob that fails its checksum, a blob of
    another namespace or shape, token ids that differ -- ends the fetch at that chunk: the
    request computes the rest itself. A bad blob is also deleted from the service.
  * Codec work (quantize, zstd, dequantize) runs on threads that set torch to one thread: a
    second multi-threaded OpenMP team in the process would throttle the step loop's (see the
    threading NOTE in async_engine).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
from opentelemetry import context as otel_context
from opentelemetry.context import Context

from kvmesh.errors import Unavailable
from kvmesh.kv import codec
from kvmesh.kv.keys import prefix_keys, tail_key
from kvmesh.kv.namespace import EXACT, NAMESPACE_BYTES, KvLayout, KvNamespace
from kvmesh.kv.rope import rotate_keys, unrotate_keys
from kvmesh.model.llama import RotaryEmbedding
from kvmesh.services.engine.hot_chunks import HotChunks
from kvmesh.services.engine.kvcache_client import KvcacheClient, KvcacheWriter
from kvmesh.threads import lower_thread_priority, set_torch_threads

if TYPE_CHECKING:
    from kvmesh.services.engine.kv_transfer import Handoff

log = logging.getLogger(__name__)


def encode_chunk(k: torch.Tensor, v: torch.Tensor, token_ids, namespace: bytes, spec: codec.CodecSpec,
                 position: int, rotary: RotaryEmbedding, positioned: bool) -> bytes:
    """One chunk of a sequence's KV ``[layers, n, kv_heads, head_dim]`` (keys at their positions,
    the first at `position`) as an export stores it: keys un-rotated to position-free unless
    `positioned` (an exact prefix chunk keeps them as computed); the sequence's first chunk is
    marked as its start (the codecs' fp16 head tokens)."""
    if not positioned:
        k = unrotate_keys(k, position, rotary).to(v.dtype)
    meta = codec.ChunkMeta(namespace, tuple(token_ids), positioned=positioned)
    return codec.encode(k, v, meta, spec, sequence_start=position == 0)


def stored_round_trip(k: torch.Tensor, v: torch.Tensor, token_ids, namespace: bytes, spec: codec.CodecSpec,
                      rotary: RotaryEmbedding, chunk_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt prefix's KV (keys at positions 0.., ``[layers, n, kv_heads, head_dim]``, n a
    multiple of `chunk_tokens`) as a fetch imports it after an export with `spec`: chunk by chunk
    encoded and decoded, keys back at their positions. What a codec does to a cache hit, for the
    guardrail's replays and kvmesh bench quality."""
    positioned = spec.storage(v.dtype) == EXACT
    ks, vs = [], []
    for start in range(0, k.shape[1], chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        blob = encode_chunk(k[:, sl], v[:, sl], token_ids[sl], namespace, spec, start, rotary, positioned)
        dk, dv, header = codec.decode(blob, namespace=namespace, dtype=v.dtype)
        ks.append(dk if header.positioned else rotate_keys(dk, start, rotary).to(k.dtype))
        vs.append(dv)
    return torch.cat(ks, dim=1), torch.cat(vs, dim=1)


@dataclass(frozen=True)
class KvConnectorConfig:
    """How an engine uses the KV-cache service."""

    address: str
    chunk_tokens: int = 256
    codec: codec.CodecSpec = field(default_factory=codec.CodecSpec)
    timeout_s: float = 5.0
    retry_s: float = 2.0
    """After the service failed to answer, how long requests skip it (KvcacheClient's NOTE)."""
    max_export_queue: int = 64
    """Jobs each export queue holds (one job: a prompt's new chunks); more are dropped (counted)."""
    max_export_bytes: int = 1 << 30
    """KV bytes the queued background jobs may hold; a job past it is dropped (counted)."""
    export_priority: str = "idle"
    """The background export thread's CPU priority: "idle" (only CPU nothing else wants) or
    "normal" (competes with the step loop). Urgent jobs always run at normal priority."""
    hot_bytes: int = 512 << 20
    """Byte budget of the engine's own LRU of decoded document chunks (services/engine/hot_chunks.py);
    0 turns it off."""


@dataclass
class KvPlan:
    """What the KV service had for one prompt, attached to the request at admission."""

    namespace: KvNamespace
    keys: list[bytes]  # chained keys of the prompt's full chunks
    present: list[bool]  # per key, stored when looked up (no need to export it again)
    kv: tuple[torch.Tensor, torch.Tensor] | None = None  # fetched [layers, tokens, kvh, hd]
    start: int = 0  # sequence position of the first token `kv` covers (whole chunks)
    tokens: int = 0  # end position of what `kv` covers (whole blocks)
    spec: codec.CodecSpec | None = None  # codec for this prompt's exports (None = the deployment's)
    handoff: Optional["Handoff"] = None
    """A P/D prefill hop: export chunk by chunk as computed, and report when stored (kv_transfer)."""
    tail_key: Optional[bytes] = None
    """The key of the prompt's trailing partial chunk (kvmesh.kv.keys.tail_key), None when the
    prompt ends on a chunk boundary: a P/D prefill hop stores it, a decode hop fetches it."""
    tail_present: bool = False


@dataclass(frozen=True)
class ExportJob:
    """New full chunks of one prompt to store: k, v [layers, n*chunk, kvh, hd] from position start."""

    namespace: KvNamespace
    keys: list[bytes]
    token_ids: list[int]
    start: int  # sequence position of the first token (keys are stored un-rotated from there)
    k: torch.Tensor
    v: torch.Tensor
    spec: codec.CodecSpec | None = None  # the request's codec; None = the deployment's
    positioned: bool = False
    """Store the keys as the paged cache holds them (at their positions) instead of position-free:
    exact prefix chunks (codec.ChunkMeta.positioned)."""
    on_done: Optional[Callable[[bool], None]] = None
    """Called on the export thread once the job's chunks are stored (True) or given up (False)."""
    trace_context: Optional[Context] = None
    """The request's OpenTelemetry context: its Puts become spans of the request's trace."""
    on_stored: Optional[Callable[[int], None]] = None
    """Called on the export thread with the byte size of each chunk it stored."""
    urgent: bool = False
    """Someone waits for it (a P/D handoff's chunk, which a decode hop needs; an ingested
    document): stored by the normal-priority export thread, never behind background jobs."""
    ready: Optional[Callable[[], None]] = None
    """Blocks until k, v hold their values (a device-to-host copy in flight on the engine's copy
    stream, services/engine/kv_copies.py); called on the export thread before they are read."""


@dataclass
class ConnectorStats:
    lookups: int = 0
    fetched_chunks: int = 0
    fetch_failures: int = 0
    bad_blobs: int = 0
    exported_chunks: int = 0
    export_failures: int = 0
    export_dropped: int = 0
    hot_chunks: int = 0
    """Document chunks served from the engine's own hot LRU, without a Get."""


def _single_thread_torch() -> None:
    set_torch_threads(1)


class KvConnector:
    """The KV-cache service as one engine uses it (one model identity and KV layout): fetch,
    document chunks, export. Every namespace comes in as a KvNamespace value (the request's);
    this class never builds one."""

    def __init__(self, config: KvConnectorConfig, *, layout: KvLayout, dtype: torch.dtype, block_size: int,
                 rotary: RotaryEmbedding, client: Optional[KvcacheClient] = None) -> None:
        if config.chunk_tokens % block_size:
            raise ValueError(f"kv chunk_tokens ({config.chunk_tokens}) must be a multiple of the block "
                             f"size ({block_size})")
        self.config = config
        self.layout = layout
        self.dtype = dtype
        self.block_size = block_size
        self.rotary = rotary  # stored keys are position-free (see kvmesh.kv.rope)
        self.client = client or KvcacheClient(config.address, config.timeout_s, config.retry_s)
        self.stats = ConnectorStats()
        # Two single-threaded decoders: a fetch decodes two chunks at a time (a prompt's TTFT
        # waits on it), each without an OpenMP team of its own.
        self._codec_pool = ThreadPoolExecutor(2, "kv-codec", initializer=_single_thread_torch)
        # Two export threads (see the NOTE on export priority): urgent jobs, which someone waits for,
        # at normal priority; the others on a thread that takes only idle CPU. None ends a thread
        # after what is queued.
        self._exports: dict[bool, queue.Queue[ExportJob | None]] = {
            urgent: queue.Queue(config.max_export_queue) for urgent in (True, False)}
        self._queued_bytes = 0  # of background jobs, under _lock
        self._lock = threading.Lock()  # _queued_bytes and the export stats (two export threads)
        self.export_priority = "normal"  # what the background thread got (lower_thread_priority)
        started = threading.Event()
        self._export_threads = [
            threading.Thread(target=self._export_loop, args=(True, None), name="kv-export-urgent", daemon=True),
            threading.Thread(target=self._export_loop, args=(False, started), name="kv-export", daemon=True)]
        for t in self._export_threads:
            t.start()
        started.wait()
        self.hot = HotChunks(config.hot_bytes)

    def _shape(self, tokens: int) -> tuple[int, int, int, int]:
        return self.layout.num_layers, tokens, self.layout.num_kv_heads, self.layout.head_dim

    async def warm_up(self) -> bool:
        """Connects to the service and runs the codec once on each decoder thread, so the first
        fetch pays no set-up. Returns whether the service answered (it may come up later)."""
        k = torch.zeros(self._shape(self.config.chunk_tokens))
        ns = bytes(NAMESPACE_BYTES)  # a local round trip only: never stored
        blob = codec.encode(k, k, codec.ChunkMeta(ns, (0,) * self.config.chunk_tokens), self.config.codec)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*[loop.run_in_executor(self._codec_pool, lambda: codec.decode(blob, namespace=ns))
                               for _ in range(2)])
        try:
            await self.client.ping()
            return True
        except Unavailable as err:
            log.warning("%s not answering yet; requests recompute until it does", err)
            return False

    # ---- fetch (asyncio side) ------------------------------------------------------------------

    async def prepare(self, prompt: list[int], namespace: KvNamespace, spec: codec.CodecSpec | None = None,
                      local_tokens: int = 0, *, fetch: bool = True, tail: bool = False) -> KvPlan | None:
        """Looks up and fetches the prompt's cached prefix; None when it has no full chunk.

        `namespace` is the request's (its storage names `spec`, the codec this prompt's new
        chunks will be stored with; None: the deployment's); `local_tokens` how much of the
        prompt the engine's own prefix cache holds: whole chunks of it are not fetched again (a
        chat's next turn on the same replica fetches nothing). `fetch` False only looks up which
        chunks the service lacks (they are exported once computed): for a request that computes
        its whole prompt anyway. `tail` (P/D hops) also looks up the key of the prompt's partial last
        chunk (kvmesh.kv.keys.tail_key), which only a P/D prefill hop stores."""
        chunk = self.config.chunk_tokens
        if len(prompt) < chunk:
            return None
        keys = prefix_keys(prompt, chunk, namespace.digest())
        plan = KvPlan(namespace, keys, [False] * len(keys), spec=spec,
                      tail_key=tail_key(prompt, chunk, namespace.digest(), keys) if tail else None)
        t0 = time.perf_counter()
        try:
            self.stats.lookups += 1
            # the tail key rides on the same Lookup (the service counts it as one more chunk)
            found = await self.client.lookup(keys + ([plan.tail_key] if plan.tail_key else []), chunk)
            plan.present = found.present[:len(keys)]
            plan.tail_present = plan.tail_key is not None and found.prefix_chunks > len(keys)
            t_lookup = time.perf_counter()
            first = local_tokens // chunk
            if fetch and min(found.prefix_chunks, len(keys)) > first:
                t_streamed = await self._fetch(plan, prompt, first, min(found.prefix_chunks, len(keys)))
                # Whole blocks only, and never the last prompt token: it is computed for logits.
                plan.tokens = min(plan.tokens, (len(prompt) - 1) // self.block_size * self.block_size)
        except Unavailable as err:
            self.stats.fetch_failures += 1
            log.warning("KV service unavailable for fetch (%s); computing the prompt", err)
        if plan.kv is not None:
            log.info("KV of prompt tokens %d..%d fetched in %.0f ms (lookup %.0f ms, stream %.0f ms, then "
                     "decoding %.0f ms)", plan.start, plan.tokens, 1e3 * (time.perf_counter() - t0),
                     1e3 * (t_lookup - t0), 1e3 * (t_streamed - t_lookup),
                     1e3 * (time.perf_counter() - t_streamed))
        return plan

    async def _fetch(self, plan: KvPlan, prompt: list[int], first: int, n: int) -> float:
        """Streams chunks first..n-1 (and the prompt's tail after the last full chunk, when all
        are there and the service holds it) and decodes each on the codec thread as soon as it
        has arrived (decode overlaps the transfer), straight into one destination tensor.
        Returns when the stream ended (perf_counter), for the log."""
        chunk = self.config.chunk_tokens
        keys = plan.keys[first:n]
        spans = [((first + i) * chunk, (first + i + 1) * chunk) for i in range(len(keys))]
        if plan.tail_present and n == len(plan.keys):
            keys.append(plan.tail_key)
            spans.append((n * chunk, len(prompt)))
        shape = self._shape(spans[-1][1] - spans[0][0])
        dest = (torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))
        loop = asyncio.get_running_loop()
        decodes: list[asyncio.Future] = []
        ns = plan.namespace.digest()
        async for blob in self.client.get(keys):
            if blob is None:
                break  # evicted since Lookup, or damaged in transit: import what came before it
            a, b = spans[len(decodes)]
            decodes.append(loop.run_in_executor(
                self._codec_pool, self._decode_into, blob, prompt[a:b], ns, dest, a - spans[0][0], a))
        streamed = time.perf_counter()
        ok = 0
        for i, fut in enumerate(decodes):  # in order: the prefix ends at the first bad chunk
            if await fut and ok == i:
                ok += 1
        if ok < len(decodes):
            self.stats.bad_blobs += 1
            if first + ok < len(plan.keys):
                plan.present[first + ok] = False
            else:
                plan.tail_present = False
            try:
                await self.client.delete([keys[ok]])
            except Unavailable:
                pass
        if ok:
            covered = spans[ok - 1][1] - spans[0][0]
            plan.kv = (dest[0][:, :covered], dest[1][:, :covered])
            plan.start, plan.tokens = spans[0][0], spans[ok - 1][1]
            self.stats.fetched_chunks += ok
        return streamed

    def _decode(self, blob: bytes, ids: list[int], namespace: bytes, what: str
                ) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
        """(k, v, whether k is at its positions) of one blob, or None (logged) when it is damaged,
        of another namespace or shape, or holds other token ids than `ids`."""
        try:
            k, v, header = codec.decode(blob, namespace=namespace, dtype=self.dtype,
                                        expect_shape=self._shape(len(ids)))
        except (codec.CorruptBlob, codec.NamespaceMismatch) as err:
            log.warning("KV blob of %s rejected (%s); computing it", what, err)
            return None
        if list(header.token_ids) != list(ids):  # a key collision or a bad writer: never use it
            log.warning("KV blob of %s holds other token ids than its key claims; computing it", what)
            return None
        return k, v, header.positioned

    def _decode_into(self, blob: bytes, ids: list[int], namespace: bytes,
                     dest: tuple[torch.Tensor, torch.Tensor], start: int, position: int) -> bool:
        """Decodes one chunk (sequence position `position`) into dest[:, start:start+len(ids)],
        keys at their positions (rotated there unless stored so); False (and nothing written)
        when it is unusable."""
        kv = self._decode(blob, ids, namespace, f"the prompt at token {position}")
        if kv is None:
            return False
        k, v, positioned = kv
        dest[0][:, start:start + len(ids)].copy_(k if positioned else rotate_keys(k, position, self.rotary))
        dest[1][:, start:start + len(ids)].copy_(v)
        return True

    def _decode_free(self, blob: bytes, ids: list[int], namespace: bytes
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A document chunk: position-free (k, v), or None when unusable."""
        kv = self._decode(blob, ids, namespace, "a document chunk")
        if kv is not None and kv[2]:  # content keys are only ever stored position-free
            log.warning("document KV chunk stored at fixed positions; computing it")
            return None
        return kv[:2] if kv is not None else None

    # ---- documents: content keys (asyncio side) ------------------------------------------------

    async def lookup(self, keys: list[bytes]) -> list[bool]:
        """Which of `keys` the service holds (any tier). Raises Unavailable when it does not answer."""
        if not keys:
            return []
        return (await self.client.lookup(keys)).present

    async def fetch_chunks(self, namespace: KvNamespace, chunks: list[tuple[bytes, list[int]]]
                           ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """KV of chunks stored by content key: per (key, token ids), position-free keys and
        values [layers, len(ids), kvh, hd] in the engine dtype, or None where the chunk is
        missing, damaged or holds other tokens. Never raises for a chunk: a failed stream leaves
        the rest None (computed instead). Chunks in the hot LRU come from there (see
        hot_chunks.py); the returned tensors are shared: read them, never write them."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [self.hot.get(key, ids) for key, ids in chunks]
        wanted = [i for i, hit in enumerate(out) if hit is None]
        self.stats.hot_chunks += len(chunks) - len(wanted)
        if not wanted:
            return out
        loop = asyncio.get_running_loop()
        decodes: dict[int, asyncio.Future] = {}
        ns = namespace.digest()
        try:
            n = 0
            async for blob in self.client.get([chunks[i][0] for i in wanted]):
                if blob is not None:
                    i = wanted[n]
                    decodes[i] = loop.run_in_executor(self._codec_pool, self._decode_free, blob, chunks[i][1], ns)
                n += 1
        except Unavailable as err:
            self.stats.fetch_failures += 1
            log.warning("KV service unavailable for document chunks (%s); computing them", err)
        for i, fut in decodes.items():
            out[i] = await fut
            if out[i] is not None:
                self.hot.put(chunks[i][0], chunks[i][1], *out[i])
        self.stats.fetched_chunks += sum(out[i] is not None for i in wanted)
        return out

    # ---- export (step loop -> export thread) ---------------------------------------------------

    def submit_export(self, job: ExportJob) -> None:
        """Queues chunks for storing; never blocks. Drops the job (counted) when its queue is full,
        or, for a background job, when the KV it holds would pass config.max_export_bytes."""
        size = job.k.nbytes + job.v.nbytes
        if not job.urgent:
            with self._lock:
                over = self._queued_bytes + size > self.config.max_export_bytes
                if not over:
                    self._queued_bytes += size
            if over:
                self._drop(job)
                return
        try:
            self._exports[job.urgent].put_nowait(job)
        except queue.Full:
            if not job.urgent:
                with self._lock:
                    self._queued_bytes -= size
            self._drop(job)

    def _drop(self, job: ExportJob) -> None:
        self.stats.export_dropped += len(job.keys)
        if job.on_done is not None:
            job.on_done(False)

    def _export_loop(self, urgent: bool, started: Optional[threading.Event]) -> None:
        set_torch_threads(1)
        if started is not None:  # the background thread
            if self.config.export_priority == "idle":
                self.export_priority = lower_thread_priority()
            started.set()
        writer = KvcacheWriter(self.config.address)  # each Put a CLIENT span under its request
        jobs = self._exports[urgent]
        while (job := jobs.get()) is not None:
            self._export(job, writer)
            if not urgent:
                with self._lock:
                    self._queued_bytes -= job.k.nbytes + job.v.nbytes
            jobs.task_done()
        jobs.task_done()
        writer.close()

    def _export(self, job: ExportJob, writer: KvcacheWriter) -> None:
        ok = True
        chunk = self.config.chunk_tokens
        token = otel_context.attach(job.trace_context or Context())
        ns = job.namespace.digest()
        if job.ready is not None:
            job.ready()
        for i, key in enumerate(job.keys):
            sl = slice(i * chunk, (i + 1) * chunk)
            try:
                blob = encode_chunk(job.k[:, sl], job.v[:, sl], job.token_ids[sl], ns,
                                    job.spec or self.config.codec, job.start + i * chunk, self.rotary,
                                    job.positioned)
                writer.put(key, blob, job.namespace)
                with self._lock:
                    self.stats.exported_chunks += 1
                if job.on_stored is not None:
                    job.on_stored(len(blob))
            except Unavailable as err:
                with self._lock:
                    self.stats.export_failures += len(job.keys) - i
                log.warning("KV export failed (%s); dropping %d chunks", err, len(job.keys) - i)
                ok = False
                break
        otel_context.detach(token)
        if job.on_done is not None:
            job.on_done(ok)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every queued export has been attempted (tests, benchmarks)."""
        done = threading.Event()

        def wait() -> None:
            for jobs in self._exports.values():
                jobs.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout_s)

    def stop_exports(self, timeout_s: float = 30.0) -> None:
        """Ends both export threads after what is queued (blocking)."""
        for jobs in self._exports.values():
            jobs.put(None)
        for t in self._export_threads:
            t.join(timeout_s)

    async def close(self) -> None:
        """Finishes queued exports, then closes channels and threads."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop_exports)
        self._codec_pool.shutdown(wait=False)
        await self.client.close()
