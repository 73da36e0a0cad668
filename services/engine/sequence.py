"""One request's tokens and progress, as the scheduler and block manager see them."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from kvmesh.services.engine.sampling import SamplingParams

if TYPE_CHECKING:  # the control plane does not import torch
    import torch

    KvPayload = tuple[torch.Tensor, torch.Tensor]
    """Keys and values [layers, tokens, kv_heads, head_dim], keys rotated to their positions (on
    CUDA, a fetched payload is a kv_copies.StagedKv: the same, copying to the device)."""


class SequenceStatus(enum.Enum):
    """Where a sequence is: queued, holding KV blocks and being computed, or done."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


class FinishReason(str, enum.Enum):
    """Why a sequence stopped; the values mirror kvmesh.common.v1.FinishReason."""

    STOP = "stop"
    """An end-of-sequence token or one of the request's stop token ids was produced."""
    LENGTH = "length"
    """max_tokens was reached."""
    ABORT = "abort"
    """Aborted by the client, a deadline or the engine."""
    STOP_STRING = "stop_string"
    """One of the request's stop strings appeared in the output text."""

    def __str__(self) -> str:
        return self.value  # "stop", not "FinishReason.STOP", in labels and f-strings


@dataclass(eq=False)
class Sequence:
    """A request inside the engine.

    The scheduling model is vLLM v1's single token budget: a sequence *knows* `num_tokens` tokens
    (prompt + generated) and has *computed* `num_computed_tokens` of them (their KV is in the paged
    cache). Each step the scheduler gives it some tokens to compute; prefill chunks, prefix-cache
    hits, decodes and the recompute after a preemption are all the same thing. When every known
    token is computed the sequence needs sampling: the logits of its last token give the next one.

    Identity semantics (eq=False): two sequences are the same only if they are the same object,
    so they can key dicts and sets.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the paged cache (prefix-cache hits included)."""
    num_cached_tokens: int = 0
    """Prompt tokens reused at the last admission: prefix-cache hits plus imported KV."""
    num_imported_tokens: int = 0
    """Of those, the tokens whose KV was imported (fetched from the KV-cache service, or blended)."""
    block_table: list[int] = field(default_factory=list)
    """Physical KV block of each logical block: token p lives in block_table[p // block_size]."""
    finish_reason: str | None = None
    namespace: bytes = b""
    """Digest of the request's KvNamespace (model, layout, storage format, tenant): sequences
    only share prefix-cache blocks with equal namespaces."""
    needs_prompt_logprobs: bool = False
    """Set while the request's prompt logprobs are being collected: the scheduler then computes
    the whole prompt (no prefix-cache hits, no imported KV) and the runner returns the logits
    of every prompt position. Cleared once they are delivered with the first token."""
    external_kv: Optional[KvPayload] = None
    """Prompt KV fetched from the KV-cache service or blended (the runner writes it), covering
    positions external_start..external_tokens-1. Dropped once imported, or if admission finds
    it moot."""
    external_start: int = 0
    """First position `external_kv` covers: the fetch skips what the engine's own prefix cache
    held when the request arrived, so it only fits on top of at least that many local hits."""
    external_tokens: int = 0
    """End of what `external_kv` covers: whole blocks, always fewer than the prompt (the last
    prompt token is computed to produce logits)."""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known: prompt + generated."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """A new list of prompt + generated token ids."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    @property
    def num_pending_prefill_tokens(self) -> int:
        """Known tokens still to compute before the sequence decodes: the rest of its prompt, or
        after a preemption everything but its last generated token (recomputed like a prompt)."""
        decode_token = 1 if self.output_token_ids else 0
        return max(0, self.num_tokens - decode_token - self.num_computed_tokens)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_sampling(self) -> bool:
        """True after a step that computed every known token: the next token must be sampled."""
        return self.num_computed_tokens == self.num_tokens

    def token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in positions [start, end) without building the whole token list."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def append_token(self, token_id: int) -> None:
        """Record a sampled token; it becomes known (not yet computed) and is computed next step."""
        self.output_token_ids.append(token_id)
