"""Test helper: drive LlamaForCausalLM.forward through the paged path like an engine would."""

from __future__ import annotations

import torch

from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache


class PagedRunner:
    """Owns a KV cache and random (non-contiguous) block tables for a few sequences."""

    def __init__(self, model, num_seqs: int, *, block_size: int = 4, num_blocks: int = 96,
                 max_blocks: int = 24, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        self.kv = allocate_kv_cache(model.config, num_blocks, block_size, model.dtype, model.device)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=g)[: num_seqs * max_blocks]
        self.tables = perm.view(num_seqs, max_blocks).to(model.device)  # block ids never shared
        self.lens = [0] * num_seqs

    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run one step. chunks: seq index -> new token ids. Returns seq -> logits [q, vocab]."""
        order = sorted(chunks)
        ids, pos, slots, q_lens, c_lens = [], [], [], [], []
        for s in order:
            toks = chunks[s]
            start = self.lens[s]
            for j, t in enumerate(toks):
                p = start + j
                ids.append(t)
                pos.append(p)
                slots.append(int(self.tables[s, p // self.block_size]) * self.block_size + p % self.block_size)
            self.lens[s] += len(toks)
            q_lens.append(len(toks))
            c_lens.append(self.lens[s])
        dev = self.model.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=dev),
            query_lens=q_lens,
            context_lens=c_lens,
            block_tables=self.tables[order],
        )
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), self.kv, meta)
            logits = self.model.compute_logits(hidden)
        out, off = {}, 0
        for s, q in zip(order, q_lens):
            out[s] = logits[off:off + q]
            off += q
        return out


def greedy_paged(model, prompts: list[list[int]], max_new: int, prefill_chunk: int = 7) -> list[list[int]]:
    """Greedy-decode several prompts in one batch: chunked prefill, then batched decode steps."""
    runner = PagedRunner(model, len(prompts), max_blocks=64, num_blocks=64 * len(prompts) + 8)
    last: dict[int, torch.Tensor] = {}
    offsets = [0] * len(prompts)
    while any(o < len(p) for o, p in zip(offsets, prompts)):
        chunks = {}
        for s, p in enumerate(prompts):
            if offsets[s] < len(p):
                chunks[s] = p[offsets[s]:offsets[s] + prefill_chunk]
                offsets[s] += len(chunks[s])
        for s, lg in runner.step(chunks).items():
            last[s] = lg[-1]
    outs = [[int(last[s].argmax())] for s in range(len(prompts))]
    for _ in range(max_new - 1):
        res = runner.step({s: [outs[s][-1]] for s in range(len(prompts))})
        for s in range(len(prompts)):
            outs[s].append(int(res[s][-1].argmax()))
    return outs
