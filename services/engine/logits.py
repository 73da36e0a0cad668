"""What happens to a row of logits before a token is chosen from it: structured-output masks,
min_tokens, logit_bias and the penalties, with OpenAI's and vLLM's semantics.

NOTE (order and exactness). The order is vLLM's: the grammar mask, then min_tokens (end-of-
sequence and the stop token ids banned until min_tokens tokens were generated), then logit_bias
(added), then the penalties -- repetition (over prompt + output tokens: a positive logit divided
by it, a negative one multiplied), frequency (minus frequency * count, over output tokens only)
and presence (minus presence * [count > 0], output tokens only). Greedy decoding takes the
argmax of the result; sampling applies temperature, min_p, top-k and top-p after it
(sampler.sampling_probs). Every input is a value of the row's token history (`RowContext`), never
of the KV cache, so prefix-cache hits, preemption and speculative decoding cannot change it:
verification processes draft row j with the history the sequence would have at that row.

When the grammar and min_tokens together leave a row no token (the grammar can only end, and
min_tokens forbids ending), the grammar wins: the row keeps the grammar's mask alone.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvmesh.services.engine.sampling import SamplingParams


@dataclass(frozen=True)
class RowContext:
    """What one logits row's processing depends on besides the logits: the request's params and
    the tokens before the row's token."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    """Tokens generated before this row's token (for a draft row: the accepted output plus the
    drafts before it)."""


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [R, ceil(V / 32)] int32, bit b of word w allowing token 32 * w + b (llguidance's
    layout) -> allowed [R, V] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)  # [32]
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool()  # [R, W, 32]
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size]


class LogitsProcessor:
    """Applies the NOTE's processing to the rows that need it; other rows pass untouched."""

    def __init__(self, eos_token_ids: Sequence[int]) -> None:
        self.eos_token_ids = tuple(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: Sequence[RowContext],
                 allowed: torch.Tensor | None = None) -> torch.Tensor:
        """logits [R, V] float32 -> processed logits [R, V] (a new tensor when any row changes);
        allowed: [R, V] bool grammar masks, rows without a constraint all True (or None)."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"expected logits [{len(rows)}, vocab], got {list(logits.shape)}")
        todo = [i for i, r in enumerate(rows) if r.params.processes_logits]
        if not todo:
            return logits
        logits = logits.clone()
        if allowed is not None:  # computed on the CPU by the grammar library
            logits.masked_fill_(~allowed.to(logits.device, non_blocking=True), float("-inf"))
        self._min_tokens(logits, rows, todo)
        self._logit_bias(logits, rows, todo)
        penalized = [i for i in todo if rows[i].params.has_penalties]
        if penalized:
            index = torch.tensor(penalized, device=logits.device)
            logits[index] = apply_penalties(logits[index], [rows[i] for i in penalized])
        return logits

    def _min_tokens(self, logits: torch.Tensor, rows: Sequence[RowContext], todo: list[int]) -> None:
        for i in todo:
            p = rows[i].params
            if len(rows[i].output_token_ids) >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
            if not banned:
                continue
            kept = logits[i].clone()
            logits[i, banned] = float("-inf")
            if torch.isneginf(logits[i]).all():  # the grammar can only end here: it wins
                logits[i] = kept

    @staticmethod
    def _logit_bias(logits: torch.Tensor, rows: Sequence[RowContext], todo: list[int]) -> None:
        for i in todo:
            bias = rows[i].params.logit_bias
            if bias:
                ids = torch.tensor([t for t, _ in bias], device=logits.device)
                logits[i, ids] += torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)


def token_counts(histories: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """counts [R, V] float32: how often each token occurs in each row's history."""
    width = max((len(h) for h in histories), default=0)
    counts = torch.zeros(len(histories), vocab_size + 1, device=device)
    if width:
        padded = torch.full((len(histories), width), vocab_size, dtype=torch.long)  # pad -> column V
        for i, h in enumerate(histories):
            if h:
                padded[i, :len(h)] = torch.as_tensor(list(h), dtype=torch.long)
        counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, rows: Sequence[RowContext]) -> torch.Tensor:
    """Repetition, frequency and presence penalties (see the NOTE) of logits [P, V] -> [P, V]."""
    device, vocab = logits.device, logits.shape[1]
    counts = token_counts([r.output_token_ids for r in rows], vocab, device)  # [P, V]
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device)[:, None]  # [P, 1]
    if (rep != 1.0).any():
        seen = (counts > 0) | (token_counts([r.prompt_token_ids for r in rows], vocab, device) > 0)
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, scaled, logits)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device)[:, None]
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)[:, None]
    return logits - freq * counts - presence * (counts > 0).float()


@dataclass(frozen=True)
class Processing:
    """How to process a batch of logits rows: the processor, each row's context and the rows'
    grammar masks ([R, V] bool, or None when no row is constrained)."""

    processor: LogitsProcessor
    contexts: list[RowContext]
    allowed: torch.Tensor | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.processor(logits, self.contexts, self.allowed)
