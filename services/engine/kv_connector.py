"""The engine's link to the KV-cache service: fetch a prompt's cached prefix, export new chunks.

NOTE (where the work happens, and why nothing here can fail a request).
  * Fetch runs on the asyncio side when a request arrives, before it is queued: Lookup the
    prompt's chained chunk keys, Get the leading present ones, decode them on the `kv-codec`
    thread. The step loop keeps computing other requests meanwhile, so the fetch overlaps with
    work. The fetched KV rides on the request; the scheduler imports it into paged blocks at
    admission (see scheduler.KvImport).
  * Export: once a prompt is fully computed the step loop copies the KV of its new full chunks
    out of the paged cache (one index_select per layer) and hands them to the `kv-export`
    thread, which encodes and Puts them. The step loop never waits on it; a full export queue
    drops the job (counted).
  * Every failure -- service down, slow (deadline), a blob that fails its checksum, a blob of
    another namespace or shape, token ids that differ -- ends the fetch at that chunk: the
    request computes the rest itself. A bad blob is also deleted from the service.
  * Codec work (quantize, zstd, dequantize) runs on threads that set torch to one thread: a
    second multi-threaded OpenMP team in the process would throttle the step loop's (see the
    threading NOTE in async_engine).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Optional

import grpc
import torch
from opentelemetry import context as otel_context

from kvmesh.kv import codec, transfer
from kvmesh.kv.keys import KvLayout, make_namespace, prefix_keys
from kvmesh.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.kv.rope import rotate_keys, unrotate_keys
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.kvcache.v1 import kvcache_pb2_grpc
from kvmesh.model.llama import RotaryEmbedding
from kvmesh.rpc.client import make_channel, make_sync_channel

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 60.0
"""Deadline of one export Put: exports are off the request path, so they may wait out a busy service."""


@dataclass(frozen=True)
class KvConnectorConfig:
    """How an engine uses the KV-cache service."""

    address: str
    chunk_tokens: int = 256
    codec: codec.CodecSpec = field(default_factory=codec.CodecSpec)
    timeout_s: float = 5.0
    max_export_queue: int = 64
    hot_bytes: int = 512 << 20
    """Byte budget of the engine's own LRU of decoded document chunks (see KvConnector's NOTE);
    0 turns it off."""


@dataclass
class KvPlan:
    """What the KV service had for one prompt, attached to the request at admission."""

    namespace: bytes
    keys: list[bytes]  # chained keys of the prompt's full chunks
    present: list[bool]  # per key, stored when looked up (no need to export it again)
    kv: tuple[torch.Tensor, torch.Tensor] | None = None  # fetched [layers, tokens, kvh, hd]
    start: int = 0  # sequence position of the first token `kv` covers (whole chunks)
    tokens: int = 0  # end position of what `kv` covers (whole blocks)
    spec: codec.CodecSpec | None = None  # codec for this prompt's exports (None = the deployment's)


@dataclass(frozen=True)
class ExportJob:
    """New full chunks of one prompt to store: k, v [layers, n*chunk, kvh, hd] from position start."""

    namespace: bytes
    keys: list[bytes]
    token_ids: list[int]
    start: int  # sequence position of the first token (keys are stored un-rotated from there)
    k: torch.Tensor
    v: torch.Tensor
    spec: codec.CodecSpec | None = None  # the request's codec; None = the deployment's
    on_done: Optional[Callable[[bool], None]] = None
    """Called on the export thread once the job's chunks are stored (True) or given up (False)."""
    trace_context: Optional[object] = None
    """The request's OpenTelemetry context: its Puts become spans of the request's trace."""


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


def parse_codec(name: str, base: codec.CodecSpec) -> codec.CodecSpec:
    """'int4', 'int2+zstd', 'fp16' ... -> a CodecSpec (group and residual from `base`); ValueError
    with the accepted forms otherwise."""
    codec_name, plus, extra = name.partition("+")
    if codec_name not in codec.CODECS or (plus and extra != "zstd"):
        raise ValueError(f"unknown KV codec {name!r}; use one of {', '.join(codec.CODECS)}, optionally with '+zstd'")
    return dataclasses.replace(base, name=codec_name, zstd=bool(plus))


def _single_thread_torch() -> None:
    torch.set_num_threads(1)


# NOTE: the hot document LRU. Prefix chunks come back to the engine once per prompt and then
# live in its paged prefix cache; document chunks are blended at a new position in every prompt
# that cites them, so without a local copy each such prompt fetches and decodes the same chunks
# from the KV service again (~200 ms for ~2,000 tokens of fp16 KV here, most of a blended
# prompt's overhead). The connector keeps the decoded chunks it fetched -- position-free keys
# and values in the engine dtype, keyed by content key (which names the namespace) together
# with their token ids -- in an LRU bounded by `hot_bytes`, and serves them without a Get. It is
# a cache of what the service holds, never the source of truth: nothing is exported from it,
# a chunk the service has deleted may still be served until evicted (its content key fixes its
# tokens and model, so it is still correct KV), and the tensors are shared read-only (blending
# copies them into its own buffers).


class KvConnector:
    """Client side of kvmesh.kvcache.v1 for one engine (one model identity and KV layout)."""

    def __init__(self, config: KvConnectorConfig, *, model_identity: str, layout: KvLayout,
                 dtype: torch.dtype, block_size: int, rotary: RotaryEmbedding) -> None:
        if config.chunk_tokens % block_size:
            raise ValueError(f"kv chunk_tokens ({config.chunk_tokens}) must be a multiple of the block "
                             f"size ({block_size})")
        self.config = config
        self.model_identity = model_identity
        self.layout = layout
        self.dtype = dtype
        self.block_size = block_size
        self.rotary = rotary  # stored keys are position-free (see kvmesh.kv.rope)
        self.stats = ConnectorStats()
        # Two single-threaded decoders: a fetch decodes two chunks at a time (a prompt's TTFT
        # waits on it), each without an OpenMP team of its own.
        self._codec_pool = ThreadPoolExecutor(2, "kv-codec", initializer=_single_thread_torch)
        self._aio_channel: grpc.aio.Channel | None = None
        self._exports: queue.Queue[ExportJob | None] = queue.Queue(config.max_export_queue)
        self._export_thread = threading.Thread(target=self._export_loop, name="kv-export", daemon=True)
        self._export_thread.start()
        self._hot: OrderedDict[bytes, tuple[tuple[int, ...], torch.Tensor, torch.Tensor, int]] = OrderedDict()
        self._hot_bytes = 0  # event-loop thread only

    async def warm_up(self) -> bool:
        """Connects to the service and runs the codec once on each decoder thread, so the first
        fetch pays no set-up. Returns whether the service answered (it may come up later)."""
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        k = torch.zeros(L, self.config.chunk_tokens, H, D)
        ns = self.namespace(b"warm-up")
        blob = codec.encode(k, k, codec.ChunkMeta(ns, (0,) * self.config.chunk_tokens), self.config.codec)
        loop = asyncio.get_running_loop()
        await asyncio.gather(*[loop.run_in_executor(self._codec_pool, lambda: codec.decode(blob, namespace=ns))
                               for _ in range(2)])
        try:
            await self._stub().Stats(pb.StatsRequest(), timeout=self.config.timeout_s)
            return True
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            log.warning("KV-cache service %s not answering yet (%s); requests recompute until it does",
                        self.config.address, _describe(err))
            return False

    def namespace(self, salt: bytes) -> bytes:
        return make_namespace(self.model_identity, self.layout, salt.decode("utf-8", "replace"))

    def _stub(self) -> kvcache_pb2_grpc.KvcacheServiceStub:
        if self._aio_channel is None:  # created lazily on the serving event loop
            # kvmesh's client channel: deadlines capped by the serving call's, trace context carried.
            self._aio_channel = make_channel(self.config.address, default_timeout_s=self.config.timeout_s)
        return kvcache_pb2_grpc.KvcacheServiceStub(self._aio_channel)

    # ---- fetch (asyncio side) ------------------------------------------------------------------

    async def prepare(self, prompt: list[int], salt: bytes, spec: codec.CodecSpec | None = None,
                      local_tokens: int = 0, *, fetch: bool = True) -> KvPlan | None:
        """Looks up and fetches the prompt's cached prefix; None when it has no full chunk.

        `spec` is the codec this prompt's new chunks will be stored with (None: the deployment's);
        `local_tokens` how much of the prompt the engine's own prefix cache holds: whole chunks
        of it are not fetched again (a chat's next turn on the same replica fetches nothing).
        `fetch` False only looks up which chunks the service lacks (they are exported once
        computed): for a request that computes its whole prompt anyway."""
        chunk = self.config.chunk_tokens
        if len(prompt) < chunk:
            return None
        ns = self.namespace(salt)
        keys = prefix_keys(prompt, chunk, ns)
        plan = KvPlan(ns, keys, [False] * len(keys), spec=spec)
        stub = self._stub()
        t0 = time.perf_counter()
        try:
            self.stats.lookups += 1
            found = await stub.Lookup(pb.LookupRequest(keys=keys, chunk_tokens=chunk),
                                      timeout=self.config.timeout_s)
            plan.present = [t != pb.TIER_NONE for t in found.tiers]
            t_lookup = time.perf_counter()
            first = local_tokens // chunk
            if fetch and found.prefix_chunks > first:
                t_streamed = await self._fetch(stub, plan, prompt, first, found.prefix_chunks)
                # Whole blocks only, and never the last prompt token: it is computed for logits.
                plan.tokens = min(plan.tokens, (len(prompt) - 1) // self.block_size * self.block_size)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            self.stats.fetch_failures += 1
            log.warning("KV service unavailable for fetch (%s); computing the prompt", _describe(err))
        if plan.kv is not None:
            log.info("KV of prompt tokens %d..%d fetched in %.0f ms (lookup %.0f ms, stream %.0f ms, then "
                     "decoding %.0f ms)", plan.start, plan.tokens, 1e3 * (time.perf_counter() - t0),
                     1e3 * (t_lookup - t0), 1e3 * (t_streamed - t_lookup),
                     1e3 * (time.perf_counter() - t_streamed))
        return plan

    async def _fetch(self, stub, plan: KvPlan, prompt: list[int], first: int, n: int) -> float:
        """Streams chunks first..n-1 and decodes each on the codec thread as soon as it has
        arrived (decode overlaps the transfer), straight into one destination tensor. Returns
        when the stream ended (perf_counter), for the log."""
        chunk, layout = self.config.chunk_tokens, self.layout
        shape = (layout.num_layers, (n - first) * chunk, layout.num_kv_heads, layout.head_dim)
        dest = (torch.empty(shape, dtype=self.dtype), torch.empty(shape, dtype=self.dtype))
        loop = asyncio.get_running_loop()
        decodes: list[asyncio.Future] = []
        call = stub.Get(pb.GetRequest(keys=plan.keys[first:n]), timeout=self.config.timeout_s)
        async for blob in _received_blobs(call):
            if blob is None:
                break  # evicted since Lookup, or damaged in transit: import what came before it
            i = len(decodes)
            pos = (first + i) * chunk
            decodes.append(loop.run_in_executor(
                self._codec_pool, self._decode_into, blob, prompt[pos:pos + chunk],
                plan.namespace, dest, i * chunk, pos))
        call.cancel()  # no-op when the stream ended
        streamed = time.perf_counter()
        ok = 0
        for i, fut in enumerate(decodes):  # in order: the prefix ends at the first bad chunk
            if await fut and ok == i:
                ok += 1
        if ok < len(decodes):
            self.stats.bad_blobs += 1
            plan.present[first + ok] = False
            try:
                await stub.Delete(pb.DeleteRequest(keys=[plan.keys[first + ok]]), timeout=self.config.timeout_s)
            except grpc.RpcError:
                pass
        if ok:
            plan.kv = (dest[0][:, :ok * chunk], dest[1][:, :ok * chunk])
            plan.start, plan.tokens = first * chunk, (first + ok) * chunk
            self.stats.fetched_chunks += ok
        return streamed

    def _decode_into(self, blob: bytes, ids: list[int], namespace: bytes,
                     dest: tuple[torch.Tensor, torch.Tensor], start: int, position: int) -> bool:
        """Decodes one chunk (sequence position `position`) into dest[:, start:start+len(ids)],
        keys rotated to their positions; False (and nothing written) when the blob is damaged,
        of another namespace or shape, or holds other token ids."""
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        try:
            k, v, header = codec.decode(blob, namespace=namespace, dtype=self.dtype, expect_shape=(L, len(ids), H, D))
        except (codec.CorruptBlob, codec.NamespaceMismatch) as err:
            log.warning("KV blob at token %d rejected (%s); computing from there", position, err)
            return False
        if list(header.token_ids) != ids:  # a key collision or a bad writer: never use it
            log.warning("KV blob at token %d holds other token ids than its key claims; computing from there", position)
            return False
        dest[0][:, start:start + len(ids)].copy_(rotate_keys(k, position, self.rotary))
        dest[1][:, start:start + len(ids)].copy_(v)
        return True

    # ---- documents: content keys and the catalog (asyncio side) --------------------------------

    async def lookup(self, keys: list[bytes]) -> list[bool]:
        """Which of `keys` the service holds (any tier). Raises Unavailable when it does not answer."""
        if not keys:
            return []
        try:
            found = await self._stub().Lookup(pb.LookupRequest(keys=keys), timeout=self.config.timeout_s)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            raise Unavailable(f"KV-cache service {self.config.address}: {_describe(err)}") from err
        return [t != pb.TIER_NONE for t in found.tiers]

    async def fetch_chunks(self, namespace: bytes, chunks: list[tuple[bytes, list[int]]]
                           ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """KV of chunks stored by content key: per (key, token ids), position-free keys and
        values [layers, len(ids), kvh, hd] in the engine dtype, or None where the chunk is
        missing, damaged or holds other tokens. Never raises for a chunk: a failed stream leaves
        the rest None (computed instead). Chunks in the hot LRU come from there (see the NOTE);
        the returned tensors are shared: read them, never write them."""
        out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(chunks)
        if not chunks:
            return out
        wanted = []
        for i, (key, ids) in enumerate(chunks):
            hot = self._hot.get(key)
            if hot is not None and hot[0] == tuple(ids):
                self._hot.move_to_end(key)
                out[i] = hot[1], hot[2]
            else:
                wanted.append(i)
        self.stats.hot_chunks += len(chunks) - len(wanted)
        if not wanted:
            return out
        loop = asyncio.get_running_loop()
        decodes: dict[int, asyncio.Future] = {}
        try:
            call = self._stub().Get(pb.GetRequest(keys=[chunks[i][0] for i in wanted]), timeout=self.config.timeout_s)
            n = 0
            async for blob in _received_blobs(call):
                if blob is not None:
                    i = wanted[n]
                    decodes[i] = loop.run_in_executor(self._codec_pool, self._decode_free, blob,
                                                      chunks[i][1], namespace)
                n += 1
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            self.stats.fetch_failures += 1
            log.warning("KV service unavailable for document chunks (%s); computing them", _describe(err))
        for i, fut in decodes.items():
            out[i] = await fut
            if out[i] is not None:
                self._keep_hot(chunks[i][0], chunks[i][1], *out[i])
        self.stats.fetched_chunks += sum(out[i] is not None for i in wanted)
        return out

    def _keep_hot(self, key: bytes, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Adds a decoded chunk to the hot LRU, evicting the least recently used past the budget."""
        size = k.numel() * k.element_size() + v.numel() * v.element_size()
        if size > self.config.hot_bytes:
            return
        old = self._hot.pop(key, None)
        if old is not None:
            self._hot_bytes -= old[3]
        while self._hot and self._hot_bytes + size > self.config.hot_bytes:
            self._hot_bytes -= self._hot.popitem(last=False)[1][3]
        self._hot[key] = (tuple(ids), k, v, size)
        self._hot_bytes += size

    def _decode_free(self, blob: bytes, ids: list[int], namespace: bytes
                     ) -> tuple[torch.Tensor, torch.Tensor] | None:
        L, H, D = self.layout.num_layers, self.layout.num_kv_heads, self.layout.head_dim
        try:
            k, v, header = codec.decode(blob, namespace=namespace, dtype=self.dtype, expect_shape=(L, len(ids), H, D))
        except (codec.CorruptBlob, codec.NamespaceMismatch) as err:
            log.warning("document KV chunk rejected (%s); computing it", err)
            return None
        if list(header.token_ids) != list(ids):
            log.warning("document KV chunk holds other token ids than its key claims; computing it")
            return None
        return k, v

    async def get_document(self, namespace: bytes, document_id: str) -> pb.Document:
        """The catalog entry (NotFound when absent, Unavailable when the service is down)."""
        try:
            resp = await self._stub().GetDocument(pb.GetDocumentRequest(namespace=namespace, document_id=document_id),
                                                  timeout=self.config.timeout_s)
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"document {document_id!r} is not in the KV service's catalog for this tenant; "
                               "ingest it first (kvmesh docs add, or Engine.IngestDocument)") from err
            raise Unavailable(f"KV-cache service {self.config.address}: {_describe(err)}") from err
        return resp.document

    async def search_documents(self, namespace: bytes, query: str, k: int) -> list[str]:
        """Ids of the `k` catalogued documents nearest to `query`, nearest first."""
        try:
            resp = await self._stub().Search(pb.SearchRequest(text=query, namespace=namespace,
                                                              kind=pb.INDEX_KIND_DOCUMENT, k=k),
                                             timeout=self.config.timeout_s)
        except grpc.RpcError as err:
            raise Unavailable(f"KV-cache service {self.config.address}: {_describe(err)}") from err
        return [h.document_id for h in resp.hits]

    async def put_document(self, request: pb.PutDocumentRequest) -> None:
        try:
            await self._stub().PutDocument(request, timeout=max(self.config.timeout_s, EXPORT_TIMEOUT_S))
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(err.details()) from err
            raise Unavailable(f"KV-cache service {self.config.address}: {_describe(err)}") from err

    # ---- export (step loop -> export thread) ---------------------------------------------------

    def submit_export(self, job: ExportJob) -> None:
        """Queues chunks for storing; never blocks (drops the job when the queue is full)."""
        try:
            self._exports.put_nowait(job)
        except queue.Full:
            self.stats.export_dropped += len(job.keys)
            if job.on_done is not None:
                job.on_done(False)

    def _export_loop(self) -> None:
        torch.set_num_threads(1)
        channel = make_sync_channel(self.config.address)  # each Put a CLIENT span under its request
        stub = kvcache_pb2_grpc.KvcacheServiceStub(channel)
        chunk = self.config.chunk_tokens
        while (job := self._exports.get()) is not None:
            ok = True
            token = otel_context.attach(job.trace_context or otel_context.Context())
            for i, key in enumerate(job.keys):
                sl = slice(i * chunk, (i + 1) * chunk)
                try:
                    k = unrotate_keys(job.k[:, sl], job.start + i * chunk, self.rotary).to(job.v.dtype)
                    blob = codec.encode(k, job.v[:, sl],
                                        codec.ChunkMeta(job.namespace, tuple(job.token_ids[sl])),
                                        job.spec or self.config.codec, sequence_start=job.start + i * chunk == 0)
                    stub.Put(transfer.put_requests(key, blob), timeout=EXPORT_TIMEOUT_S)
                    self.stats.exported_chunks += 1
                except grpc.RpcError as err:
                    self.stats.export_failures += len(job.keys) - i
                    log.warning("KV export failed (%s); dropping %d chunks", _describe(err), len(job.keys) - i)
                    ok = False
                    break
            otel_context.detach(token)
            if job.on_done is not None:
                job.on_done(ok)
            self._exports.task_done()
        channel.close()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Waits until every queued export has been attempted (tests, benchmarks)."""
        done = threading.Event()

        def wait() -> None:
            self._exports.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        return done.wait(timeout_s)

    async def close(self) -> None:
        """Finishes queued exports, then closes channels and threads."""
        self._exports.put(None)
        await asyncio.get_running_loop().run_in_executor(None, self._export_thread.join, 30)
        self._codec_pool.shutdown(wait=False)
        if self._aio_channel is not None:
            await self._aio_channel.close()


async def _received_blobs(call) -> AsyncIterator[bytes | None]:
    """Each entry of a Get stream, in request order: its blob, or None where the service does not
    hold it or it arrived damaged (length or checksum)."""
    header, parts, got = None, [], 0
    async for msg in call:
        if msg.HasField("header"):
            if not msg.header.found:
                header = None
                yield None
            else:
                header, parts, got = msg.header, [], 0
            continue
        parts.append(msg.data)
        got += len(msg.data)
        if header is not None and got >= header.total_bytes:
            blob = b"".join(parts)
            yield blob if len(blob) == header.total_bytes and transfer.checksum(blob) == header.checksum else None
            header = None


def _describe(err: BaseException) -> str:
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        return f"{err.code().name}: {err.details()}"
    return type(err).__name__
