"""`kvmesh bench routing`: KV-cache-aware placement against round-robin over two engine replicas.

The workload is multi-turn chat: every user opens with a long document of their own (a distinct
slice of ``pydoc_data.topics``) and a question, then asks short follow-ups; each turn's prompt is
the whole conversation so far (chat template applied), so a replica that served the user's
previous turn holds all but the newest few dozen tokens in its prefix cache. Users join one
every `arrival_gap_s` and then run concurrently, each turn right after the previous answer.
Greedy, fixed-length answers.

Side by side in one run on the bundled SmolLM2-135M, through the real router and two engine
processes (one torch thread each: two cores), for each policy (kv_aware, round_robin) and each
KV-pool size per engine:

* ``tight`` — the pool holds about 60% of all users' conversations: a policy that spreads each
  user over both replicas needs twice the cache of one that keeps users in place, which is how a
  fleet's aggregate cache capacity is lost in practice;
* ``ample`` — every conversation fits in every replica (quick runs skip it): only the first visit
  of a user to the second replica is lost.

Engines use their own prefix caches only (no KV-cache service), so what is measured is placement.
Each policy runs under its own cache salt on the same engines (no cached KV carries over between
policies). Metrics: prefix-cache hit rate (cached prompt tokens / prompt tokens, from the
engines' usage), mean and p90 time to first token at the client.
"""
from __future__ import annotations

import asyncio
import statistics
import sys
import time
from dataclasses import dataclass

from kvmesh.loadtest.report import pivot, row

KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # SmolLM2-135M fp32: layers x kv heads x head dim x (k, v)
FOLLOW_UPS = ("What is the main point so far?", "Give one example from the text.",
              "Which detail matters most, and why?", "Summarize that in one sentence.",
              "What would a beginner find confusing here?", "Name a related topic.",
              "Is anything in the text surprising?")


@dataclass(frozen=True)
class Plan:
    users: int = 8
    doc_tokens: int = 768
    turns: int = 8
    answer_tokens: int = 16
    arrival_gap_s: float = 2.0
    pools: tuple[str, ...] = ("tight", "ample")


FULL = Plan()
QUICK = Plan(users=6, doc_tokens=512, turns=6, arrival_gap_s=1.5, pools=("tight",))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _conversation_tokens(plan: Plan) -> int:
    # document + template + per turn (question ~15, answer, template ~10)
    return plan.doc_tokens + 40 + plan.turns * (plan.answer_tokens + 30)


def pool_bytes(plan: Plan, pool: str) -> int:
    total = plan.users * _conversation_tokens(plan)
    share = 0.6 if pool == "tight" else 1.5
    return int(total * share) * KV_BYTES_PER_TOKEN


async def _user(stub, tok, doc: str, user: int, plan: Plan, salt: str, samples: list) -> None:
    from kvmesh.common.v1 import common_pb2
    from kvmesh.engine.v1 import engine_pb2
    from kvmesh.router.v1 import router_pb2

    await asyncio.sleep(user * plan.arrival_gap_s)  # the workload's arrival schedule: users join over time
    messages = [{"role": "user", "content": f"Read this document.\n\n{doc}\n\nWhat is it about?"}]
    for turn in range(plan.turns):
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        req = router_pb2.RouteRequest(tenant=f"user{user}", request=engine_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=ids), cache_salt=salt,
            sampling=engine_pb2.SamplingParams(max_tokens=plan.answer_tokens, temperature=0.0,
                                               ignore_eos=True)))
        t0 = time.perf_counter()
        first = None
        text = []
        final = None
        async for msg in stub.Generate(req, timeout=900):
            if first is None and msg.response.delta.token_ids:
                first = time.perf_counter() - t0
            text.append(msg.response.delta.text)
            if msg.response.HasField("final"):
                final = msg.response.final
        samples.append((first, final.usage.prompt_tokens, final.usage.cached_prompt_tokens, user, turn))
        messages.append({"role": "assistant", "content": "".join(text)})
        messages.append({"role": "user", "content": FOLLOW_UPS[(user + turn) % len(FOLLOW_UPS)]})


async def _workload(address: str, tok, docs: list[str], plan: Plan, salt: str) -> list[tuple]:
    import grpc

    from kvmesh.router.v1 import router_pb2_grpc

    samples: list[tuple] = []
    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterServiceStub(ch)
        await asyncio.gather(*(_user(stub, tok, docs[u], u, plan, salt, samples) for u in range(plan.users)))
    return samples


def _documents(tok, plan: Plan) -> list[str]:
    from kvmesh.model.perplexity import reference_text

    ids = tok.encode(reference_text())
    n = plan.doc_tokens
    return [tok.decode(ids[u * n:(u + 1) * n]) for u in range(plan.users)]


def run(quick: bool = False) -> list[dict]:
    from kvmesh import launcher
    from kvmesh.model.loader import load_tokenizer

    plan = QUICK if quick else FULL
    print(f"kvmesh bench routing ({'quick' if quick else 'full'}): {plan}", file=sys.stderr)
    tok = load_tokenizer("bundled")
    docs = _documents(tok, plan)
    one_thread = {"OMP_NUM_THREADS": "1"}
    rows: list[dict] = []
    for pool in plan.pools:
        kv_bytes = pool_bytes(plan, pool)
        engines, routers = [], {}
        try:
            for i in range(2):
                engines.append(launcher.start_service(
                    f"bench-engine-{i}", "kvmesh.services.engine",
                    ["--threads", "1", "--kv-cache-bytes", str(kv_bytes)], launcher.free_port()))
            tier = "smollm2=" + ",".join(e.address for e in engines)
            for policy in ("kv_aware", "round_robin"):
                routers[policy] = launcher.start_service(
                    f"bench-router-{policy}", "kvmesh.services.router",
                    ["--tiers", tier, "--policy", policy], launcher.free_port(), env=one_thread)
            for policy, router in routers.items():
                t0 = time.perf_counter()
                samples = asyncio.run(_workload(router.address, tok, docs, plan, salt=f"{pool}-{policy}"))
                wall = time.perf_counter() - t0
                ttfts = [s[0] for s in samples]
                hit = sum(s[2] for s in samples) / sum(s[1] for s in samples)
                tag = dict(policy=policy, kv_pool=pool)
                rows += [row("hit_rate", hit, "share", **tag),
                         row("ttft_mean_s", statistics.fmean(ttfts), "s", **tag),
                         row("ttft_p90_s", _percentile(ttfts, 0.9), "s", **tag),
                         row("wall_s", wall, "s", **tag)]
                print(f"{pool} {policy}: hit {hit:.3f} ttft mean {statistics.fmean(ttfts):.3f}s "
                      f"p90 {_percentile(ttfts, 0.9):.3f}s wall {wall:.1f}s "
                      f"({len(samples)} turns, pool {kv_bytes >> 20} MiB/engine)", file=sys.stderr)
        finally:
            for svc in [*routers.values(), *engines]:
                launcher.stop_service(svc)
    print(pivot(rows, "policy", baseline="kv_aware"))
    return rows
