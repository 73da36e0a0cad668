"""The engine's RPC link to the KV-cache service: proto <-> domain only.

Everything the engine asks the KV service goes through here, in domain terms (keys, blobs,
KvNamespace values, token ids); the KV connector and the document planner never see a proto
message or a grpc error. A failed call raises kvmesh.errors.Unavailable (NotFound for a missing
document, InvalidArgument for a refused one): callers decide whether that means recompute.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

import grpc

from kvmesh.errors import InvalidArgument, NotFound, Unavailable
from kvmesh.kv import transfer
from kvmesh.kv.namespace import KvNamespace
from kvmesh.kv.namespace_proto import namespace_to_proto
from kvmesh.kvcache.v1 import kvcache_pb2 as pb
from kvmesh.kvcache.v1 import kvcache_pb2_grpc
from kvmesh.rpc.client import call_timeout, make_channel, make_sync_channel

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 60.0
"""Deadline of one export Put: exports are off the request path, so they may wait out a busy service."""


@dataclass(frozen=True)
class Lookup:
    """Which of the asked keys the service holds."""

    present: list[bool]
    """Per key, stored in any tier."""
    prefix_chunks: int
    """Leading keys present without a gap."""


@dataclass(frozen=True)
class CatalogEntry:
    """A catalogued document as the engine uses it: the token ids it was ingested with."""

    document_id: str
    token_ids: list[int]


@dataclass(frozen=True)
class NewDocument:
    """A catalog entry to store (its chunks are stored first, by content key)."""

    namespace: KvNamespace
    document_id: str
    text: str
    token_ids: list[int]
    chunk_keys: list[bytes]
    metadata: dict[str, str]
    ttl_s: float | None = None
    pinned: bool = False


def describe(err: BaseException) -> str:
    """A one-line reason for a failed call (status and details, or the exception's type)."""
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        return f"{err.code().name}: {err.details()}"
    return str(err) or type(err).__name__


_DOWN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class KvcacheClient:
    """Asyncio client of the KV service for one engine; the channel is made lazily on the loop
    that serves (every call's deadline is `timeout_s`, capped by the serving call's).

    NOTE (back-off): a call the service does not answer (UNAVAILABLE, or late: a hung or
    overloaded service) marks it down for `retry_s`. Late means late by the client's own
    `timeout_s`: a call cut short because the request being served had less time left (its
    deadline caps every outgoing call's) says nothing about the service, and marks nothing. Meanwhile the request-path calls (lookup,
    get, the catalog's) fail at once instead of each waiting out its deadline, so a hung KV
    service costs the requests already waiting on it at most `timeout_s` of TTFT and the next
    ones nothing: they compute their prompt. The first call after `retry_s` tries again."""

    def __init__(self, address: str, timeout_s: float, retry_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._clock = clock
        self._down_until = float("-inf")
        self._down_why = ""
        self.skipped_calls = 0
        """Calls not made because the service was marked down."""
        self._channel: grpc.aio.Channel | None = None

    def _open(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = make_channel(self.address, default_timeout_s=self.timeout_s)
        return self._channel

    def _stub(self) -> kvcache_pb2_grpc.KvcacheServiceStub:
        return kvcache_pb2_grpc.KvcacheServiceStub(self._open())

    def _catalog(self) -> kvcache_pb2_grpc.KvCatalogServiceStub:
        return kvcache_pb2_grpc.KvCatalogServiceStub(self._open())

    def _timeout(self) -> float:
        """This call's deadline: `timeout_s`, capped by the request being served."""
        return call_timeout(self.timeout_s)

    def _unavailable(self, err: BaseException, timeout: float | None = None) -> Unavailable:
        """The error to raise for a failed call whose deadline was `timeout` (None: the client's
        own); marks the service down when it did not answer within the client's own deadline."""
        late = isinstance(err, asyncio.TimeoutError) or (
            isinstance(err, grpc.RpcError) and hasattr(err, "code")
            and err.code() is grpc.StatusCode.DEADLINE_EXCEEDED)
        down = isinstance(err, grpc.RpcError) and hasattr(err, "code") and err.code() in _DOWN
        capped = timeout is not None and timeout < self.timeout_s
        if (down or late) and not (late and capped):
            self._down_until, self._down_why = self._clock() + self.retry_s, describe(err)
        return Unavailable(f"KV-cache service {self.address}: {describe(err)}")

    def _check_up(self) -> None:
        """Unavailable at once while the service is marked down (see the NOTE on back-off)."""
        left = self._down_until - self._clock()
        if left > 0:
            self.skipped_calls += 1
            raise Unavailable(f"KV-cache service {self.address}: not called for {left:.1f}s more after it "
                              f"failed ({self._down_why}; --kv-retry-s)")

    async def ping(self) -> None:
        try:
            await self._stub().Stats(pb.StatsRequest(), timeout=self.timeout_s)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            raise self._unavailable(err) from err

    async def lookup(self, keys: list[bytes], chunk_tokens: int = 0) -> Lookup:
        self._check_up()
        timeout = self._timeout()
        try:
            found = await self._stub().Lookup(pb.LookupRequest(keys=keys, chunk_tokens=chunk_tokens),
                                              timeout=timeout)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            raise self._unavailable(err, timeout) from err
        return Lookup([t != pb.TIER_UNSPECIFIED for t in found.tiers], found.prefix_chunks)

    async def get(self, keys: list[bytes]) -> AsyncIterator[bytes | None]:
        """Each key's blob in order, None where the service lacks it or it arrived damaged
        (length or checksum). Stops early when the consumer does (the stream is cancelled)."""
        self._check_up()
        timeout = self._timeout()
        call = self._stub().Get(pb.GetRequest(keys=keys), timeout=timeout)
        header, parts, got = None, [], 0
        try:
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
                    ok = len(blob) == header.total_bytes and transfer.checksum(blob) == header.checksum
                    yield blob if ok else None
                    header = None
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            raise self._unavailable(err, timeout) from err
        finally:
            call.cancel()  # a no-op when the stream ended

    async def delete(self, keys: list[bytes]) -> None:
        try:
            await self._stub().Delete(pb.DeleteRequest(keys=keys), timeout=self.timeout_s)
        except (grpc.RpcError, asyncio.TimeoutError) as err:
            raise self._unavailable(err) from err

    async def get_document(self, namespace: KvNamespace, document_id: str) -> CatalogEntry:
        self._check_up()
        timeout = self._timeout()
        try:
            resp = await self._catalog().GetDocument(
                pb.GetDocumentRequest(namespace=namespace_to_proto(namespace), document_id=document_id),
                timeout=timeout)
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.NOT_FOUND:
                raise NotFound(f"document {document_id!r} is not in the KV service's catalog for this tenant; "
                               "ingest it first (kvmesh docs add, or Engine.IngestDocument)") from err
            raise self._unavailable(err) from err
        return CatalogEntry(resp.document.document_id, list(resp.document.token_ids))

    async def search_documents(self, namespace: KvNamespace, query: str, k: int) -> list[str]:
        self._check_up()
        timeout = self._timeout()
        try:
            resp = await self._catalog().Search(pb.SearchRequest(text=query, namespace=namespace_to_proto(namespace),
                                                                 kind=pb.INDEX_KIND_DOCUMENT, k=k),
                                                timeout=timeout)
        except grpc.RpcError as err:
            raise self._unavailable(err, timeout) from err
        return [h.document_id for h in resp.hits]

    async def put_document(self, doc: NewDocument) -> None:
        request = pb.PutDocumentRequest(
            namespace=namespace_to_proto(doc.namespace), document_id=doc.document_id, metadata=doc.metadata,
            text=doc.text, token_ids=doc.token_ids, chunk_keys=doc.chunk_keys, ttl_s=doc.ttl_s,
            pinned=doc.pinned)
        try:
            await self._catalog().PutDocument(request, timeout=max(self.timeout_s, EXPORT_TIMEOUT_S))
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.INVALID_ARGUMENT:
                raise InvalidArgument(err.details()) from err
            raise self._unavailable(err) from err

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()


class KvcacheWriter:
    """Blocking Put client for the export thread: each Put a CLIENT span in the calling thread's
    current context."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = make_sync_channel(address)
        self._stub = kvcache_pb2_grpc.KvcacheServiceStub(self._channel)

    def put(self, key: bytes, blob: bytes, namespace: KvNamespace) -> None:
        """Stores one blob encoded for `namespace` (the service refuses a blob whose header names
        another); Unavailable when the service refuses or is down."""
        try:
            self._stub.Put(transfer.put_requests(key, blob, namespace), timeout=EXPORT_TIMEOUT_S)
        except grpc.RpcError as err:
            raise Unavailable(f"KV-cache service {self.address}: {describe(err)}") from err

    def close(self) -> None:
        self._channel.close()
