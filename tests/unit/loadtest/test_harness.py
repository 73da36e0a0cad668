"""`kvmesh loadtest`'s harness: arrival schedules, the summary's definitions (vLLM's), SLO
parsing and goodput, the workloads, and the runner's timing and accounting against a scripted
transport whose chunks advance a fake clock (nothing here reads the wall clock)."""
from __future__ import annotations

import json
import math
import statistics

import httpx
import pytest

from fake_clock import FakeClock
from kvmesh.loadtest.harness import workloads
from kvmesh.loadtest.harness.runner import Target, arrivals, body, run_level
from kvmesh.loadtest.harness.stats import Record, Slo, parse_slos, percentile, summarize
from kvmesh.loadtest.harness.report import rows as report_rows


def test_constant_arrivals_are_evenly_spaced_and_poisson_ones_are_seeded_exponential():
    assert arrivals(5, 4.0, kind="constant") == [0.0, 0.25, 0.5, 0.75, 1.0]
    a = arrivals(20000, 10.0, seed=3)
    assert a == arrivals(20000, 10.0, seed=3) and a != arrivals(20000, 10.0, seed=4)
    gaps = [y - x for x, y in zip(a, a[1:])]
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    with pytest.raises(ValueError, match="rate must be > 0"):
        arrivals(3, 0.0)


def test_slo_parses_units_and_refuses_what_it_does_not_know():
    slo = Slo.parse("ttft=2s, tpot=100ms,e2el=30")
    assert (slo.ttft, slo.tpot, slo.itl, slo.e2el) == (2.0, pytest.approx(0.1), None, 30.0)
    assert str(slo) == "ttft=2s,tpot=100ms,e2el=30s"
    for bad in ("ttft=fast", "latency=2s", "ttft"):
        with pytest.raises(ValueError, match="NAME=VALUE"):
            Slo.parse(bad)


def _record(sent, chunks, end, tokens, status="ok"):
    return Record(sent=sent, status=status, chunk_times=list(chunks), end=end, prompt_tokens=10,
                  output_tokens=tokens, cached_tokens=4)


def test_the_summary_follows_vllms_definitions():
    records = [_record(0.0, [0.5, 0.6, 0.8], 1.0, 5),        # ttft 0.5, tpot (1.0-0.5)/4, itl 0.1 0.2
               _record(1.0, [3.0, 3.5], 4.0, 3),             # ttft 2.0, tpot 0.5, itl 0.5
               _record(2.0, [], 2.1, 0, status="503"),
               _record(2.5, [], 3.0, 0, status="timeout")]
    s = summarize(records, Slo.parse("ttft=1s"))
    assert (s.requests, s.completed, s.errors) == (4, 2, {"503": 1, "timeout": 1})
    assert s.duration_s == 4.0 and s.request_throughput == 0.5
    assert (s.input_tokens, s.output_tokens, s.output_throughput) == (20, 8, 2.0)
    assert s.cached_fraction == pytest.approx(8 / 20)
    assert s.latency["ttft"]["mean"] == pytest.approx(1.25) and s.latency["ttft"]["p50"] == pytest.approx(1.25)
    assert s.latency["tpot"]["p50"] == pytest.approx((0.125 + 0.5) / 2)
    assert sorted(records[0].itls + records[1].itls) == pytest.approx([0.1, 0.2, 0.5])
    assert s.latency["itl"]["p50"] == pytest.approx(0.2) and s.latency["e2el"]["p99"] == pytest.approx(2.98)
    assert s.goodput == pytest.approx(1 / 4.0)  # only the first met ttft <= 1 s
    assert summarize(records).goodput is None
    assert math.isnan(percentile([], 50)) and percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)


def test_several_slos_score_the_same_records_each():
    records = [_record(0.0, [0.5, 0.6, 0.8], 1.0, 5),        # ttft 0.5, tpot 0.125
               _record(1.0, [3.0, 3.5], 4.0, 3)]             # ttft 2.0, tpot 0.5
    first, *more = parse_slos("ttft=3s;ttft=3s,tpot=200ms; ttft=1s")
    s = summarize(records, first, tuple(more))
    assert s.goodput == pytest.approx(2 / 4.0)
    assert s.more_goodput == (("ttft=3s,tpot=200ms", pytest.approx(1 / 4.0)), ("ttft=1s", pytest.approx(1 / 4.0)))
    goodput_rows = [(r["slo"], r["value"]) for r in report_rows(s, system="x") if r["metric"] == "goodput"]
    assert goodput_rows == [("ttft=3s", 0.5), ("ttft=3s,tpot=200ms", 0.25), ("ttft=1s", 0.25)]
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_slos("ttft=3s;tpot")


def test_an_itl_bound_looks_at_the_largest_gap():
    r = _record(0.0, [0.1, 0.2, 1.5], 1.6, 3)
    assert not Slo.parse("itl=1s").met(r) and Slo.parse("itl=1.5s").met(r)


def test_workloads_are_seeded_and_shaped_as_their_names_say():
    for name in ("random", "shared-prefix", "multiturn", "rag", "mixed"):
        a, b = workloads.make(name, 24, seed=1, max_tokens=8), workloads.make(name, 24, seed=1, max_tokens=8)
        assert [r.messages for r in a] == [r.messages for r in b] and len(a) == 24
        assert [r.messages for r in a] != [r.messages for r in workloads.make(name, 24, seed=2, max_tokens=8)]
    # another level (variant): the shared parts stay, every request's own part changes
    level2 = workloads.make("rag", 24, seed=1, max_tokens=8, variant=1)
    first = workloads.make("rag", 24, seed=1, max_tokens=8)
    assert {d for r in level2 for d in r.documents} == {d for r in first for d in r.documents}
    assert not {r.messages[-1]["content"] for r in level2} & {r.messages[-1]["content"] for r in first}
    shared = workloads.make("shared-prefix", 40, seed=1, max_tokens=8)
    systems = {r.messages[0]["content"] for r in shared}
    assert len(systems) == 4 and all(len(s.split()) > 300 for s in systems)
    chat = workloads.make("multiturn", 20, seed=1, max_tokens=8)
    assert [r.session for r in chat[:8]] == [f"v0s{i}" for i in range(8)] and chat[8].tags["turn"] == 1
    wide = workloads.make("multiturn", 20, seed=1, max_tokens=8, sessions=5)
    assert len({r.session for r in wide}) == 5 and [r.tags["turn"] for r in wide[::5]] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="multiturn workload only"):
        workloads.make("rag", 4, seed=1, max_tokens=8, sessions=2)
    docs = workloads.make("rag", 50, seed=1, max_tokens=8)
    assert all(len(r.documents) == 3 for r in docs)
    orders = {tuple(r.tags["documents"]) for r in docs}
    assert any(tuple(reversed(o)) in orders or sorted(o) != list(o) for o in orders)  # varying orders
    inlined = workloads.inline_documents(docs[0].messages, docs[0].documents)
    assert inlined[-1]["content"] == "".join(f"{d}\n\n" for d in docs[0].documents) + docs[0].messages[-1]["content"]
    with pytest.raises(ValueError, match="unknown workload"):
        workloads.make("nope", 1, seed=0, max_tokens=1)
    mixed = workloads.make("mixed", 24, seed=1, max_tokens=8)
    assert [r.tags["class"] for r in mixed[:8]] == ["short"] * 7 + ["long"]
    assert all(len(r.messages[0]["content"].split()) > 3000 for r in mixed if r.tags["class"] == "long")
    assert all(len(r.messages[0]["content"].split()) <= 40 for r in mixed if r.tags["class"] == "short")
    assert len({r.messages[0]["content"][:200] for r in mixed}) == 24  # no shared prefix


def test_a_mooncake_trace_replays_its_times_lengths_and_shared_prefixes(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in (
        {"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [1, 2]},
        {"timestamp": 1500, "input_length": 500, "output_length": 900, "hash_ids": [1, 3]},
        {"timestamp": 700, "input_length": 50, "output_length": 5, "session_id": 7})) + "\n")
    rows = workloads.read_trace(trace, max_tokens_cap=512, block_words=400)
    assert [r.arrival for r in rows] == [0.0, 0.7, 1.5] and [r.max_tokens for r in rows] == [20, 5, 512]
    first, third = rows[0].messages[0]["content"].split(), rows[2].messages[0]["content"].split()
    assert len(first) == 600 and len(third) == 500 and first[:400] == third[:400] and first[400:] != third[400:500]
    assert rows[1].session == "7"
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a Mooncake trace row"):
        workloads.read_trace(tmp_path / "bad.jsonl")


class Scripted:
    """An httpx transport that answers every chat completion with `chunks` SSE chunks, advancing
    the fake clock by `gap` before each, and records every body."""

    def __init__(self, clock: FakeClock, chunks: int = 4, gap: float = 0.1, shed: bool = False) -> None:
        self.clock, self.chunks, self.gap, self.shed = clock, chunks, gap, shed
        self.bodies: list[dict] = []

    async def _sse(self):
        for i in range(self.chunks):
            self.clock.advance(self.gap)
            yield f'data: {json.dumps({"choices": [{"index": 0, "delta": {"content": f" w{i}"}}]})}\n\n'.encode()
        usage = {"prompt_tokens": 7, "completion_tokens": self.chunks, "prompt_tokens_details": {"cached_tokens": 3}}
        yield f'data: {json.dumps({"choices": [], "usage": usage})}\n\ndata: [DONE]\n\n'.encode()

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(json.loads(request.content))
        if self.shed:
            return httpx.Response(503, headers={"retry-after": "2"}, json={"error": {"message": "full"}})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self._sse())


async def _run(transport, requests, **kw):
    async with httpx.AsyncClient(transport=httpx.MockTransport(transport)) as client:
        return await run_level(Target("http://x/v1", "m", documents=kw.pop("documents", False)), requests,
                               clock=transport.clock, client=client, **kw)


async def test_the_runner_times_each_stream_on_its_clock():
    clock = FakeClock(0.0)
    script = Scripted(clock, chunks=4, gap=0.1)
    records = await _run(script, workloads.make("random", 3, seed=0, max_tokens=4), concurrency=1)
    assert len(records) == 3 and all(r.ok for r in records)
    assert [r.ttft for r in records] == pytest.approx([0.1] * 3)
    assert all(r.itls == pytest.approx([0.1] * 3) and r.tpot == pytest.approx(0.1) for r in records)
    assert [(r.prompt_tokens, r.output_tokens, r.cached_tokens) for r in records] == [(7, 4, 3)] * 3
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"]
               and b["max_tokens"] == 4 for b in script.bodies)


async def test_records_carry_their_request_tags_so_a_class_can_be_summarized_alone():
    records = await _run(Scripted(FakeClock(0.0), chunks=2), workloads.make("mixed", 16, seed=0, max_tokens=2),
                         concurrency=1)
    assert sorted(r.tags["class"] for r in records) == ["long"] * 2 + ["short"] * 14
    short = summarize([r for r in records if r.tags["class"] == "short"])
    assert short.requests == 14 and short.completed == 14


async def test_shed_requests_are_counted_by_status_with_their_retry_after():
    script = Scripted(FakeClock(0.0), shed=True)
    records = await _run(script, workloads.make("random", 5, seed=0, max_tokens=4), concurrency=2)
    assert summarize(records).errors == {"503": 5} and {r.retry_after for r in records} == {"2"}
    assert summarize(records).retry_after == 5
    assert {"metric": "errors_with_retry_after", "value": 5, "unit": "requests"} in report_rows(summarize(records))


async def test_a_session_resends_its_conversation_with_the_real_answers():
    script = Scripted(FakeClock(0.0), chunks=2)
    chat = workloads.make("multiturn", 16, seed=0, max_tokens=2)  # 8 sessions, 2 turns each
    await _run(script, chat, concurrency=4)
    second = [b for b in script.bodies if len(b["messages"]) > 1]
    assert len(second) == 8
    assert all([m["role"] for m in b["messages"]] == ["user", "assistant", "user"] and
               b["messages"][1]["content"] == " w0 w1" for b in second)


async def test_rag_documents_go_in_the_extension_or_inline():
    docs = workloads.make("rag", 2, seed=0, max_tokens=2)
    for extension in (True, False):
        script = Scripted(FakeClock(0.0), chunks=1)
        await _run(script, docs, concurrency=1, documents=extension)
        for b, r in zip(script.bodies, docs):
            assert b == body(Target("http://x/v1", "m", documents=extension), r, r.messages)
            assert ("documents" in b) == extension
            assert (b["messages"][-1]["content"].startswith(r.documents[0])) != extension


@pytest.mark.parametrize("text, expected", [
    ('# TYPE kvmesh_gateway_tokens counter\nkvmesh_gateway_tokens_total{kind="prompt"} 1000.0\n'
     'kvmesh_gateway_tokens_total{kind="cached"} 640.0\nkvmesh_gateway_tokens_total{kind="completion"} 9.0\n',
     (640.0, 1000.0)),
    ('# TYPE vllm:prefix_cache_hits counter\nvllm:prefix_cache_hits_total{model_name="m"} 30.0\n'
     '# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{model_name="m"} 120.0\n',
     (30.0, 120.0)),
    ("# TYPE llamacpp:prompt_tokens counter\nllamacpp:prompt_tokens_total 77.0\n", None),
])
async def test_kv_hits_are_read_from_the_metrics_servers_export(text, expected):
    from kvmesh.loadtest.harness.runner import scrape_hits

    seen = []

    def metrics(request):
        seen.append(request.url.path)
        return httpx.Response(200, text=text)

    async with httpx.AsyncClient(transport=httpx.MockTransport(metrics)) as client:
        assert await scrape_hits("http://x:1/v1", client) == expected
    assert seen == ["/metrics"]


def _loadtest_args(*argv):
    import argparse

    from kvmesh.loadtest.harness import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    return parser.parse_args(["loadtest", *argv])


def test_repeats_rerun_the_sweep_with_new_seeds_and_report_each_peaks_spread(tmp_path, monkeypatch):
    """--repeats 3 runs every level three times, repeat r seeded --seed + r; its rows carry the
    repeat, and the peak-goodput rows are the min/median/max of each repeat's best level."""
    import asyncio
    import threading

    from kvmesh.loadtest.harness import cli, stub

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(stub.serve(0))
    port = server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    seeds = []
    make = cli.workloads.make
    monkeypatch.setattr(cli.workloads, "make", lambda *a, **kw: seeds.append(kw["seed"]) or make(*a, **kw))
    out = tmp_path / "rows.json"
    try:
        args = _loadtest_args("--target", f"stub=http://127.0.0.1:{port}/v1", "--rate", "200,400",
                              "--num-requests", "4", "--max-tokens", "2", "--slo", "ttft=30s", "--warmup", "0",
                              "--seed", "7", "--repeats", "3", "--json", str(out), "--plot", str(tmp_path / "p.png"))
        assert cli.run(args) == 0
    finally:
        loop.call_soon_threadsafe(server.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    assert sorted(set(seeds[1:])) == [7, 8, 9]  # after the up-front check: each repeat's own seed
    data = json.loads(out.read_text())
    goodput = [r for r in data if r["metric"] == "goodput"]
    assert sorted((r["repeat"], r["rate"]) for r in goodput) == [(r, v) for r in range(3) for v in (200.0, 400.0)]
    best = sorted(max(r["value"] for r in goodput if r["repeat"] == k) for k in range(3))
    peaks = {r["metric"]: r for r in data if r["metric"].startswith("peak_goodput_")}
    assert [peaks[f"peak_goodput_{s}"]["value"] for s in ("min", "median", "max")] == best
    assert peaks["peak_goodput_median"]["system"] == "stub" and peaks["peak_goodput_median"]["repeats"] == 3
    assert (tmp_path / "p.png").stat().st_size > 0  # one line per system and repeat


def test_repeats_below_one_are_refused_with_the_flag_named():
    from kvmesh.loadtest.harness import cli

    with pytest.raises(SystemExit, match="--repeats must be at least 1"):
        cli.run(_loadtest_args("--rate", "1", "--repeats", "0"))
