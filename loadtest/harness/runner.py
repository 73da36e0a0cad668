"""Sending a workload to an OpenAI-compatible endpoint and timing every stream.

NOTE (open loop). A level at `--rate` sends request i at its arrival time whether or not earlier
ones have finished (Poisson: exponential gaps with mean 1/rate, seeded; constant: 1/rate
apart), as `vllm bench serve` does: a slow server then builds a queue, which is what latency
under load means. The turns of one multi-turn session are the exception a user imposes: turn
t+1 is sent at its arrival time or when turn t's answer is complete, whichever is later (its
messages carry that answer). `--concurrency` is the closed loop instead: that many workers, each
sending its next request when its previous one ends. A level is bounded in count (the
workload's requests) and time (`duration_s`: no request is sent after it; those in flight get
`timeout_s`). Times come from one monotonic clock; sleeping until an arrival time is the
schedule itself, not synchronization.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional

import httpx

from kvmesh.loadtest.harness.stats import Record
from kvmesh.sse import json_events
from kvmesh.loadtest.harness.workloads import LoadRequest, inline_documents


def arrivals(n: int, rate: float, *, kind: str = "poisson", seed: int = 0) -> list[float]:
    """Send times (seconds from the start) of `n` requests at `rate` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if kind == "constant":
        return [i / rate for i in range(n)]
    if kind != "poisson":
        raise ValueError(f"unknown arrival process {kind!r}; use poisson or constant")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class Target:
    """An OpenAI-compatible endpoint: `url` is its base (…/v1)."""

    url: str
    model: str
    api_key: str = "none"
    documents: bool = False
    """It takes kvmesh's `documents` extension (else documents are inlined)."""
    extra: Optional[dict] = None
    """Fields merged into every body (e.g. {"kvmesh": {"lossy": {...}}} for blending)."""


def body(target: Target, req: LoadRequest, messages: list[dict]) -> dict:
    out = {"model": target.model, "messages": messages, "max_tokens": req.max_tokens, "temperature": 0.0,
           "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    if req.documents:
        if target.documents:
            out["documents"] = [{"text": d} for d in req.documents]
        else:
            out["messages"] = inline_documents(messages, req.documents)
    if target.extra:
        out.update(target.extra)
    return out


async def send(client: httpx.AsyncClient, target: Target, req: LoadRequest, messages: list[dict],
               clock: Callable[[], float], timeout_s: float) -> Record:
    """One streamed chat completion, timed (see stats for the definitions)."""
    record = Record(sent=clock())
    try:
        async with client.stream("POST", f"{target.url}/chat/completions", json=body(target, req, messages),
                                 headers={"Authorization": f"Bearer {target.api_key}"}, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                record.status, record.retry_after = str(resp.status_code), resp.headers.get("retry-after")
                await resp.aread()
                record.end = clock()
                return record
            usage = None
            async for chunk in json_events(resp.aiter_lines()):
                if "error" in chunk:
                    record.status = "stream"
                    break
                now = clock()
                for choice in chunk.get("choices") or ():
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        record.chunk_times.append(now)
                        record.text += content
                if chunk.get("usage"):
                    usage = chunk["usage"]
            record.end = clock()
    except httpx.TimeoutException:
        record.status, record.end = "timeout", clock()
        return record
    except (httpx.TransportError, json.JSONDecodeError):
        record.status, record.end = ("connect" if not record.chunk_times else "stream"), clock()
        return record
    if record.ok:
        if usage:
            record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            details = usage.get("prompt_tokens_details") or {}
            record.cached_tokens = int(details.get("cached_tokens") or 0)
        else:  # a server without stream usage: one token per content chunk
            record.output_tokens = len(record.chunk_times)
    return record


async def run_level(target: Target, requests: list[LoadRequest], *, rate: Optional[float] = None,
                    concurrency: Optional[int] = None, arrival: str = "poisson", seed: int = 0,
                    duration_s: float = float("inf"), timeout_s: float = 300.0,
                    clock: Callable[[], float] = time.monotonic,
                    client: Optional[httpx.AsyncClient] = None) -> list[Record]:
    """Sends `requests` open-loop at `rate` (or closed-loop with `concurrency` workers; a trace's
    own arrival times when neither is given) and returns one Record per request sent."""
    own = client is None
    client = client or httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    history: dict[str, list[dict]] = {}
    turn_done: dict[str, asyncio.Event] = {}
    records: list[Record] = []
    start = clock()

    async def one(req: LoadRequest, prev: Optional[asyncio.Event], mine: Optional[asyncio.Event],
                  at: Optional[float] = None) -> None:
        try:
            if prev is not None:
                await prev.wait()
            if clock() - start > duration_s:
                return
            messages = history.get(req.session, []) + req.messages if req.session else req.messages
            record = await send(client, target, req, messages, clock, timeout_s)
            record.scheduled = start + at if at is not None else None
            record.tags = req.tags
            records.append(record)
            if req.session:
                history[req.session] = messages + [{"role": "assistant", "content": record.text}]
        finally:
            if mine is not None:
                mine.set()

    def chain(req: LoadRequest) -> tuple[Optional[asyncio.Event], Optional[asyncio.Event]]:
        if not req.session:
            return None, None
        prev, mine = turn_done.get(req.session), asyncio.Event()
        turn_done[req.session] = mine
        return prev, mine

    try:
        if concurrency is not None:
            queue = list(reversed(requests))

            async def worker() -> None:
                while queue and clock() - start <= duration_s:
                    req = queue.pop()
                    await one(req, *chain(req))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            if rate is not None:
                times = arrivals(len(requests), rate, kind=arrival, seed=seed)
            elif all(r.arrival is not None for r in requests):
                times = [r.arrival - requests[0].arrival for r in requests]
            else:
                raise ValueError("give a rate or a concurrency (only a trace carries its own arrival times)")
            tasks = []
            for req, at in zip(requests, times):
                if at > duration_s:
                    break
                delay = start + at - clock()
                if delay > 0:
                    await asyncio.sleep(delay)  # open loop: the schedule, not a synchronization
                tasks.append(asyncio.ensure_future(one(req, *chain(req), at)))
            await asyncio.gather(*tasks)
    finally:
        if own:
            await client.aclose()
    return sorted(records, key=lambda r: r.sent)


HIT_COUNTERS = (
    ("kvmesh_gateway_tokens_total", {"kind": "cached"}, "kvmesh_gateway_tokens_total", {"kind": "prompt"}),
    ("vllm:prefix_cache_hits_total", {}, "vllm:prefix_cache_queries_total", {}),
)
"""(hit counter, its labels, total counter, its labels) of servers whose /metrics say how many
prompt tokens came from their KV cache: kvmesh's gateway, vLLM."""


async def scrape_hits(url: str, client: Optional[httpx.AsyncClient] = None) -> Optional[tuple[float, float]]:
    """(tokens served from cache, prompt tokens) so far from the /metrics beside base URL `url`
    (…/v1), summed over the other labels; None when there is none or it has no such counters."""
    from prometheus_client.parser import text_string_to_metric_families

    root = url[:-3] if url.endswith("/v1") else url
    try:
        if client is None:
            async with httpx.AsyncClient(timeout=5) as own:
                resp = await own.get(f"{root}/metrics")
        else:
            resp = await client.get(f"{root}/metrics")
        if resp.status_code != 200:
            return None
        samples = [s for f in text_string_to_metric_families(resp.text) for s in f.samples]
    except (httpx.HTTPError, ValueError):
        return None
    for hit, hit_labels, total, total_labels in HIT_COUNTERS:
        def total_of(name: str, labels: dict) -> Optional[float]:
            vals = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
            return sum(vals) if vals else None
        h, t = total_of(hit, hit_labels), total_of(total, total_labels)
        if h is not None and t is not None:
            return h, t
    return None
