"""Per-request sampling and stopping parameters, validated once at admission.

`SamplingParams.validate` is the engine's one check of a request's sampling fields (called by
`EngineCore.validate` for every request the gRPC edge admits); the limits are the shared ones in
`kvmesh.limits`, which the gateway checks too, with OpenAI's parameter names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvmesh.errors import InvalidArgument
from kvmesh.grammar import Constraint, ConstraintKind
from kvmesh.limits import (MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_SEED, MAX_STOP_STRING_CHARS,
                           MAX_STOP_STRINGS, MAX_TEMPERATURE)

__all__ = ["Constraint", "ConstraintKind", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples its tokens and when it stops.

    Defaults follow the engine proto: greedy decoding, 256 tokens, no stop strings. Sequences are
    stored as tuples so the object is hashable and cannot change under a running request; lists
    passed by callers are converted on construction.
    """

    max_tokens: int = 256
    """Maximum tokens to generate (1 .. context length - prompt length)."""
    temperature: float = 0.0
    """0 means greedy (argmax); otherwise the logits are divided by it, in (0, 2]."""
    top_k: int = 0
    """Keep only the k most likely tokens; 0 disables."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose mass reaches top_p; 1 disables."""
    seed: int | None = None
    """Seed of this request's own random stream; None draws a random seed."""
    stop: tuple[str, ...] = ()
    """Stop strings: the output text is cut before the first one that appears."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end generation, in addition to the model's end-of-sequence ids."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (benchmarks)."""
    logprobs: int | None = None
    """None: no log-probabilities. n: the chosen token's logprob plus the top-n alternatives."""
    prompt_logprobs: int | None = None
    """None: none. n: each prompt token's logprob (from the second on) plus the top-n
    alternatives at its position. The prompt is then computed in full (no cached KV reused)."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from the logit of every token generated at least once, in [-2, 2]."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted once per time a token was generated, in [-2, 2]."""
    repetition_penalty: float = 1.0
    """vLLM's (and HF's): each token seen in the prompt or the output has a positive logit divided
    by it and a negative one multiplied by it; > 0, 1 disables."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in [-100, 100]) pairs, added to the logits (a dict is converted)."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one, in [0, 1]; 0 disables."""
    min_tokens: int = 0
    """No stop condition before this many tokens are generated: end-of-sequence and stop_token_ids
    are masked (logits.py), and a stop string counts only when it ends later (stop.py's NOTE)."""
    constraint: Constraint | None = None
    """Structured output: the language the output must belong to (None: free text)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted((t, b) for t, b in bias)))

    @property
    def has_penalties(self) -> bool:
        """True when the logits depend on the token history (presence, frequency, repetition)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """True when the logits change before argmax or temperature (penalties, logit_bias,
        min_tokens, a constraint); rows without any skip that work."""
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
                or self.constraint is not None)

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax of the logits."""
        return self.temperature == 0.0

    def validate(self, *, prompt_len: int, max_model_len: int, vocab_size: int) -> None:
        """Raise InvalidArgument, saying what to fix, if this request cannot be served."""
        if prompt_len < 1:
            raise InvalidArgument("the prompt is empty; send at least one token")
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be at least 1, got {self.max_tokens}")
        if prompt_len + self.max_tokens > max_model_len:
            raise InvalidArgument(
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the model's "
                f"context length {max_model_len}; shorten the prompt or lower max_tokens"
            )
        if math.isnan(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidArgument(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 means greedy), got {self.temperature}"
            )
        if math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise InvalidArgument(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed <= MAX_SEED:
                raise InvalidArgument(f"seed must be in [0, 2^64 - 1], got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not 0 <= value <= MAX_LOGPROBS:
                    raise InvalidArgument(
                        f"{name} must be in 0..{MAX_LOGPROBS} (top alternatives per token), got {value}")
        self._validate_stops(vocab_size)
        self._validate_processing(vocab_size)

    def _validate_processing(self, vocab_size: int) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidArgument(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] "
                                      f"(0 disables it), got {value}")
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidArgument(f"repetition_penalty must be > 0 (1 disables it; above 1 "
                                  f"discourages repeats), got {self.repetition_penalty}")
        if math.isnan(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgument(f"min_tokens must be in 0..max_tokens ({self.max_tokens}), "
                                  f"got {self.min_tokens}")
        for tid, bias in self.logit_bias:
            _check_int("logit_bias token id", tid)
            if not 0 <= tid < vocab_size:
                raise InvalidArgument(f"logit_bias token id {tid} is outside the vocabulary "
                                      f"(0..{vocab_size - 1})")
            if not math.isfinite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidArgument(f"logit_bias of token {tid} must be in [-{MAX_LOGIT_BIAS:g}, "
                                      f"{MAX_LOGIT_BIAS:g}], got {bias}")
        if self.constraint is not None:
            self.constraint.validate()

    def _validate_stops(self, vocab_size: int) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgument(
                f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}; drop some"
            )
        for i, s in enumerate(self.stop):
            if not isinstance(s, str) or not s:
                raise InvalidArgument(f"stop[{i}] is empty; stop strings need at least one character")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgument(
                    f"stop[{i}] is {len(s)} characters long; the limit is {MAX_STOP_STRING_CHARS}"
                )
        for tid in self.stop_token_ids:
            _check_int("stop_token_ids", tid)
            if not 0 <= tid < vocab_size:
                raise InvalidArgument(
                    f"stop token id {tid} is outside the vocabulary (0..{vocab_size - 1})"
                )


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
