"""The one place that sizes torch's intra-op thread pool. Importing it does not import torch (the
router and the gateway never load torch).

NOTE (why one place). On a small shared CPU, torch running more threads than there are cores
slows it 10-50x, and "every core" must mean the cores this process may run on (its affinity
mask, as a container or `taskset` sets it), not the machine's. `set_torch_threads` applies that
rule; `torch_threads` holds a count for a block (a helper that must not compete with the
engine's step loop) and restores the caller's afterwards.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def set_torch_threads(n: int) -> int:
    """Size torch's intra-op pool to `n` threads (0: `usable_cores()`); returns the count set.
    It also sizes the calling thread's OpenMP team: call it on the thread that runs the work."""
    import torch

    count = n or usable_cores()
    torch.set_num_threads(count)
    return count


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the block with `n` torch threads (0: `usable_cores()`), then restore the count the
    thread had."""
    import torch

    before = torch.get_num_threads()
    try:
        yield set_torch_threads(n)
    finally:
        torch.set_num_threads(before)
