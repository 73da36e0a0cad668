"""The machine rows of `kvmesh bench engine` (kvmesh.loadtest.machine): the CPU read from
/proc/cpuinfo, matmul speeds computed from the probe's own timings, and the header line."""
from __future__ import annotations

import itertools

import pytest
import torch

from kvmesh.loadtest.machine import cpu_info, describe, machine_rows, matmul_gflops

CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu sse2 avx512f avx512_bf16 amx_tile amx_bf16
processor\t: 1
model name\t: something else
flags\t\t: fpu
"""


def test_cpu_info_reads_the_first_processor(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO)
    assert cpu_info(f) == ("Intel(R) Xeon(R) Platinum 8480C", ("avx512f", "avx512_bf16", "amx_bf16"))


def test_cpu_info_without_the_file(tmp_path):
    assert cpu_info(tmp_path / "absent") == ("unknown", ())


def test_matmul_gflops_is_the_flops_over_the_median_time():
    # each call of the clock advances 0.25 s, so each timed matmul takes 0.25 s (warm-ups untimed)
    ticks = itertools.count()
    clock = lambda: next(ticks) * 0.25  # noqa: E731
    got = matmul_gflops(torch.float32, 1, repeats=3, shape=(64, 32, 16), clock=clock)
    assert got == pytest.approx(2 * 64 * 32 * 16 / 0.25 / 1e9)


def test_machine_rows_and_their_line(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text(CPUINFO)
    rows = machine_rows(1, repeats=1, cpuinfo=f)
    by = {r["metric"]: r for r in rows}
    assert set(by) == {"fp32_matmul_gflops", "bf16_matmul_gflops", "bf16_vs_fp32_matmul"}
    assert all(r["system"] == "machine" and r["threads"] == 1 and r["when"] == "start" for r in rows)
    assert all(r["cpu"] == "Intel(R) Xeon(R) Platinum 8480C" for r in rows)
    assert by["fp32_matmul_gflops"]["value"] > 0 and by["bf16_matmul_gflops"]["value"] > 0
    assert by["bf16_vs_fp32_matmul"]["value"] == pytest.approx(
        by["bf16_matmul_gflops"]["value"] / by["fp32_matmul_gflops"]["value"])
    line = describe([*rows, {"system": "hf", "metric": "ttft_s", "value": 1.0, "unit": "s"}])
    assert line.startswith("machine: Intel(R) Xeon(R) Platinum 8480C (avx512f+avx512_bf16+amx_bf16), 1 threads; start: ")
    assert f"({by['bf16_vs_fp32_matmul']['value']:.2f}x)" in line and "end:" not in line
    assert describe([]) == "machine: not measured"


def test_describe_names_the_start_and_the_end():
    def rows(when, fp32, bf16):
        p = {"system": "machine", "cpu": "X", "flags": "none", "threads": 2, "when": when}
        return [{**p, "metric": "fp32_matmul_gflops", "value": fp32, "unit": "GFLOP/s"},
                {**p, "metric": "bf16_matmul_gflops", "value": bf16, "unit": "GFLOP/s"},
                {**p, "metric": "bf16_vs_fp32_matmul", "value": bf16 / fp32, "unit": "x"}]

    line = describe(rows("start", 240.0, 940.0) + rows("end", 300.0, 2100.0))
    assert line == ("machine: X (none), 2 threads; start: fp32 matmul 240 GFLOP/s, bf16 940 (3.92x); "
                    "end: fp32 matmul 300 GFLOP/s, bf16 2100 (7.00x)")
