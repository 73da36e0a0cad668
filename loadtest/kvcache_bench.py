"""`kvmesh bench kvcache`: what storing prompt KV costs in bytes and quality, and what it saves in
time to first token.

Side by side in one run on the bundled SmolLM2-135M (or the model of `--model PATH`):
  * per codec (fp32 -- the deployment default ``--kv-codec auto`` of a float32 engine, exact --
    then the lossy fp16, int8, int4, int2; each with and without zstd), on the real KV of a
    2,048-token prompt of English text (``pydoc_data.topics``) cut in 256-token chunks: stored
    bytes per token and the ratio to fp16; perplexity of the held-out next 512 tokens when the
    prompt's KV comes back from the codec, against exact KV; and the share of 32 greedy tokens
    identical to the run on exact KV (one text: `kvmesh bench quality` measures the lossy paths
    on many prompts);
  * time to first token through the real services (engine + KV-cache processes on loopback), with
    the default codec (``auto``: exact fp32 + zstd) and with int4+zstd (``codec`` param): cold
    (full prefill), warm from the KV service's memory tier (engine restarted, so its own prefix
    cache is empty), and warm from LMDB (engine and KV service restarted; the OS page cache is
    warm, as on a live machine).
"""
from __future__ import annotations

import asyncio
import math
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvmesh.loadtest.report import pivot, row
from kvmesh.threads import usable_cores

CODECS = ("fp32", "fp16", "int8", "int4", "int2")
TTFT_CODECS = ("auto", "int4")
CHUNK = 256


@dataclass(frozen=True)
class Plan:
    quality_prompt: int = 2048
    quality_continuation: int = 512
    greedy_tokens: int = 32
    ttft_prompts: tuple[int, ...] = (2048, 4096)
    repeats: int = 2


FULL = Plan()
QUICK = Plan(quality_prompt=1024, quality_continuation=256, greedy_tokens=16, repeats=1)


# ---- bytes and quality (in process) -----------------------------------------------------------

class PagedSequence:
    """One sequence in a private paged cache: prefill, import KV, extend, read logits."""

    def __init__(self, lm, capacity: int, block_size: int = 16) -> None:
        from kvmesh.model.attention import allocate_kv_cache

        self.lm, self.bs = lm, block_size
        self.nb = -(-capacity // block_size)
        self.kv = allocate_kv_cache(lm.config, self.nb, block_size, lm.dtype, lm.device)
        self.table = list(range(self.nb))
        self.n = 0

    def write(self, k: torch.Tensor, v: torch.Tensor) -> None:
        from kvmesh.model.attention import write_kv_range

        write_kv_range(self.kv, self.table, self.n, k, v)
        self.n += k.shape[1]

    def extend(self, ids: list[int]) -> torch.Tensor:
        """Computes `ids` after what is cached; returns their logits [len(ids), vocab]."""
        from kvmesh.model.attention import AttentionMetadata

        pos = torch.arange(self.n, self.n + len(ids))
        meta = AttentionMetadata(slot_mapping=pos.clone(), query_lens=[len(ids)], context_lens=[self.n + len(ids)],
                                 block_tables=torch.tensor([self.table]))
        hidden = self.lm.model(torch.tensor(ids), pos, self.kv, meta)
        self.n += len(ids)
        return self.lm.model.compute_logits(hidden)


@torch.inference_mode()
def quality_rows(plan: Plan, model: str = "bundled") -> list[dict]:
    from kvmesh.kv import codec
    from kvmesh.kv.namespace import EXACT
    from kvmesh.kv.rope import rotate_keys
    from kvmesh.model.attention import read_kv
    from kvmesh.model.loader import load_model
    from kvmesh.model.perplexity import reference_text
    from kvmesh.services.engine.build import engine_namespace
    from kvmesh.services.engine.kv_connector import encode_chunk

    lm = load_model(model, progress=False)
    ids = lm.tokenizer.encode(reference_text())
    prompt = ids[:plan.quality_prompt]
    cont = ids[plan.quality_prompt:plan.quality_prompt + plan.quality_continuation]
    total = len(prompt) + len(cont) + plan.greedy_tokens
    ns = engine_namespace(lm).digest()
    rotary = lm.model.rotary

    exact = PagedSequence(lm, total)
    exact.extend(prompt)
    k_all, v_all = read_kv(exact.kv, exact.table, 0, len(prompt))  # [L, T, kvh, hd]

    def continue_from(k: torch.Tensor, v: torch.Tensor) -> tuple[float, list[int]]:
        """(perplexity of `cont`, greedy tokens) with the prompt's KV given."""
        seq = PagedSequence(lm, total)
        seq.write(k, v)
        logits = seq.extend(cont)
        # logits[i] predicts cont[i+1]; the first continuation token is predicted from the prompt's
        # last position, which is inside the stored KV, so score cont[1:].
        nll = F.cross_entropy(logits[:-1], torch.tensor(cont[1:]), reduction="mean").item()
        greedy = PagedSequence(lm, total)
        greedy.write(k, v)
        out = [int(greedy.extend([cont[0]])[-1].argmax())]
        for _ in range(plan.greedy_tokens - 1):
            out.append(int(greedy.extend([out[-1]])[-1].argmax()))
        return math.exp(nll), out

    base_ppl, base_greedy = continue_from(k_all, v_all)
    print(f"exact KV: continuation perplexity {base_ppl:.4f}", file=sys.stderr)
    fp16_bytes = 2 * k_all.numel() * 2  # k and v at 2 bytes per element
    rows = []
    n_chunks = len(prompt) // CHUNK
    for name in CODECS:
        recon = None
        for zstd in (False, True):
            spec = codec.CodecSpec(name=name, zstd=zstd)
            positioned = spec.storage(lm.dtype) == EXACT  # an exact prefix chunk keeps its keys as computed
            t0 = time.perf_counter()
            # As the engine's export stores them (lossy: keys un-rotated to position 0, kvmesh.kv.rope).
            blobs = [encode_chunk(k_all[:, i * CHUNK:(i + 1) * CHUNK], v_all[:, i * CHUNK:(i + 1) * CHUNK],
                                  prompt[i * CHUNK:(i + 1) * CHUNK], ns, spec, i * CHUNK, rotary, positioned)
                     for i in range(n_chunks)]
            enc_s = (time.perf_counter() - t0) / n_chunks
            t0 = time.perf_counter()
            parts = []
            for i, b in enumerate(blobs):
                k, v, header = codec.decode(b, namespace=ns)
                parts.append((k if header.positioned else rotate_keys(k, i * CHUNK, rotary), v))
            dec_s = (time.perf_counter() - t0) / n_chunks
            size = sum(map(len, blobs))
            tag = dict(codec=name, zstd=zstd)
            rows.append(row("bytes_per_token", size / (n_chunks * CHUNK), "B", **tag))
            rows.append(row("ratio_vs_fp16", fp16_bytes * n_chunks * CHUNK / len(prompt) / size, "x", **tag))
            rows.append(row("encode_ms_per_chunk", enc_s * 1e3, "ms", **tag))
            rows.append(row("decode_ms_per_chunk", dec_s * 1e3, "ms", **tag))
            if recon is None:  # zstd is lossless: quality is the codec's
                k = torch.cat([p[0] for p in parts], dim=1)
                v = torch.cat([p[1] for p in parts], dim=1)
                ppl, greedy = continue_from(k, v)
                recon = (100 * (ppl - base_ppl) / base_ppl,
                         sum(a == b for a, b in zip(greedy, base_greedy)) / len(base_greedy))
            rows.append(row("ppl_delta_pct", recon[0], "%", **tag))
            rows.append(row("greedy_agree", recon[1], "share", **tag))
        print(f"{name}: ppl delta {recon[0]:+.3f}% greedy agree {recon[1]:.2f}", file=sys.stderr)
    return rows


# ---- time to first token (services as processes) ----------------------------------------------

async def _ttft(address: str, ids: list[int]) -> tuple[float, int]:
    import grpc

    from kvmesh.common.v1 import common_pb2
    from kvmesh.engine.v1 import engine_pb2, engine_pb2_grpc

    req = engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids),
                                     sampling=engine_pb2.SamplingParams(max_tokens=1, temperature=0.0))
    async with grpc.aio.insecure_channel(address) as ch:
        t0 = time.perf_counter()
        final = None
        async for msg in engine_pb2_grpc.EngineServiceStub(ch).Generate(req, timeout=600):
            if msg.HasField("final"):
                final = msg.final
        return time.perf_counter() - t0, final.usage.cached_prompt_tokens


def ttft_rows(plan: Plan, model: str = "bundled", engine_args: tuple[str, ...] = ()) -> list[dict]:
    """`engine_args` name the model (BenchModel.engine_args)."""
    rows = []
    for name in TTFT_CODECS:
        rows += [{"codec": name, **r} for r in _ttft_rows(plan, name, model, engine_args)]
    return rows


def _ttft_rows(plan: Plan, codec_name: str, model: str, engine_args: tuple[str, ...]) -> list[dict]:
    from kvmesh import launcher
    from kvmesh.model.loader import load_tokenizer
    from kvmesh.model.perplexity import reference_text

    ids = load_tokenizer(model).encode(reference_text())
    data = tempfile.mkdtemp(prefix="kvmesh-bench-kv-")
    kv_port, eng_port = launcher.free_port(), launcher.free_port()
    kv_args = ["--data-dir", data, "--tiers", "memory,disk", "--disk-map-bytes", str(4 << 30)]
    eng_args = ["--kvcache-address", f"127.0.0.1:{kv_port}", "--threads", str(usable_cores()),
                "--kv-codec", codec_name, "--kv-zstd", "true", *engine_args]
    # The KV service idles while the engine computes: one torch thread for it, the cores for the engine.
    one_thread = {"OMP_NUM_THREADS": "1"}
    rows: list[dict] = []
    samples: dict[tuple[int, str], list[float]] = {}
    offset = 0
    kv = launcher.start_service("bench-kvcache", "kvmesh.services.kvcache", kv_args, kv_port, env=one_thread)
    eng = None
    try:
        for rep in range(plan.repeats):
            prompts = {}
            for n in plan.ttft_prompts:
                prompts[n] = ids[offset:offset + n]  # distinct text per repeat: no stale hits
                offset += n
            for source in ("cold", "memory", "lmdb"):
                if source == "lmdb":
                    launcher.stop_service(kv)
                    kv = launcher.start_service("bench-kvcache", "kvmesh.services.kvcache", kv_args, kv_port,
                                                env=one_thread)
                if eng is not None:  # a fresh engine: its own prefix cache is empty; stopping it
                    launcher.stop_service(eng)  # waits for its queued exports
                eng = launcher.start_service("bench-engine", "kvmesh.services.engine", eng_args, eng_port)
                asyncio.run(_ttft(eng.address, ids[-64:]))  # warm-up: first-call allocations
                for n, p in prompts.items():
                    seconds, cached = asyncio.run(_ttft(eng.address, p))
                    expect = 0 if source == "cold" else (n - 1) // 16 * 16  # whole blocks, last token computed
                    if cached != expect:
                        print(f"warning: {source} {n}: {cached} cached tokens, expected {expect}", file=sys.stderr)
                    samples.setdefault((n, source), []).append(seconds)
                    print(f"ttft {codec_name} {source} {n} tokens: {seconds:.3f}s ({cached} cached)",
                          file=sys.stderr)
    finally:
        for svc in (eng, kv):
            if svc is not None:
                launcher.stop_service(svc)
        shutil.rmtree(data, ignore_errors=True)
    for (n, source), vals in samples.items():
        rows.append(row("ttft_s", statistics.median(vals), "s", prompt_tokens=n, source=source))
    return rows


def run(quick: bool = False, model: str = "bundled") -> list[dict]:
    from kvmesh.loadtest.models import bench_model

    plan = QUICK if quick else FULL
    bm = bench_model(model)
    bm.require_context("kvcache", max(plan.quality_prompt + plan.quality_continuation + plan.greedy_tokens,
                                      max(plan.ttft_prompts) + 1),
                       f"its {plan.quality_prompt}-token quality prompt and prompts of up to "
                       f"{max(plan.ttft_prompts)} tokens")
    print(f"kvmesh bench kvcache ({'quick' if quick else 'full'}, model {model}): {plan}", file=sys.stderr)
    rows = quality_rows(plan, model)
    print(pivot([r for r in rows], "codec"))
    trows = ttft_rows(plan, model, tuple(bm.engine_args()))
    for name in TTFT_CODECS:
        print(f"codec {name}:")
        print(pivot([r for r in trows if r["codec"] == name], "source", baseline="cold"))
    return rows + trows
