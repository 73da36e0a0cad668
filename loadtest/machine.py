"""The machine a CPU benchmark ran on, measured in the same run: what its CPU is and how fast its
dense matmuls go, so that rows from different machines can be read side by side.

NOTE (why). The engine benchmark's targets are ratios within one run, and those ratios move with
the machine, not only with kvmesh: the default's exact prefill runs on the AMX tile unit (five
bf16 products per fp32 product) while HF's runs MKL's fp32, so its TTFT ratio follows the
machine's bf16-to-fp32 matmul speed. On the 2-core Xeon VM of this project's runs that speed is
not even constant: the same probe gave bf16 ~940 and fp32 ~240 GFLOP/s (3.9x) at one hour and
2,173 and 298 (7.3x) an hour later, with nothing else running. So the rows are measured twice,
before any service starts (``when=start``) and after the last column (``when=end``), and the
table's header names both.
The speeds are torch's own matmuls (MKL for fp32, oneDNN for bf16) at one prefill shape (a
2,048-token chunk times SmolLM2's gate/up width), at the threads the benchmark gives kvmesh,
median of `repeats`.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

from kvmesh.loadtest.report import row

SHAPE = (2048, 576, 1536)
"""rows x inner x outputs of the probe matmul: a 2,048-token prefill chunk of SmolLM2-135M."""

FLAGS = ("avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_info(cpuinfo: Path = Path("/proc/cpuinfo")) -> tuple[str, tuple[str, ...]]:
    """(the CPU's model name, which of FLAGS it has); ("unknown", ()) where /proc/cpuinfo is not
    there (not Linux) or names neither."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "unknown", ()
    name, flags = "unknown", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and name == "unknown":
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, tuple(f for f in FLAGS if f in flags)


def matmul_gflops(dtype, threads: int, repeats: int = 7, shape: tuple[int, int, int] = SHAPE,
                  clock=time.perf_counter) -> float:
    """GFLOP/s of torch's [M, K] @ [K, N] in `dtype` at `threads`, median of `repeats` after
    two warm-up calls (the caller's thread count is restored)."""
    import torch

    from kvmesh.threads import torch_threads

    m, k, n = shape
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    with torch_threads(threads):
        for _ in range(2):
            a @ b
        times = []
        for _ in range(repeats):
            t0 = clock()
            a @ b
            times.append(clock() - t0)
    return 2.0 * m * k * n / statistics.median(times) / 1e9


def machine_rows(threads: int, repeats: int = 7, cpuinfo: Path = Path("/proc/cpuinfo"), when: str = "start") -> list[dict]:
    """Rows of system "machine": fp32 and bf16 matmul GFLOP/s and their ratio, each with the
    CPU's name, the FLAGS it has, the threads and `when` (start, end) as params."""
    import torch

    name, flags = cpu_info(cpuinfo)
    params = {"system": "machine", "cpu": name, "flags": "+".join(flags) or "none", "threads": threads,
              "when": when}
    fp32 = matmul_gflops(torch.float32, threads, repeats)
    bf16 = matmul_gflops(torch.bfloat16, threads, repeats)
    return [row("fp32_matmul_gflops", fp32, "GFLOP/s", **params),
            row("bf16_matmul_gflops", bf16, "GFLOP/s", **params),
            row("bf16_vs_fp32_matmul", bf16 / fp32, "x", **params)]


def describe(rows: list[dict]) -> str:
    """The machine rows in words, one line (the CPU, then each measurement: start, end)."""
    machine = [r for r in rows if r.get("system") == "machine"]
    if not machine:
        return "machine: not measured"
    first = machine[0]
    parts = [f"machine: {first['cpu']} ({first['flags']}), {first['threads']} threads"]
    for when in dict.fromkeys(r.get("when", "start") for r in machine):
        got = {r["metric"]: r["value"] for r in machine if r.get("when", "start") == when}
        parts.append(f"{when}: fp32 matmul {got.get('fp32_matmul_gflops', float('nan')):.0f} GFLOP/s, "
                     f"bf16 {got.get('bf16_matmul_gflops', float('nan')):.0f} "
                     f"({got.get('bf16_vs_fp32_matmul', float('nan')):.2f}x)")
    return "; ".join(parts)
