"""Document ingest: a document's KV computed alone (from position 0), stored by content key, then
its catalog entry -- so later prompts that cite it blend instead of prefilling it."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from kvmesh.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvmesh.kv.codec import CodecSpec
from kvmesh.kv.keys import document_chunks
from kvmesh.services.engine.documents import DocumentExports
from kvmesh.services.engine.kvcache_client import EXPORT_TIMEOUT_S, NewDocument
from kvmesh.services.engine.prepare import GenerateInput
from kvmesh.services.engine.sampling import SamplingParams
from kvmesh.services.engine.sequence import FinishReason
from kvmesh.services.engine.speculation import SpecMode

if TYPE_CHECKING:
    from kvmesh.services.engine.async_engine import AsyncEngine


@dataclass(frozen=True)
class IngestRequest:
    """One document to ingest."""

    document_id: str
    token_ids: list[int]
    text: str = ""
    """Stored in the catalog (decoded from the token ids when empty)."""
    metadata: Optional[dict[str, str]] = None
    tenant_salt: str = ""
    ttl_s: Optional[float] = None
    pinned: bool = False
    kv_codec: Optional[CodecSpec] = None


@dataclass(frozen=True)
class IngestResult:
    tokens: int
    chunks: int
    reused_chunks: int
    """Chunks the service already held (not computed again)."""


async def ingest_document(engine: AsyncEngine, req: IngestRequest) -> IngestResult:
    """Stores the document's missing chunks (one engine request over the document alone, whose
    prompt KV is exported by content key), then its catalog entry."""
    kv = engine.core.kv
    if kv is None:
        raise FailedPrecondition("ingesting documents needs the KV-cache service; start the engine with "
                                 "--kvcache-address (kvmesh up does)")
    if not req.document_id:
        raise InvalidArgument("IngestDocument: document_id is empty; name the document")
    if not req.token_ids:
        raise InvalidArgument("IngestDocument: the document is empty; send text or token ids")
    if req.ttl_s is not None and not req.ttl_s > 0:
        raise InvalidArgument(f"IngestDocument: ttl_s must be > 0 seconds, got {req.ttl_s}")
    namespace = engine.core.request_namespace(req.tenant_salt, req.kv_codec)
    chunks = document_chunks(req.token_ids, kv.config.chunk_tokens, namespace.digest())
    present = await kv.lookup([key for _, _, key in chunks])
    missing = [(key, a, b) for (a, b, key), p in zip(chunks, present) if not p]
    if missing:
        loop = asyncio.get_running_loop()
        stored: asyncio.Future[bool] = loop.create_future()

        def done(ok: bool) -> None:  # on the export thread
            loop.call_soon_threadsafe(lambda: stored.done() or stored.set_result(ok))

        exports = DocumentExports(namespace, missing, spec=req.kv_codec, on_done=done, urgent=True)
        inp = GenerateInput(req.token_ids, SamplingParams(max_tokens=1, temperature=0.0),
                            tenant_salt=req.tenant_salt, kv_codec=req.kv_codec, speculation=SpecMode.OFF,
                            doc_exports=exports)
        last = None
        async for last in engine.submit(inp):
            pass
        if last is None or last.finish_reason == FinishReason.ABORT:
            raise Unavailable("ingesting the document was aborted (engine stopping?); retry")
        if not await asyncio.wait_for(stored, EXPORT_TIMEOUT_S * len(missing)):
            raise Unavailable("storing the document's KV in the KV-cache service failed; retry")
    await kv.client.put_document(NewDocument(
        namespace=namespace, document_id=req.document_id, metadata=req.metadata or {},
        text=req.text or engine.core.tokenizer.decode(req.token_ids), token_ids=req.token_ids,
        chunk_keys=[key for _, _, key in chunks], ttl_s=req.ttl_s, pinned=req.pinned))
    return IngestResult(len(req.token_ids), len(chunks), len(chunks) - len(missing))
