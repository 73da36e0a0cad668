"""Model runner: turns a scheduled step into one forward pass over the paged KV cache.

The only engine module that touches tensors. Everything it needs from the control plane arrives
in a `SchedulerOutput`; everything it returns is plain logits for the sequences that need a token.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache, kv_bytes_per_block, read_kv, write_kv_range
from kvmesh.model.loader import LoadedModel
from kvmesh.services.engine.kv_copies import KvCopies
from kvmesh.services.engine.sampler import TokenLogprobs, token_logprobs
from kvmesh.services.engine.scheduler import SchedulerOutput
from kvmesh.services.engine.sequence import Sequence

if TYPE_CHECKING:
    from kvmesh.gpu.decode_graphs import DecodeGraphs


PROMPT_LOGITS_ROWS = 256
"""Prompt positions whose full-vocabulary logits are computed at once (bounds that buffer)."""


@dataclass(frozen=True)
class PromptLogprobsChunk:
    """Logprobs of the prompt tokens this step's chunk of `seq` predicts: entry j is prompt token
    start+1+j, predicted from position start+j."""

    seq: Sequence
    start: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True)
class DraftLogits:
    """What verifying one sequence's drafts needs: row j of `logits` predicts the token after
    draft j (row 0: after the last known token)."""

    seq: Sequence
    draft_token_ids: tuple[int, ...]
    logits: torch.Tensor     # [1 + len(draft_token_ids), vocab] float32, on CPU


@dataclass(frozen=True)
class StepResult:
    """Logits for the sequences whose known tokens are now all computed."""

    seqs: list[Sequence]     # sequences that get a new token this step, in batch order
    logits: torch.Tensor     # [len(seqs), vocab] float32, on CPU
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    """For sequences collecting prompt logprobs (Sequence.needs_prompt_logprobs)."""
    drafts: list[DraftLogits] = field(default_factory=list)
    """Sequences that verify draft tokens this step (not in `seqs`)."""


# NOTE: draft tokens as decode rows. A sequence verifying k drafts brings 1 + k tokens at
# positions s..s+k (its last known token, then the drafts). Rather than as one multi-token row
# (the prefill path: a per-sequence attention with a causal mask), the runner gives attention
# 1 + k single-token rows that share the sequence's block table, row j with context s+j+1. The
# step writes every new token's KV before any row attends, so row j sees exactly the keys a
# causal mask would give it, and all of them go through the batched decode path with every
# other decode: one batched SDPA however many sequences speculate, and the attention arithmetic
# of plain decoding. (The linear layers see more rows, which may round differently in the last
# bits, as any change in the batch does in plain decoding; greedy outputs can only differ where
# plain decoding's own argmax is a tie at float precision.) The cost: each row gathers its
# sequence's blocks, so a verification reads the context 1 + k times (a paged-attention
# kernel that reads blocks in place would not).


def blocks_for_budget(loaded: LoadedModel, block_size: int, budget_bytes: int) -> int:
    """How many KV blocks fit in `budget_bytes` (the pool never grows past it)."""
    per_block = kv_bytes_per_block(loaded.config, block_size, loaded.model_dtype)
    return max(1, budget_bytes // per_block)


class ModelRunner:
    """Owns the paged KV pool of one model on one device and runs forward passes over it.

    ``graph_batch_sizes``: plain decode steps of up to the largest of these sizes are replayed as
    CUDA graphs (kvmesh.gpu.decode_graphs), captured here for sequences of up to ``max_model_len``
    tokens; the pool then holds one block more than ``num_blocks``, the padding rows' scratch
    block, which the block manager never hands out. Off CUDA (tests) the same steps run the graphs'
    code eagerly."""

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int,
                 graph_batch_sizes: tuple[int, ...] = (), max_model_len: int = 0) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = torch.device(loaded.device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        graphs = bool(graph_batch_sizes)
        # [layers] x ([num_blocks (+ scratch), block_size, kv_heads, head_dim], same for V)
        self.kv_caches = allocate_kv_cache(
            loaded.config, num_blocks + graphs, block_size, loaded.model_dtype, self.device)
        self.kv_cache_bytes = num_blocks * kv_bytes_per_block(
            loaded.config, block_size, loaded.model_dtype)
        self.copies = KvCopies(self.device)
        self.graphs: Optional[DecodeGraphs] = None
        if graphs:
            from kvmesh.gpu.decode_graphs import DecodeGraphs  # triton: only where graphs are asked for

            self.graphs = DecodeGraphs(self.model, self.kv_caches, scratch_block=num_blocks,
                                       max_blocks=-(-(max_model_len or loaded.config.context_length) // block_size),
                                       batch_sizes=graph_batch_sizes)
            if self.device.type == "cuda":
                self.graphs.capture()

    @torch.inference_mode()
    def read_kv(self, seq: Sequence, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of seq's cached KV for positions [start, end): [layers, end-start, kv_heads, head_dim]."""
        return read_kv(self.kv_caches, seq.block_table, start, end)

    @torch.inference_mode()
    def read_kv_to_host(self, seq: Sequence, start: int, end: int):
        """`read_kv` on the host for an export: (k, v, wait), where on CUDA the copy runs on the
        copy stream (services/engine/kv_copies.py) and ``wait()`` blocks until it is done; off
        CUDA wait is None and k, v are read_kv's."""
        return self.copies.to_host(*self.read_kv(seq, start, end))

    def stage_kv(self, payload):
        """An imported payload (k, v on the host) whose copy to the device starts now, on the copy
        stream (a StagedKv); as it is off CUDA."""
        return self.copies.to_device(payload)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Writes imported KV, computes every scheduled token; returns logits where a sequence
        needs its next token."""
        if self.graphs is not None:
            graphed = self._replay(out)
            if graphed is not None:
                return graphed
        for imp in out.imports:
            k, v = self.copies.ready(imp.payload)  # [layers, tokens, kv_heads, head_dim], positions from payload_start
            a, b = imp.start - imp.payload_start, imp.end - imp.payload_start
            write_kv_range(self.kv_caches, imp.seq.block_table, imp.start, k[:, a:b], v[:, a:b])
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[tuple[Sequence, int, int, int]] = []  # seq, start, flat row of start, rows
        draft_rows: list[tuple[Sequence, tuple[int, ...], int]] = []  # seq, drafts, flat row of start
        for item in out.scheduled:
            seq, n = item.seq, item.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            if item.draft_token_ids:  # see the NOTE: 1 + k decode rows
                draft_rows.append((seq, item.draft_token_ids, len(input_ids)))
                input_ids.append(seq.last_token_id)
                input_ids.extend(item.draft_token_ids)
                positions.extend(range(start, end))
                table = seq.block_table
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
                query_lens.extend([1] * n)
                context_lens.extend(range(start + 1, end + 1))
                tables.extend([table] * n)
                continue
            # Position p's logits predict token p+1; the last prompt position's predict the first
            # generated token (sampled below), so prompt logprobs use positions start..P-2.
            num_prompt_rows = min(end, seq.num_prompt_tokens - 1) - start
            if seq.needs_prompt_logprobs and num_prompt_rows > 0:
                prompt_rows.append((seq, start, len(input_ids), num_prompt_rows))
            tokens = seq.all_token_ids
            table = seq.block_table
            input_ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_lens.append(n)
            context_lens.append(end)
            tables.append(table)
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        attn = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=torch.tensor(padded, dtype=torch.long, device=dev),
        )
        for _, drafts, flat in draft_rows:
            sample_rows.extend(range(flat, flat + 1 + len(drafts)))
        # Only the sampled rows' hidden states are read (unless prompt logprobs want more): the
        # last layer computes the others' keys and values and skips the rest (see keep).
        keep = None if prompt_rows or len(sample_rows) == len(input_ids) else sorted(sample_rows)
        hidden = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches, attn, keep=keep)
        chunks = [self._prompt_logprobs(hidden, *r) for r in prompt_rows]
        if not sample_rows:
            return StepResult([], torch.empty(0, self.loaded.config.vocab_size), chunks)
        if keep is not None:
            where = {r: i for i, r in enumerate(keep)}
            sample_rows = [where[r] for r in sample_rows]
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden.index_select(0, rows)).float().cpu()  # [rows, vocab]
        verified, row = [], len(sample_seqs)
        for seq, drafts, _ in draft_rows:
            verified.append(DraftLogits(seq, drafts, logits[row:row + 1 + len(drafts)]))
            row += 1 + len(drafts)
        return StepResult(sample_seqs, logits[:len(sample_seqs)], chunks, verified)

    def _replay(self, out: SchedulerOutput) -> Optional[StepResult]:
        """A plain decode step (every sequence one new token, its last known one, no drafts, no
        imports, no prompt logprobs) as a graph replay; None for any other step (run eagerly)."""
        graphs = self.graphs
        if out.imports or not out.scheduled or len(out.scheduled) > graphs.max_batch:
            return None
        bs = self.block_size
        ids, positions, slots, lens, tables, seqs = [], [], [], [], [], []
        for item in out.scheduled:
            seq = item.seq
            p = seq.num_computed_tokens
            if (item.num_new_tokens != 1 or item.draft_token_ids or seq.needs_prompt_logprobs
                    or p + 1 != seq.num_tokens or len(seq.block_table) > graphs.max_blocks):
                return None
            table = seq.block_table
            ids.append(seq.last_token_id)
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(table)
            seqs.append(seq)
        logits = graphs.run(ids, positions, slots, lens, tables)
        return StepResult(seqs, logits.float().cpu())

    def _prompt_logprobs(self, hidden: torch.Tensor, seq: Sequence, start: int, flat: int,
                         n: int) -> PromptLogprobsChunk:
        """Full-vocabulary logits of positions start..start+n-1 (hidden rows flat..flat+n-1 of
        hidden [T, hidden]) turned into logprobs of the prompt tokens they predict, on the device
        and in slices, so only the chosen and top-n values leave it."""
        top_n = seq.params.prompt_logprobs or 0
        targets = seq.prompt_token_ids[start + 1:start + 1 + n]
        entries: list[TokenLogprobs] = []
        for a in range(0, n, PROMPT_LOGITS_ROWS):
            b = min(n, a + PROMPT_LOGITS_ROWS)
            logits = self.model.compute_logits(hidden[flat + a:flat + b])  # [b-a, vocab] float32
            entries += token_logprobs(logits, targets[a:b], [top_n] * (b - a))
        return PromptLogprobsChunk(seq, start, entries)
