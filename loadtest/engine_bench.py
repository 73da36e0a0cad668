"""`kvmesh bench engine`: the kvmesh engine vs Hugging Face generate() on the same weights.

On the bundled model by default; `--model PATH` measures another (HF generate() loads the same
folder or GGUF file; the llama.cpp columns need a GGUF file). The llama.cpp peers, built by
`bash scripts/build-llamacpp.sh`: `llamacpp` (llama-cpp-python's API, in process, sequential
requests) and `llamacpp-server` (llama.cpp's HTTP server, continuous batching).

Side by side, one run, one machine. kvmesh runs as its real gRPC service process (so its
resident memory is the service's); HF runs in this process after the engine has stopped, so
the two never compete for cores. Prompts are distinct slices of real text, so the engine's prefix
cache never turns a measurement into a cache hit.
"""
from __future__ import annotations

import asyncio
import gc
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from kvmesh.loadtest import paired
from kvmesh.loadtest.hf_column import bench_hf
from kvmesh.loadtest.machine import describe, machine_rows
from kvmesh.loadtest.report import pivot, row
from kvmesh.threads import set_torch_threads, usable_cores


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

BENCH_SCHEMA = ('{"type": "object", "required": ["items"], "properties": {"items": {"type": "array", '
                '"minItems": 64, "items": {"type": "object", "required": ["id", "name"], "properties": '
                '{"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "name": {"type": "string", '
                '"maxLength": 12}}, "additionalProperties": false}}}, "additionalProperties": false}')
"""The JSON schema of the structured-output row: 64 items at least, so that no output can end
before max_tokens and the row compares the same token counts as the unconstrained one."""


async def _one(stub, ids: list[int], max_tokens: int, json_schema: str = ""):
    """Streams one request; returns (t_start, t_first_token, t_end, n_tokens)."""
    from kvmesh.common.v1 import common_pb2
    from kvmesh.engine.v1 import engine_pb2

    req = engine_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    if json_schema:
        req.sampling.structured_output.json_schema = json_schema
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
        rows += decode_rows(rates, "kvmesh")
        for p in plan.ttft_prompts:
            ttfts = []
            for _ in range(plan.repeats):
                t0, first, end, n = await _one(stub, prompts.take(p), 1)
                ttfts.append(first - t0)
            rows.append(row("ttft_s", statistics.mean(ttfts), "s", system="kvmesh", prompt_tokens=p))
            rss = max(rss, proc.memory_info().rss)
        for c in plan.concurrency:
            rate = await _throughput(stub, prompts, plan, c)
            rows.append(row("throughput_tok_s", rate, "tok/s", system="kvmesh", concurrency=c))
            rss = max(rss, proc.memory_info().rss)
        # Structured output at the largest concurrency: grammar masks for the whole batch every step.
        c = max(plan.concurrency)
        await _one(stub, prompts.take(16), 4, BENCH_SCHEMA)  # warm-up: the grammar tokenizer's build
        plain, constrained = await _throughput(stub, prompts, plan, c), await _throughput(stub, prompts, plan, c,
                                                                                        BENCH_SCHEMA)
        rows.append(row("throughput_tok_s", constrained, "tok/s", system="kvmesh", concurrency=c,
                        output="json_schema"))
        rows.append(row("json_schema_vs_plain", constrained / plain, "x", system="kvmesh", concurrency=c))
    rows.append(row("rss_bytes", float(rss), "bytes", system="kvmesh"))
    return rows


async def _throughput(stub, prompts: Prompts, plan: Plan, c: int, json_schema: str = "") -> float:
    """Tokens per second of `c` concurrent requests of the plan's size."""
    reqs = [prompts.take(plan.conc_prompt) for _ in range(c)]
    t0 = time.perf_counter()
    results = await asyncio.gather(*[_one(stub, r, plan.conc_tokens, json_schema) for r in reqs])
    return sum(r[3] for r in results) / (time.perf_counter() - t0)


def bench_kvmesh(plan: Plan, prompts: Prompts, engine_args: list[str], system: str = "kvmesh") -> list[dict]:
    """`engine_args` name the model (BenchModel.engine_args) and any other engine flags."""
    from kvmesh import launcher

    port = launcher.free_port()
    svc = launcher.start_service("bench-engine", "kvmesh.services.engine",
                                 ["--threads", str(usable_cores()), *engine_args], port)
    try:
        rows = asyncio.run(_kvmesh_workload(svc.address, prompts, plan, psutil.Process(svc.pid)))
        return [{**r, "system": system} for r in rows]
    finally:
        launcher.stop_service(svc)


# ---- llama.cpp (llama-cpp-python, same GGUF file) ----------------------------------------------

def bench_llamacpp(plan: Plan, prompts: Prompts, gguf: Path) -> list[dict]:
    """llama.cpp on the same GGUF file (its native kernels) through llama-cpp-python's Python API,
    in this process (`bash scripts/build-llamacpp.sh` installs it built for this CPU, AMX off).

    decode_tok_s (median, min, max over the repeats): (tokens - 1) / (time from the first token to
    the last); ttft_s: time to the first generated token of a fresh prompt; rss_bytes: this
    process. llama-cpp-python has no continuous batching in its Python API: throughput_tok_s at
    concurrency c is c *sequential* requests (its aggregate throughput equals its single-stream
    rate) -- the `llamacpp-server` column is llama.cpp's concurrent peer."""
    from llama_cpp import Llama

    threads = usable_cores()
    # Weight repacking (llama.cpp's extra buffer types) stays on, as in llama-server; the build has
    # no AMX buffer type (scripts/build-llamacpp.sh). Llama() has no such argument: it ignores one.
    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads,
                n_threads_batch=threads, n_batch=512, verbose=False)

    def gen(ids: list[int], new: int) -> tuple[float, float]:
        return llama_generate(llm, ids, new)

    rows = []
    gen(prompts.take(16), 4)
    rates = []
    for _ in range(plan.repeats):
        ttft, total = gen(prompts.take(plan.decode_prompt), plan.decode_tokens)
        rates.append((plan.decode_tokens - 1) / (total - ttft))
    rows += decode_rows(rates, "llamacpp")
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
    llm.close()  # frees the model and context now, not whenever the object is collected
    gc.collect()
    return rows


def llama_generate(llm, ids: list[int], new: int) -> tuple[float, float]:
    """(time to first token, total time) of one greedy request of `new` tokens on a llama_cpp.Llama."""
    llm.reset()
    t0 = time.perf_counter()
    first = None
    n = 0
    for _tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        if first is None:
            first = time.perf_counter()
        n += 1
        if n >= new:
            break
    return first - t0, time.perf_counter() - t0


def decode_rows(rates: list[float], system: str) -> list[dict]:
    """decode_tok_s (the median over the repeats) and its spread, decode_tok_s_min / _max."""
    return [row(metric, agg(rates), "tok/s", system=system, concurrency=1)
            for metric, agg in (("decode_tok_s", statistics.median), ("decode_tok_s_min", min),
                                ("decode_tok_s_max", max))]


# ---- llama.cpp's HTTP server (llama-server: continuous batching, same GGUF file) ---------------

LLAMACPP_VERSION = "0.3.36"  # llama-cpp-python; = scripts/build-llamacpp.sh and pyproject's `bench` extra
LLAMA_SERVER_ENV = "KVMESH_LLAMA_SERVER"
BUILD_HINT = "bash scripts/build-llamacpp.sh"
SERVER_SYSTEM = "llamacpp-server"


def llama_server_path(env: dict | None = None) -> Path | None:
    """The llama-server binary: $KVMESH_LLAMA_SERVER when set, else where build-llamacpp.sh puts
    it (kvmesh's cache, $KVMESH_CACHE_DIR or ~/.cache/kvmesh, then llamacpp/<version>/bin/llama-server).
    None when that is not an executable file."""
    env = os.environ if env is None else env
    if env.get(LLAMA_SERVER_ENV):
        path = Path(env[LLAMA_SERVER_ENV])
    else:
        cache = Path(env.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")
        path = cache / "llamacpp" / LLAMACPP_VERSION / "bin" / "llama-server"
    return path if path.is_file() and os.access(path, os.X_OK) else None


def llamacpp_skip_reasons(env: dict | None = None, have_llama_cpp: bool | None = None) -> dict[str, str]:
    """{column: the one line saying why it is skipped} for the llama.cpp columns that cannot run."""
    if have_llama_cpp is None:
        have_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    out = {}
    if not have_llama_cpp:
        out["llamacpp"] = f"llamacpp column skipped: llama-cpp-python is not installed; run `{BUILD_HINT}`"
    if llama_server_path(env) is None:
        out[SERVER_SYSTEM] = (f"{SERVER_SYSTEM} column skipped: llama-server is not built; run `{BUILD_HINT}`"
                              f" (or point {LLAMA_SERVER_ENV} at a llama-server binary)")
    return out


def server_slots(plan: Plan) -> tuple[int, int]:
    """(slots, context tokens per slot): one slot per request of the plan's largest concurrency,
    each holding the plan's longest request (the TTFT prompt + 1 token = 2049 by default) rounded
    up to a power of two (4096). llama-server's -c is the total, slots x per slot: with --parallel
    it gives each slot its own 1/slots of the KV cache (not unified)."""
    per_slot = max(256, 1 << (longest_sequence(plan) - 1).bit_length())
    return max(plan.concurrency), per_slot


def llama_server_command(binary: Path, gguf: Path, plan: Plan, port: int, threads: int) -> list[str]:
    """llama-server's command line for `plan`: `threads` for decode and prompt batches alike,
    one continuous-batching slot per concurrent request (see server_slots), and no host-memory
    prompt cache (--cache-ram 0: by default idle slots are copied there, for prompt reuse that
    this benchmark's distinct prompts never have)."""
    slots, per_slot = server_slots(plan)
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(threads), "-tb", str(threads), "--parallel", str(slots),
            "-c", str(slots * per_slot), "--cont-batching", "--cache-ram", "0"]


def completion_body(ids: list[int], n_predict: int) -> dict:
    """A /completion request: greedy, exactly `n_predict` new tokens after the token-id prompt,
    no reuse of an earlier request's KV cache."""
    return {"prompt": list(ids), "n_predict": n_predict, "temperature": 0, "top_k": 1,
            "cache_prompt": False, "ignore_eos": True, "stream": False}


@dataclass(frozen=True)
class Completion:
    """What the benchmark reads from one /completion response."""

    tokens: int          # tokens_predicted
    prompt_n: int        # timings.prompt_n: prompt tokens evaluated
    prompt_ms: float     # timings.prompt_ms: slot start -> logits of the prompt's last token
    predicted_n: int     # timings.predicted_n: generated tokens (the first comes from the prompt)
    predicted_ms: float  # timings.predicted_ms: first generated token -> last

    @property
    def decode_tok_s(self) -> float:
        """(predicted_n - 1) / predicted_ms: the decode steps' rate, as the other columns count it
        ((tokens - 1) / (last token - first token)); = the server's timings.predicted_per_second."""
        return (self.predicted_n - 1) / (self.predicted_ms / 1000.0)


def parse_completion(resp: dict) -> Completion:
    t = resp["timings"]
    return Completion(int(resp["tokens_predicted"]), int(t["prompt_n"]), float(t["prompt_ms"]),
                      int(t["predicted_n"]), float(t["predicted_ms"]))


def ttft_row(done: list[Completion], prompt_tokens: int, system: str = SERVER_SYSTEM) -> dict:
    """ttft_s: the mean of the server's prompt_ms (prefill until the first token's logits)."""
    return row("ttft_s", statistics.mean(c.prompt_ms for c in done) / 1000.0, "s", system=system,
               prompt_tokens=prompt_tokens)


def throughput_row(done: list[Completion], wall_s: float, concurrency: int, system: str = SERVER_SYSTEM) -> dict:
    """throughput_tok_s: all requests' tokens_predicted over the client's wall clock for the batch."""
    return row("throughput_tok_s", sum(c.tokens for c in done) / wall_s, "tok/s", system=system,
               concurrency=concurrency)


def wait_ready(client, proc, deadline_s: float, log_tail=lambda: "") -> None:
    """Polls GET /health until it answers 200 {"status": "ok"} (503 while the model loads).
    Raises RuntimeError, with the end of the server's log, when the process exits first or
    `deadline_s` passes."""
    import httpx

    end = time.monotonic() + deadline_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with status {proc.returncode} before it was ready:\n{log_tail()}")
        try:
            r = client.get("/health", timeout=5.0)
            if r.status_code == 200 and r.json().get("status") == "ok":
                return
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"llama-server not ready after {deadline_s:.0f} s:\n{log_tail()}")
        time.sleep(0.2)


def _stop(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _server_workload(client, prompts: Prompts, plan: Plan, proc: psutil.Process) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    def complete(ids: list[int], n_predict: int) -> Completion:
        r = client.post("/completion", json=completion_body(ids, n_predict))
        r.raise_for_status()
        done = parse_completion(r.json())
        if done.tokens != n_predict:
            raise RuntimeError(f"llama-server generated {done.tokens} tokens, asked for {n_predict}")
        return done

    rows = []
    rss = 0
    complete(prompts.take(16), 4)  # warm-up
    rows += decode_rows([complete(prompts.take(plan.decode_prompt), plan.decode_tokens).decode_tok_s
                         for _ in range(plan.repeats)], SERVER_SYSTEM)
    for p in plan.ttft_prompts:
        rows.append(ttft_row([complete(prompts.take(p), 1) for _ in range(plan.repeats)], p))
        rss = max(rss, proc.memory_info().rss)
    with ThreadPoolExecutor(max_workers=max(plan.concurrency)) as pool:
        for c in plan.concurrency:
            reqs = [prompts.take(plan.conc_prompt) for _ in range(c)]
            t0 = time.perf_counter()
            done = list(pool.map(lambda ids: complete(ids, plan.conc_tokens), reqs))
            rows.append(throughput_row(done, time.perf_counter() - t0, c))
            rss = max(rss, proc.memory_info().rss)
    rows.append(row("rss_bytes", float(rss), "bytes", system=SERVER_SYSTEM))
    return rows


def bench_llamacpp_server(plan: Plan, prompts: Prompts, gguf: Path, binary: Path | None = None,
                          ready_s: float = 120.0) -> list[dict]:
    """llama.cpp's own HTTP server on the same GGUF file: the continuous-batching peer of kvmesh's
    concurrency rows. Started as `llama_server_command` (all cores, one slot per concurrent
    request), requests are greedy token-id prompts to /completion, stream off, prompt cache off.

    decode_tok_s (median, min, max over the repeats) and ttft_s come from the server's own
    `timings`, so they exclude HTTP: decode = (predicted_n - 1) / predicted_ms (first generated
    token to the last, as the other columns measure), ttft = prompt_ms (the prompt's evaluation
    until the first token's logits, no queueing, sampling or transfer). throughput_tok_s at
    concurrency c: c requests sent at once from a thread pool, the sum of their tokens_predicted
    over the client's wall clock (HTTP included, as kvmesh's gRPC is). rss_bytes: the server
    process, whose KV cache is allocated up front for all slots (server_slots)."""
    import tempfile

    import httpx

    from kvmesh import launcher

    binary = binary or llama_server_path()
    if binary is None:
        raise FileNotFoundError(f"llama-server is not built: run `{BUILD_HINT}` (or set {LLAMA_SERVER_ENV})")
    port = launcher.free_port()
    cmd = llama_server_command(binary, gguf, plan, port, usable_cores())
    slots, _ = server_slots(plan)
    limits = httpx.Limits(max_connections=slots, max_keepalive_connections=slots)
    with tempfile.TemporaryFile() as log, \
            httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600.0, limits=limits) as client:
        def log_tail() -> str:
            log.flush()
            log.seek(0)
            return log.read().decode(errors="replace")[-3000:]

        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(client, proc, ready_s, log_tail)
            return _server_workload(client, prompts, plan, psutil.Process(proc.pid))
        finally:
            _stop(proc)


def llamacpp_columns(plan: Plan, prompts: Prompts, gguf: Path, skip: dict[str, str] | None = None) -> list[dict]:
    """The llama.cpp columns on `gguf`, the Python-API one first, then llama-server; a column that
    cannot run here prints one line naming the build script instead (skip: llamacpp_skip_reasons)."""
    skip = llamacpp_skip_reasons() if skip is None else skip
    rows = []
    for system, bench in (("llamacpp", bench_llamacpp), (SERVER_SYSTEM, bench_llamacpp_server)):
        if system in skip:
            print(skip[system], file=sys.stderr)
        else:
            rows += bench(plan, prompts, gguf)
    return rows


AGREE_PROMPTS, AGREE_TOKENS, AGREE_PROMPT_LEN = 20, 64, 32


def greedy_agreement(model: str, formats: list[str], prompts: Prompts, quick: bool) -> list[dict]:
    """Share of greedy tokens equal to fp32's, position by position, for each weight format in
    `formats`: 20 prompts (quick: 5) of 32 tokens, 64 new tokens each, one sequence at a time
    through the paged forward path (the engine's decode steps, fused GGUF decode included)."""
    import torch

    from kvmesh.model.loader import load_model

    from kvmesh.loadtest.quant_bench import greedy_decode

    set_torch_threads(0)
    n = 5 if quick else AGREE_PROMPTS
    ids = [prompts.take(AGREE_PROMPT_LEN) for _ in range(n)]

    def answers(weights: str) -> list[list[int]]:
        dtype = "bfloat16" if weights == "bf16" else "float32"
        lm = load_model(model, dtype=dtype, weights=weights, progress=False)
        with torch.inference_mode():
            out = [greedy_decode(lm, p, AGREE_TOKENS)[0] for p in ids]
        del lm
        gc.collect()
        return out

    ref = answers("fp32")
    rows = []
    for fmt in formats:
        got = answers(fmt)
        same = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
        rows.append(row("greedy_agree", same / (n * AGREE_TOKENS), "share", system=SYSTEM_OF[fmt]))
    return rows


SYSTEM_OF = {"fp32": "kvmesh-fp32", "int4-w8a8": "kvmesh-int4-w8a8", "gguf": "kvmesh", "bf16": "kvmesh-bf16",
             "gguf-a8": "kvmesh-gguf-a8"}

BF16_ARGS = ["--dtype", "bfloat16", "--weights", "bf16", "--max-num-batched-tokens", "2048"]
"""The `kvmesh-bf16` column: bf16 weights and activations (oneDNN's matmuls and flash attention on
AMX), lossy but within llama.cpp's quality cost (`kvmesh bench quality`), each prompt of up to
2,048 tokens prefilled in one chunk: the fastest time to first token that cost allows."""


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
    from kvmesh.model import gguf_a8
    from kvmesh.model.loader import load_tokenizer

    plan = QUICK if quick else FULL
    bm = bench_model(model)
    bm.require_context("engine", longest_sequence(plan), f"its prompts of up to {max(plan.ttft_prompts)} tokens")
    prompts = Prompts(load_tokenizer(model))
    print(f"kvmesh bench engine ({'quick' if quick else 'full'}, model {model}): {plan}", file=sys.stderr)
    # the machine's own matmul speeds, before any service starts (kvmesh.loadtest.machine's NOTE)
    machine = machine_rows(usable_cores(), repeats=3 if quick else 7)
    print(describe(machine), file=sys.stderr)
    base = [*bm.engine_args(), *(engine_args or [])]
    # The deployment default: for a GGUF model on CPU, the file's own blocks (--weights auto =
    # gguf, lossless w.r.t. the file); for an HF folder, fp32.
    rows = bench_kvmesh(plan, prompts, base)
    is_gguf = gguf_file(model) is not None
    if is_gguf:  # fp32 of the same file: the lossless reference the default is compared with
        rows += bench_kvmesh(plan, prompts, [*base, "--weights", "fp32"], system="kvmesh-fp32")
    # lossy: int4 for one- and two-row matmuls, int8 x int8 (SmoothQuant) for batches, prefill and lm_head
    rows += bench_kvmesh(plan, prompts, [*base, "--weights", "int4-w8a8"], system="kvmesh-int4-w8a8")
    rows += bench_kvmesh(plan, prompts, [*base, *BF16_ARGS], system="kvmesh-bf16")
    lossy = ["int4-w8a8", "bf16"]
    if is_gguf and gguf_a8.ops() is not None:  # lossy: the file's blocks x 8-bit activations (llama.cpp's arithmetic)
        rows += bench_kvmesh(plan, prompts, [*base, "--weights", "gguf-a8"], system="kvmesh-gguf-a8")
        lossy.append("gguf-a8")
    elif is_gguf:
        print("kvmesh-gguf-a8 column skipped: it needs AVX-512 VNNI and the native kernels", file=sys.stderr)
    rows += greedy_agreement(model, ["gguf", *lossy] if is_gguf else lossy, prompts, quick)
    # llama.cpp before HF: both run in this process, and HF's memory is not all returned to the OS.
    gguf = gguf_file(model)
    if gguf is None:
        print("llama.cpp columns skipped: llama.cpp runs GGUF files, the model is an HF folder", file=sys.stderr)
    else:
        skip = llamacpp_skip_reasons()
        rows += llamacpp_columns(plan, prompts, gguf, skip)
        if "llamacpp" not in skip:  # the decode ratio with requests in turns (loadtest/paired.py)
            rows += paired.bench_paired_decode(plan, prompts, base, gguf, paired.QUICK_PAIRS if quick else paired.PAIRS)
    rows += bench_hf(plan, prompts, model)
    rows += paired.bench_paired_ttft(plan, prompts, base, model, paired.QUICK_PAIRS if quick else paired.TTFT_PAIRS)
    machine += machine_rows(usable_cores(), repeats=3 if quick else 7, when="end")
    print(describe(machine))
    print(pivot(rows, "system", baseline="hf"))
    if any(r["system"] == "llamacpp-server" for r in rows):  # the same rows against llama.cpp's server
        print(pivot(rows, "system", baseline="llamacpp-server"))
    return machine + rows
