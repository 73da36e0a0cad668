"""`kvmesh bench quality`: what every lossy path does to the answers users get, measured against
exact computation on prompts never used for tuning, next to the time blending saves.

Prompts: ``kvmesh.loadtest.quality_workloads`` (RAG over shuffled passages, multi-turn chat,
long-document QA with generated questions; 156 prompts, dev and test split by source). The
test split is measured unless ``KVMESH_BENCH_SPLIT`` says ``dev`` or ``both`` (the dev split is
for tuning; what is reported is the test split); ``KVMESH_BENCH_PATHS`` (e.g. ``codec``) measures
only some kinds of path (codec, blend, weights; the TTFT section comes with blend), and
``KVMESH_BENCH_RATIOS`` (e.g. ``0.15,0.25``) only some blend ratios. Full: every prompt of the split, exact answers
of up to 64 tokens, blend ratios 0, 0.1, 0.15, 0.25, 0.3, 0.4, 0.5; quick: 4 prompts per workload
(spread evenly over the split), 32 tokens, ratios 0, 0.15, 0.25. With a JSON path, the
per-prompt scores are written beside it (``<name>.prompts.json``).

Exact reference, per prompt (once, shared by every path): the bundled SmolLM2-135M with fp32
weights, through the model's paged forward as the engine runs it (prefill in steps of the
engine's ``max_num_batched_tokens``, then one token per decode step): the greedy answer (up to
and including the end-of-turn token, at most N tokens) and the logits along it.

Paths (all on the exact answer, teacher-forced; the scores are ``kvmesh.kv.quality.compare``):
* ``codec=<name>``: what a KV-service hit gives the engine. The prompt's KV (as the exact run
  computed it) in whole chunks of ``kv_chunk_tokens``, each encoded and decoded as the engine's
  connector does (deployment codec settings from EngineConfig: group size, residual, head and
  key-outlier defaults; keys un-rotated to be stored position-free and rotated back after
  decoding, the sequence's first chunk marked as its start; zstd left out because it is
  lossless), imported up to the last whole block before the last prompt token, the rest of the
  prompt computed over it, then the answer. ``codec=fp32`` is the deployment default (exact,
  keys stored at their positions): a control that must give exact-match 1, KL 0.
* ``blend=<ratio>``: documents (passages; pasted docstrings of earlier chat turns; the module
  reference) computed alone (``kvmesh.kv.blend.segment_kv``: the KV the KV service holds for
  an ingested document; the deployment stores it with the exact fp32 codec, which gives back
  every bit, so no codec round trip), blended into the prompt by ``blend_prefill`` with the
  engine's blending settings (EngineConfig's select layers and selection), imported up to the
  last whole block before the last prompt token as the engine does, the rest computed over it.
* ``weights=<format>``: the whole computation with gguf (GGUF models: the file's own blocks), gguf-a8
  (the same blocks times 8-bit activations, llama.cpp's arithmetic),
  int8, int4 or int4-w8a8 weights (a model loaded with them, no cache): the prompt in the engine's prefill steps, the answer in steps of
  ``kvmesh.model.quant.SMALL_BATCH`` rows (the kernel a one-token decode step uses).
Codec and blend logits are compared with the exact KV run through the same import-and-continue
computation (so ``codec=fp32`` is exact to the bit), weights with the reference's own logits.

Metrics per (split, workload, path), and over all workloads (``workload=all``):
* ``exact_match``: share of prompts whose greedy answer on the path equals the exact one;
* ``first_divergence``: mean position (0-based) of the first token where it differs; a prompt
  with no divergence counts as its answer's length. Both come from the teacher-forced logits,
  not from a second decode: greedy decoding on the path reproduces the exact answer exactly up
  to the first position whose teacher-forced argmax differs, which is that divergence
  (``kvmesh.kv.quality.first_divergence``). Measured in process, not through engine processes;
* ``top1``: share of answer tokens whose most likely next token is the exact one's (pooled over
  tokens); ``kl``: mean KL(exact || path) per answer token, nats (pooled over tokens);
* ``ppl_delta_pct``: the answer's perplexity on the path against exact, mean of per-prompt %;
* with ``stat`` = min | median | max: the spread of the per-prompt values;
* ``answer_tokens`` (path ``exact``): mean length of the exact answers.
TTFT (test split; the RAG and long-document prompts nearest 2,500 tokens: 8, quick 3): through
a real engine over gRPC (all cores, deployment defaults: exact fp32 KV codec, the hot document
LRU). ``path=full``: an engine without a KV service (nothing cached, nothing exported behind the
measurement). ``blend=<ratio>``: a second engine with a KV service, documents ingested first
(``IngestDocument``), one untimed pass of every prompt at another ratio (its documents reach the
engine's hot LRU), then each prompt sent as parts with ``blend.recompute_ratio`` (guardrail
shadow checks off, and every timed request checked to have blended): ``ttft_s``
(mean; spread) and ``ttft_speedup`` (mean full TTFT / mean path TTFT; spread of per-prompt
ratios).
"""
from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Optional

from kvmesh.kv.quality import first_divergence
from kvmesh.loadtest.quality_ttft import measure_ttft
from kvmesh.loadtest.quality_workloads import SPLITS, WORKLOADS, QualityPrompt, build_prompts
from kvmesh.loadtest.report import row

if TYPE_CHECKING:
    import torch

    from kvmesh.kv.quality import Comparison
    from kvmesh.model.loader import LoadedModel

CODECS = ("fp32", "fp16", "bf16", "int8", "int4", "int2")
WEIGHTS = ("gguf", "gguf-a8", "int8", "int4", "int4-w8a8", "bf16")
"""gguf, gguf-a8: GGUF sources only (the file's own blocks; gguf-a8 times 8-bit activations, on CPUs
with AVX-512 VNNI); bf16: bf16 weights and activations (--dtype bfloat16)."""
SPLIT_ENV = "KVMESH_BENCH_SPLIT"
PATHS_ENV = "KVMESH_BENCH_PATHS"
RATIOS_ENV = "KVMESH_BENCH_RATIOS"
PATH_KINDS = ("codec", "blend", "weights")
TTFT_TOKENS = 2500
DOC_KV_BYTES = 2 << 30
METRICS = ("exact_match", "first_divergence", "top1", "kl", "ppl_delta_pct", "ttft_s", "ttft_speedup")


@dataclass(frozen=True)
class Plan:
    per_workload: int = 0
    """Prompts per (split, workload), spread evenly over it; 0 = all."""
    answer_tokens: int = 64
    ratios: tuple[float, ...] = (0.0, 0.1, 0.15, 0.25, 0.3, 0.4, 0.5)
    ttft_prompts: int = 8
    paths: tuple[str, ...] = PATH_KINDS
    """The kinds of paths measured (KVMESH_BENCH_PATHS); TTFT only with blend."""


FULL = Plan()
QUICK = Plan(per_workload=4, answer_tokens=32, ratios=(0.0, 0.15, 0.25), ttft_prompts=3)


# ---- scores and rows (no torch) --------------------------------------------------------------

@dataclass(frozen=True)
class Score:
    """One prompt on one path against exact computation."""

    prompt_id: str
    workload: str
    split: str
    path: str
    ratio: Optional[float]
    tokens: int
    """Length of the exact answer."""
    kl: float
    top1: float
    ppl_delta: float
    divergence: int

    @property
    def exact_match(self) -> bool:
        return self.divergence == self.tokens


def score(prompt: QualityPrompt, path: str, ratio: Optional[float], answer: list[int], cmp: Comparison,
          predicted: Iterable[int]) -> Score:
    """The Score of a path whose teacher-forced argmax along `answer` is `predicted`."""
    return Score(prompt.id, prompt.workload, prompt.split, path, ratio, len(answer), cmp.kl, cmp.top1,
                 cmp.ppl_delta, first_divergence(answer, list(predicted)))


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def quality_rows(scores: list[Score]) -> list[dict]:
    """Rows per (split, workload, path) and per (split, all, path); see the module docstring."""
    groups: dict[tuple, list[Score]] = {}
    for s in scores:
        for workload in (s.workload, "all"):
            groups.setdefault((s.split, workload, s.path, s.ratio), []).append(s)
    rows = []
    for (split, workload, path, ratio), group in groups.items():
        tag = dict(split=split, workload=workload, path=path, **({} if ratio is None else {"ratio": ratio}))
        tokens = sum(s.tokens for s in group)
        per_prompt = {"first_divergence": ([float(s.divergence) for s in group], "tokens"),
                      "top1": ([s.top1 for s in group], "share"),
                      "kl": ([s.kl for s in group], "nats/token"),
                      "ppl_delta_pct": ([100.0 * s.ppl_delta for s in group], "%")}
        rows += [row("exact_match", statistics.fmean(s.exact_match for s in group), "share", **tag),
                 row("first_divergence", statistics.fmean(per_prompt["first_divergence"][0]), "tokens", **tag),
                 row("top1", sum(s.top1 * s.tokens for s in group) / tokens, "share", **tag),
                 row("kl", sum(s.kl * s.tokens for s in group) / tokens, "nats/token", **tag),
                 row("ppl_delta_pct", statistics.fmean(per_prompt["ppl_delta_pct"][0]), "%", **tag)]
        rows += [row(metric, v, unit, **tag, stat=stat)
                 for metric, (values, unit) in per_prompt.items() for stat, v in spread(values).items()]
    return rows


def answer_rows(scores: list[Score]) -> list[dict]:
    """Mean exact answer length per (split, workload) and over all workloads."""
    lengths: dict[tuple, dict[str, int]] = {}
    for s in scores:
        for workload in (s.workload, "all"):
            lengths.setdefault((s.split, workload), {})[s.prompt_id] = s.tokens
    return [row("answer_tokens", statistics.fmean(v.values()), "tokens", split=split, workload=w, path="exact")
            for (split, w), v in lengths.items()]


def ttft_rows(full: list[float], blends: dict[float, list[float]]) -> list[dict]:
    """TTFT rows from per-prompt seconds (same prompt order in `full` and every blend list)."""
    tag = dict(split="test", workload="all")
    rows = [row("ttft_s", statistics.fmean(full), "s", **tag, path="full", ratio=1.0),
            row("ttft_speedup", 1.0, "x", **tag, path="full", ratio=1.0)]
    rows += [row("ttft_s", v, "s", **tag, path="full", ratio=1.0, stat=k) for k, v in spread(full).items()]
    for ratio, secs in blends.items():
        btag = dict(tag, path=f"blend={ratio:g}", ratio=ratio)
        per_prompt = [f / b for f, b in zip(full, secs)]
        rows += [row("ttft_s", statistics.fmean(secs), "s", **btag),
                 row("ttft_speedup", statistics.fmean(full) / statistics.fmean(secs), "x", **btag)]
        rows += [row("ttft_s", v, "s", **btag, stat=k) for k, v in spread(secs).items()]
        rows += [row("ttft_speedup", v, "x", **btag, stat=k) for k, v in spread(per_prompt).items()]
    return rows


def table(rows: list[dict], split: str = "test") -> str:
    """Path x metric over all workloads of `split` (headline values), then the spreads."""
    main = [r for r in rows if r.get("split") == split and r.get("workload") == "all" and "stat" not in r]
    paths = list(dict.fromkeys(r["path"] for r in main if r["metric"] in METRICS))
    cell = {(r["path"], r["metric"]): r["value"] for r in main}
    out = [_grid(["path", *METRICS], [[p, *(_fmt(cell.get((p, m))) for m in METRICS)] for p in paths])]
    stats = [r for r in rows if r.get("split") == split and r.get("workload") == "all" and "stat" in r]
    spread_metrics = list(dict.fromkeys(r["metric"] for r in stats))
    sc = {(r["path"], r["metric"], r["stat"]): r["value"] for r in stats}
    lines = [[p, *("/".join(_fmt(sc.get((p, m, s))) for s in ("min", "median", "max"))
                   if (p, m, "min") in sc else "-" for m in spread_metrics)] for p in paths]
    out.append("spread over prompts (min/median/max):")
    out.append(_grid(["path", *spread_metrics], lines))
    by_workload = [r for r in rows if r.get("split") == split and r["metric"] == "top1" and "stat" not in r]
    wl = {(r["path"], r["workload"]): r["value"] for r in by_workload}
    out.append("top1 by workload:")
    out.append(_grid(["path", *WORKLOADS], [[p, *(_fmt(wl.get((p, w))) for w in WORKLOADS)] for p in paths
                                            if any((p, w) in wl for w in WORKLOADS)]))
    return "\n".join(out)


def _grid(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(str(x[i])) for x in [header, *lines]) for i in range(len(header))]
    fmt = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)])


def _fmt(v) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"


def select(prompts: list[QualityPrompt], per_workload: int) -> list[QualityPrompt]:
    """`per_workload` prompts of each (split, workload), spread evenly over it (0 = all)."""
    out = []
    for split in SPLITS:
        for workload in WORKLOADS:
            group = [p for p in prompts if p.split == split and p.workload == workload]
            n = len(group) if not per_workload else min(per_workload, len(group))
            out += [group[i * len(group) // n] for i in range(n)]
    return out


def ttft_prompts(prompts: list[QualityPrompt], n: int) -> list[QualityPrompt]:
    """The n test prompts with documents (RAG, long-document) nearest TTFT_TOKENS."""
    pool = [p for p in prompts if p.split == "test" and p.workload in ("rag", "longdoc")]
    return sorted(pool, key=lambda p: (abs(len(p.token_ids) - TTFT_TOKENS), p.id))[:n]


def paths_from_env() -> tuple[str, ...]:
    value = os.environ.get(PATHS_ENV, ",".join(PATH_KINDS))
    kinds = tuple(k.strip() for k in value.split(",") if k.strip())
    if not kinds or any(k not in PATH_KINDS for k in kinds):
        raise SystemExit(f"{PATHS_ENV}={value!r}: a comma-separated list of {', '.join(PATH_KINDS)} (default: all)")
    return tuple(k for k in PATH_KINDS if k in kinds)


def ratios_from_env(default: tuple[float, ...]) -> tuple[float, ...]:
    value = os.environ.get(RATIOS_ENV)
    if value is None:
        return default
    try:
        ratios = tuple(float(r) for r in value.split(",") if r.strip())
    except ValueError:
        ratios = ()
    if not ratios or any(not 0.0 <= r <= 1.0 for r in ratios):
        raise SystemExit(f"{RATIOS_ENV}={value!r}: a comma-separated list of recompute ratios in [0, 1]")
    return ratios


def splits_from_env() -> tuple[str, ...]:
    value = os.environ.get(SPLIT_ENV, "test")
    choices = {"dev": ("dev",), "test": ("test",), "both": SPLITS}
    if value not in choices:
        raise SystemExit(f"{SPLIT_ENV}={value!r}: use dev, test or both (test is what the README reports)")
    return choices[value]


# ---- in process: the paths against exact computation -----------------------------------------

class _Sequence:
    """One sequence in a private paged KV cache, run by the model's paged forward (the engine's
    path): KV imported as a fetch imports it, tokens computed `rows` per forward."""

    def __init__(self, loaded: LoadedModel, capacity: int, block_size: int) -> None:
        from kvmesh.model.attention import allocate_kv_cache

        self.loaded = loaded
        blocks = -(-capacity // block_size)
        self.kv = allocate_kv_cache(loaded.config, blocks, block_size, loaded.dtype, loaded.device)
        self.table = list(range(blocks))  # block i holds positions i*bs.., so slot = position
        self.n = 0

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        from kvmesh.model.attention import write_kv_range

        write_kv_range(self.kv, self.table, self.n, k, v)
        self.n += k.shape[1]

    def read(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        from kvmesh.model.attention import read_kv

        return read_kv(self.kv, self.table, 0, end)

    def extend(self, ids: list[int], rows: int, keep: int) -> torch.Tensor:
        """Computes `ids` after what is cached, `rows` tokens per forward -> float32 logits
        [keep, vocab] of the last `keep` of them."""
        import torch

        from kvmesh.model.attention import AttentionMetadata

        hidden = []
        for a in range(0, len(ids), rows):
            part = ids[a:a + rows]
            pos = torch.arange(self.n, self.n + len(part))
            meta = AttentionMetadata(slot_mapping=pos.clone(), query_lens=[len(part)],
                                     context_lens=[self.n + len(part)], block_tables=torch.tensor([self.table]))
            h = self.loaded.model(torch.tensor(part), pos, self.kv, meta)  # [len(part), hidden]
            self.n += len(part)
            first = len(ids) - keep - a  # the first kept token's index in this part
            if first < len(part):
                hidden.append(h[max(0, first):])
        return self.loaded.model.compute_logits(torch.cat(hidden)).float()


@dataclass(frozen=True)
class _Reference:
    answer: list[int]
    logits: torch.Tensor  # [len(answer), vocab] as decoded
    k: torch.Tensor  # [layers, T, kvh, hd] the prompt's KV as computed (keys at their positions)
    v: torch.Tensor


class _Measure:
    """Every path of one plan, prompt by prompt, in this process."""

    def __init__(self, loaded: LoadedModel, plan: Plan) -> None:
        from kvmesh.kv.codec import CodecSpec
        from kvmesh.model.loader import load_model
        from kvmesh.services.engine.blending import BlendConfig
        from kvmesh.services.engine.build import engine_namespace
        from kvmesh.services.engine.config import EngineConfig

        cfg = EngineConfig()  # the deployment's defaults
        self.loaded, self.plan = loaded, plan
        self.block, self.chunk, self.prefill_rows = cfg.block_size, cfg.kv_chunk_tokens, cfg.max_num_batched_tokens
        # As services/engine/build.py builds them from the engine's config.
        self.codec_base = CodecSpec(name="fp32", zstd=False, group_size=cfg.kv_group_size, residual=cfg.kv_residual,
                                    head=cfg.kv_head_tokens, key_outliers=cfg.kv_key_outliers)
        self.blend = BlendConfig(cfg.blend_recompute_ratio, cfg.blend_select_layers,
                                 cfg.blend_selection).for_model(loaded.config.num_layers)
        self.namespace = engine_namespace(loaded).digest()
        self.eos = set(loaded.tokenizer.eos_token_ids)
        t0 = time.perf_counter()
        from kvmesh.model import gguf_a8
        from kvmesh.model.loader import GGUF_FORMATS, gguf_source

        formats = [f for f in WEIGHTS if f not in GGUF_FORMATS or gguf_source(loaded.source) is not None]
        if "gguf-a8" in formats and gguf_a8.ops() is None:
            print("weights=gguf-a8 skipped: it needs AVX-512 VNNI and the native kernels", file=sys.stderr)
            formats.remove("gguf-a8")
        self.weights = {fmt: load_model(loaded.source, dtype="bfloat16" if fmt == "bf16" else "float32", weights=fmt,
                                        progress=False)
                        for fmt in (formats if "weights" in plan.paths else ())}
        if self.weights:
            print(f"loaded the {', '.join(self.weights)} models in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        self._docs: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self.seconds: dict[str, float] = {}
        self.flips = [0, 0]  # exact tokens whose two exact computations disagree on the argmax, of all

    def _timed(self, what: str, t0: float) -> None:
        self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - t0

    def prompt(self, p: QualityPrompt) -> list[Score]:
        import torch

        from kvmesh.kv.quality import compare

        with torch.inference_mode():
            ids = p.token_ids
            t0 = time.perf_counter()
            ref = self._reference(self.loaded, ids)
            self._timed("exact", t0)
            answer = torch.tensor(ref.answer)
            exact_tf: dict[int, torch.Tensor] = {}

            def against_exact(path, ratio, k, v, m):
                if m not in exact_tf:  # the exact KV through the same import-and-continue
                    exact_tf[m] = self._continue(ids, ref.k, ref.v, m, ref.answer)
                    self.flips[0] += int((exact_tf[m].argmax(-1) != answer).sum())
                    self.flips[1] += len(ref.answer)
                lossy = self._continue(ids, k, v, m, ref.answer)
                return score(p, path, ratio, ref.answer, compare(exact_tf[m], lossy, answer), lossy.argmax(-1).tolist())

            scores = []
            t0 = time.perf_counter()
            for name in CODECS if "codec" in self.plan.paths else ():
                k, v, m = self._codec_kv(ids, ref, name)
                scores.append(against_exact(f"codec={name}", None, k, v, m))
            self._timed("codecs", t0)
            t0 = time.perf_counter()
            m = (len(ids) - 1) // self.block * self.block
            for ratio in self.plan.ratios if "blend" in self.plan.paths else ():
                k, v = self._blend_kv(p, ratio)
                scores.append(against_exact(f"blend={ratio:g}", ratio, k, v, m))
            self._timed("blend", t0)
            t0 = time.perf_counter()
            for fmt, model in self.weights.items():
                lossy = self._weights_logits(model, ids, ref.answer)
                scores.append(score(p, f"weights={fmt}", None, ref.answer, compare(ref.logits, lossy, answer),
                                    lossy.argmax(-1).tolist()))
            self._timed("weights", t0)
        return scores

    def _reference(self, loaded: LoadedModel, ids: list[int]) -> _Reference:
        """Greedy answer of the exact model and its logits, as the engine computes them."""
        import torch

        seq = _Sequence(loaded, len(ids) + self.plan.answer_tokens, self.block)
        logits = [seq.extend(ids, self.prefill_rows, 1)[0]]
        k, v = seq.read(len(ids))
        answer: list[int] = []
        while True:
            answer.append(int(logits[-1].argmax()))
            if answer[-1] in self.eos or len(answer) == self.plan.answer_tokens:
                break
            logits.append(seq.extend([answer[-1]], 1, 1)[0])
        return _Reference(answer, torch.stack(logits), k, v)

    def _continue(self, ids: list[int], k, v, m: int, answer: list[int]) -> torch.Tensor:
        """Logits along `answer` with the prompt's KV [0, m) imported from k, v and the rest of
        the prompt computed over it."""
        seq = _Sequence(self.loaded, len(ids) + len(answer), self.block)
        seq.write(k[:, :m], v[:, :m])
        return seq.extend(ids[m:] + answer[:-1], self.prefill_rows, len(answer))

    def _codec_kv(self, ids: list[int], ref: _Reference, name: str):
        """The prompt's KV as a fetch from the KV service imports it: (k, v, tokens imported)."""
        from kvmesh.services.engine.kv_connector import stored_round_trip

        c = self.chunk
        m = min(len(ids) // c * c, (len(ids) - 1) // self.block * self.block)
        if not m:
            return ref.k[:, :0], ref.v[:, :0], 0
        whole = -(-m // c) * c
        spec = dataclasses.replace(self.codec_base, name=name)
        k, v = stored_round_trip(ref.k[:, :whole], ref.v[:, :whole], ids, self.namespace, spec,
                                 self.loaded.model.rotary, c)
        return k, v, m

    def _doc_kv(self, doc_id: str, ids: tuple[int, ...]):
        from kvmesh.kv.blend import segment_kv

        if doc_id in self._docs:
            self._docs.move_to_end(doc_id)
            return self._docs[doc_id]
        kv = segment_kv(self.loaded.model, ids)
        self._docs[doc_id] = kv
        while sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                  for a, b in self._docs.values()) > DOC_KV_BYTES and len(self._docs) > 1:
            self._docs.popitem(last=False)
        return kv

    def _blend_kv(self, p: QualityPrompt, ratio: float):
        from kvmesh.kv.blend import Segment, blend_prefill

        # Prompts end in new text (the template's assistant header), so unlike plan_documents
        # no cached last segment needs splitting off.
        names = iter(p.documents)
        segments = [Segment.cached(ids, *self._doc_kv(next(names), ids)) if is_doc else Segment.new(ids)
                    for ids, is_doc in p.segments]
        res = blend_prefill(self.loaded.model, segments, ratio, self.blend.select_layers, self.blend.selection)
        return res.k, res.v

    def _weights_logits(self, model: LoadedModel, ids: list[int], answer: list[int]) -> torch.Tensor:
        import torch

        from kvmesh.model.native import LINEAR_ROWS
        from kvmesh.model.quant import SMALL_BATCH

        seq = _Sequence(model, len(ids) + len(answer), self.block)
        logits = [seq.extend(ids, self.prefill_rows, 1)]
        if len(answer) > 1:
            # gguf: steps of 8 rows over earlier context are decode rows of the fused decode step,
            # each row the bits of a one-token step (tests/unit/model/test_gguf_decode.py)
            rows = SMALL_BATCH.get(model.weights, LINEAR_ROWS)
            logits.append(seq.extend(answer[:-1], rows, len(answer) - 1))
        return torch.cat(logits)


def measure(loaded: LoadedModel, prompts: list[QualityPrompt], plan: Plan) -> list[Score]:
    m = _Measure(loaded, plan)
    scores: list[Score] = []
    t_start = time.perf_counter()
    for i, p in enumerate(prompts):
        t0 = time.perf_counter()
        new = m.prompt(p)
        scores += new
        print(f"[{i + 1}/{len(prompts)}] {p.id}: {len(p.token_ids)} tokens, answer {new[0].tokens}, "
              f"{time.perf_counter() - t0:.1f} s (total {time.perf_counter() - t_start:.0f} s)", file=sys.stderr)
    print("in-process seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in m.seconds.items())
          + f"; exact argmax flips between decode and import-and-continue: {m.flips[0]} of {m.flips[1]} tokens",
          file=sys.stderr)
    return scores


def run(quick: bool = False, json_path: Optional[str] = None, model: str = "bundled") -> list[dict]:
    from kvmesh.loadtest.models import bench_model
    from kvmesh.model.loader import load_model

    base = QUICK if quick else FULL
    plan = dataclasses.replace(base, paths=paths_from_env(), ratios=ratios_from_env(base.ratios))
    splits = splits_from_env()
    print(f"kvmesh bench quality ({'quick' if quick else 'full'}, split {'+'.join(splits)}, model {model}): {plan}",
          file=sys.stderr)
    t_start = time.perf_counter()
    bm = bench_model(model)
    loaded = load_model(model, dtype="float32", progress=False)
    prompts = build_prompts(loaded.tokenizer, splits)
    chosen = select(prompts, plan.per_workload)
    timed = ttft_prompts(prompts, plan.ttft_prompts) if "test" in splits and "blend" in plan.paths else []
    longest = max(len(p.token_ids) for p in chosen + timed) + plan.answer_tokens
    bm.require_context("quality", longest, "its prompts with their answers")
    bm.require_full_attention("quality", longest, "its prompts with their answers")
    counts = {(p.split, p.workload) for p in chosen}
    print(f"{len(chosen)} of {len(prompts)} prompts: " + ", ".join(
        f"{s}/{w} {sum(p.split == s and p.workload == w for p in chosen)}" for s, w in sorted(counts)), file=sys.stderr)
    rows: list[dict] = []
    if "test" in splits and "blend" in plan.paths:
        t0 = time.perf_counter()
        warm = loaded.tokenizer.encode("<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n")
        rows += ttft_rows(*measure_ttft(timed, plan.ratios, warm, bm.engine_args()))
        print(f"TTFT section: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    scores = measure(loaded, chosen, plan)
    rows += answer_rows(scores) + quality_rows(scores)
    if json_path:
        path = Path(json_path).with_suffix(".prompts.json")
        path.write_text(json.dumps([dataclasses.asdict(s) for s in scores], indent=1))
        print(f"wrote {len(scores)} per-prompt scores to {path}", file=sys.stderr)
    for split in splits:
        print(f"split {split}, all workloads ({sum(p.split == split for p in chosen)} prompts):")
        print(table(rows, split))
    print(f"kvmesh bench quality: {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return rows
