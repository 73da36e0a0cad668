"""The `hf` column of `kvmesh bench engine`: Hugging Face transformers' `generate()` on the same
weights, fp32, in this process (concurrency c is one static, left-padded batch of c prompts)."""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from kvmesh.loadtest.report import row
from kvmesh.threads import set_torch_threads

if TYPE_CHECKING:
    from kvmesh.loadtest.engine_bench import Plan, Prompts


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
    set_torch_threads(0)
    model = hf_model(source)

    def gen(batch: list[list[int]], new: int) -> float:
        return hf_generate(model, batch, new)

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


def hf_generate(model, batch: list[list[int]], new: int) -> float:
    """Seconds of one greedy `generate` of `new` tokens for `batch` (one static, left-padded batch)."""
    import torch

    eos = model.config.eos_token_id
    pad = eos if isinstance(eos, int) else eos[0] if eos else 2
    width = max(len(b) for b in batch)
    ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
    mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=pad)
    return time.perf_counter() - t0
