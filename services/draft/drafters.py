"""The drafter interface: what every drafter takes and returns, and the registry that names them.

A drafter proposes a continuation of each sequence's committed tokens. Concrete drafters (n-gram,
model) implement `Drafter`; ADAPTIVE is not a drafter but a choice between them, made per
sequence by `kvmesh.services.draft.adaptive` (see the service).
"""
from __future__ import annotations

import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kvmesh.services.draft.state import SequenceState


class DrafterKind(str, enum.Enum):
    """A drafter a request may name (ADAPTIVE: let the service choose per sequence)."""

    NGRAM = "ngram"
    MODEL = "model"
    ADAPTIVE = "adaptive"


@dataclass(frozen=True)
class DraftJob:
    """One sequence to draft for: its state (committed tokens and the drafter's own per-sequence
    state) and the most tokens wanted (>= 1)."""

    state: SequenceState
    max_tokens: int


@dataclass(frozen=True)
class Proposal:
    """A drafter's answer for one job: at most `max_tokens` tokens, and their log-probabilities
    under the drafter when it has them (empty for the n-gram drafter)."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)


class Drafter(Protocol):
    """A strategy that proposes draft tokens for a batch of sequences."""

    kind: DrafterKind

    def propose(self, jobs: Sequence[DraftJob]) -> list[Proposal]:
        """One proposal per job, in order. May update the jobs' per-sequence drafter state."""
        ...

    def release(self, state: SequenceState) -> None:
        """Frees what this drafter holds for `state` (called when the state is dropped)."""
        ...

    def describe(self) -> str:
        """One line for GetInfo and the start-up log."""
        ...


class DrafterRegistry:
    """The concrete drafters this service offers, by kind (never ADAPTIVE)."""

    def __init__(self, drafters: Sequence[Drafter]) -> None:
        self._by_kind: dict[DrafterKind, Drafter] = {}
        for drafter in drafters:
            if drafter.kind is DrafterKind.ADAPTIVE or drafter.kind in self._by_kind:
                raise ValueError(f"cannot register a drafter of kind {drafter.kind.value} "
                                 "(ADAPTIVE or registered twice)")
            self._by_kind[drafter.kind] = drafter

    def __contains__(self, kind: object) -> bool:
        return kind in self._by_kind

    def __getitem__(self, kind: DrafterKind) -> Drafter:
        return self._by_kind[kind]

    def __iter__(self) -> Iterator[Drafter]:
        return iter(self._by_kind.values())

    @property
    def kinds(self) -> tuple[DrafterKind, ...]:
        """Registered kinds, in registration order."""
        return tuple(self._by_kind)

    def release(self, state: SequenceState) -> None:
        """Frees every drafter's resources for `state`."""
        for drafter in self._by_kind.values():
            drafter.release(state)
