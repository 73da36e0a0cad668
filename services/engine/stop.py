"""When a sequence stops: on tokens (end-of-sequence, stop ids, max_tokens) and on stop strings."""
from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import NamedTuple

from kvmesh.services.engine.sequence import FinishReason, Sequence


def check_stop(seq: Sequence, new_token: int, eos_token_ids: Collection[int]) -> FinishReason | None:
    """Why seq must stop after `new_token` (already appended), or None to continue.

    A stop token wins over the length limit: a model that ended on its last allowed token
    stopped on its own.
    """
    params = seq.params
    if (not params.ignore_eos and new_token in eos_token_ids) or new_token in params.stop_token_ids:
        return FinishReason.STOP
    if seq.num_output_tokens >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def stop_strings_apply(seq: Sequence) -> bool:
    """Whether a stop string may end in the text of `seq`'s newest output token: only once more
    than min_tokens tokens were generated (StopStringMatcher's NOTE)."""
    return seq.num_output_tokens > seq.params.min_tokens


class StopUpdate(NamedTuple):
    """What one delta of output text produced."""

    text: str
    """Text that is safe to emit now."""
    matched: str | None
    """The stop string that ended the output with this delta, else None."""


class StopStringMatcher:
    """Finds a request's stop strings in its incremental output text.

    Feed each text delta to `feed`; it returns the text that is safe to emit now. Text that could
    be the beginning of a stop string is held back until the next delta decides it. The first
    stop string to *complete* wins (at equal ends, the one starting first); the result does not
    depend on how the text was split into deltas. After a match, `text` is the final output,
    cut before the stop string, and further deltas are ignored. When generation ends otherwise,
    `flush` releases the held-back text.

    NOTE: state is the whole output text and how much of it was emitted. Each feed searches only
    windows that end inside the new delta, so a stop string is found exactly once, when its last
    character arrives, wherever the deltas split it.

    NOTE (min_tokens, vLLM's rule). Until min_tokens tokens were generated no stop condition
    applies, stop strings included: their text is fed with `check=False`, emitted normally and
    never searched, so a stop string that ends inside it never counts, not even later. One that
    starts there and ends in a later token's text does stop, cut at its start (possible text is
    held back as always, so nothing past the cut was emitted). This is what vLLM's detokenizer
    does (its stop-check offset moves past the first min_tokens tokens' text, and stop strings
    are searched in windows that end after that offset).
    """

    def __init__(self, stop: Iterable[str]) -> None:
        self.stop = tuple(s for s in stop if s)
        self._first_chars = frozenset(s[0] for s in self.stop)
        self._max_len = max((len(s) for s in self.stop), default=0)
        self._text = ""
        self._emitted = 0
        self.matched: str | None = None
        """The stop string that ended the output, once found."""

    @property
    def text(self) -> str:
        """All output text so far; after a match, the final text cut before the stop string."""
        return self._text

    @property
    def held_back(self) -> str:
        """Received text not yet emitted (a possible stop-string beginning)."""
        return self._text[self._emitted :]

    def feed(self, delta: str, check: bool = True) -> StopUpdate:
        """Append a delta of output text; return the newly emittable text and any match. With
        `check` False no stop string may end in this delta (min_tokens: see the NOTE)."""
        if self.matched is not None or not delta:
            return StopUpdate("", None)
        old_len = len(self._text)
        self._text += delta
        match = self._find(old_len) if check else None
        if match is not None:
            start, stop = match
            self.matched = stop
            self._text = self._text[:start]
            return StopUpdate(self._release(len(self._text)), stop)
        return StopUpdate(self._release(len(self._text) - self._holdback()), None)

    def flush(self) -> str:
        """Generation ended without a match: return whatever was held back."""
        return self._release(len(self._text))

    def _release(self, end: int) -> str:
        out = self._text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return out

    def _find(self, old_len: int) -> tuple[int, str] | None:
        """The stop string with the earliest end past old_len (then earliest start)."""
        best: tuple[int, int, str] | None = None
        for s in self.stop:
            start = self._text.find(s, max(0, old_len - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        return None if best is None else (best[1], best[2])

    def _holdback(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self._text
        for pos in range(max(0, len(text) - self._max_len + 1), len(text)):
            if text[pos] in self._first_chars:
                tail = text[pos:]
                if any(len(s) > len(tail) and s.startswith(tail) for s in self.stop):
                    return len(text) - pos
        return 0
