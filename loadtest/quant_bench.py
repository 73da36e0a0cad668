"""Quality and speed of the weight formats (fp32, bf16, int8, int4, int4-w8a8, and gguf and gguf-a8 for a GGUF
model) on the bundled model (or the model of `--model PATH`), and llama.cpp's perplexity on the same GGUF file.

For each format: perplexity on the first 8192 tokens of ``kvmesh.model.reference_text()``
(quick: 2048) with window 1024 / stride 512 (a model with a shorter context: window = its
context, stride half of it; the unit names the window), its change against fp32, single-sequence greedy
decode speed through the paged forward path (the engine's path: AttentionMetadata + KV cache),
and the share of greedy tokens equal to fp32's on chat prompts through that same path (where the
packed int8/int4 kernels round activations to bf16, which perplexity on long windows does not see).
For a GGUF model, where llama-cpp-python is installed (the bench extra), the row ``llamacpp`` is
llama.cpp's own perplexity on the same tokens and windows (its logits of every position), so
its arithmetic's cost is measured beside ``gguf-a8``'s, which copies it.

    python loadtest/quant_bench.py [--quick] [--device cpu] [--model PATH]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from kvmesh.model import AttentionMetadata, allocate_kv_cache, load_model
# Not through kvmesh.model: `from kvmesh.model import perplexity` gives the submodule of that name.
from kvmesh.model.perplexity import perplexity, reference_text

FORMATS = (("fp32", "float32"), ("bf16", "bfloat16"), ("int8", "float32"), ("int4", "float32"), ("int4-w8a8", "float32"))
BLOCK_SIZE = 16


CHAT_PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
                "2 + 2 =", "Why is the sky blue?", "Write a haiku about the sea.",
                "Translate 'good morning' to French.", "What is a KV cache?", "Name a prime number above 100.")


@torch.inference_mode()
def greedy_decode(lm, prompt: list[int], new_tokens: int, warmup: int = 0) -> tuple[list[int], float]:
    """Greedy-decode one sequence through ``forward``: (the new tokens, seconds of the decode steps
    after the first ``warmup`` of them)."""
    model, dev = lm.model, lm.device
    total = len(prompt) + new_tokens + warmup
    nblocks = -(-total // BLOCK_SIZE)
    kv = allocate_kv_cache(lm.config, nblocks, BLOCK_SIZE, lm.dtype, dev)
    table = torch.arange(nblocks, device=dev)[None]  # one sequence owns blocks 0..n-1

    def step(ids: list[int], start: int) -> int:
        pos = torch.arange(start, start + len(ids), device=dev)
        meta = AttentionMetadata.build(pos.clone(), [len(ids)], [start + len(ids)], table, BLOCK_SIZE)
        hidden = model(torch.tensor(ids, device=dev), pos, kv, meta)
        return int(model.compute_logits(hidden[-1:]).argmax())  # .item() syncs the device

    out = [step(prompt, 0)]
    n = len(prompt)
    for _ in range(warmup):
        out.append(step([out[-1]], n))
        n += 1
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        out.append(step([out[-1]], n))
        n += 1
    return out[warmup:warmup + new_tokens], time.perf_counter() - t0


def decode_tokens_per_s(lm, prompt: list[int], new_tokens: int, warmup: int = 4) -> float:
    """Tokens/s over the decode steps of one greedy sequence (after ``warmup`` steps)."""
    _, seconds = greedy_decode(lm, prompt, new_tokens + 1, warmup)
    return new_tokens / seconds


def chat_greedy(lm, new_tokens: int) -> list[list[int]]:
    """Greedy continuations of CHAT_PROMPTS (the model's chat template), one sequence at a time."""
    tok = lm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
               for p in CHAT_PROMPTS]
    return [greedy_decode(lm, p, new_tokens)[0] for p in prompts]


PPL_WINDOW = 1024


def ppl_window(context_length: int) -> tuple[int, int]:
    """(window, stride) of the perplexity: 1024 / 512, or the model's whole context and half of it
    when that is shorter."""
    window = min(PPL_WINDOW, context_length)
    return window, max(1, window // 2)


def run(quick: bool, device: str = "cpu", model: str = "bundled") -> list[dict]:
    """Measure every format; rows {"weights", "metric", "value", "unit"}."""
    from kvmesh.loadtest.models import bench_model

    n_tokens = 2048 if quick else 8192
    decode_steps = 32 if quick else 128
    chat_tokens = 16 if quick else 64
    bm = bench_model(model)
    window, stride = ppl_window(bm.config.context_length)
    bm.require_context("quant", 64 + decode_steps + 5, "its decode-speed sequence")
    unit_suffix = "" if window == PPL_WINDOW else f" window {window}"
    rows: list[dict] = []
    base_ppl = None
    base_greedy = None
    ids = None
    from kvmesh.model.loader import gguf_source

    from kvmesh.model import gguf_a8

    is_gguf = gguf_source(model) is not None and device == "cpu"
    formats = FORMATS + ((("gguf", "float32"),) if is_gguf else ()) + \
        ((("gguf-a8", "float32"),) if is_gguf and gguf_a8.ops() is not None else ())
    for weights, dtype in formats:
        lm = load_model(model, dtype=dtype, device=device, weights=weights)
        if ids is None:
            ids = lm.tokenizer.encode(reference_text())[:n_tokens]
        ppl = perplexity(lm.model, ids, window=window, stride=stride)
        base_ppl = base_ppl or ppl
        tps = decode_tokens_per_s(lm, ids[:64], decode_steps)
        greedy = chat_greedy(lm, chat_tokens)
        base_greedy = base_greedy or greedy
        agree = (sum(a == b for g, b0 in zip(greedy, base_greedy) for a, b in zip(g, b0))
                 / sum(len(b0) for b0 in base_greedy))
        rows += [
            {"weights": weights, "metric": "ppl", "value": ppl, "unit": f"ppl@{len(ids)}tok{unit_suffix}"},
            {"weights": weights, "metric": "ppl_delta_pct", "value": 100 * (ppl - base_ppl) / base_ppl, "unit": "%"},
            {"weights": weights, "metric": "decode_tok_s", "value": tps, "unit": "tok/s"},
            {"weights": weights, "metric": "greedy_agree", "value": agree, "unit": "share"},
        ]
        del lm
        gc.collect()
    if is_gguf and ids is not None:
        ppl = llamacpp_perplexity(gguf_source(model), ids, window, stride)
        if ppl is not None:
            rows += [{"weights": "llamacpp", "metric": "ppl", "value": ppl, "unit": f"ppl@{len(ids)}tok{unit_suffix}"},
                     {"weights": "llamacpp", "metric": "ppl_delta_pct", "value": 100 * (ppl - base_ppl) / base_ppl,
                      "unit": "%"}]
    print(format_table(rows))
    return rows


def llamacpp_perplexity(gguf, ids: list[int], window: int, stride: int) -> float | None:
    """llama.cpp's perplexity of ``ids`` under the GGUF file, with kvmesh.model.perplexity's
    windows (each token after the first scored once), or None without llama-cpp-python."""
    import math

    try:
        from llama_cpp import Llama
    except ImportError:
        print("llamacpp row skipped: llama-cpp-python is not installed (scripts/build-llamacpp.sh)", file=sys.stderr)
        return None
    threads = torch.get_num_threads()
    llm = Llama(model_path=str(gguf), n_ctx=window, n_threads=threads, n_threads_batch=threads, n_batch=512,
                logits_all=True, verbose=False)
    nll, scored, prev_end, n = 0.0, 0, 0, len(ids)
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        llm.reset()
        llm.eval(ids[begin:end])
        logits = torch.from_numpy(llm.scores[: end - begin].copy()).float()
        first = max(prev_end, begin + 1) - begin
        logp = torch.log_softmax(logits[first - 1:-1], dim=-1)
        targets = torch.tensor(ids[begin + first:end])
        nll -= logp.gather(1, targets[:, None]).sum().item()
        scored += targets.numel()
        prev_end = end
        if end == n:
            break
    del llm
    return math.exp(nll / scored)


def format_table(rows: list[dict]) -> str:
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    cell = {(r["weights"], r["metric"]): r["value"] for r in rows}
    lines = ["| weights | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for w in dict.fromkeys(r["weights"] for r in rows):
        lines.append(f"| {w} | " + " | ".join(f"{cell[(w, m)]:.3f}" if (w, m) in cell else "" for m in metrics) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2048-token perplexity, 32 decode steps")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="bundled", help="'bundled', a .gguf file or an HF folder")
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, python {sys.version.split()[0]}")
    run(args.quick, args.device, args.model)


if __name__ == "__main__":
    main()
