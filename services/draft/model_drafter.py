"""Model drafter: greedy drafts from a (small or self-speculative) model with its own paged KV.

NOTE (per-sequence KV). Each sequence's KvSlot (kv_pool) holds the draft model's KV of the tokens
it has computed: the committed history up to its last call, then the drafts it fed back. On each
Propose, per sequence:
  1. rollback: the KV is kept up to the longest common prefix of those tokens and the committed
     history (drafts the engine accepted stay; the first rejected draft and all after it go), and
     at most up to len(history) - 1, since the last committed token must be fed to get logits;
  2. catch-up: the committed tokens past that prefix are computed, all sequences of the batch in
     one forward. A call computes at most `catch_up_tokens` of them in all, shortest first: in
     steady state a sequence brings its accepted drafts and one more token, while a new (or
     resynced, or evicted) sequence may bring thousands, which on a CPU take seconds. A sequence
     that does not finish catching up gets no drafts this call and continues at its next one, so
     no call waits for a long prompt and the engines' other sequences keep their drafts;
  3. drafting: the logits of the last committed token give draft 1; drafts 1..k-1 are fed one
     decode step at a time (all sequences still drafting in one forward), so the slot ends at
     history + drafts[:k-1].
Rows whose slot cannot get enough blocks (see kv_pool) or whose history reaches the model's
context length get fewer or no drafts. Greedy argmax of float32 logits; the log-probability is
log_softmax at the chosen token.

Only this module touches tensors; everything it calls runs on the service's one worker thread.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache
from kvmesh.model.loader import LoadedModel
from kvmesh.services.draft.drafters import DraftJob, DrafterKind, Proposal
from kvmesh.services.draft.kv_pool import DraftKvPool, KvSlot
from kvmesh.services.draft.state import SequenceState

SLOT = "model"


@dataclass
class _Row:
    """One sequence being drafted in this call."""

    slot: KvSlot
    feed: list[int]  # committed tokens still to compute
    want: int  # drafts to produce
    drafts: list[int]
    logprobs: list[float]


def describe_model(loaded: LoadedModel) -> str:
    """E.g. 'bundled int4, 30 layers' or 'bundled int4, first 20 of 30 layers'."""
    layers = loaded.config.num_layers
    cut = (f"first {layers} of {loaded.source_num_layers} layers" if loaded.source_num_layers
           else f"{layers} layers")
    return f"{loaded.source} {loaded.weights}, {cut}"


class ModelDrafter:
    """Greedy drafts of `loaded`, batched over the sequences of a Propose (see the NOTE)."""

    kind = DrafterKind.MODEL

    def __init__(self, loaded: LoadedModel, *, num_blocks: int, block_size: int,
                 catch_up_tokens: int = 32) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.device = torch.device(loaded.device)
        self.pool = DraftKvPool(num_blocks, block_size)
        self.catch_up_tokens = catch_up_tokens
        self.max_positions = loaded.config.max_position_embeddings
        # [layers] x ([num_blocks, block_size, kv_heads, head_dim], same for V)
        self.kv = allocate_kv_cache(loaded.config, num_blocks, block_size, loaded.dtype, self.device)

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    def describe(self) -> str:
        return describe_model(self.loaded)

    def release(self, state: SequenceState) -> None:
        slot = state.slots.pop(SLOT, None)
        if slot is not None:
            self.pool.drop(slot)

    @torch.inference_mode()
    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        rows: list[_Row | None] = [self._plan(job) for job in jobs]
        self._ration([row for row in rows if row is not None])
        protected = {row.slot for row in rows if row is not None}
        for i, row in enumerate(rows):
            if row is None:
                continue
            positions = len(row.slot.tokens) + len(row.feed) + max(row.want - 1, 0)
            if not self.pool.reserve(row.slot, positions, protected):
                self.pool.truncate(row.slot, 0)  # no room even after evictions: no drafts, and its
                rows[i] = None                   # KV is recomputed when it next gets room
        live = [row for row in rows if row is not None]
        self._catch_up(live)
        for _ in range(1, max((row.want for row in live), default=0)):
            drafting = [row for row in live if len(row.drafts) < row.want]
            self._step(drafting, [[row.drafts[-1]] for row in drafting])
        return [Proposal(row.drafts, row.logprobs) if row else Proposal([]) for row in rows]

    def _plan(self, job: DraftJob) -> _Row | None:
        """Rolls the slot back to what it shares with the history; None when nothing can be drafted."""
        state, history = job.state, job.state.tokens
        want = min(job.max_tokens, self.max_positions - len(history))
        if want < 1 or not history:
            return None
        slot = state.slots.get(SLOT)
        if slot is None:
            slot = state.slots[SLOT] = KvSlot(epoch=state.epoch)
        if slot.epoch != state.epoch:
            slot.epoch, slot.checked = state.epoch, 0
        common = slot.checked
        limit = min(len(slot.tokens), len(history))
        while common < limit and slot.tokens[common] == history[common]:
            common += 1
        keep = min(common, len(history) - 1)
        self.pool.truncate(slot, keep)
        slot.checked = keep
        return _Row(slot, list(history[keep:]), want, [], [])

    def _ration(self, rows: list[_Row]) -> None:
        """Cuts the rows' catch-up to `catch_up_tokens` in all, shortest first; a row cut short
        drafts nothing this call."""
        budget = self.catch_up_tokens
        for row in sorted(rows, key=lambda r: len(r.feed)):
            take = min(len(row.feed), budget)
            budget -= take
            if take < len(row.feed):
                del row.feed[take:]
                row.want = 0

    def _catch_up(self, rows: list[_Row]) -> None:
        """Computes every row's (rationed) committed tokens in one forward; a row that caught up
        fully takes its first draft from the logits of its last token."""
        pending = [row for row in rows if row.feed]
        self._step(pending, [row.feed for row in pending], want=[row.want > 0 for row in pending])
        for row in pending:
            row.slot.checked = len(row.slot.tokens)  # it fed committed tokens only
            row.feed = []

    def _step(self, rows: list[_Row], new: list[list[int]], want: list[bool] | None = None) -> None:
        """One forward: row i computes new[i] at its next positions; rows with want[i] (default
        all) take their next greedy draft from the logits of their last new token."""
        if not rows:
            return
        bs, dev = self.pool.block_size, self.device
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        for row, tokens in zip(rows, new):
            start = len(row.slot.tokens)
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += [row.slot.slot_of(p, bs) for p in range(start, start + len(tokens))]
            query_lens.append(len(tokens))
            row.slot.tokens.extend(tokens)
            self.pool.touch(row.slot)
        width = max(len(row.slot.blocks) for row in rows)
        tables = torch.tensor([row.slot.blocks + [0] * (width - len(row.slot.blocks)) for row in rows],
                              dtype=torch.long, device=dev)  # [B, width]
        meta = AttentionMetadata.build(
            torch.tensor(slots, dtype=torch.long, device=dev), query_lens,
            [len(row.slot.tokens) for row in rows], tables, bs)
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),  # [T, hidden]
                            torch.tensor(positions, dtype=torch.long, device=dev), self.kv, meta)
        picked = [i for i in range(len(rows)) if want is None or want[i]]
        if not picked:
            return
        ends = torch.tensor(query_lens, device=dev).cumsum(0) - 1  # [B] last new token of each row
        last = hidden.index_select(0, ends[torch.tensor(picked, device=dev)])  # [P, hidden]
        logits = self.model.compute_logits(last)  # [P, vocab] float32
        top = logits.argmax(-1)  # [P]
        logprobs = logits.gather(-1, top[:, None])[:, 0] - logits.logsumexp(-1)  # [P]
        for i, token, logprob in zip(picked, top.tolist(), logprobs.tolist()):
            rows[i].drafts.append(token)
            rows[i].logprobs.append(logprob)
