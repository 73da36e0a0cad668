"""Decode steps as CUDA graphs: one captured forward per batch size, replayed with new inputs.

A decode step of a small model is hundreds of kernel launches of a few microseconds each (SmolLM2-
135M: 30 layers of norms, three matmuls, RoPE, the KV write, attention and the MLP). Launched one by
one from Python, the step costs what the launches cost, not what the GPU does. Captured once into a
CUDA graph, the whole step is one launch (vLLM and SGLang capture their decode steps the same way).

A graph replays fixed addresses and shapes, so everything a step varies lives in one static device
buffer that each step overwrites before the replay (one host-to-device copy from a pinned buffer):
per row, its token id, position, KV slot, context length and block-table row. A step of n
sequences replays the graph of the smallest captured batch size >= n; the extra rows are padding
that writes its KV into a scratch block no sequence owns (the runner allocates one block more than
the block manager hands out) and attends to one key there. Attention is the Triton kernel that
reads the block table in place (kvmesh.gpu.paged_attention) with a fixed upper bound of the
context, so the capture needs no device-to-host read of the lengths.

The same code runs eagerly on any device (no capture where there is no CUDA): the tests compare it
on CPU, with Triton's interpreter, against the engine's own paged forward.
"""
from __future__ import annotations

import torch

from kvmesh.gpu.paged_attention import paged_decode_attention
from kvmesh.model.attention import KVCache, write_kv
from kvmesh.model.llama import LlamaForCausalLM

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
"""Batch sizes captured by default (capped at the engine's --max-num-seqs)."""

_ID, _POS, _SLOT, _LEN, _TABLE = 0, 1, 2, 3, 4
"""Columns of the static input buffer; the block-table row starts at _TABLE."""


def graph_batch_sizes(max_num_seqs: int, sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> tuple[int, ...]:
    """The captured sizes for an engine running at most ``max_num_seqs`` sequences: those below it, and
    ``max_num_seqs`` itself, so any decode batch has a graph."""
    return tuple(sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs}))


def supports(model: LlamaForCausalLM) -> str | None:
    """Why ``model``'s decode steps cannot be replayed as graphs, or None when they can."""
    cfg = model.config
    if any(cfg.window_of(i) is not None for i in range(cfg.num_layers)):
        return "a sliding-window layer (the Triton decode kernel attends to the whole context)"
    return None


def decode_forward(model: LlamaForCausalLM, kv_caches: KVCache, input_ids: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   max_seq_len: int) -> torch.Tensor:
    """One decode step of ``model`` over its paged KV, every op a device op (nothing reads a
    tensor back to the host, so it can be captured): input_ids, positions, slots (flat KV slot of
    each new token), seq_lens [B] and block_tables [B, W] (W * block_size >= max_seq_len >= every
    seq_len) -> float32 logits [B, vocab]. Each layer runs LlamaDecoderLayer's own halves around
    its attention, so the arithmetic is the eager forward's but for the attention kernel."""
    h = model.model.embed_tokens(input_ids)  # [B, hidden]
    cos, sin = model.rotary(positions, h.dtype)
    for layer, (k_cache, v_cache) in zip(model.model.layers, kv_caches):
        q, k, v = layer.attention_inputs(h, cos, sin)  # q [B, heads, hd], k/v [B, kv_heads, hd]
        write_kv(k, v, k_cache, v_cache, slots)
        o = paged_decode_attention(q[:, None], k_cache, v_cache, block_tables, seq_lens, layer.self_attn.scale,
                                   max_seq_len=max_seq_len)[:, 0]
        h = layer.attention_outputs(h, o.reshape(h.shape[0], -1))
    return model.compute_logits(model.model.norm(h))


class DecodeGraphs:
    """Decode steps of one model over one paged KV pool, replayed as CUDA graphs per batch size.

    ``scratch_block``: a block of the pool no sequence is given (padding rows write there);
    ``max_blocks``: block-table width, the most blocks a sequence can hold (max model length /
    block size, rounded up). ``capture()`` records the graphs (CUDA only); until then, and on other
    devices, ``run`` computes the same step eagerly on the same buffers.
    """

    def __init__(self, model: LlamaForCausalLM, kv_caches: KVCache, *, scratch_block: int, max_blocks: int,
                 batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> None:
        why = supports(model)
        if why is not None:
            raise ValueError(f"decode graphs do not support this model: {why}")
        if not batch_sizes or min(batch_sizes) < 1:
            raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
        self.model = model
        self.kv_caches = kv_caches
        k0 = kv_caches[0][0]
        self.device = k0.device
        self.block_size = k0.shape[1]
        if not 0 <= scratch_block < k0.shape[0]:
            raise ValueError(f"scratch block {scratch_block} is not in the pool of {k0.shape[0]} blocks")
        self.scratch_block = scratch_block
        self.max_blocks = max_blocks
        self.max_seq_len = max_blocks * self.block_size
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_batch = self.batch_sizes[-1]
        cols = _TABLE + max_blocks
        pin = self.device.type == "cuda"
        # a padding row: token 0 at position 0, KV into the scratch block's slot 0, one key of
        # context, every table entry the scratch block
        self._pad = [0, 0, scratch_block * self.block_size, 1] + [scratch_block] * max_blocks
        host = torch.tensor([self._pad] * self.max_batch, dtype=torch.long)
        self._host = host.pin_memory() if pin else host
        self._inputs = self._host.to(self.device, copy=True)
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.steps = 0
        """Steps run (replayed, or eagerly where nothing was captured)."""
        self.replays = 0
        """Of those, the steps replayed from a graph."""

    def _forward(self, batch: int) -> torch.Tensor:
        x = self._inputs[:batch]
        return decode_forward(self.model, self.kv_caches, x[:, _ID], x[:, _POS], x[:, _SLOT], x[:, _TABLE:],
                              x[:, _LEN].contiguous(), self.max_seq_len)

    def padded_size(self, rows: int) -> int | None:
        """The captured batch size a step of ``rows`` sequences runs as, None when none is big enough."""
        return next((b for b in self.batch_sizes if b >= rows), None)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up (compiles the Triton kernels, sizes cuBLAS's workspace) on a side stream, then
        record one graph per batch size, largest first, all in one memory pool. CUDA only."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device, the KV pool is on {self.device}")
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b in self.batch_sizes:
                self._forward(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = None
        for b in reversed(self.batch_sizes):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(b)
            pool = graph.pool()
            self.graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step of len(input_ids) sequences: float32 logits [n, vocab] on the device.
        Each table lists a sequence's blocks (at most ``max_blocks``); each seq_len counts its new
        token and is at most ``max_blocks * block_size``."""
        n = len(input_ids)
        batch = self.padded_size(n)
        if batch is None or n == 0:
            raise ValueError(f"a decode step of {n} sequences: captured sizes are {self.batch_sizes}")
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the pinned buffer
        rows = []
        for i, table in enumerate(block_tables):
            if len(table) > self.max_blocks or seq_lens[i] > len(table) * self.block_size:
                raise ValueError(f"row {i}: {len(table)} blocks for {seq_lens[i]} tokens; the graphs hold "
                                 f"{self.max_blocks} blocks of {self.block_size}")
            rows.append([input_ids[i], positions[i], slots[i], seq_lens[i], *table,
                         *self._pad[_TABLE + len(table):]])
        self._host[:batch] = torch.tensor(rows + [self._pad] * (batch - n), dtype=torch.long)  # one conversion
        self._inputs[:batch].copy_(self._host[:batch], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        self.steps += 1
        captured = self.graphs.get(batch)
        if captured is None:
            return self._forward(batch)[:n]
        graph, logits = captured
        graph.replay()
        self.replays += 1
        return logits[:n]
