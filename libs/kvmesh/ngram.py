"""Prompt lookup: the n-gram index behind the draft service's n-gram drafter and the engine's
in-process n-gram arms (kvmesh.services.engine.speculator).

NOTE (index). For each n in ngram_min..ngram_max, a history's index holds a dict from every
n-gram of its tokens to the position of the token that followed its most recent occurrence.
Indexing is incremental: each update adds only the tokens appended since the last one
(ngram_max - ngram_min + 1 dict writes per token), so a lookup costs one dict probe per n no
matter how long the context is. Lookup takes the longest suffix n-gram of the history that
occurred before (the suffix itself is never in the index: its follower is not known yet) and
proposes the tokens that followed that occurrence. The copy may run into the suffix and past the
end of the history; it then continues from its own proposal (an overlapping copy, as in LZ77),
so a repeating pattern of period p yields a full budget of drafts, not just p tokens.
"""
from __future__ import annotations

from collections.abc import Sequence

NGRAM_MIN, NGRAM_MAX = 2, 4
"""The n-gram lengths matched by default (the draft service's --ngram-min/--ngram-max)."""


def continue_from(tokens: Sequence[int], start: int, max_tokens: int) -> list[int]:
    """Up to `max_tokens` tokens copied from `tokens[start:]`, continuing into the copy itself once
    the history runs out (start < len(tokens))."""
    out: list[int] = []
    end = len(tokens)
    for i in range(max_tokens):
        pos = start + i
        out.append(tokens[pos] if pos < end else out[pos - end])
    return out


class NgramIndex:
    """Incremental map n-gram -> position after its latest occurrence, for one token history."""

    def __init__(self, n_min: int, n_max: int, epoch: int = 0) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got {n_min}..{n_max}")
        self.n_min, self.n_max, self.epoch = n_min, n_max, epoch
        self._tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_min, n_max + 1)]
        self.indexed = 0  # leading tokens whose arrival is in the tables

    def update(self, tokens: Sequence[int]) -> None:
        """Indexes the tokens appended to `tokens` since the last update (same history)."""
        n_min, n_max, tables = self.n_min, self.n_max, self._tables
        for i in range(self.indexed, len(tokens)):
            # token i follows the n-grams ending at i-1
            widest = tuple(tokens[max(0, i - n_max):i])
            for n, table in enumerate(tables, start=n_min):
                if n > len(widest):
                    break
                table[widest[len(widest) - n:]] = i
        self.indexed = len(tokens)

    def match(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """(n, follower position) of the longest suffix n-gram seen earlier, or None."""
        end = len(tokens)
        for n in range(min(self.n_max, end - 1), self.n_min - 1, -1):
            follower = self._tables[n - self.n_min].get(tuple(tokens[end - n:]))
            if follower is not None:
                return n, follower
        return None

    def lookup(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """The proposed continuation of `tokens` (already indexed), at most `max_tokens` long."""
        found = self.match(tokens)
        return [] if found is None else continue_from(tokens, found[1], max_tokens)
