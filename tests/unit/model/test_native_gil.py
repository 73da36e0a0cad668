"""The native kernels release the GIL while they run (kvmesh.model.native, NOTE (the GIL)): the
engine's event-loop thread (probes, health, streamed tokens) keeps running during a fused decode
step or a prefill matmul, as it does during torch's own ops.

The check counts events, not time: with the interpreter's switch interval set to 1,000 s, a
thread that holds the GIL keeps it until it blocks or releases it. A worker calls the kernel 20
times, counting the calls it finished; the main thread waits for the worker to start, then reads
the count as soon as it has the GIL again. If a call releases the GIL, that is during the first
calls (count < 20); if none does, only after the worker's last call (count 20). The worker keeps
every result: torch releases the GIL while it frees a large tensor, which would let the main
thread in between two calls."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from kvmesh.model import fused_rows
from kvmesh.model.gguf_native import gguf_ops
from kvmesh.model.native import linear_rows_kernel

CALLS = 20


def releases_gil(call) -> bool:
    """Whether the main thread ran Python while a worker was still making its CALLS calls."""
    done = 0
    started = threading.Event()
    kept = []  # every result stays alive: freeing a large tensor can release the GIL itself

    def worker():
        nonlocal done
        started.set()
        for _ in range(CALLS):
            kept.append(call())
            done += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        t = threading.Thread(target=worker)
        t.start()
        started.wait()  # blocks: the worker takes the GIL and runs
        seen = done  # the main thread has the GIL again
        t.join()
    finally:
        sys.setswitchinterval(old)
    return seen < CALLS


def test_the_check_sees_a_call_that_keeps_the_gil():
    # Pure Python never releases the GIL without a switch request: the check must say so, or it
    # could not tell a kernel that keeps the GIL from one that releases it.
    assert not releases_gil(lambda: sum(range(20000)))
    assert releases_gil(lambda: torch.mm(torch.ones(256, 256), torch.ones(256, 256)))  # torch's own op


@pytest.mark.skipif(gguf_ops() is None, reason="the GGUF kernels could not be built here")
def test_gguf_kernels_release_the_gil():
    ops = gguf_ops()
    blocks = torch.randint(0, 256, (1024, 34 * 32), dtype=torch.uint8)  # Q8_0: 1,024 rows of 1,024
    blocks[:, 0::34], blocks[:, 1::34] = 0x00, 0x3C  # every block's fp16 d = 1.0 (little-endian 0x3C00)
    x = torch.randn(4, 1024)
    assert releases_gil(lambda: ops.gguf_mm(x, [blocks], [8]))
    assert releases_gil(lambda: ops.gguf_dequant(blocks, 8, 1024))


@pytest.mark.skipif(linear_rows_kernel() is None, reason="the native kernels could not be built here")
def test_native_kernels_release_the_gil():
    linear_rows = linear_rows_kernel()
    x, w = torch.randn(4, 1024), torch.randn(2048, 1024)
    assert releases_gil(lambda: linear_rows(x, w))


@pytest.mark.skipif(fused_rows._ops() is None, reason="the fused row kernels could not be built here")
def test_fused_row_kernels_release_the_gil():
    x, w = torch.randn(1024, 576), torch.ones(576)
    assert releases_gil(lambda: fused_rows._ops().rms_norm(x, w, 1e-5))
