"""`kvmesh loadtest`: a workload against OpenAI-compatible endpoints, level by level.

    kvmesh loadtest --workload multiturn --rate 0.5,1,2,4 --num-requests 64 --slo ttft=2s,tpot=150ms \\
        --json loadtest/results/multiturn.json --plot loadtest/results/multiturn.png
    kvmesh loadtest --target kvmesh=http://127.0.0.1:8000/v1 --target llama=http://127.0.0.1:8080/v1 ...
    kvmesh loadtest --compare --workload rag --rate 0.25,0.5,1,1.5,2,3 ...   # starts each system itself

Each target gets the same seeded requests at each level, one level after the other. --compare
starts the systems of kvmesh.loadtest.harness.systems one at a time on the bundled model.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import httpx

from kvmesh.loadtest.harness import systems, workloads
from kvmesh.loadtest.harness.report import peak_goodput, peak_text, plot, rows, table
from kvmesh.loadtest.harness.runner import Target, run_level, scrape_hits
from kvmesh.loadtest.harness.stats import Summary, parse_slos, summarize


def add_parser(sub) -> None:
    p = sub.add_parser("loadtest", help="open-loop load against OpenAI-compatible endpoints: latency "
                                        "percentiles, throughput, goodput",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="base URL of the endpoint (…/v1); default: the local stack's gateway")
    p.add_argument("--target", action="append", default=[], metavar="NAME=URL",
                   help="a named endpoint (repeatable): every one gets the same workload at each level")
    p.add_argument("--compare", nargs="?", const=",".join(systems.SYSTEMS), metavar="SYSTEMS",
                   help="start and measure these systems one after the other (comma-separated; default: "
                        f"{','.join(systems.SYSTEMS)})")
    p.add_argument("--model", help="model name to request (default: the first one /models lists)")
    p.add_argument("--api-key", default="none", help="bearer key sent to every target")
    p.add_argument("--workload", default="random", choices=workloads.WORKLOADS)
    p.add_argument("--sessions", type=int, help="multiturn: conversations per level (default 8); the level's "
                                                "requests are spread over them, turn by turn")
    p.add_argument("--trace", help="Mooncake-format JSONL to replay (--workload trace)")
    p.add_argument("--rate", help="request rate(s) per second, comma-separated for a sweep (open loop)")
    p.add_argument("--concurrency", help="closed loop instead: number(s) of concurrent users, comma-separated")
    p.add_argument("--arrival", default="poisson", choices=("poisson", "constant"))
    p.add_argument("--num-requests", type=int, default=100, help="requests per level")
    p.add_argument("--duration", type=float, default=float("inf"), help="seconds per level after which no request is sent")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (ignore_eos is sent)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrivals")
    p.add_argument("--warmup", type=int, default=2,
                   help="requests sent one at a time to each target before its first level, not measured")
    p.add_argument("--slo", help="goodput bounds, e.g. ttft=2s,tpot=100ms (also itl, e2el); several SLOs "
                   "separated by ';' score each level against each (the first is the table's and admission's)")
    p.add_argument("--documents", choices=("auto", "on", "off"), default="auto",
                   help="rag: send documents through kvmesh's `documents` extension (auto: when the target's "
                        "/openapi.json has it), else inline them")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one request may take")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole sweep this many times (under --compare each system restarted, in the "
                        "same order, every repeat); repeat r is seeded --seed + r, so a server that stays up "
                        "gains nothing from the repeat before; each system's peak goodput is then reported "
                        "as min/median/max")
    p.add_argument("--json", help="write rows {params..., metric, value, unit} here")
    p.add_argument("--plot", help="write a PNG of latency percentiles and goodput vs rate here")


def _levels(text: str | None, kind: type) -> list:
    return [kind(v) for v in text.split(",") if v.strip()] if text else []


def _local_url() -> str:
    from kvmesh.launcher import openai_base_url

    return openai_base_url() or "http://127.0.0.1:8000/v1"


async def _describe(name: str, url: str, args, extra: dict | None = None) -> Target:
    """The target's model (from /models unless given) and whether it takes `documents`."""
    async with httpx.AsyncClient(timeout=10) as client:
        headers = {"Authorization": f"Bearer {args.api_key}"}
        model = args.model
        if model is None:
            try:
                listed = (await client.get(f"{url}/models", headers=headers)).json()["data"]
                model = listed[0]["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                raise SystemExit(f"kvmesh loadtest: {name} ({url}) lists no model ({e!r}); pass --model") from None
        documents = args.documents == "on"
        if args.documents == "auto":
            root = url[:-3] if url.endswith("/v1") else url
            try:
                spec = (await client.get(f"{root}/openapi.json")).json()
                documents = "documents" in json.dumps(spec.get("components", {}).get("schemas", {}).get(
                    "ChatCompletionBody", {}))
            except (httpx.HTTPError, ValueError):
                documents = False
    return Target(url.rstrip("/"), model, args.api_key, documents, extra)


def run_systems(args) -> list[tuple[dict, Summary]]:
    """--compare: each system started, measured at every level, stopped, in turn."""
    names = [s.strip() for s in args.compare.split(",") if s.strip()]
    unknown = [s for s in names if s not in systems.KNOWN]
    if unknown:
        raise SystemExit(f"kvmesh loadtest: unknown system(s) {', '.join(unknown)}; choose from "
                         f"{', '.join(systems.KNOWN)}")
    users = _levels(args.concurrency, int)
    slo = parse_slos(args.slo)[0] if args.slo else None
    levels: list[tuple[dict, Summary]] = []
    for name in names:
        with systems.serving(name, parallel=max(users or [16]),
                             slo_ttft_s=slo.ttft if slo is not None and slo.ttft else 2.0) as served:
            levels += asyncio.run(_run(args, [(name, served.url, served.extra)]))
    return levels


async def _run(args, targets: list[tuple[str, str, dict | None]] | None = None) -> list[tuple[dict, Summary]]:
    if targets is None:
        named = [t.split("=", 1) for t in args.target]
        if any(len(t) != 2 for t in named):
            raise SystemExit("kvmesh loadtest: --target takes NAME=URL, e.g. --target llama=http://127.0.0.1:8080/v1")
        targets = [(n, u, None) for n, u in named] or [("target", args.url or _local_url(), None)]
    rates, users = _levels(args.rate, float), _levels(args.concurrency, int)
    if args.workload != "trace" and not rates and not users:
        raise SystemExit("kvmesh loadtest: give --rate (open loop) or --concurrency (closed loop)")
    slo, *more = parse_slos(args.slo) if args.slo else [None]
    plan = [("rate", r) for r in rates] + [("concurrency", c) for c in users] or [("rate", None)]
    # level i's requests: the same for every target, new at each level (workloads' docstring)
    per_level = [workloads.make(args.workload, args.num_requests, seed=args.seed, max_tokens=args.max_tokens,
                                trace=args.trace, variant=i + 1, sessions=args.sessions)
                 for i in range(len(plan))]
    warmup = workloads.make(args.workload, args.warmup, seed=args.seed, max_tokens=args.max_tokens,
                            trace=args.trace, sessions=args.sessions) if args.warmup else []
    levels: list[tuple[dict, Summary]] = []
    for name, url, extra in targets:
        target = await _describe(name, url, args, extra)
        if warmup:
            await run_level(target, [dataclasses.replace(r, arrival=None) for r in warmup], concurrency=1,
                            timeout_s=args.timeout)
        for (kind, value), requests in zip(plan, per_level):
            before = await scrape_hits(target.url)
            records = await run_level(target, requests, rate=value if kind == "rate" else None,
                                      concurrency=value if kind == "concurrency" else None, arrival=args.arrival,
                                      seed=args.seed, duration_s=args.duration, timeout_s=args.timeout)
            params = {"system": name, "workload": args.workload, "sessions": args.sessions, kind: value}
            summary = summarize(records, slo, tuple(more))
            after = await scrape_hits(target.url)
            if before is not None and after is not None and after[1] > before[1]:
                summary = dataclasses.replace(summary, metrics_hit_rate=(after[0] - before[0]) / (after[1] - before[1]))
            levels.append((params, summary))
            print(table([(params, summary)]).splitlines()[1], file=sys.stderr, flush=True)
            for cls in sorted({r.tags.get("class") for r in records} - {None}):  # e.g. mixed: short, long
                part = ({**params, "class": cls}, summarize([r for r in records if r.tags.get("class") == cls], slo,
                                                                  tuple(more)))
                levels.append(part)
                print(table([part]).splitlines()[1], file=sys.stderr, flush=True)
    return levels


def run(args) -> int:
    if args.repeats < 1:
        raise SystemExit(f"kvmesh loadtest: --repeats must be at least 1 (got {args.repeats})")
    try:  # a bad workload option fails here, before any system is started
        workloads.make(args.workload, 1, seed=args.seed, max_tokens=args.max_tokens, trace=args.trace,
                       sessions=args.sessions)
        if args.slo:
            parse_slos(args.slo)
    except (ValueError, OSError) as e:
        raise SystemExit(f"kvmesh loadtest: {e}") from None
    levels: list[tuple[dict, Summary]] = []
    for repeat in range(args.repeats):
        once = argparse.Namespace(**{**vars(args), "seed": args.seed + repeat})
        got = run_systems(once) if args.compare else asyncio.run(_run(once))
        levels += [({**params, "repeat": repeat}, s) for params, s in got] if args.repeats > 1 else got
    print(table(levels))
    peaks = peak_goodput(levels)
    if peaks:
        print(peak_text(peaks))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        out = [r for params, s in levels for r in rows(s, **{k: v for k, v in params.items() if v is not None})]
        out += peaks
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {len(out)} rows to {args.json}", file=sys.stderr)
    if args.plot:
        plot(levels, args.plot, str(parse_slos(args.slo)[0]) if args.slo else None)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
