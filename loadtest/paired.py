"""`kvmesh bench engine`'s paired rows: single-stream decode of the kvmesh engine and llama.cpp, and
the time to first token of a long prompt on the kvmesh engine and HF transformers, taken in turns:
the ratio of each pair is one measurement of kvmesh against its peer.

NOTE (why). The bench's columns run one after another, minutes apart, and the VMs it runs on lose
CPU time to their host in phases about that long. Two full runs of the same build on the same
2-core Ice Lake VM gave llama-cpp-python's decode 58.5 and 99.8 tok/s (and llama-server's 102.4
and 71.7, in the opposite direction): the decode ratio of the default against llama-cpp-python
read 1.32x in one and 0.87x in the other. Requests of both systems in alternation see the same
phase: a pair is one request of each on the same prompt, back to back, and the order within a
pair alternates (kvmesh first in even pairs), so neither system always runs just after the other
has warmed or cooled the caches. The rows: each system's median rate over the pairs, and the
median, min and max of the per-pair ratios.

The kvmesh engine runs as its gRPC service process (as in its column, streaming included); llama.cpp
runs in this process through llama-cpp-python (the `llamacpp` column's setup), HF's model too (the
`hf` column's). Only one of them computes at any time.
"""
from __future__ import annotations

import asyncio
import statistics
from pathlib import Path
from typing import Awaitable, Callable

from kvmesh.loadtest.report import row

PAIRS, QUICK_PAIRS = 8, 3  # decode pairs
TTFT_PAIRS = 4  # TTFT pairs (each ~2 x 2 s of prefill); QUICK_PAIRS with --quick
PEER = "llamacpp"


async def alternate(pairs: int, ours: Callable[[int], Awaitable[float]],
                    theirs: Callable[[int], float]) -> tuple[list[float], list[float]]:
    """Runs `pairs` pairs, ours(i) and theirs(i) back to back (ours first in even pairs, theirs
    first in odd ones); returns (our rates, their rates) in pair order."""
    a, b = [], []
    for i in range(pairs):
        if i % 2 == 0:
            a.append(await ours(i))
            b.append(theirs(i))
        else:
            b.append(theirs(i))
            a.append(await ours(i))
    return a, b


def paired_rows(ours: list[float], theirs: list[float], system: str = "kvmesh", peer: str = PEER, *,
                kind: str = "decode", unit: str = "tok/s", faster_is_lower: bool = False,
                **params) -> list[dict]:
    """<kind>_<unit>_paired for both systems (medians over the pairs: decode_tok_s_paired, ttft_s_paired)
    and <kind>_vs_<peer>_paired (median, min, max of the per-pair ratios, each how many times faster
    ours was: ours / theirs for rates, theirs / ours for times, `faster_is_lower`). `params` go on
    every row (default: concurrency=1)."""
    if not ours or len(ours) != len(theirs):
        raise ValueError(f"paired measurements need one of each system per pair, got {len(ours)} and {len(theirs)}")
    ratios = [(b / a) if faster_is_lower else (a / b) for a, b in zip(ours, theirs)]
    at = {**(params or {"concurrency": 1}), "pairs": len(ours)}
    each, metric = f"{kind}_{unit.replace('/', '_')}_paired", f"{kind}_vs_{peer}_paired"
    return [row(each, statistics.median(ours), unit, system=system, **at),
            row(each, statistics.median(theirs), unit, system=peer, **at),
            row(metric, statistics.median(ratios), "x", system=system, **at),
            row(f"{metric}_min", min(ratios), "x", system=system, **at),
            row(f"{metric}_max", max(ratios), "x", system=system, **at)]


def alternate_with_engine(engine_args: list[str], pairs: int, warm: list[int],
                          ours: Callable[[object, int], Awaitable[float]], theirs: Callable[[int], float],
                          warm_peer: Callable[[], object], warm_tokens: int = 1) -> tuple[list[float], list[float]]:
    """Starts the kvmesh engine service (engine_args, this machine's cores), warms it and the peer
    (first-call allocations, both sides: one request of `warm`, `warm_tokens` new tokens, to the
    engine, then `warm_peer()`), then `alternate`s ours(stub, i)
    and theirs(i); stops the service."""
    import grpc

    from kvmesh import launcher
    from kvmesh.engine.v1 import engine_pb2_grpc
    from kvmesh.loadtest import engine_bench as eb
    from kvmesh.threads import usable_cores

    port = launcher.free_port()
    svc = launcher.start_service("bench-engine-paired", "kvmesh.services.engine",
                                 ["--threads", str(usable_cores()), *engine_args], port)
    try:
        async def main() -> tuple[list[float], list[float]]:
            async with grpc.aio.insecure_channel(svc.address) as ch:
                stub = engine_pb2_grpc.EngineServiceStub(ch)
                await eb._one(stub, warm, warm_tokens)
                warm_peer()
                return await alternate(pairs, lambda i: ours(stub, i), theirs)

        return asyncio.run(main())
    finally:
        launcher.stop_service(svc)


def bench_paired_decode(plan, prompts, engine_args: list[str], gguf: Path, pairs: int) -> list[dict]:
    """`pairs` pairs of one decode request of the plan's size (decode_prompt tokens of a fresh
    prompt, decode_tokens new ones) on the kvmesh engine (engine_args: the default column's) and on
    llama-cpp-python, the same prompt for both within a pair; rates as the decode rows count them
    ((tokens - 1) / time from the first token to the last)."""
    from llama_cpp import Llama

    from kvmesh.loadtest import engine_bench as eb
    from kvmesh.threads import usable_cores

    threads = usable_cores()
    ids = [prompts.take(plan.decode_prompt) for _ in range(pairs)]
    warm = prompts.take(16)
    llm = Llama(model_path=str(gguf), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    try:
        async def ours(stub, i: int) -> float:
            t0, first, end, n = await eb._one(stub, ids[i], plan.decode_tokens)
            return (n - 1) / (end - first)

        def theirs(i: int) -> float:
            ttft, total = eb.llama_generate(llm, ids[i], plan.decode_tokens)
            return (plan.decode_tokens - 1) / (total - ttft)

        ours_rates, their_rates = alternate_with_engine(engine_args, pairs, warm, ours, theirs,
                                                        lambda: eb.llama_generate(llm, warm, 4), warm_tokens=4)
    finally:
        llm.close()
    return paired_rows(ours_rates, their_rates)


def bench_paired_ttft(plan, prompts, engine_args: list[str], source: str, pairs: int) -> list[dict]:
    """`pairs` pairs of one request of the plan's longest TTFT prompt (fresh tokens each pair, the
    same for both within it): the kvmesh engine (engine_args: the default column's; time to the
    first streamed token of `max_tokens=1`) and HF transformers in fp32 (`generate` of one token,
    as the `hf` column times it). Rows ttft_s_paired and ttft_vs_hf_paired (times faster)."""
    from kvmesh.loadtest import engine_bench as eb
    from kvmesh.loadtest.hf_column import hf_generate, hf_model
    from kvmesh.threads import set_torch_threads

    tokens = max(plan.ttft_prompts)
    ids = [prompts.take(tokens) for _ in range(pairs)]
    warm = prompts.take(16)
    set_torch_threads(0)
    model = hf_model(source)

    async def ours(stub, i: int) -> float:
        t0, first, _end, _n = await eb._one(stub, ids[i], 1)
        return first - t0

    ours_s, theirs_s = alternate_with_engine(engine_args, pairs, warm, ours,
                                             lambda i: hf_generate(model, [ids[i]], 1),
                                             lambda: hf_generate(model, [warm], 1))
    return paired_rows(ours_s, theirs_s, peer="hf", kind="ttft", unit="s", faster_is_lower=True,
                       prompt_tokens=tokens)
