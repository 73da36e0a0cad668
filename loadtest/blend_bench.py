"""`kvmesh bench blend`: reusing documents' KV in any order (blending) against full prefill and
prefix-only reuse, and retrieval from the document catalog, on the bundled SmolLM2-135M (or the
model of `--model PATH`: its chat template frames the prompts; a model whose sliding window is
narrower than the prompts is refused, as the engine would not blend them).

Workload (real text): documents are sections of ``pydoc_data.topics`` (the 16 of 300-600
tokens; the catalog for retrieval holds every section, cut to its first ~2,400 characters).
Each prompt is a chat turn that gives 4-6 of those documents in a shuffled order, then a
question answered by one of them (questions written for this benchmark, in other words than the
section's), and asks for the passage that answers it. The reference answer is the first 48 tokens
of that section's body.

Processes: one KV-cache service and one engine (fp32, all cores, the deployment's default KV
codec: exact fp32, so the figures measure blending alone), both on this machine, driven over gRPC.
Blending is opt-in: every blend request sets its recompute ratio.

Rows:
* ``mode`` = full (``recompute_ratio`` 1: nothing reused), prefix (the same documents were
  seen before in another order: the engine and the KV service reuse what the prefix allows), and
  blend at ``recompute_ratio`` 0, 0.05, 0.15, 0.3 (documents stored by content beforehand; the
  engine keeps the chunks it fetched in its hot document LRU, so a document cited again is not
  fetched again), and blend at 0.15 with ``hot_lru`` false (a second engine with
  ``--kv-hot-bytes 0``: every prompt fetches its chunks from the KV service);
  metrics ``ttft_s`` (mean over prompts, through the engine's gRPC), ``greedy_agree`` (share of
  the 32 greedy output tokens equal to full prefill's, position by position) and
  ``ppl_delta_pct`` (perplexity of the reference answer over the same KV, against full prefill;
  computed in this process with the engine's blending code on exact, uncompressed document KV --
  prefix reuse is exact, so its row is 0 by construction).
* ``mode`` = retrieve, ``embedding`` = minilm (the KV service's index: all-MiniLM-L6-v2) or
  model_hidden (mean-pooled last hidden states of the served model, computed here), ``k``:
  ``recall_at_k`` of the section that answers each question among the whole catalog.
* ``mode`` = retrieve_blend | retrieve_prefill: ``ttft_s`` of a prompt that asks the engine to
  retrieve the top-4 documents for its question (Search + GetDocument in the KV service), blended
  at 15% or prefilled.
A plot of TTFT and quality against the recompute ratio is written beside the JSON.
"""
from __future__ import annotations

import asyncio
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from kvmesh.loadtest.report import pivot, row
from kvmesh.threads import usable_cores

QUESTIONS = {
    "augassign": "How does writing x += 1 differ from writing x = x + 1?",
    "booleans": "Which values count as false when Python evaluates a condition?",
    "context-managers": "What must an object provide so that it can be used in a with block?",
    "dict": "What happens when the same key is given twice in a dictionary literal?",
    "exceptions": "What happens to an error that no code handles?",
    "exprlists": "When does a comma make a tuple inside an expression?",
    "for": "Can a loop over a list have an else clause, and when does it run?",
    "global": "How can a function rebind a variable that lives at module level?",
    "id-classes": "What do names that begin and end with two underscores mean?",
    "in": "How do I check whether a value is contained in a list or a string?",
    "integers": "How do I write a number in hexadecimal or binary notation?",
    "power": "What does raising a negative number to a fractional exponent give?",
    "slicings": "How do I select a range of items from a sequence using start and stop positions?",
    "specialattrs": "Which read-only attributes such as __dict__ or __class__ do objects carry?",
    "subscriptions": "What happens when square brackets are applied to a generic class like list[int]?",
    "typesmethods": "What is the difference between a bound method and a plain function?",
}
RATIOS = (0.0, 0.05, 0.15, 0.3)
ANSWER_TOKENS = 48
OUTPUT_TOKENS = 32
RETRIEVE_K = 4


@dataclass(frozen=True)
class Plan:
    prompts: int = 12
    catalog: int = 0  # 0 = every section
    recall_ks: tuple[int, ...] = (1, 3, 5)


FULL = Plan()
QUICK = Plan(prompts=4, catalog=32)


@dataclass(frozen=True)
class RagPrompt:
    target: str
    docs: tuple[str, ...]  # section names in prompt order
    head: tuple[int, ...]
    tail: tuple[int, ...]
    answer: tuple[int, ...]

    def ids(self, texts: dict[str, list[int]], sep: list[int]) -> list[int]:
        out = list(self.head)
        for i, d in enumerate(self.docs):
            out += (sep if i else []) + texts[d]
        return out + list(self.tail)


def _sections(tok) -> tuple[dict[str, str], dict[str, list[int]]]:
    from pydoc_data.topics import topics

    texts = {k: topics[k] for k in QUESTIONS}
    return texts, {k: tok.encode(v) for k, v in texts.items()}


def _catalog(limit: int) -> dict[str, str]:
    from pydoc_data.topics import topics

    out = {}
    for name in sorted(topics):
        text = topics[name]
        if len(text) > 2400:
            cut = text.rfind("\n\n", 0, 2400)
            text = text[:cut if cut > 600 else 2400]
        out[name] = text
    keep = list(QUESTIONS) + [n for n in out if n not in QUESTIONS]
    return {n: out[n] for n in keep[:limit or len(keep)]}


def _prompts(tok, ids: dict[str, list[int]], n: int, source: str = "bundled") -> list[RagPrompt]:
    from kvmesh.loadtest.models import chat_frame

    rng = random.Random(7)
    names = list(QUESTIONS)
    out = []
    for i in range(n):
        target = names[i % len(names)]
        others = rng.sample([x for x in names if x != target], rng.randint(3, 5))
        docs = others + [target]
        rng.shuffle(docs)
        head, tail = chat_frame(tok, source, "Answer from these passages of the Python reference.\n\n",
                                f"\n\nQuestion: {QUESTIONS[target]}\nQuote the passage that answers it.")
        body = ids[target]
        title_end = next((j for j in range(len(body)) if tok.decode(body[:j]).count("\n") >= 3), 0)
        out.append(RagPrompt(target, tuple(docs), tuple(head), tuple(tail),
                             tuple(body[title_end:title_end + ANSWER_TOKENS])))
    return out


# ---- through the services ------------------------------------------------------------------

def _parts(p: RagPrompt, ids: dict[str, list[int]], sep: list[int]):
    from kvmesh.common.v1.common_pb2 import TokenIds
    from kvmesh.engine.v1 import engine_pb2 as pb

    parts = [pb.PromptPart(tokens=TokenIds(ids=p.head))]
    for i, d in enumerate(p.docs):
        if i:
            parts.append(pb.PromptPart(tokens=TokenIds(ids=sep)))
        parts.append(pb.PromptPart(document=TokenIds(ids=ids[d])))
    parts.append(pb.PromptPart(tokens=TokenIds(ids=p.tail)))
    return pb.Prompt(parts=parts)


async def generate(stub, *, salt: str, ids=None, parts=None, ratio=None, max_tokens=OUTPUT_TOKENS):
    """One greedy request to an engine stub: (seconds to the first token, tokens, Final)."""
    from kvmesh.engine.v1 import engine_pb2 as pb

    req = pb.GenerateRequest(cache_salt=salt, speculation=pb.SPECULATION_OFF,
                             sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    if ids is not None:
        req.token_ids.ids.extend(ids)
    else:
        req.parts.CopyFrom(parts)
    if ratio is not None:
        req.blend.recompute_ratio = ratio
    t0 = time.perf_counter()
    first, tokens, final = None, [], None
    async for msg in stub.Generate(req, timeout=600):
        if first is None and msg.delta.token_ids:
            first = time.perf_counter() - t0
        tokens += msg.delta.token_ids
        if msg.HasField("final"):
            final = msg.final
    return first, tokens, final


def _agree(a: list[int], ref: list[int]) -> float:
    return sum(x == y for x, y in zip(a, ref)) / len(ref)


async def _service_rows(address: str, kv_address: str, prompts, ids, sep, catalog,
                        questions) -> tuple[list[dict], dict]:
    import grpc

    from kvmesh.common.v1.common_pb2 import TokenIds
    from kvmesh.engine.v1 import engine_pb2 as pb
    from kvmesh.engine.v1 import engine_pb2_grpc

    rows, outputs = [], {}
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_receive_message_length", 64 << 20)]) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        await generate(stub, salt="warm", ids=prompts[0].ids(ids, sep), max_tokens=2)  # first-call costs
        # full: cold, nothing reused
        res = [await generate(stub, salt="full", ids=p.ids(ids, sep)) for p in prompts]
        outputs["full"] = [r[1] for r in res]
        rows.append(row("ttft_s", statistics.fmean(r[0] for r in res), "s", mode="full", recompute_ratio=1.0))
        # prefix: the same documents seen before in their sorted order
        for p in prompts:
            seen = RagPrompt(p.target, tuple(sorted(p.docs)), p.head, p.tail, p.answer)
            await generate(stub, salt="prefix", ids=seen.ids(ids, sep), max_tokens=1)
        res = [await generate(stub, salt="prefix", ids=p.ids(ids, sep)) for p in prompts]
        outputs["prefix"] = [r[1] for r in res]
        reused = statistics.fmean(r[2].usage.cached_prompt_tokens / r[2].usage.prompt_tokens for r in res)
        rows += [row("ttft_s", statistics.fmean(r[0] for r in res), "s", mode="prefix"),
                 row("reused_share", reused, "share", mode="prefix")]
        # blend: every document stored by content (ingested alone) first
        for name in QUESTIONS:
            await stub.IngestDocument(pb.IngestDocumentRequest(document_id=name, token_ids=TokenIds(ids=ids[name]),
                                                               cache_salt="blend"), timeout=600)
        for ratio in RATIOS:
            res = [await generate(stub, salt="blend", parts=_parts(p, ids, sep), ratio=ratio) for p in prompts]
            outputs[ratio] = [r[1] for r in res]
            reused = statistics.fmean(r[2].blended_tokens / r[2].usage.prompt_tokens for r in res)
            rows += [row("ttft_s", statistics.fmean(r[0] for r in res), "s", mode="blend", recompute_ratio=ratio),
                     row("reused_share", reused, "share", mode="blend", recompute_ratio=ratio)]
        tags = {"full": dict(mode="full", recompute_ratio=1.0), "prefix": dict(mode="prefix")}
        for key, outs in outputs.items():
            tag = tags.get(key) or dict(mode="blend", recompute_ratio=key)
            rows.append(row("greedy_agree", statistics.fmean(_agree(o, f) for o, f in zip(outs, outputs["full"])),
                            "share", **tag))
        # retrieval: the catalog, then prompts that ask the engine to retrieve
        t0 = time.perf_counter()
        for name, text in catalog.items():
            await stub.IngestDocument(pb.IngestDocumentRequest(document_id=name, text=text, cache_salt="rag"),
                                      timeout=600)
        print(f"ingested {len(catalog)} documents in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        rag_namespace = (await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)).kv_namespace
        rag_namespace.tenant_salt = "rag"  # the engine's namespace, for the requests' salt
        hits = {name: await _search(kv_address, rag_namespace, q, 5) for name, q in questions.items()}
        for ratio, mode in ((0.15, "retrieve_blend"), (1.0, "retrieve_prefill")):
            ttfts = []
            for p in prompts:
                parts = pb.Prompt(parts=[pb.PromptPart(tokens=TokenIds(ids=p.head)),
                                         pb.PromptPart(retrieve=pb.Retrieve(query=QUESTIONS[p.target], k=RETRIEVE_K,
                                                                            separator=TokenIds(ids=sep))),
                                         pb.PromptPart(tokens=TokenIds(ids=p.tail))])
                first, _, final = await generate(stub, salt="rag", parts=parts, ratio=ratio)
                ttfts.append(first)
            rows.append(row("ttft_s", statistics.fmean(ttfts), "s", mode=mode, k=RETRIEVE_K))
    return rows, hits


async def _fetch_rows(address: str, prompts, ids, sep) -> list[dict]:
    """Blending at 15% on an engine without the hot document LRU: every prompt fetches its
    documents' chunks from the KV service (what the first prompt citing a document pays)."""
    import grpc

    from kvmesh.engine.v1 import engine_pb2_grpc

    async with grpc.aio.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        await generate(stub, salt="warm", ids=prompts[0].ids(ids, sep), max_tokens=2)
        res = [await generate(stub, salt="blend", parts=_parts(p, ids, sep), ratio=0.15) for p in prompts]
    return [row("ttft_s", statistics.fmean(r[0] for r in res), "s", mode="blend", recompute_ratio=0.15,
                hot_lru=False)]


async def _search(kv_address: str, namespace, query: str, k: int) -> list[str]:
    """Top-k catalogued documents for `query` from the KV service's index (MiniLM), in
    `namespace` (a kvmesh.common.v1.KvNamespace)."""
    import grpc

    from kvmesh.kvcache.v1 import kvcache_pb2 as kpb
    from kvmesh.kvcache.v1 import kvcache_pb2_grpc

    async with grpc.aio.insecure_channel(kv_address) as ch:
        resp = await kvcache_pb2_grpc.KvCatalogServiceStub(ch).Search(
            kpb.SearchRequest(text=query, namespace=namespace, kind=kpb.INDEX_KIND_DOCUMENT, k=k), timeout=60)
    return [h.document_id for h in resp.hits]


# ---- quality, in this process ----------------------------------------------------------------

def _quality_rows(loaded, prompts, ids, sep, select_layers: int) -> list[dict]:
    """`select_layers`: the engine's default fitted to the model (BenchModel.select_layers)."""
    from kvmesh.kv.blend import DEFAULT_SELECTION, SELECTIONS, Segment, blend_prefill, continuation_logprobs, segment_kv

    model = loaded.model
    doc_kv = {name: segment_kv(model, ids[name]) for name in QUESTIONS}
    ppl: dict[tuple, list[float]] = {}
    for p in prompts:
        full = blend_prefill(model, [Segment.new(p.ids(ids, sep))], recompute_ratio=1.0, select_layers=select_layers)
        base = _ppl(continuation_logprobs(model, full.k, full.v, full.logits, p.answer))
        segments = [Segment.new(p.head)]
        for i, d in enumerate(p.docs):
            if i:
                segments.append(Segment.new(sep))
            segments.append(Segment.cached(ids[d], *doc_kv[d]))
        segments.append(Segment.new(p.tail))
        for ratio in RATIOS:
            for selection in SELECTIONS:
                res = blend_prefill(model, segments, recompute_ratio=ratio, select_layers=select_layers,
                                    selection=selection)
                val = _ppl(continuation_logprobs(model, res.k, res.v, res.logits, p.answer))
                ppl.setdefault((ratio, selection), []).append(100.0 * (val / base - 1.0))
    rows = [row("ppl_delta_pct", 0.0, "%", mode="full", recompute_ratio=1.0),
            row("ppl_delta_pct", 0.0, "%", mode="prefix")]
    # The engine's default selection as the plain blend rows, the others beside it.
    rows += [row("ppl_delta_pct", statistics.fmean(v), "%", mode="blend", recompute_ratio=r,
                 **({} if sel == DEFAULT_SELECTION else {"selection": sel})) for (r, sel), v in ppl.items()]
    return rows


def _ppl(logprobs) -> float:
    return math.exp(-float(logprobs.mean()))


def _recall_rows(loaded, questions: dict[str, str], catalog: dict[str, str], minilm_hits: dict[str, list[str]],
                 ks, max_tokens: int = 1024) -> list[dict]:
    """`max_tokens`: the longest text embedded (1024, or the model's context when shorter)."""
    import numpy as np
    import torch

    model, tok = loaded.model, loaded.tokenizer

    @torch.inference_mode()
    def hidden(text: str) -> np.ndarray:
        from kvmesh.kv.blend import hidden_states

        h = hidden_states(model, tok.encode(text)[:max_tokens]).float().mean(dim=0)
        return (h / h.norm()).numpy()

    names = list(catalog)
    docs = np.stack([hidden(catalog[n]) for n in names])
    rows = []
    for k in ks:
        model_hits = 0
        for name, q in questions.items():
            top = np.argsort(-(docs @ hidden(q)))[:k]
            model_hits += name in {names[i] for i in top}
        minilm = sum(name in minilm_hits[name][:k] for name in questions)
        rows += [row("recall_at_k", minilm / len(questions), "share", mode="retrieve", embedding="minilm", k=k),
                 row("recall_at_k", model_hits / len(questions), "share", mode="retrieve", embedding="model_hidden", k=k)]
    return rows


def _plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def get(metric, mode, ratio=None, selection=None):
        return next((r["value"] for r in rows if r["metric"] == metric and r.get("mode") == mode
                     and r.get("selection") == selection
                     and (ratio is None or r.get("recompute_ratio") == ratio)), None)

    xs = list(RATIOS)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(xs, [get("ttft_s", "blend", x) for x in xs], "o-", label="blend")
    a.axhline(get("ttft_s", "full"), color="r", ls="--", label="full prefill")
    a.axhline(get("ttft_s", "prefix"), color="g", ls=":", label="prefix reuse")
    a.set_xlabel("recompute ratio")
    a.set_ylabel("mean TTFT (s)")
    a.legend()
    b.plot(xs, [get("ppl_delta_pct", "blend", x) for x in xs], "o-", label="Δ perplexity (%)")
    b.plot(xs, [get("ppl_delta_pct", "blend", x, "deviation") for x in xs], "o:", color="tab:blue", alpha=0.5,
           label="Δ perplexity, deviation-only selection")
    b.legend(loc="upper right")
    b2 = b.twinx()
    b2.plot(xs, [get("greedy_agree", "blend", x) for x in xs], "s--", color="tab:orange", label="greedy agree")
    b.set_xlabel("recompute ratio")
    b.set_ylabel("Δ perplexity vs full prefill (%)")
    b2.set_ylabel("greedy tokens equal to full prefill")
    b.set_title("quality")
    a.set_title("time to first token")
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=100)


def longest_prompts(prompts, ids, sep, catalog_ids: list[list[int]]) -> tuple[int, int]:
    """(tokens of the longest RAG prompt, of the longest retrieval prompt: its head and tail around
    the RETRIEVE_K longest catalogued documents)."""
    rag = max(len(p.ids(ids, sep)) for p in prompts)
    docs = sum(sorted(map(len, catalog_ids))[-RETRIEVE_K:]) + (RETRIEVE_K - 1) * len(sep)
    return rag, max(len(p.head) + len(p.tail) for p in prompts) + docs


def run(quick: bool = False, json_path: str | None = None, model: str = "bundled") -> list[dict]:
    import tempfile

    from kvmesh import launcher
    from kvmesh.kv.blend import SELECT_LAYERS
    from kvmesh.loadtest.models import bench_model
    from kvmesh.model.loader import load_model

    plan = QUICK if quick else FULL
    bm = bench_model(model)
    loaded = load_model(model, dtype="float32")
    tok = loaded.tokenizer
    _, ids = _sections(tok)
    sep = tok.encode("\n\n")
    prompts = _prompts(tok, ids, plan.prompts, model)
    catalog = _catalog(plan.catalog)
    rag, retrieve = longest_prompts(prompts, ids, sep, [tok.encode(t) for t in catalog.values()])
    longest = max(rag + max(OUTPUT_TOKENS, ANSWER_TOKENS), retrieve + OUTPUT_TOKENS)
    bm.require_context("blend", longest, "its RAG and retrieval prompts with their answers")
    bm.require_full_attention("blend", longest, "its RAG and retrieval prompts with their answers")
    print(f"kvmesh bench blend ({'quick' if quick else 'full'}, model {model}): {plan}", file=sys.stderr)
    print(f"{len(prompts)} prompts of {min(len(p.ids(ids, sep)) for p in prompts)}-"
          f"{max(len(p.ids(ids, sep)) for p in prompts)} tokens; catalog of {len(catalog)} documents",
          file=sys.stderr)
    threads = str(usable_cores())
    procs = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-blend-") as tmp:
        try:
            kv = launcher.start_service("bench-kvcache", "kvmesh.services.kvcache", ["--data-dir", tmp],
                                        launcher.free_port(), env={"OMP_NUM_THREADS": "1"})
            procs.append(kv)

            def start_engine(*extra: str):
                return launcher.start_service(
                    "bench-engine", "kvmesh.services.engine",
                    ["--threads", threads, "--kvcache-address", kv.address,
                     "--kv-cache-bytes", str(1 << 30), *bm.engine_args(), *extra], launcher.free_port())

            engine = start_engine()
            procs.append(engine)
            rows, hits = asyncio.run(_service_rows(engine.address, kv.address, prompts, ids, sep,
                                                   catalog, QUESTIONS))
            launcher.stop_service(procs.pop())
            cold = start_engine("--kv-hot-bytes", "0")
            procs.append(cold)
            rows += asyncio.run(_fetch_rows(cold.address, prompts, ids, sep))
        finally:
            for p in reversed(procs):
                launcher.stop_service(p)
    rows += _quality_rows(loaded, prompts, ids, sep, bm.select_layers(SELECT_LAYERS))
    rows += _recall_rows(loaded, QUESTIONS, catalog, hits, plan.recall_ks, min(1024, bm.config.context_length))
    print(pivot([r for r in rows if r.get("mode") in ("full", "prefix", "blend")], "mode", baseline="full"))
    print(pivot([r for r in rows if r.get("mode") not in ("full", "prefix", "blend")], "mode"))
    png = Path(json_path).with_suffix(".png") if json_path else Path("bench-results/blend.png")
    _plot(rows, png)
    print(f"wrote the TTFT/quality plot to {png}", file=sys.stderr)
    return rows
