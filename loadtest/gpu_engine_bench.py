"""`kvmesh bench gpu`'s engine rows: kvmesh's engine step on CUDA in bf16 against HF transformers'
bf16 ``generate`` on the same GPU, the same weights and the same token counts.

The model has SmolLM2-135M-Instruct's architecture (30 layers, 9 query and 3 KV heads of 64, a
49,152-token tied vocabulary) with random weights: the bundled GGUF file (98 MB) is over what can
be carried to a lent GPU machine, and speed does not depend on the weights' values. Every sequence
generates exactly ``NEW_TOKENS`` tokens (EOS ignored), greedily.

kvmesh runs its own scheduler and model runner (services/engine: chunked prefill, paged KV, the
engine's block manager) with greedy argmax over the logits the runner returns to the host, as the
engine's sampler gets them; the gRPC edge and the detokenizer are not in the loop. Three systems:
  * ``kvmesh graphs``: decode steps replayed as CUDA graphs (the engine's default on CUDA);
  * ``kvmesh eager``: the same steps launched op by op (``--cuda-graphs false``);
  * ``hf generate``: transformers' ``model.generate`` (its default SDPA attention, dynamic cache).
Rows:
  * decode tok/s at batch 1/8/32: generated tokens / wall time of the whole generation (prompts of
    ``PROMPT_TOKENS``: their prefill is in the time, for every system alike);
  * TTFT at 2,048 tokens, batch 1: from the request to the first token (kvmesh at the engine's
    default chunk of 512 tokens and with the whole prompt in one chunk);
  * greedy agreement of ``kvmesh graphs`` with ``kvmesh eager`` (tokens equal, same position).
Each figure is the median of ``REPEATS`` timed runs after a warm-up run (min and max in the rows).
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvmesh.loadtest.report import row
from kvmesh.model.config import ModelConfig

SMOLLM2_135M = ModelConfig(
    name="smollm2-135m-shape", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,))
"""The bundled model's architecture (tests check it against the GGUF file's)."""

BATCHES = (1, 8, 32)
PROMPT_TOKENS = 32
NEW_TOKENS = 128
TTFT_TOKENS = 2048
REPEATS = 3
BLOCK_SIZE = 16


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_checkpoint(folder: Path, cfg: ModelConfig = SMOLLM2_135M, seed: int = 0, dtype=torch.bfloat16,
                      init: float = 0.02):
    """An HF folder (config.json, model.safetensors) of ``cfg`` with transformers' own random
    initialisation (weights ~ N(0, init); tests pass 0.2 for peaky logits, no greedy near-ties);
    returns the transformers model (on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**cfg.to_hf_config(), "initializer_range": init}))
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=dtype)
    hf.save_pretrained(folder)
    return hf.eval()


def _prompts(batch: int, tokens: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, tokens), generator=g).tolist()


class KvmeshRunner:
    """kvmesh's scheduler + model runner over one KV pool, generating greedily."""

    def __init__(self, loaded, *, graphs: bool, num_blocks: int, max_model_len: int, max_batch: int) -> None:
        from kvmesh.gpu.decode_graphs import graph_batch_sizes
        from kvmesh.services.engine.runner import ModelRunner

        self.loaded = loaded
        self.max_model_len = max_model_len
        t0 = time.perf_counter()
        self.runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                                  graph_batch_sizes=graph_batch_sizes(max_batch) if graphs else ())
        _sync(loaded.device)
        self.capture_s = time.perf_counter() - t0

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int, *, chunk: int = 512) -> tuple[float, float, list]:
        """Wall seconds to generate ``new_tokens`` for every prompt, seconds to the first token of the
        first sequence, and the tokens."""
        from kvmesh.services.engine.block_manager import BlockManager
        from kvmesh.services.engine.sampling import SamplingParams
        from kvmesh.services.engine.scheduler import Scheduler, SchedulerConfig
        from kvmesh.services.engine.sequence import Sequence

        n = len(prompts)
        sched = Scheduler(SchedulerConfig(max_num_seqs=max(n, 1), max_num_batched_tokens=max(chunk, n),
                                          max_model_len=self.max_model_len, block_size=BLOCK_SIZE),
                          BlockManager(self.runner.num_blocks, BLOCK_SIZE, enable_prefix_caching=False))
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        seqs = [Sequence(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
        _sync(self.loaded.device)
        t0 = time.perf_counter()
        for s in seqs:
            sched.add(s)
        first = None
        while sched.has_work:
            out = sched.schedule()
            result = self.runner.execute(out)
            sched.commit(out)
            if not result.seqs:
                continue
            for seq, token in zip(result.seqs, result.logits.argmax(-1).tolist()):
                seq.append_token(token)
                if seq.num_output_tokens >= new_tokens:
                    sched.finish(seq, "length")
            if first is None:
                first = time.perf_counter() - t0
        elapsed = time.perf_counter() - t0
        return elapsed, first, [s.output_token_ids for s in seqs]


@torch.inference_mode()
def hf_generate(hf, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    ids = torch.tensor(prompts, device=hf.device)
    _sync(hf.device)
    t0 = time.perf_counter()
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(hf.device)
    return time.perf_counter() - t0, out[:, ids.shape[1]:].tolist()


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "max": max(values)}


def engine_rows(problems: list[str], *, device: str = "cuda", cfg: ModelConfig = SMOLLM2_135M,
                batches: tuple[int, ...] = BATCHES, new_tokens: int = NEW_TOKENS, ttft_tokens: int = TTFT_TOKENS,
                repeats: int = REPEATS, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """Decode tok/s at ``batches``, TTFT at ``ttft_tokens``, for kvmesh (graphs, eager) and HF
    generate. (Off CUDA, for the tests, "graphs" runs the graphs' code eagerly.)"""
    from kvmesh.model.loader import load_model

    rows: list[dict] = []
    model = cfg.name
    with tempfile.TemporaryDirectory() as tmp:
        hf = random_checkpoint(Path(tmp) / "model", cfg, dtype=dtype)
        loaded = load_model(str(Path(tmp) / "model"), dtype=dtype, device=device, progress=False)
    hf = hf.to(device)
    max_len = ttft_tokens + new_tokens
    blocks = max(batches) * -(-(PROMPT_TOKENS + new_tokens) // BLOCK_SIZE) + -(-max_len // BLOCK_SIZE) + 8
    systems = {name: KvmeshRunner(loaded, graphs=name == "kvmesh graphs", num_blocks=blocks, max_model_len=max_len,
                                  max_batch=max(batches)) for name in ("kvmesh graphs", "kvmesh eager")}
    graphs = systems["kvmesh graphs"].runner.graphs
    rows.append(row("graph capture time", systems["kvmesh graphs"].capture_s, "s", model=model,
                    system="kvmesh graphs"))
    for batch in batches:
        prompts = _prompts(batch, PROMPT_TOKENS, cfg.vocab_size, seed=batch)
        tokens = {}
        for name, sys_ in systems.items():
            sys_.generate(prompts, new_tokens)  # warm-up: Triton compiles for this batch's shapes
            runs = [sys_.generate(prompts, new_tokens) for _ in range(repeats)]
            rates = [batch * new_tokens / r[0] for r in runs]
            tokens[name] = runs[0][2]
            rows.append(row("decode tok/s", statistics.median(rates), "tok/s", model=model, system=name,
                            batch=batch, **_spread(rates)))
        hf_generate(hf, prompts, new_tokens)
        runs = [hf_generate(hf, prompts, new_tokens) for _ in range(repeats)]
        rates = [batch * new_tokens / r[0] for r in runs]
        rows.append(row("decode tok/s", statistics.median(rates), "tok/s", model=model, system="hf generate",
                        batch=batch, **_spread(rates)))
        same = sum(a == b for x, y in zip(tokens["kvmesh graphs"], tokens["kvmesh eager"]) for a, b in zip(x, y))
        rows.append(row("greedy tokens equal to eager", same / (batch * new_tokens), "share", model=model,
                        system="kvmesh graphs", batch=batch))
    if graphs.steps == 0 or (device == "cuda" and graphs.replays != graphs.steps):
        problems.append(f"kvmesh graphs: {graphs.replays} of {graphs.steps} decode steps replayed from CUDA graphs")
    prompt = _prompts(1, ttft_tokens, cfg.vocab_size, seed=99)
    sys_ = systems["kvmesh graphs"]
    for chunk in sorted({512, ttft_tokens}):
        sys_.generate(prompt, 1, chunk=chunk)
        ttfts = [sys_.generate(prompt, 1, chunk=chunk)[1] * 1000 for _ in range(repeats + 2)]
        rows.append(row("TTFT", statistics.median(ttfts), "ms", model=model, system="kvmesh graphs",
                        tokens=ttft_tokens, chunk=chunk, **_spread(ttfts)))
    hf_generate(hf, prompt, 1)
    ttfts = [hf_generate(hf, prompt, 1)[0] * 1000 for _ in range(repeats + 2)]
    rows.append(row("TTFT", statistics.median(ttfts), "ms", model=model, system="hf generate",
                    tokens=ttft_tokens, chunk=ttft_tokens, **_spread(ttfts)))
    return rows


def engine_summary(rows: list[dict]) -> list[str]:
    """Summary lines: decode against HF (target: >= 3x at batch 1) and TTFT."""
    def value(metric: str, **params) -> float:
        for r in rows:
            if r["metric"] == metric and all(r.get(k) == v for k, v in params.items()):
                return r["value"]
        return float("nan")

    out = ["engine decode tok/s, SmolLM2-135M shape, bf16 (target: kvmesh >= 3x hf generate at batch 1)",
           f"  {'batch':>5} | {'graphs':>8} {'eager':>8} {'hf':>8} | {'graphs/hf':>9} {'eager/hf':>8}"]
    for batch in BATCHES:
        t = {s: value("decode tok/s", system=s, batch=batch) for s in ("kvmesh graphs", "kvmesh eager", "hf generate")}
        out.append(f"  {batch:>5} | {t['kvmesh graphs']:8.0f} {t['kvmesh eager']:8.0f} {t['hf generate']:8.0f} | "
                   f"{t['kvmesh graphs'] / t['hf generate']:8.2f}x {t['kvmesh eager'] / t['hf generate']:7.2f}x")
    hf = value("TTFT", system="hf generate")
    out.append(f"TTFT {TTFT_TOKENS} tokens, ms: kvmesh chunk 512 {value('TTFT', system='kvmesh graphs', chunk=512):.1f}, "
               f"one chunk {value('TTFT', system='kvmesh graphs', chunk=TTFT_TOKENS):.1f}; hf generate {hf:.1f}")
    out.append("greedy tokens of graphs equal to eager, share: " + ", ".join(
        f"batch {b} {value('greedy tokens equal to eager', batch=b):.3f}" for b in BATCHES))
    return out
