"""Continuous batching with chunked prefill under one per-step token budget."""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvmesh.errors import InvalidArgument, ResourceExhausted
from kvmesh.services.engine.block_manager import BlockManager
from kvmesh.services.engine.sequence import FinishReason, Sequence, SequenceStatus

if TYPE_CHECKING:
    from kvmesh.services.engine.sequence import KvPayload


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """Limits of one engine's batching; frozen after start."""

    max_num_seqs: int = 64
    """Most sequences running (holding KV blocks) at once."""
    max_num_batched_tokens: int = 512
    """Per-step token budget shared by decodes and prefill chunks."""
    solo_prefill_tokens: int = 0
    """Per-step token budget of a step with no decodes (see the NOTE); values up to
    max_num_batched_tokens (the default 0) mean max_num_batched_tokens. The engine service sets
    it (--solo-prefill-tokens, 2048 by default)."""
    max_model_len: int
    """Most tokens (prompt + generated) of one sequence."""
    block_size: int
    """Tokens per KV block; must match the BlockManager's."""
    max_waiting: int = 1024
    """Most queued requests; `Scheduler.add` refuses more with ResourceExhausted."""

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.solo_prefill_tokens < 0:
            raise ValueError(f"solo_prefill_tokens must be >= 0, got {self.solo_prefill_tokens}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running decode fits in one step; raise the budget "
                "or lower max_num_seqs"
            )


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens [start, start + num_new_tokens).

    With draft tokens the last of them are the drafts, verified in this step: the sequence's
    known tokens end at start + num_new_tokens - len(draft_token_ids).
    `start` and `needs_sampling` are snapshots taken when the step is scheduled, so they stay
    right while the runner works and after `Scheduler.commit` advances the sequence.
    """

    seq: Sequence
    num_new_tokens: int
    draft_token_ids: tuple[int, ...] = ()
    """Draft tokens following the sequence's last (known) token, for speculative decoding."""
    start: int = field(init=False)
    """Position of the first token to compute (the sequence's num_computed_tokens)."""
    needs_sampling: bool = field(init=False)
    """True when this chunk reaches the last known token: sample from its last position."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "start", self.seq.num_computed_tokens)
        object.__setattr__(self, "draft_token_ids", tuple(self.draft_token_ids))
        known_end = self.start + self.num_new_tokens - len(self.draft_token_ids)
        object.__setattr__(self, "needs_sampling", known_end == self.seq.num_tokens)


@dataclass(frozen=True)
class KvImport:
    """Externally fetched KV the runner writes into `seq`'s blocks before the step's forward:
    sequence positions [start, end), taken from the payload (which begins at payload_start;
    positions below `start` were prefix-cache hits)."""

    seq: Sequence
    payload: KvPayload
    start: int
    end: int
    payload_start: int = 0
    """Sequence position of the payload's first token."""


@dataclass(frozen=True)
class SchedulerOutput:
    """What the model runner computes this step."""

    scheduled: list[ScheduledSeq]
    """Decodes first, then running prefill chunks, then newly admitted sequences."""
    preempted: list[Sequence]
    """Sequences that lost their KV blocks this step; they are waiting to be recomputed."""
    num_batched_tokens: int
    imports: list[KvImport] = field(default_factory=list)
    """KV from the KV-cache service to write before computing (counts as computed, not budget)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# NOTE: the scheduling model (Sarathi-Serve's stall-free batching on vLLM v1's token budget).
#
# A sequence knows num_tokens tokens and has computed num_computed_tokens of them; each step
# spends at most max_num_batched_tokens tokens (solo_prefill_tokens when no running sequence is
# decoding), in this order:
#   1. every running decode (exactly one token left to compute) gets its token;
#   2. running sequences with a partial prefill get their next chunk, oldest first;
#   3. waiting sequences are admitted first-come-first-served: prefix-cache hits count as
#      computed, so does KV fetched from the KV-cache service beyond them (imported: copied
#      into the new blocks before the forward, no budget), the rest is computed in chunks of
#      whatever budget is left (a request collecting prompt logprobs takes neither: it
#      computes its whole prompt). Admission is strict FCFS (a head that does not fit blocks the
#      queue) and is skipped in a step that preempted.
# A long prompt therefore never delays decodes: it only uses the budget they leave. A step with
# no decodes delays nobody's next token, so its prefill chunks may be bigger (solo_prefill_tokens):
# fewer passes over the prompt's growing KV, and bigger matmuls. The function computed is the
# same; with the default GGUF weights the logprobs are the same bit for bit (tested), while
# kernels that round a short chunk's rows differently (MKL's fp32 sgemm) move the last bits, as
# any chunk boundary (a prefix-cache hit's remainder) already does. Requests that arrive meanwhile
# wait for the step to end, as they would wait for the older prompt's later chunks under strict
# FCFS.
#
# Draft tokens (speculative decoding) are tokens to compute like any other. A decode offered k
# drafts computes 1 + k tokens: its last known token and the drafts, whose logits verify them.
# Drafts take what the step's budget has left after one token for every decode (reserved in
# step 1, before prefill chunks), and blocks only after everything else running got its own
# (step 1b): when blocks run short a decode verifies fewer drafts or none. Drafts never preempt
# anything and never keep a request waiting; the budget they reserved but could not use goes
# back before admission. After verification `accept_drafts` keeps the accepted ones as computed
# and frees the blocks that held only rejected ones.
#
# Preemption is by recompute. When a running sequence cannot get blocks, the most recently
# arrived running sequence (the tail of `running`) is preempted: its blocks are freed (full ones
# stay in the prefix cache until evicted), num_computed_tokens drops to 0 and it goes to the
# FRONT of `waiting`. Its generated tokens are kept: on readmission they are computed like
# prompt tokens, and sampling resumes after the last one, so its output continues exactly.
#
# Invariants that keep this simple:
#   - running + waiting is in arrival order: admission moves waiting's head to running's tail,
#     preemption moves running's tail to waiting's head. So running[-1] is the newest.
#   - only the newest running sequence can be mid-prefill: a sequence is admitted only when the
#     budget outlasted every older one, i.e. their prefills completed. So even with decodes
#     going first, everything the loop scheduled before a sequence is older than it, and the
#     victim (the newest, at least as new as the sequence being scheduled) was never already
#     scheduled in this step: no step ever has to be unwound.


class Scheduler:
    """Decides, each step, which sequences compute how many tokens; owns waiting and running."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        if config.block_size != block_manager.block_size:
            raise ValueError(
                f"SchedulerConfig.block_size ({config.block_size}) differs from the block "
                f"manager's ({block_manager.block_size}); build both from the same value"
            )
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Prefill (and recompute) tokens still to compute over running and waiting sequences,
        before any prefix-cache hit a waiting sequence may get at admission."""
        return (sum(s.num_pending_prefill_tokens for s in self.running)
                + sum(s.num_pending_prefill_tokens for s in self.waiting))

    def get(self, request_id: str) -> Sequence | None:
        """The waiting or running sequence with this id."""
        return self._by_id.get(request_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence, validated at the engine's edge (EngineCore.validate: a
        non-empty prompt that `check_fits`).

        Raises ResourceExhausted when the waiting queue is full, InvalidArgument when the id is
        taken (ids key the scheduler's own table).
        """
        if len(self.waiting) >= self.config.max_waiting:
            raise ResourceExhausted(
                f"the engine's queue is full ({self.config.max_waiting} waiting requests); retry later"
            )
        if seq.request_id in self._by_id:
            raise InvalidArgument(f"request id {seq.request_id!r} is already in use; pick a unique id")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._by_id[seq.request_id] = seq

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """InvalidArgument when a sequence of this length could never fit in the KV cache (checked
        at the engine's edge, before any KV is fetched)."""
        max_len = prompt_tokens + max_tokens
        needed, have = -(-max_len // self.config.block_size), self.block_manager.num_blocks
        if needed > have:
            raise InvalidArgument(
                f"prompt + max_tokens ({max_len} tokens) needs {needed} KV blocks but the cache holds "
                f"{have}; shorten the prompt, lower max_tokens or raise the engine's --kv-cache-bytes")

    def schedule(self, drafts: Mapping[Sequence, list[int]] | None = None) -> SchedulerOutput:
        """Plan one step (see the NOTE). Allocates the blocks the planned tokens need.

        `drafts` maps running decodes to draft tokens to verify this step (at most what the
        budget and free blocks allow is taken, a prefix of each)."""
        drafts = drafts or {}
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        step_budget = self.config.max_num_batched_tokens
        if not decodes:
            step_budget = max(step_budget, self.config.solo_prefill_tokens)
        budget = step_budget
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        imports: list[KvImport] = []
        spare = budget - len(decodes)  # budget left for drafts once every decode has its token
        reserved: dict[int, int] = {}  # index in `scheduled` -> drafts it reserved budget for
        for seq in decodes + prefills:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or out of budget
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                num_drafts = min(len(drafts.get(seq, ())), spare, budget - num_new)
                if num_drafts > 0 and num_new == 1:
                    reserved[len(scheduled)] = num_drafts
                    spare -= num_drafts
                    budget -= num_drafts
                scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        budget += self._add_drafts(scheduled, reserved, drafts)

        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.needs_prompt_logprobs:  # every prompt position's logits are needed
                computed_blocks, num_hit = [], 0
            else:
                computed_blocks, num_hit = self.block_manager.match_prefix(seq)
            # Fetched KV extends the local hits only where it is contiguous with them (blocks
            # evicted since the fetch leave a gap: then compute instead).
            usable = (seq.external_kv is not None and seq.external_start <= num_hit
                      and not seq.needs_prompt_logprobs)
            num_import = max(0, seq.external_tokens - num_hit) if usable else 0
            num_new = min(seq.num_tokens - num_hit - num_import, budget)
            if not self.block_manager.allocate_slots(seq, num_import + num_new, computed_blocks):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if num_import:
                imports.append(KvImport(seq, seq.external_kv, num_hit, num_hit + num_import,
                                        seq.external_start))
            seq.external_kv = None  # imported now, or fully covered by the prefix cache
            seq.num_computed_tokens = num_hit + num_import
            seq.num_cached_tokens = min(num_hit + num_import, seq.num_prompt_tokens)
            seq.num_imported_tokens = num_import
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

        return SchedulerOutput(
            scheduled=scheduled,
            preempted=preempted,
            num_batched_tokens=step_budget - budget,
            imports=imports,
        )

    def _add_drafts(self, scheduled: list[ScheduledSeq], reserved: dict[int, int],
                    drafts: Mapping[Sequence, list[int]]) -> int:
        """Gives each decode in `reserved` the blocks for as many of its drafts as fit (never
        preempting); returns the reserved budget left unused."""
        unused = 0
        for i, wanted in reserved.items():
            seq = scheduled[i].seq
            num_drafts = wanted
            while num_drafts and not self.block_manager.allocate_slots(seq, 1 + num_drafts):
                num_drafts -= 1
            if num_drafts:
                scheduled[i] = ScheduledSeq(seq, 1 + num_drafts, tuple(drafts[seq][:num_drafts]))
            unused += wanted - num_drafts
        return unused

    def commit(self, output: SchedulerOutput) -> None:
        """After the forward: the scheduled known tokens are computed; cache newly full blocks.

        Draft tokens are not known tokens yet: `accept_drafts` counts the accepted ones.
        Sequences finished or aborted since `schedule` are skipped.
        """
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            seq.num_computed_tokens = item.start + item.num_new_tokens - len(item.draft_token_ids)
            self.block_manager.cache_full_blocks(seq)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After verifying seq's drafts and appending the tokens it emitted (the accepted drafts
        and one more): the accepted drafts' KV counts as computed, full blocks are cached, and
        blocks past the last known token (only rejected drafts' KV) are freed. The KV of rejected
        drafts inside a kept block is overwritten before anything attends to it."""
        if seq.status is not SequenceStatus.RUNNING:
            return
        seq.num_computed_tokens += num_accepted
        if seq.num_computed_tokens >= seq.num_tokens:
            raise RuntimeError(f"{seq.request_id!r}: {num_accepted} accepted drafts leave no token "
                               "to compute; append the emitted tokens first")
        self.block_manager.cache_full_blocks(seq)
        self.block_manager.trim(seq, seq.num_tokens)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End seq: free its blocks and forget it. Idempotent."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        self._by_id.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a waiting or running request as aborted; None if unknown or already finished."""
        seq = self._by_id.get(request_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute (see the NOTE)."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
