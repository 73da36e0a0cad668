"""`kvmesh bench pd`: what prefill/decode disaggregation costs the long request and saves the
decodes beside it, by prompt length (the measurement behind --pd-min-prompt-tokens).

One stack, `kvmesh up --pd 1:1 --pin-engines` (a prefill and a decode engine, each pinned to its
half of the cores), run twice: `pd` with the router's P/D route on for every prompt of at least
256 tokens (one KV chunk: below it there is nothing to hand off), and `colocated` with the route
off (--pd-min-prompt-tokens past every prompt), so every request runs whole on the decode engine,
as on a colocated replica of the same size. For each prompt length N:

  alone      one N-token request (a distinct text: no cache hit), 16 new tokens, alone on the
             stack: its TTFT, and its second-token latency (the first inter-token gap: on `pd` the
             handoff's wait, the decode engine's fetch and import, and what it computes itself)
  beside     a short chat decoding 256 tokens; 1 s after it starts, the N-token request arrives:
             the chat's worst inter-token gap and its TPOT (on `colocated` the long prefill shares
             the chat's engine step by step; on `pd` only its decode hop does)

`pd_overhead` = pd second-token latency - colocated's (what P/D costs the long request);
`interference` = colocated chat worst gap - pd's (what it saves each decode beside it). Median of
3 repeats (quick: 1) with min and max. The bundled model only (see the registry).
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import statistics
import time
from collections.abc import Iterator

import httpx

from kvmesh.loadtest.harness import systems
from kvmesh.loadtest.harness.runner import Target, send
from kvmesh.loadtest.harness.stats import Record
from kvmesh.loadtest.harness.workloads import WORDS, LoadRequest
from kvmesh.loadtest.report import pivot, row

LENGTHS = (256, 512, 1024, 2048, 4096)
QUICK_LENGTHS = (512, 2048)
MODEL = "smollm2-135m-instruct"
ROUTE_OFF = 1_000_000


def _prompt(tokenizer, n: int, rng: random.Random) -> str:
    """A text of about `n` tokens in a chat turn (the template adds a few)."""
    words = [rng.choice(WORDS) for _ in range(2 * n)]
    lo, hi = 1, len(words)  # the most words that stay within n - 12 tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if len(tokenizer.encode(" ".join(words[:mid]))) <= n - 12 else (lo, mid - 1)
    return " ".join(words[:lo])


@contextlib.contextmanager
def _stack(route: str) -> Iterator[str]:
    threshold = 256 if route == "pd" else ROUTE_OFF
    with systems._stack(up_args=("--pd=1:1", "--pin-engines", f"--router-arg=--pd-min-prompt-tokens={threshold}")) \
            as url:
        yield url


async def _one(client: httpx.AsyncClient, target: Target, text: str, max_tokens: int) -> Record:
    req = LoadRequest([{"role": "user", "content": text}], max_tokens)
    record = await send(client, target, req, req.messages, time.perf_counter, 600.0)
    if not record.ok:
        raise SystemExit(f"kvmesh bench pd: a request failed ({record.status})")
    return record


async def _measure(url: str, route: str, lengths, repeats: int, tokenizer, seed: int) -> list[dict]:
    target = Target(url, MODEL)
    rng = random.Random(seed)
    out: list[dict] = []
    async with httpx.AsyncClient() as client:
        await _one(client, target, "Hello there.", 4)  # warm both paths' connections
        for n in lengths:
            alone: dict[str, list[float]] = {"ttft": [], "second_token": []}
            beside: dict[str, list[float]] = {"chat_max_itl": [], "chat_tpot": []}
            for _ in range(repeats):
                r = await _one(client, target, _prompt(tokenizer, n, rng), 16)
                alone["ttft"].append(r.ttft * 1e3)
                alone["second_token"].append(r.itls[0] * 1e3)
                chat = asyncio.ensure_future(_one(client, target, f"Tell a long story. {rng.random()}", 256))
                await asyncio.sleep(1.0)  # the schedule: the long prompt arrives while the chat decodes
                await _one(client, target, _prompt(tokenizer, n, rng), 16)
                c = await chat
                beside["chat_max_itl"].append(max(c.itls) * 1e3)
                beside["chat_tpot"].append(c.tpot * 1e3)
            for metric, values in (*alone.items(), *beside.items()):
                for stat, value in (("median", statistics.median(values)), ("min", min(values)),
                                    ("max", max(values))):
                    out.append(row(metric, value, "ms", route=route, prompt_tokens=n, stat=stat, repeats=repeats))
    return out


def _derived(rows: list[dict], lengths) -> list[dict]:
    value = {(r["route"], r["prompt_tokens"], r["metric"]): r["value"] for r in rows if r["stat"] == "median"}
    out = []
    for n in lengths:
        out.append(row("pd_overhead", value["pd", n, "second_token"] - value["colocated", n, "second_token"], "ms",
                       prompt_tokens=n))
        out.append(row("interference", value["colocated", n, "chat_max_itl"] - value["pd", n, "chat_max_itl"], "ms",
                       prompt_tokens=n))
    return out


def run(quick: bool = False) -> list[dict]:
    from kvmesh.model.loader import load_tokenizer

    tokenizer = load_tokenizer("bundled", progress=False)
    lengths, repeats = (QUICK_LENGTHS, 1) if quick else (LENGTHS, 3)
    rows: list[dict] = []
    for route in ("colocated", "pd"):
        with _stack(route) as url:
            rows += asyncio.run(_measure(url, route, lengths, repeats, tokenizer, seed=7))
    derived = _derived(rows, lengths)
    print(pivot(rows, "route"))
    print(pivot(derived, "prompt_tokens"))
    return rows + derived
