"""Per-sequence state and the store that keeps it: TTL after the last call, an LRU cap, Release.

NOTE (state). A sequence's state is its committed tokens (what the engine has accepted so far)
plus one slot per drafter for what that drafter derives from them (the n-gram index, the model
drafter's KV), the adaptive policy's acceptance estimates, and the last proposal (so the next
call's `last_accepted` can be scored against it). Committed tokens only grow, except when the
engine resyncs with a history that disagrees with ours: then `epoch` increases and every drafter
re-derives its slot (the model drafter keeps the KV of the common prefix).

The store is an OrderedDict in least-recently-used order under one lock. A state is dropped
  * at once on Release;
  * when `ttl_s` passes without a call for it: `get` treats it as gone immediately, `sweep`
    returns its resources in the background;
  * when adding a sequence would exceed `max_sequences`: the least recently used one goes.
Every drop runs `on_drop` (the drafters free their per-sequence resources) outside the dict but
under the lock, so a dropped state is never handed out again.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvmesh.services.draft.drafters import DrafterKind


@dataclass(frozen=True)
class LastProposal:
    """What the service proposed at a sequence's previous call."""

    drafter: DrafterKind
    tokens: int


@dataclass(eq=False)
class SequenceState:
    """Everything the service remembers about one sequence (see the module NOTE)."""

    sequence_id: str
    tokens: list[int]
    epoch: int = 0
    slots: dict[str, Any] = field(default_factory=dict)
    last_proposal: LastProposal | None = None
    last_used: float = 0.0

    def append(self, new_tokens: Iterable[int]) -> None:
        """Commits `new_tokens` after the current ones."""
        self.tokens.extend(new_tokens)

    def replace(self, tokens: list[int]) -> int:
        """Replaces the committed history (a resync); returns how many leading tokens are unchanged.
        A history that only extends the current one keeps the epoch, any other bumps it."""
        old = self.tokens
        common = 0
        for a, b in zip(old, tokens):
            if a != b:
                break
            common += 1
        if common == len(old):
            self.tokens.extend(tokens[common:])
        else:
            self.tokens = list(tokens)
            self.epoch += 1
        return common


class StateStore:
    """Thread-safe map sequence_id -> SequenceState with TTL, LRU cap and drop hooks."""

    def __init__(self, *, ttl_s: float, max_sequences: int,
                 on_drop: Callable[[SequenceState], None] = lambda state: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s <= 0 or max_sequences < 1:
            raise ValueError(f"need ttl_s > 0 and max_sequences >= 1, got {ttl_s}, {max_sequences}")
        self.ttl_s = ttl_s
        self.max_sequences = max_sequences
        self._on_drop = on_drop
        self._clock = clock
        self._states: OrderedDict[str, SequenceState] = OrderedDict()
        self._lock = threading.RLock()
        self.evicted = 0  # dropped by the LRU cap
        self.expired = 0  # dropped by the TTL

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, sequence_id: object) -> bool:
        return self.peek(sequence_id) is not None  # type: ignore[arg-type]

    def peek(self, sequence_id: str) -> SequenceState | None:
        """The live state of `sequence_id` without touching its recency (None when gone)."""
        with self._lock:
            state = self._states.get(sequence_id)
            if state is None or self._clock() - state.last_used > self.ttl_s:
                return None
            return state

    def get(self, sequence_id: str) -> SequenceState | None:
        """The live state of `sequence_id`, now the most recently used; an expired one is dropped
        and reported as missing."""
        with self._lock:
            state = self._states.get(sequence_id)
            if state is None:
                return None
            now = self._clock()
            if now - state.last_used > self.ttl_s:
                self._drop(sequence_id)
                self.expired += 1
                return None
            state.last_used = now
            self._states.move_to_end(sequence_id)
            return state

    def create(self, sequence_id: str, tokens: list[int]) -> SequenceState:
        """A fresh state for `sequence_id` (replacing any old one), evicting the least recently
        used states beyond the cap."""
        with self._lock:
            if sequence_id in self._states:
                self._drop(sequence_id)
            state = SequenceState(sequence_id, list(tokens), last_used=self._clock())
            self._states[sequence_id] = state
            while len(self._states) > self.max_sequences:
                self._drop(next(iter(self._states)))
                self.evicted += 1
            return state

    def release(self, sequence_ids: Iterable[str]) -> int:
        """Drops these states now; returns how many were live (expired ones are dropped too)."""
        with self._lock:
            live = 0
            for sequence_id in dict.fromkeys(sequence_ids):
                if sequence_id in self._states:
                    live += self.peek(sequence_id) is not None
                    self._drop(sequence_id)
            return live

    def sweep(self) -> int:
        """Drops every state idle for longer than the TTL; returns how many."""
        with self._lock:
            now, dropped = self._clock(), 0
            # LRU order is last-use order, so the stale states are the leading ones.
            while self._states:
                oldest = next(iter(self._states.values()))
                if now - oldest.last_used <= self.ttl_s:
                    break
                self._drop(oldest.sequence_id)
                dropped += 1
            self.expired += dropped
            return dropped

    def _drop(self, sequence_id: str) -> None:
        state = self._states.pop(sequence_id)
        self._on_drop(state)
