"""KV copies between host memory and a CUDA device on a stream of their own, through pinned buffers.

On CUDA the engine's step loop keeps the GPU busy on the default (compute) stream; a KV transfer
there would queue behind the steps already launched and hold up those launched after it. So:
  * imports: a fetched payload (decoded on the host) is copied to the device when the request is
    admitted (`to_device`), from pinned memory on the copy stream, while the engine computes the
    steps before the one that writes it into the paged blocks; that step's compute stream waits on
    the copy's event, not the host (`ready`);
  * exports: the step loop gathers a chunk's KV out of the paged blocks on the compute stream and
    queues its copy into pinned host memory on the copy stream (`to_host`), which returns at once;
    the export thread waits for that copy alone before encoding.
Off CUDA every call passes the tensors through (the host is the device).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class StagedKv:
    """An imported payload on its way to the device: ``k``, ``v`` are device tensors whose copy
    is in flight on the copy stream until ``copied`` completes (wait with `KvCopies.ready`)."""

    k: torch.Tensor
    v: torch.Tensor
    copied: torch.cuda.Event
    host: tuple[torch.Tensor, torch.Tensor]
    """The pinned sources, kept alive until the copy is done."""


class KvCopies:
    """Host <-> device KV copies of one engine on a dedicated CUDA stream (none off CUDA)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.staged = 0
        """Payloads copied to the device ahead of their step."""
        self.exported = 0
        """Exports copied to the host on the copy stream."""

    def to_device(self, payload):
        """Starts copying an imported payload (k, v on the host) to the device; returns a StagedKv,
        or the payload as it is off CUDA or when it is already on the device."""
        k, v = payload
        if self.stream is None or k.device.type != "cpu":
            return payload
        host = tuple(t if t.is_pinned() else t.pin_memory() for t in (k, v))
        with torch.cuda.stream(self.stream):
            dk, dv = (t.to(self.device, non_blocking=True) for t in host)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self.staged += 1
        return StagedKv(dk, dv, copied, host)

    def ready(self, payload) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of a payload, usable on the current stream: a StagedKv's copy is waited for by the
        stream (not the host), and its tensors are marked as used there for the allocator."""
        if not isinstance(payload, StagedKv):
            return payload
        current = torch.cuda.current_stream(self.device)
        current.wait_event(payload.copied)
        payload.k.record_stream(current)
        payload.v.record_stream(current)
        return payload.k, payload.v

    def to_host(self, k: torch.Tensor, v: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, Optional[Callable[[], None]]]:
        """Host copies of device tensors computed on the current stream: (k, v, wait), where
        ``wait()`` blocks until the copy is done (None when nothing is in flight)."""
        if self.stream is None or k.device.type == "cpu":
            return k, v, None
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(computed)
            hk = torch.empty(k.shape, dtype=k.dtype, pin_memory=True)
            hv = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
            hk.copy_(k, non_blocking=True)
            hv.copy_(v, non_blocking=True)
            k.record_stream(self.stream)
            v.record_stream(self.stream)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        self.exported += 1
        return hk, hv, copied.synchronize
