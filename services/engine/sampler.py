"""Turns one step's logits into next tokens, each sequence with its own params and random stream."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

from kvmesh.services.engine.logits import Processing
from kvmesh.services.engine.sampling import SamplingParams


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one generated position, under the model's unmodified distribution."""

    token_id: int
    logprob: float
    """The chosen token's logprob."""
    top: list[tuple[int, float]]
    """The n most likely (token id, logprob), most likely first; n = SamplingParams.logprobs."""


@dataclass(frozen=True)
class SamplerOutput:
    """One entry per input row."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """None for rows whose request did not ask for logprobs."""


def token_logprobs(logits: torch.Tensor, chosen: list[int], top_n: list[int]) -> list[TokenLogprobs]:
    """Per row of logits [N, vocab]: the log_softmax logprob of token chosen[i] and the top_n[i]
    most likely (token id, logprob), most likely first (ties by token id order of topk)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    ids = torch.tensor(chosen, dtype=torch.long, device=logits.device)  # [N]
    picked = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    k = min(max(top_n, default=0), logprobs.shape[-1])
    top_vals: list[list[float]] = [[] for _ in chosen]
    top_ids: list[list[int]] = [[] for _ in chosen]
    if k:
        vals, idx = logprobs.topk(k, dim=-1)  # [N, k], most likely first
        top_vals, top_ids = vals.tolist(), idx.tolist()
    return [TokenLogprobs(token_id=chosen[i], logprob=picked[i],
                          top=list(zip(top_ids[i][:top_n[i]], top_vals[i][:top_n[i]])))
            for i in range(len(chosen))]


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside its row's top-k, then outside its row's top-p nucleus.

    logits: [R, V] float32; top_k: [R] int64, 0 = off; top_p: [R] float32 in (0, 1], 1 = off.
    Top-p keeps the smallest set of most likely tokens whose mass (after top-k) reaches p; the
    most likely token always survives. Ties are broken by token id (stable sort) so it is exact.
    """
    num_rows, vocab = logits.shape
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [R, V]
    ranks = torch.arange(vocab, device=logits.device)  # [V]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)  # [R]
    sorted_logits = sorted_logits.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))
    probs = sorted_logits.softmax(dim=-1)  # [R, V]
    mass_before = probs.cumsum(dim=-1) - probs  # [R, V] mass of the strictly more likely tokens
    outside = mass_before >= top_p[:, None]
    outside[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(outside, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, sorted_ids, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit whose probability is below min_p times its row's largest one.
    logits: [R, V] float32 (temperature applied); min_p: [R] float32 in [0, 1], 0 = off."""
    probs = logits.softmax(dim=-1)  # [R, V]
    floor = probs.max(dim=-1, keepdim=True).values * min_p[:, None]  # [R, 1]
    return logits.masked_fill(probs < floor, float("-inf"))


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax of logits [R, vocab] divided by the row's
    temperature, after its min_p, top-k and top-p, in vLLM's order (every row must sample:
    temperature > 0). [R, vocab] float32. Speculative verification accepts drafts against
    exactly this distribution."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)  # [R]
    scaled = logits.float() / temperature[:, None]  # [R, V]
    if any(p.min_p > 0.0 for p in params):
        scaled = apply_min_p(scaled, torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1)


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The seed of the draw for output position `position` of a request seeded `seed`: both
    mixed through splitmix64's finalizer, so neighbouring seeds or positions give unrelated
    streams. A 64-bit value (what torch.Generator.manual_seed takes)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class Draws:
    """A sampled request's randomness, keyed by output position.

    NOTE: the draw that picks output token p (0 = the first generated token) comes from a
    generator seeded with position_seed(seed, p), never from a stream shared with earlier
    draws. A token therefore depends only on (seed, p) and the distribution at p. That is what
    makes a seeded request reproducible wherever its tokens are computed: after a preemption
    (recompute), on another replica that continues it (request migration resumes at position
    p with the same seed), and with or without speculative decoding (verification samples
    position p exactly as plain decoding does: see speculation's NOTE).
    """

    def __init__(self, seed: int, device: torch.device | str = "cpu") -> None:
        self.seed = seed
        self._generator = torch.Generator(device=device)

    def at(self, position: int) -> torch.Generator:
        """The generator for the draw at output `position` (one object, re-seeded per call:
        use it before asking for another position)."""
        self._generator.manual_seed(position_seed(self.seed, position))
        return self._generator


def make_draws(params: SamplingParams, device: torch.device | str = "cpu") -> Draws | None:
    """A request's Draws, seeded from params.seed (else a random 64-bit seed); None when greedy.
    Keep it for the request's lifetime."""
    if params.greedy:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(64)
    return Draws(seed, device)


class Sampler:
    """Samples the next token of N sequences from logits [N, vocab].

    The logits are first processed (`logits.LogitsProcessor`: grammar masks, min_tokens,
    logit_bias, penalties) for the rows that ask for it. Greedy rows (temperature 0) are then one
    batched argmax. Other rows get temperature, min_p, top-k and top-p applied as one batched
    tensor op, then one draw each from the row's own generator (`Draws.at` the row's output
    position). A row's draw never touches another row's, so a seed reproduces its output
    whatever else shares the batch.
    Logprobs come from log_softmax of the raw logits, before any processing (vLLM's default).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        processing: Processing | None = None,
    ) -> SamplerOutput:
        """logits [N, vocab]; params and generators: one per row (generators on logits' device);
        processing: the rows' logits processing, needed when a row's params ask for any."""
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
            raise ValueError(
                f"expected logits [{len(params)}, vocab] and {len(params)} generators, got "
                f"{list(logits.shape)} and {len(generators)}"
            )
        raw = logits = logits.float()
        if processing is not None:
            logits = processing(logits)
        elif any(p.processes_logits for p in params):
            raise ValueError("a row's params process logits (penalties, logit_bias, min_tokens, a "
                             "constraint) but no row histories were given")
        device = logits.device
        token_ids = logits.argmax(dim=-1)  # [N]

        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rparams = [params[i] for i in random_rows]
            index = torch.tensor(random_rows, device=device)  # [R]
            probs = sampling_probs(logits[index], rparams)  # [R, V]
            drawn = []
            for j, i in enumerate(random_rows):
                if generators[i] is None:
                    raise ValueError(f"row {i} samples (temperature > 0) but has no generator")
                drawn.append(torch.multinomial(probs[j], 1, generator=generators[i]))
            token_ids[index] = torch.cat(drawn)

        ids = token_ids.tolist()
        return SamplerOutput(token_ids=ids, logprobs=self._logprobs(raw, params, ids))

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, params: list[SamplingParams], ids: list[int]
    ) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(params)
        lp_rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not lp_rows:
            return out
        rows = torch.tensor(lp_rows, device=logits.device)
        entries = token_logprobs(logits[rows], [ids[i] for i in lp_rows], [params[i].logprobs for i in lp_rows])
        for i, entry in zip(lp_rows, entries):
            out[i] = entry
        return out
