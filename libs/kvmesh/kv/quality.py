"""How far a lossy reuse path moves the model's answer, measured the one way the benchmark
(`kvmesh bench quality`) and the engine's online guardrail both use: along an answer, compare
the next-token distributions computed over lossy KV with those of exact computation (teacher
forcing: both read the same answer tokens, so a divergence early does not hide what follows).

`QualityBudget` is the contract a request, a tenant or the deployment declares for a lossy path;
`compare` gives the two figures it bounds. Torch is imported only by `compare`, so the gateway
can import the budget.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_KL = 0.05
"""Nats per answer token, KL(exact || lossy): the deployment default budget."""
DEFAULT_MIN_TOP1 = 0.95
"""Share of answer positions whose most likely next token is unchanged: the deployment default."""


@dataclass(frozen=True)
class QualityBudget:
    """The quality a caller accepts from a lossy path: at most `max_kl` mean KL(exact || lossy)
    per answer token, at least `min_top1` teacher-forced top-1 agreement. None = not declared
    (filled from the next level: request, then tenant, then deployment)."""

    max_kl: Optional[float] = None
    min_top1: Optional[float] = None

    def __post_init__(self) -> None:
        if self.max_kl is not None and not (self.max_kl > 0 and math.isfinite(self.max_kl)):
            raise ValueError(f"max_kl must be a positive number of nats per token, got {self.max_kl}")
        if self.min_top1 is not None and not 0.0 < self.min_top1 <= 1.0:
            raise ValueError(f"min_top1 must be in (0, 1], got {self.min_top1}")

    def over(self, default: QualityBudget) -> QualityBudget:
        """This budget with its undeclared fields taken from `default`."""
        return QualityBudget(self.max_kl if self.max_kl is not None else default.max_kl,
                             self.min_top1 if self.min_top1 is not None else default.min_top1)

    def tighter(self, other: QualityBudget) -> QualityBudget:
        """The budget that satisfies both (smaller KL bound, larger top-1 bound)."""
        def pick(a, b, f):
            return b if a is None else a if b is None else f(a, b)
        return QualityBudget(pick(self.max_kl, other.max_kl, min), pick(self.min_top1, other.min_top1, max))

    def looser(self, other: QualityBudget) -> QualityBudget:
        """The budget that either satisfies (larger KL bound, smaller top-1 bound)."""
        def pick(a, b, f):
            return b if a is None else a if b is None else f(a, b)
        return QualityBudget(pick(self.max_kl, other.max_kl, max), pick(self.min_top1, other.min_top1, min))

    def holds(self, kl: float, top1: float) -> bool:
        """Whether measured (kl, top1) are within the budget (an undeclared bound always holds)."""
        return ((self.max_kl is None or kl <= self.max_kl)
                and (self.min_top1 is None or top1 >= self.min_top1))

    def describe(self) -> str:
        parts = []
        if self.max_kl is not None:
            parts.append(f"KL <= {self.max_kl:g}")
        if self.min_top1 is not None:
            parts.append(f"top-1 >= {self.min_top1:.1%}")
        return ", ".join(parts) or "none"


DEFAULT_BUDGET = QualityBudget(DEFAULT_MAX_KL, DEFAULT_MIN_TOP1)

LOSSY_KV_CODECS = ("fp16", "bf16", "int8", "int4", "int2")
"""KV codecs a request or tenant may opt into (lossy for a float32 engine)."""
LOSSY_FIELDS = ("kv_codec", "recompute_ratio", "max_kl", "min_top1")


@dataclass(frozen=True)
class LossyOptIn:
    """An opt-in to lossy reuse paths, with the quality accepted: a tenant's (the keys file's
    ``"lossy"`` object) or a request's (the ``kvmesh.lossy`` extension). Same JSON shape in
    both: ``{"kv_codec": "int8", "recompute_ratio": 0.15, "max_kl": 0.05, "min_top1": 0.95}``,
    every field optional."""

    kv_codec: Optional[str] = None
    """A lossy KV codec (LOSSY_KV_CODECS) for the prompt KV stored and reused; None = exact."""
    recompute_ratio: Optional[float] = None
    """Blending of documents at this recompute ratio, in [0, 1); None = no blending."""
    budget: QualityBudget = QualityBudget()

    def __post_init__(self) -> None:
        if self.kv_codec is not None and self.kv_codec not in LOSSY_KV_CODECS:
            raise ValueError(f"kv_codec {self.kv_codec!r} is not a lossy KV codec; use one of "
                             f"{', '.join(LOSSY_KV_CODECS)} (exact reuse needs no opt-in)")
        r = self.recompute_ratio
        if r is not None and not 0.0 <= r < 1.0:
            raise ValueError(f"recompute_ratio must be in [0, 1) to opt into blending (0 = pure reuse; "
                             f"1 is the exact default), got {r}")

    @classmethod
    def from_json(cls, obj: object) -> LossyOptIn:
        """From the JSON object (ValueError naming the field on anything else)."""
        if not isinstance(obj, dict):
            raise ValueError(f"must be an object with any of {', '.join(LOSSY_FIELDS)}")
        unknown = sorted(set(obj) - set(LOSSY_FIELDS))
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r}; use any of {', '.join(LOSSY_FIELDS)}")

        def number(name: str) -> Optional[float]:
            v = obj.get(name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{name} must be a number, got {v!r}")
            return None if v is None else float(v)

        codec = obj.get("kv_codec")
        if codec is not None and not isinstance(codec, str):
            raise ValueError(f"kv_codec must be a string, got {codec!r}")
        return cls(codec, number("recompute_ratio"), QualityBudget(number("max_kl"), number("min_top1")))

    def to_json(self) -> dict:
        out = {"kv_codec": self.kv_codec, "recompute_ratio": self.recompute_ratio,
               "max_kl": self.budget.max_kl, "min_top1": self.budget.min_top1}
        return {k: v for k, v in out.items() if v is not None}

    def over(self, base: Optional[LossyOptIn]) -> LossyOptIn:
        """This opt-in with what it leaves unset taken from `base` (a request over its tenant)."""
        if base is None:
            return self
        return LossyOptIn(self.kv_codec if self.kv_codec is not None else base.kv_codec,
                          self.recompute_ratio if self.recompute_ratio is not None else base.recompute_ratio,
                          self.budget.over(base.budget))

    @property
    def any(self) -> bool:
        """Opts into at least one lossy path."""
        return self.kv_codec is not None or self.recompute_ratio is not None


@dataclass(frozen=True)
class Comparison:
    """Lossy against exact along one answer of `tokens` positions."""

    tokens: int
    kl: float
    """Mean KL(exact || lossy) per position, nats."""
    top1: float
    """Share of positions whose argmax agrees."""
    nll_exact: float
    """Mean negative log-likelihood of the answer tokens, exact (log-perplexity)."""
    nll_lossy: float

    @property
    def ppl_delta(self) -> float:
        """Relative change of the answer's perplexity (0.03 = +3%)."""
        return math.exp(self.nll_lossy - self.nll_exact) - 1.0


def compare(exact_logits: torch.Tensor, lossy_logits: torch.Tensor, answer: Optional[torch.Tensor] = None) -> Comparison:
    """exact_logits, lossy_logits: [n, vocab], row i = the distribution of answer token i (the
    logits after the prompt and answer[:i]); answer: [n] token ids (for the perplexities; None
    scores each row's exact argmax)."""
    import torch

    if exact_logits.shape != lossy_logits.shape or exact_logits.dim() != 2 or not exact_logits.shape[0]:
        raise ValueError(f"compare needs two [n, vocab] logit tensors of one shape with n >= 1, got "
                         f"{tuple(exact_logits.shape)} and {tuple(lossy_logits.shape)}")
    p = torch.log_softmax(exact_logits.float(), dim=-1)
    q = torch.log_softmax(lossy_logits.float(), dim=-1)
    kl = (p.exp() * (p - q)).sum(dim=-1).clamp_min(0.0)
    top1 = (p.argmax(dim=-1) == q.argmax(dim=-1)).float()
    ids = p.argmax(dim=-1) if answer is None else answer.to(torch.long).reshape(-1)
    if ids.shape[0] != p.shape[0]:
        raise ValueError(f"answer has {ids.shape[0]} tokens for {p.shape[0]} logit rows")
    nll_p = -p.gather(1, ids[:, None]).mean()
    nll_q = -q.gather(1, ids[:, None]).mean()
    return Comparison(int(p.shape[0]), float(kl.mean()), float(top1.mean()), float(nll_p), float(nll_q))


def first_divergence(answer: Sequence[int], predicted: Sequence[int]) -> int:
    """Position of the first token where `predicted` differs from `answer` (the exact answer);
    len(answer) when it reproduces all of it (a shorter `predicted` diverges where it ends).

    With `predicted` the argmax of a lossy path's teacher-forced logits along `answer`, this is
    where the path's own greedy answer first leaves the exact one: up to that position both
    decode the same tokens, so the lossy path sees exactly the prefix it was teacher-forced
    with, and its greedy choice there is that row's argmax."""
    for i, token in enumerate(answer):
        if i >= len(predicted) or int(predicted[i]) != int(token):
            return i
    return len(answer)
