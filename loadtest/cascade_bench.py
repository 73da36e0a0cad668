"""`kvmesh bench cascade`: what the cheap-first cascade saves, and what it costs in accuracy.

Task set (generated here, seeded, every answer checkable by a match in the reply): capitals of 16
countries, 16 single-digit additions, the day after each weekday, 10 "which number comes after
N" questions — 49 questions (quick: every other one), each sent as one chat turn, greedy, at most
24 answer tokens. A reply is correct when it contains the expected answer as a word
(case-insensitive).

Tiers (the one real model here, in two configurations, as engine processes behind the real
router): ``cheap`` = int4 weights, ``strong`` = fp32 weights; cascade route ``auto=cheap,strong``
with the mean token log-probability of the cheap answer as its confidence signal. Each request
carries its own threshold (RouteRequest.cascade_threshold), so one router serves every row.

Rows per ``threshold`` (plus ``cheap_only`` and ``strong_only``, the tiers called directly):
``cheap_share`` (answers kept from the cheap tier), ``cost`` (generated tokens x tier cost per
token, per request; the strong tier's cost is 1 and the cheap tier's is its measured decode time
per token relative to the strong tier, from the direct runs), ``accuracy``. A PNG of cost
against accuracy is written beside the JSON (or to bench-results/cascade.png).
"""
from __future__ import annotations

import asyncio
import random
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from kvmesh.loadtest.report import pivot, row
from kvmesh.threads import usable_cores

CAPITALS = {"France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
            "Russia": "Moscow", "Egypt": "Cairo", "China": "Beijing", "England": "London", "Greece": "Athens",
            "Canada": "Ottawa", "Portugal": "Lisbon", "Austria": "Vienna", "Ireland": "Dublin",
            "Norway": "Oslo", "Poland": "Warsaw"}
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
THRESHOLDS = (-100.0, -1.0, -0.7, -0.5, -0.4, -0.3, 0.0)


@dataclass(frozen=True)
class Task:
    question: str
    answer: str

    def correct(self, reply: str) -> bool:
        return re.search(rf"(?<![\w]){re.escape(self.answer)}(?![\w])", reply, re.IGNORECASE) is not None


def task_set(seed: int = 0) -> list[Task]:
    """The benchmark's questions with their answers (deterministic for a seed)."""
    rng = random.Random(seed)
    tasks = [Task(f"What is the capital of {c}?", a) for c, a in CAPITALS.items()]
    for _ in range(16):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        tasks.append(Task(f"What is {a} + {b}?", str(a + b)))
    tasks += [Task(f"What day comes after {d}?", DAYS[(i + 1) % 7]) for i, d in enumerate(DAYS)]
    for _ in range(10):
        n = rng.randint(2, 99)
        tasks.append(Task(f"What number comes after {n}?", str(n + 1)))
    return tasks


@dataclass(frozen=True)
class Answer:
    text: str
    tier: str
    completion_tokens: int   # of every tier that ran, summed per tier below
    tokens_by_tier: dict
    decode_s: float


async def _ask(stub, tok, task: Task, model: str, threshold: float | None, max_tokens: int) -> Answer:
    import time

    from kvmesh.common.v1 import common_pb2
    from kvmesh.engine.v1 import engine_pb2
    from kvmesh.router.v1 import router_pb2

    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": task.question}],
                                             add_generation_prompt=True))
    req = router_pb2.RouteRequest(model=model, request=engine_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling=engine_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    if threshold is not None:
        req.cascade_threshold = threshold
    text, route, final, first, end = [], None, None, None, None
    async for msg in stub.Generate(req, timeout=600):
        if msg.HasField("route"):
            route = msg.route
        if first is None and msg.response.delta.token_ids:
            first = time.perf_counter()
        text.append(msg.response.delta.text)
        if msg.response.HasField("final"):
            final = msg.response.final
            end = time.perf_counter()
    n = final.usage.completion_tokens
    by_tier = {route.tier: n}
    for step in route.cascade:  # tiers whose answers were dropped still cost their tokens
        if not step.accepted:
            by_tier[step.tier] = by_tier.get(step.tier, 0) + step.completion_tokens
    decode_s = (end - first) / (n - 1) if first and n > 1 else float("nan")
    return Answer("".join(text), route.tier, n, by_tier, decode_s)


async def _run_all(address: str, tok, tasks: list[Task], max_tokens: int) -> dict:
    import grpc

    from kvmesh.router.v1 import router_pb2_grpc

    results: dict = {}
    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        await _ask(stub, tok, tasks[0], "cheap", None, 4)   # warm-up of both engines
        await _ask(stub, tok, tasks[0], "strong", None, 4)
        for name in ("cheap", "strong"):
            results[f"{name}_only"] = [await _ask(stub, tok, t, name, None, max_tokens) for t in tasks]
        for th in THRESHOLDS:  # one request at a time: the engines share two cores
            results[th] = [await _ask(stub, tok, t, "auto", th, max_tokens) for t in tasks]
    return results


def _plot(points: list[tuple[str, float, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.2))
    casc = [(c, a, lab) for lab, c, a in points if not lab.endswith("_only")]
    ax.plot([c for c, _, _ in casc], [a for _, a, _ in casc], "o-", label="cascade (threshold)")
    for c, a, lab in casc:
        ax.annotate(lab, (c, a), textcoords="offset points", xytext=(4, 4), fontsize=8)
    for lab, c, a in points:
        if lab.endswith("_only"):
            ax.plot([c], [a], "s", label=lab.replace("_", " "))
    ax.set_xlabel("cost per request (generated tokens x tier cost)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("kvmesh cascade: int4 tier first, fp32 on low confidence")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(quick: bool = False, json_path: str | None = None) -> list[dict]:
    from kvmesh import launcher
    from kvmesh.model.loader import load_tokenizer

    tasks = task_set()
    if quick:
        tasks = tasks[::2]
    max_tokens = 24
    print(f"kvmesh bench cascade ({'quick' if quick else 'full'}): {len(tasks)} tasks, "
          f"thresholds {THRESHOLDS}", file=sys.stderr)
    tok = load_tokenizer("bundled")
    threads = str(usable_cores())  # the engines take turns: each may use every core
    procs = []
    try:
        cheap = launcher.start_service("bench-cheap", "kvmesh.services.engine",
                                       ["--weights", "int4", "--threads", threads, "--enable-prefix-caching", "false", "--kv-cache-bytes",
                                        str(256 << 20)], launcher.free_port())
        procs.append(cheap)
        strong = launcher.start_service("bench-strong", "kvmesh.services.engine",
                                        ["--threads", threads, "--enable-prefix-caching", "false", "--kv-cache-bytes", str(256 << 20)],
                                        launcher.free_port())
        procs.append(strong)
        router = launcher.start_service(
            "bench-router", "kvmesh.services.router",
            ["--tiers", f"cheap={cheap.address}@0.6;strong={strong.address}@1.0",
             "--cascades", "auto=cheap,strong", "--cascade-signal", "mean_logprob"],
            launcher.free_port(), env={"OMP_NUM_THREADS": "1"})
        procs.append(router)
        results = asyncio.run(_run_all(router.address, tok, tasks, max_tokens))
    finally:
        for p in reversed(procs):
            launcher.stop_service(p)

    def per_token(answers) -> float:
        return statistics.median(a.decode_s for a in answers if a.decode_s == a.decode_s)

    cost = {"strong": 1.0, "cheap": per_token(results["cheap_only"]) / per_token(results["strong_only"])}
    rows = [row("tier_cost", cost["cheap"], "x strong", threshold="cheap_only")]
    points = []
    for key, answers in results.items():
        label = key if isinstance(key, str) else f"{key:g}"
        acc = sum(t.correct(a.text) for t, a in zip(tasks, answers)) / len(tasks)
        share = sum(a.tier == "cheap" for a in answers) / len(tasks)
        spent = statistics.fmean(sum(n * cost[tier] for tier, n in a.tokens_by_tier.items()) for a in answers)
        kept = [t.correct(a.text) for t, a in zip(tasks, answers) if a.tier == "cheap"]
        rows += [row("cheap_share", share, "share", threshold=label), row("cost", spent, "token-units", threshold=label),
                 row("accuracy", acc, "share", threshold=label)]
        if kept and not label.endswith("_only"):  # how well the signal picks the answers to keep
            rows.append(row("cheap_kept_accuracy", sum(kept) / len(kept), "share", threshold=label))
        points.append((label, spent, acc))
        print(f"threshold {label}: cheap share {share:.2f} cost {spent:.1f} accuracy {acc:.3f}", file=sys.stderr)
    png = Path(json_path).with_suffix(".png") if json_path else Path("bench-results/cascade.png")
    _plot(points, png)
    print(f"wrote the cost/accuracy plot to {png}", file=sys.stderr)
    print(pivot([r for r in rows if r["metric"] != "tier_cost"], "threshold"))
    print(f"cheap tier cost per token: {cost['cheap']:.2f} x strong (measured decode time)")
    return rows
