"""N-gram (prompt lookup) drafter: continue the sequence the way it continued last time.

The index (kvmesh.ngram, shared with the engine's in-process n-gram arms) is kept per sequence
in its state's slot and updated with the tokens committed since the last call.

Only the sequence's own history is searched (no index shared across sequences).
"""
from __future__ import annotations

from collections.abc import Sequence

from kvmesh.ngram import NgramIndex, continue_from
from kvmesh.services.draft.drafters import DraftJob, DrafterKind, Proposal
from kvmesh.services.draft.state import SequenceState

__all__ = ["NgramDrafter", "NgramIndex", "continue_from"]

SLOT = "ngram"


class NgramDrafter:
    """Prompt-lookup drafts from each sequence's own history (pure Python, no model)."""

    kind = DrafterKind.NGRAM

    def __init__(self, n_min: int, n_max: int) -> None:
        NgramIndex(n_min, n_max)  # validates the range
        self.n_min, self.n_max = n_min, n_max

    def index(self, state: SequenceState) -> NgramIndex:
        """The sequence's index, brought up to date with its committed tokens (rebuilt after a
        resync that rewrote the history)."""
        index = state.slots.get(SLOT)
        if index is None or index.epoch != state.epoch:
            index = state.slots[SLOT] = NgramIndex(self.n_min, self.n_max, state.epoch)
        index.update(state.tokens)
        return index

    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        return [Proposal(self.index(job.state).lookup(job.state.tokens, job.max_tokens))
                for job in jobs]

    def release(self, state: SequenceState) -> None:
        state.slots.pop(SLOT, None)

    def describe(self) -> str:
        return f"n-gram {self.n_max}..{self.n_min}"
