"""Prompts that mark their documents: resolving parts into token ids, finding the documents' KV by
content, and the plan the step loop blends with.

NOTE (how a prompt with documents is served).
  1. Resolve (asyncio side). Parts become one token list: plain runs and inline documents as
     given, catalogued documents by id (GetDocument: the ids tokenized at ingest), retrieval as
     a Search over the catalog then those documents. Each document occupies a span of the prompt.
  2. Look up (asyncio side). A document is cut into chunks from its own start (kvmesh.kv.keys.
     document_chunks), each keyed by content only, so the same document has the same keys at any
     position and after any instruction. Chunks the service holds are fetched and decoded on the
     codec threads (position-free keys, as stored), while the step loop serves other requests.
  3. Blend (step loop, when the request reaches the head of the queue). Cached chunks become
     cached segments, everything else new text; kvmesh.kv.blend re-rotates the cached keys to
     their positions and recomputes the chosen share of cached tokens with the new context (the
     NOTE in blend.py). The result is imported into the request's paged blocks like KV fetched
     by prefix, up to the last whole block before the last prompt token; that token and the few
     before it are computed by the normal step, over the blended KV.
  4. Store. Chunks of documents the service lacked are exported by content key once the prompt
     is computed, so the next prompt that contains them blends instead of prefilling.
  Blended KV is not the KV a full prefill gives, so it never poses as exact: it is not exported
  under prefix keys, and its blocks go into the engine's prefix cache under a namespace of their
  own (only the same prompt with the same blend settings reuses them).
  Limitation: the blend runs as one step (its cost is the probe layer over every prompt token plus
  the recomputed share through the rest); other requests' decodes wait for it, unlike chunked
  prefill.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch

from kvmesh.errors import FailedPrecondition, InvalidArgument
from kvmesh.kv.blend import BlendPrefill, Segment
from kvmesh.kv.codec import CodecSpec
from kvmesh.kv.keys import document_chunks
from kvmesh.kv.namespace import KvNamespace
from kvmesh.limits import MAX_RETRIEVE_K
from kvmesh.prompt_parts import CatalogDocument, InlineDocument, Part, Retrieval, Tokens

if TYPE_CHECKING:
    from kvmesh.services.engine.kv_connector import KvConnector

log = logging.getLogger(__name__)



def check_parts(parts: list[Part]) -> None:
    """InvalidArgument for parts that cannot make a prompt."""
    if not parts:
        raise InvalidArgument("prompt parts are empty; send at least one part")
    for i, p in enumerate(parts):
        if isinstance(p, (Tokens, InlineDocument)) and not p.ids:
            what = "tokens" if isinstance(p, Tokens) else "document"
            raise InvalidArgument(f"prompt part {i} ({what}) has no token ids; drop it or fill it")
        if isinstance(p, CatalogDocument) and not p.document_id:
            raise InvalidArgument(f"prompt part {i} (document_id) is empty; name a catalogued document")
        if isinstance(p, Retrieval):
            if not p.query.strip():
                raise InvalidArgument(f"prompt part {i} (retrieve) has an empty query; send the question to search with")
            if not 1 <= p.k <= MAX_RETRIEVE_K:
                raise InvalidArgument(f"prompt part {i} (retrieve): k must be 1..{MAX_RETRIEVE_K}, got {p.k}")


@dataclass(frozen=True)
class DocumentSpan:
    """One document's place in the resolved prompt: token positions [start, end)."""

    start: int
    end: int
    document_id: str = ""  # "" for an inline document


@dataclass(frozen=True)
class ResolvedPrompt:
    token_ids: list[int]
    documents: list[DocumentSpan]
    document_ids: list[str]
    """Catalogued documents used, in prompt order (cited and retrieved)."""


async def resolve(parts: list[Part], kv: Optional[KvConnector], namespace: KvNamespace) -> ResolvedPrompt:
    """Token ids of the prompt (its parts passed `check_parts` at the edge) and where its
    documents sit. `kv` is needed for catalogued documents and retrieval (FailedPrecondition
    without it)."""
    ids: list[int] = []
    spans: list[DocumentSpan] = []
    used: list[str] = []

    async def catalogued(doc_id: str) -> None:
        doc = await kv.client.get_document(namespace, doc_id)
        if not doc.token_ids:
            raise FailedPrecondition(f"document {doc_id!r} has no token ids in the catalog; ingest it again")
        spans.append(DocumentSpan(len(ids), len(ids) + len(doc.token_ids), doc_id))
        ids.extend(doc.token_ids)
        used.append(doc_id)

    for p in parts:
        if isinstance(p, Tokens):
            ids.extend(p.ids)
        elif isinstance(p, InlineDocument):
            spans.append(DocumentSpan(len(ids), len(ids) + len(p.ids)))
            ids.extend(p.ids)
        else:
            if kv is None:
                raise FailedPrecondition("documents by id and retrieval need the KV-cache service; start the "
                                         "engine with --kvcache-address (kvmesh up does)")
            if isinstance(p, CatalogDocument):
                await catalogued(p.document_id)
            else:
                for j, doc_id in enumerate(await kv.client.search_documents(namespace, p.query, p.k)):
                    if j:
                        ids.extend(p.separator)
                    await catalogued(doc_id)
    return ResolvedPrompt(ids, spans, used)


@dataclass
class BlendPlan:
    """What the step loop blends for one request, and what it stores afterwards."""

    segments: list[Segment]
    recompute_ratio: float
    cached_tokens: int
    """Prompt tokens whose KV comes from cached document chunks."""
    job: Optional[BlendPrefill] = None
    """A blend whose probe stage ran (or runs) while the KV was fetched."""


@dataclass
class DocumentExports:
    """Document chunks the service lacked: stored by content key once the prompt is computed."""

    namespace: KvNamespace
    chunks: list[tuple[bytes, int, int]] = field(default_factory=list)  # key, prompt start, end
    spec: Optional[CodecSpec] = None
    """Codec the chunks are stored with; None = the deployment's."""
    on_done: Optional[Callable[[bool], None]] = None
    """Called once every chunk is stored (True) or one was given up (False); any thread."""
    urgent: bool = False
    """A caller waits for the chunks (an ingest): stored at normal priority (kv_connector's NOTE)."""


async def plan_documents(prompt: ResolvedPrompt, kv: KvConnector, namespace: KvNamespace, ratio: float,
                         start_probe: Callable[[list[int]], BlendPrefill] | None = None,
                         spec: Optional[CodecSpec] = None) -> tuple[BlendPlan | None, DocumentExports]:
    """Looks up and fetches every document chunk; a BlendPlan when any is cached (and ratio < 1:
    ratio 1 is a full prefill), and the chunks to store afterwards. `start_probe(token_ids)`
    starts the blend's first stage on the step loop as soon as the lookup found cached chunks,
    so it runs while they are fetched; it returns the job the plan carries."""
    t0 = time.perf_counter()
    chunk = kv.config.chunk_tokens
    where: list[tuple[bytes, int, int]] = []  # key, prompt start, end
    for span in prompt.documents:
        doc = prompt.token_ids[span.start:span.end]
        where += [(key, span.start + a, span.start + b)
                  for a, b, key in document_chunks(doc, chunk, namespace.digest())]
    exports = DocumentExports(namespace, spec=spec)
    try:
        present = await kv.lookup([key for key, _, _ in where])
    except Exception:  # noqa: BLE001 - optional: the service down means compute (and try to store)
        present = [False] * len(where)
    fetched: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    job = None
    if ratio < 1.0 and any(present):
        if start_probe is not None:
            job = start_probe(prompt.token_ids)
        wanted = [i for i, p in enumerate(present) if p]
        got = await kv.fetch_chunks(namespace, [(where[i][0], prompt.token_ids[where[i][1]:where[i][2]])
                                                for i in wanted])
        fetched = {i: kv_ for i, kv_ in zip(wanted, got) if kv_ is not None}
    exports.chunks = [w for i, w in enumerate(where) if not present[i]]
    log.info("documents: %d of %d chunks cached, %d fetched in %.0f ms", sum(present), len(where), len(fetched),
             1e3 * (time.perf_counter() - t0))
    if not fetched:
        return None, exports
    segments: list[Segment] = []
    pos = 0
    for i in sorted(fetched):
        _, a, b = where[i]
        if a > pos:
            segments.append(Segment.new(prompt.token_ids[pos:a]))
        k, v = fetched[i]
        segments.append(Segment.cached(prompt.token_ids[a:b], k, v))
        pos = b
    if pos < len(prompt.token_ids):
        segments.append(Segment.new(prompt.token_ids[pos:]))
    if segments[-1].is_cached:  # the last prompt token must be computed (its logits are the output)
        last = segments.pop()
        n = len(last.token_ids) - 1
        if n:
            segments.append(Segment.cached(last.token_ids[:n], last.k[:, :n], last.v[:, :n]))
        segments.append(Segment.new(last.token_ids[n:]))
    cached = sum(len(s.token_ids) for s in segments if s.is_cached)
    return BlendPlan(segments, ratio, cached, job), exports
