"""`kvmesh bench engine`: the kvmesh engine vs Hugging Face generate() on the same weights.

On the bundled model by default; `--model PATH` measures another (HF generate() loads the same
folder or GGUF file; the llama.cpp column needs a GGUF file).

Side by side, one run, one machine. kvmesh runs as its real gRPC service process (so its
resident memory is the service's); HF runs in this process after the engine has stopped, so
the two never compete for cores. Prompts are distinct slices of real text, so the engine's prefix
cache never turns a measurement into a cache hit.
"""
from __future__ import annotations

import asyncio
import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from kvmesh.loadtest.report import pivot, row
from kvmesh.threads import set_torch_threads


@dataclass(frozen=True)
class Plan:
    """Sizes of one benchmark run."""

    decode_prompt: int = 64
    decode_tokens: int = 128
    ttft_prompts: tuple[int, ...] = (512, 2048)
    repeats: int = 3
    concurrency: tuple[int, ...] = (1, 8, 32)
    conc_prompt: int = 128
    conc_tokens: int = 128


FULL = Plan()
QUICK = Plan(decode_tokens=64, repeats=1, conc_tokens=32)


class Prompts:
    """Distinct token slices of the reference text (pydoc topics), never reused."""

    def __init__(self, tokenizer) -> None:
        from kvmesh.model.perplexity import reference_text

        self.ids = tokenizer.encode(reference_text())
        self.offset = 0

    def take(self, n: int) -> list[int]:
        if self.offset + n > len(self.ids):
            self.offset = 0
        out = self.ids[self.offset:self.offset + n]
        self.offset += n
        return out



# ---- kvmesh (gRPC service process) -----------------------------------------------------------

async def _one(stub, ids: list[int], max_tokens: int):
    """Streams one request; returns (t_start, t_first_token, t_end, n_tokens)."""
    from kvmesh.common.v1 import common_pb2
    from kvmesh.engine.v1 import engine_pb2

    req = engine_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    first = None
    n = 0
    async for msg in stub.Generate(req, timeout=600):
        if msg.delta.token_ids and first is None:
            first = time.perf_counter()
        n += len(msg.delta.token_ids)
    return t0, first, time.perf_counter(), n


async def _kvmesh_workload(address: str, prompts: Prompts, plan: Plan, proc: psutil.Process) -> list[dict]:
    import grpc

    from kvmesh.engine.v1 import engine_pb2_grpc

    rows = []
    rss = 0
    async with grpc.aio.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        await _one(stub, prompts.take(16), 4)  # warm-up: first-call allocations
        rates = []
        for _ in range(plan.repeats):
            t0, first, end, n = await _one(stub, prompts.take(plan.decode_prompt), plan.decode_tokens)
            rates.append((n - 1) / (end - first))
        rows.append(row("decode_tok_s", statistics.median(rates), "tok/s", system="kvmesh", concurrency=1))
        for p in plan.ttft_prompts:
            ttfts = []
            for _ in range(plan.repeats):
                t0, first, end, n = await _one(stub, prompts.take(p), 1)
                ttfts.append(first - t0)
            rows.append(row("ttft_s", statistics.mean(ttfts), "s", system="kvmesh", prompt_tokens=p))
            rss = max(rss, proc.memory_info().rss)
        for c in plan.concurrency:
            reqs = [prompts.take(plan.conc_prompt) for _ in range(c)]
            t0 = time.perf_counter()
            results = await asyncio.gather(*[_one(stub, r, plan.conc_tokens) for r in reqs])
            wall = time.perf_counter() - t0
            total = sum(r[3] for r in results)
            rows.append(row("throughput_tok_s", total / wall, "tok/s", system="kvmesh", concurrency=c))
            rss = max(rss, proc.memory_info().rss)
    rows.append(row("rss_bytes", float(rss), "bytes", system="kvmesh"))
    return rows


def bench_kvmesh(plan: Plan, prompts: Prompts, engine_args: list[str], system: str = "kvmesh") -> list[dict]:
    """`engine_args` name the model (BenchModel.engine_args) and any other engine flags."""
    from kvmesh import launcher

    port = launcher.free_port()
    svc = launcher.start_service("bench-engine", "kvmesh.services.engine",
                                 ["--threads", str(os.cpu_count() or 1), *engine_args], port)
    try:
        rows = asyncio.run(_kvmesh_workload(svc.address, prompts, plan, psutil.Process(svc.pid)))
        return [{**r, "system": system} for r in rows]
    finally:
        launcher.stop_service(svc)


# ---- Hugging Face transformers (in process) ---------------------------------------------------

def hf_model(source: str):
    """transformers' model of `source` ('bundled', a .gguf file or an HF folder), fp32, eval."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.model.loader import bundled_gguf_path

    path = bundled_gguf_path() if source == "bundled" else Path(source)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def bench_hf(plan: Plan, prompts: Prompts, source: str = "bundled") -> list[dict]:
    import torch

    set_torch_threads(0)
    model = hf_model(source)
    eos = model.config.eos_token_id
    pad = eos if isinstance(eos, int) else eos[0] if eos else 2

    def gen(batch: list[list[int]], new: int) -> float:
        width = max(len(b) for b in batch)
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t0

    rows = []
    gen([prompts.take(16)], 4)  # warm-up
    rates = []
    for _ in range(plan.repeats):
        ids = prompts.take(plan.decode_prompt)
        prefill = gen([ids], 1)
        total = gen([ids], plan.decode_tokens)
        rates.append((plan.decode_tokens - 1) / (total - prefill))
    rows.append(row("decode_tok_s", statistics.median(rates), "tok/s", system="hf", concurrency=1))
    for p in plan.ttft_prompts:
        ttfts = [gen([prompts.take(p)], 1) for _ in range(plan.repeats)]
        rows.append(row("ttft_s", statistics.mean(ttfts), "s", system="hf", prompt_tokens=p))
    for c in plan.concurrency:
        # HF has no continuous batching: concurrency = one static, left-padded batch.
        wall = gen([prompts.take(plan.conc_prompt) for _ in range(c)], plan.conc_tokens)
        rows.append(row("throughput_tok_s", c * plan.conc_tokens / wall, "tok/s", system="hf", concurrency=c))
    rows.append(row("rss_bytes", float(psutil.Process().memory_info().rss), "bytes", system="hf"))
    del model
    gc.collect()
    return rows


# ---- llama.cpp (llama-cpp-python, same GGUF file) ----------------------------------------------

def bench_llamacpp(plan: Plan, prompts: Prompts, gguf: Path) -> list[dict]:
    """llama.cpp on the same GGUF file (its native kernels), when llama-cpp-python is installed.

    llama-cpp-python has no continuous batching in its Python API: concurrency c is measured as c
    sequential requests (its aggregate throughput equals its single-stream rate)."""
    from llama_cpp import Llama

    threads = os.cpu_count() or 1
    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False, use_extra_bufts=False)

    def gen(ids: list[int], new: int) -> tuple[float, float]:
        """(time to first token, total time) for one greedy request."""
        llm.reset()
        t0 = time.perf_counter()
        first = None
        n = 0
        for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
            if first is None:
                first = time.perf_counter()
            n += 1
            if n >= new:
                break
        return first - t0, time.perf_counter() - t0

    rows = []
    gen(prompts.take(16), 4)
    rates = []
    for _ in range(plan.repeats):
        ttft, total = gen(prompts.take(plan.decode_prompt), plan.decode_tokens)
        rates.append((plan.decode_tokens - 1) / (total - ttft))
    rows.append(row("decode_tok_s", statistics.median(rates), "tok/s", system="llamacpp", concurrency=1))
    for p in plan.ttft_prompts:
        ttfts = [gen(prompts.take(p), 1)[0] for _ in range(plan.repeats)]
        rows.append(row("ttft_s", statistics.mean(ttfts), "s", system="llamacpp", prompt_tokens=p))
    for c in plan.concurrency:
        t0 = time.perf_counter()
        for _ in range(c):
            gen(prompts.take(plan.conc_prompt), plan.conc_tokens)
        rows.append(row("throughput_tok_s", c * plan.conc_tokens / (time.perf_counter() - t0), "tok/s",
                        system="llamacpp", concurrency=c))
    rows.append(row("rss_bytes", float(psutil.Process().memory_info().rss), "bytes", system="llamacpp"))
    del llm
    gc.collect()
    return rows


def longest_sequence(plan: Plan) -> int:
    """Prompt + output tokens of the plan's longest request (the model's context must hold it)."""
    return max(plan.decode_prompt + plan.decode_tokens, max(plan.ttft_prompts) + 1, plan.conc_prompt + plan.conc_tokens)


def gguf_file(source: str) -> Path | None:
    """The GGUF file llama.cpp runs for `source`, None for an HF folder."""
    from kvmesh.model.loader import bundled_gguf_path

    if source == "bundled":
        return bundled_gguf_path()
    return Path(source) if Path(source).suffix == ".gguf" else None


def run(quick: bool = False, engine_args: list[str] | None = None, model: str = "bundled") -> list[dict]:
    """Runs both systems and prints the side-by-side table (kvmesh/hf ratios)."""
    from kvmesh.loadtest.models import bench_model
    from kvmesh.model.loader import load_tokenizer

    plan = QUICK if quick else FULL
    bm = bench_model(model)
    bm.require_context("engine", longest_sequence(plan), f"its prompts of up to {max(plan.ttft_prompts)} tokens")
    prompts = Prompts(load_tokenizer(model))
    print(f"kvmesh bench engine ({'quick' if quick else 'full'}, model {model}): {plan}", file=sys.stderr)
    base = [*bm.engine_args(), *(engine_args or [])]
    rows = bench_kvmesh(plan, prompts, base)
    # int4 group-32 weights reproduce the bundled Q4_1 GGUF exactly (perplexity unchanged, see
    # `kvmesh bench quant`), at a quarter of fp32's bytes read per decoded token.
    rows += bench_kvmesh(plan, prompts, [*base, "--weights", "int4"], system="kvmesh-int4")
    # int4 for one- and two-row matmuls, int8 x int8 (SmoothQuant) for batches, prefill and lm_head.
    rows += bench_kvmesh(plan, prompts, [*base, "--weights", "int4-w8a8"], system="kvmesh-int4-w8a8")
    # llama.cpp before HF: both run in this process, and HF's memory is not all returned to the OS.
    gguf = gguf_file(model)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("llamacpp column skipped: llama-cpp-python is not installed (see README)", file=sys.stderr)
    else:
        if gguf is None:
            print("llamacpp column skipped: llama.cpp runs GGUF files, the model is an HF folder", file=sys.stderr)
        else:
            rows += bench_llamacpp(plan, prompts, gguf)
    rows += bench_hf(plan, prompts, model)
    print(pivot(rows, "system", baseline="hf"))
    return rows
