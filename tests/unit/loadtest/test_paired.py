"""`kvmesh bench engine`'s paired rows (loadtest/paired.py): requests of kvmesh and its peer
(llama.cpp for decode, HF for the time to first token) in alternation, the order within a pair
swapped every pair, and the rows built from the per-pair ratios. Two tests run the real systems
for two pairs (the llama.cpp one skipped without llama-cpp-python)."""
from __future__ import annotations

import asyncio
import importlib.util

import pytest

from kvmesh.loadtest import engine_bench as eb
from kvmesh.loadtest import paired as pd


def test_pairs_alternate_which_system_goes_first():
    calls = []

    async def ours(i):
        calls.append(("kvmesh", i))
        return 100.0 + i

    def theirs(i):
        calls.append(("llamacpp", i))
        return 50.0 + i

    a, b = asyncio.run(pd.alternate(4, ours, theirs))
    assert calls == [("kvmesh", 0), ("llamacpp", 0), ("llamacpp", 1), ("kvmesh", 1),
                     ("kvmesh", 2), ("llamacpp", 2), ("llamacpp", 3), ("kvmesh", 3)]
    assert a == [100.0, 101.0, 102.0, 103.0] and b == [50.0, 51.0, 52.0, 53.0]  # in pair order


def test_rows_are_the_per_pair_ratios_spread_and_each_systems_median():
    ours, theirs = [100.0, 90.0, 120.0], [50.0, 100.0, 60.0]  # ratios 2.0, 0.9, 2.0
    rows = {(r["system"], r["metric"]): r for r in pd.paired_rows(ours, theirs)}
    assert rows[("kvmesh", "decode_tok_s_paired")]["value"] == 100.0
    assert rows[("llamacpp", "decode_tok_s_paired")]["value"] == 60.0
    assert rows[("kvmesh", "decode_vs_llamacpp_paired")]["value"] == 2.0  # not 100 / 60
    assert rows[("kvmesh", "decode_vs_llamacpp_paired_min")]["value"] == 0.9
    assert rows[("kvmesh", "decode_vs_llamacpp_paired_max")]["value"] == 2.0
    assert {r["unit"] for r in rows.values()} == {"tok/s", "x"}
    assert all(r["pairs"] == 3 and r["concurrency"] == 1 for r in rows.values())


def test_rates_that_do_not_pair_up_are_refused():
    with pytest.raises(ValueError, match="one of each system per pair, got 2 and 1"):
        pd.paired_rows([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="got 0 and 0"):
        pd.paired_rows([], [])


def test_ttft_rows_count_how_many_times_faster_from_times():
    ours, theirs = [1.0, 2.0, 1.5], [2.0, 2.0, 4.5]  # seconds: 2x, 1x, 3x faster
    rows = {(r["system"], r["metric"]): r for r in pd.paired_rows(
        ours, theirs, peer="hf", kind="ttft", unit="s", faster_is_lower=True, prompt_tokens=2048)}
    assert rows[("kvmesh", "ttft_s_paired")]["value"] == 1.5
    assert rows[("hf", "ttft_s_paired")]["value"] == 2.0
    assert rows[("kvmesh", "ttft_vs_hf_paired")]["value"] == 2.0  # median of 2, 1, 3; not 2.0 / 1.5
    assert rows[("kvmesh", "ttft_vs_hf_paired_min")]["value"] == 1.0
    assert rows[("kvmesh", "ttft_vs_hf_paired_max")]["value"] == 3.0
    assert {r["unit"] for r in rows.values()} == {"s", "x"}
    assert all(r["prompt_tokens"] == 2048 and r["pairs"] == 3 and "concurrency" not in r for r in rows.values())


def test_one_real_ttft_pair_against_hf_on_the_bundled_model():
    pytest.importorskip("transformers")
    from kvmesh.loadtest.models import bench_model
    from kvmesh.model.loader import load_tokenizer

    plan = eb.Plan(decode_prompt=8, decode_tokens=4, ttft_prompts=(8, 24), repeats=1, concurrency=(1,),
                   conc_prompt=8, conc_tokens=4)
    rows = pd.bench_paired_ttft(plan, eb.Prompts(load_tokenizer("bundled")), bench_model("bundled").engine_args(),
                                "bundled", pairs=2)
    got = {(r["system"], r["metric"]): r for r in rows}
    assert got[("kvmesh", "ttft_s_paired")]["value"] > 0 and got[("hf", "ttft_s_paired")]["value"] > 0
    assert all(r["prompt_tokens"] == 24 and r["pairs"] == 2 for r in rows)  # the longest TTFT prompt
    lo, mid, hi = (got[("kvmesh", f"ttft_vs_hf_paired{s}")]["value"] for s in ("_min", "", "_max"))
    assert 0 < lo <= mid <= hi


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed (bash scripts/build-llamacpp.sh)")
def test_one_real_pair_on_the_bundled_gguf():
    from kvmesh.loadtest.models import bench_model
    from kvmesh.model.loader import load_tokenizer

    plan = eb.Plan(decode_prompt=8, decode_tokens=6, ttft_prompts=(8,), repeats=1, concurrency=(1,),
                   conc_prompt=8, conc_tokens=4)
    rows = pd.bench_paired_decode(plan, eb.Prompts(load_tokenizer("bundled")), bench_model("bundled").engine_args(),
                                  eb.gguf_file("bundled"), pairs=2)
    got = {(r["system"], r["metric"]): r["value"] for r in rows}
    ours, theirs = got[("kvmesh", "decode_tok_s_paired")], got[("llamacpp", "decode_tok_s_paired")]
    assert ours > 0 and theirs > 0
    lo, mid, hi = (got[("kvmesh", f"decode_vs_llamacpp_paired{s}")] for s in ("_min", "", "_max"))
    assert 0 < lo <= mid <= hi
