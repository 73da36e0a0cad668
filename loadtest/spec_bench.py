"""`kvmesh bench spec`: speculative decoding with drafts from the draft service, side by side.

One engine process (the bundled SmolLM2-135M, fp32, or the model of `--model PATH`) and one draft
service process (n-gram drafter, and the model drafter: the same model with int4 weights), both on
this machine; each
request picks its drafter (GenerateRequest.speculation), so every row runs against the same
processes in one run. Greedy decoding (outputs are identical with and without speculation; the
bench checks it and reports any difference).

Workloads:
* ``extractive`` — answers that quote or edit the prompt: Python functions from the standard
  library to rewrite with a renamed identifier, and passages of ``pydoc_data.topics`` to quote;
* ``chat`` — open-ended chat turns (stories, explanations, advice).

Rows: ``drafter`` (off | ngram | model | adaptive) x ``workload`` x ``concurrency`` (1 | 8).
Metrics: ``decode_tok_s`` (concurrency 1: per request, generated tokens after the first over the
time after the first token, averaged; concurrency 8: all generated tokens over the wall time of
the batch, i.e. aggregate) and ``accepted_per_step`` (accepted draft tokens per verification
step, from the engine's usage). The drafters take turns request by request (batch by batch at
concurrency 8: three batches each, after a pass that puts every prompt in the prefix cache), in
a rotating order, so the machine's drift does not favour one of them.
"""
from __future__ import annotations

import asyncio
import inspect
import statistics
import sys
import time
from dataclasses import dataclass

from kvmesh.loadtest.report import pivot, row
from kvmesh.threads import usable_cores

DRAFTERS = ("off", "ngram", "model", "adaptive")
CHAT = ("Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "Give me three tips for learning to cook at home.",
        "Describe a perfect weekend in the mountains.",
        "What are the pros and cons of working from home?",
        "Write a friendly email inviting a colleague to lunch.",
        "Why do cats purr? Explain briefly.",
        "Suggest a name for a coffee shop and explain it.")


@dataclass(frozen=True)
class Plan:
    prompts: int = 8
    max_tokens: int = 128
    concurrencies: tuple[int, ...] = (1, 8)


FULL = Plan()
BATCH_TURNS = 3
QUICK = Plan(prompts=4, max_tokens=64)


def extractive_prompts(n: int) -> list[str]:
    """Code edits of small standard-library functions and quotes of documentation passages."""
    import shlex
    import textwrap

    from kvmesh.model.perplexity import reference_text

    funcs = [textwrap.dedent, textwrap.indent, shlex.quote, statistics.fmean,
             statistics.median, statistics.mode, inspect.cleandoc, textwrap.shorten]
    out = []
    for i, f in enumerate(funcs):
        src = inspect.getsource(f)
        src = src if len(src) < 1800 else src[:1800]
        out.append(f"Here is a Python function:\n\n```python\n{src}```\n\nRewrite the whole function with "
                   f"the function renamed to `{f.__name__}_v2`. Output only the code.")
    text = reference_text()
    for i in range(n):
        passage = text[4000 * i + 1000: 4000 * i + 2200]
        out.append(f"Read this passage:\n\n{passage}\n\nQuote its first three sentences exactly.")
    order = [x for pair in zip(out[:len(funcs)], out[len(funcs):]) for x in pair]
    return order[:n]


def _request(tok, text: str, drafter: str, max_tokens: int):
    from kvmesh.common.v1 import common_pb2
    from kvmesh.engine.v1 import engine_pb2

    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))
    spec = {"off": engine_pb2.SPECULATION_OFF, "ngram": engine_pb2.SPECULATION_NGRAM,
            "model": engine_pb2.SPECULATION_MODEL, "adaptive": engine_pb2.SPECULATION_ADAPTIVE}[drafter]
    return engine_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), speculation=spec,
                                      sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))


async def _one(stub, req) -> dict:
    t0 = time.perf_counter()
    first, tokens, final = None, [], None
    async for msg in stub.Generate(req, timeout=900):
        if first is None and msg.delta.token_ids:
            first = time.perf_counter()
        tokens.extend(msg.delta.token_ids)
        if msg.HasField("final"):
            final = msg.final
    end = time.perf_counter()
    return {"tokens": tokens, "first": first, "start": t0, "end": end, "steps": final.spec_steps,
            "accepted": final.accepted_draft_tokens, "drafted": final.draft_tokens}


async def _measure(address: str, reqs: dict[str, list], concurrency: int) -> dict[str, tuple[float, float, list]]:
    """Each drafter's (tok/s, accepted per verify step, outputs) on its requests. The drafters
    take turns -- one request each at concurrency 1, one batch each otherwise -- in an order that
    rotates from turn to turn, so that the machine's drift (its speed moves ~10% within a minute
    here) falls on every drafter alike instead of on whichever ran its requests in that minute."""
    import grpc

    from kvmesh.engine.v1 import engine_pb2_grpc

    names = list(reqs)
    n = len(next(iter(reqs.values())))
    results: dict[str, list] = {d: [] for d in names}
    walls: dict[str, float] = {d: 0.0 for d in names}
    async with grpc.aio.insecure_channel(address) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        for d in names:
            await _one(stub, reqs[d][0])  # warm-up (and the draft service's first state for it)
        if concurrency > 1:  # every prompt in the prefix cache: no batch's wall time has a cold prefill
            await asyncio.gather(*(_one(stub, r) for r in reqs[names[0]][:concurrency]))
        for turn, i in enumerate(range(0, n, concurrency)):
            for d in names[turn % len(names):] + names[:turn % len(names)]:
                t0 = time.perf_counter()
                results[d] += await asyncio.gather(*(_one(stub, r) for r in reqs[d][i:i + concurrency]))
                walls[d] += time.perf_counter() - t0
    out = {}
    for d in names:
        rs = results[d]
        if concurrency == 1:
            speeds = [(len(r["tokens"]) - 1) / (r["end"] - r["first"]) for r in rs if len(r["tokens"]) > 1]
            tok_s = statistics.fmean(speeds)
        else:
            tok_s = sum(len(r["tokens"]) for r in rs) / walls[d]
        steps = sum(r["steps"] for r in rs)
        out[d] = (tok_s, sum(r["accepted"] for r in rs) / steps if steps else 0.0, [r["tokens"] for r in rs])
    return out


def run(quick: bool = False, model: str = "bundled") -> list[dict]:
    from kvmesh import launcher
    from kvmesh.loadtest.models import bench_model
    from kvmesh.model.loader import load_tokenizer

    plan = QUICK if quick else FULL
    bm = bench_model(model)
    tok = load_tokenizer(model)
    workloads = {"extractive": extractive_prompts(plan.prompts), "chat": list(CHAT[:plan.prompts])}
    longest = max(len(_request(tok, t, "off", plan.max_tokens).token_ids.ids) for ts in workloads.values() for t in ts)
    bm.require_context("spec", longest + plan.max_tokens, f"its longest prompt ({longest} tokens) and answer")
    print(f"kvmesh bench spec ({'quick' if quick else 'full'}, model {model}): {plan}", file=sys.stderr)
    threads = str(usable_cores())  # engine and drafter take turns (the engine waits on drafts)
    procs = []
    rows: list[dict] = []
    try:
        # The model drafter drafts with the served model's own weights at int4 (the bundled model's
        # draft model is the bundled model), so it shares the tokenizer on any model.
        draft_args = [] if bm.bundled else ["--draft-model", model]
        draft = launcher.start_service("bench-draft", "kvmesh.services.draft", ["--threads", threads, *draft_args],
                                       launcher.free_port())
        procs.append(draft)
        # The engine's defaults: drafts fitted to 8 decode rows a step (fp32 steps of 1-8 rows
        # stream the weights once, kvmesh.model.native): up to 7 for one sequence, none when the
        # speculating sequences cannot each get one. The model drafter needs ~30 ms per draft
        # position here: a deadline that lets it through.
        engine = launcher.start_service("bench-engine", "kvmesh.services.engine",
                                        ["--threads", threads, "--draft-address", draft.address,
                                         "--draft-timeout-s", "1.0", *bm.engine_args()],
                                        launcher.free_port())
        procs.append(engine)
        for workload, texts in workloads.items():
            for conc in plan.concurrencies:
                prompts = texts * (conc // len(texts) + 1) if conc > len(texts) else texts
                prompts = prompts[:max(len(texts), conc)]
                if conc > 1:  # three batches per drafter, taking turns (one would be all noise)
                    prompts = prompts * BATCH_TURNS
                reqs = {d: [_request(tok, t, d, plan.max_tokens) for t in prompts] for d in DRAFTERS}
                measured = asyncio.run(_measure(engine.address, reqs, conc))
                baseline = measured["off"][2]
                for drafter in DRAFTERS:
                    tok_s, acc, outputs = measured[drafter]
                    same = sum(a == b for a, b in zip(outputs, baseline)) / len(outputs)
                    tag = dict(drafter=drafter, workload=workload, concurrency=conc)
                    rows += [row("decode_tok_s", tok_s, "tok/s", **tag),
                             row("accepted_per_step", acc, "tokens", **tag)]
                    if same < 1.0:
                        rows.append(row("outputs_equal_off", same, "share", **tag))
                    print(f"{workload} c={conc} {drafter}: {tok_s:.1f} tok/s, accepted/step {acc:.2f}, "
                          f"outputs equal to off: {same:.2f}", file=sys.stderr)
    finally:
        for p in reversed(procs):
            launcher.stop_service(p)
    print(pivot(rows, "drafter", baseline="off"))
    return rows
