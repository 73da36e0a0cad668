"""Speculative decoding, the engine's half: verifying draft tokens against the target model.

Drafts come from the draft service (see draft_client); the scheduler computes them in the same
forward pass as every other token (see its NOTE), the runner returns the logits of every draft
position, and this module decides which drafts the target accepts.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from kvmesh.services.engine.logits import Processing
from kvmesh.services.engine.sampler import Draws, sampling_probs
from kvmesh.services.engine.sampling import SamplingParams


class SpecMode(str, enum.Enum):
    """Speculative decoding policy of one request (mirrors kvmesh.engine.v1.Speculation)."""

    OFF = "off"
    """Plain decoding."""
    NGRAM = "ngram"
    """Prompt-lookup drafts."""
    MODEL = "model"
    """Drafts from the draft service's model drafter."""
    ADAPTIVE = "adaptive"
    """The draft service picks drafter and draft length from the acceptance it sees."""

    def __str__(self) -> str:
        return self.value


@dataclass
class SpecUsage:
    """Speculative decoding counters of one request, or of the whole engine."""

    steps: int = 0
    """Decode steps that verified at least one draft token."""
    draft_tokens: int = 0
    """Draft tokens verified (proposed tokens the step had no budget or blocks for are not)."""
    accepted_tokens: int = 0
    """Verified draft tokens that were accepted and emitted (a stop inside an accepted run
    drops the rest of it)."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying k drafts: the accepted ones and the target's next token."""

    token_ids: list[int]
    """Tokens to emit, in order: drafts[:num_accepted], then one token from the target
    (a correction at the first rejection, or the bonus token after all k): 1..k+1 tokens."""
    num_accepted: int


# NOTE: the acceptance rule (speculative sampling, Leviathan et al. 2023 / Chen et al. 2023,
# specialised to a point-mass proposal).
#
# The engine's last token t and the drafts x_1..x_k were computed in one forward pass: logits
# row j (0..k) is the target's distribution of the token after t, x_1..x_j. Let p_j be the
# distribution the request samples from at row j: softmax(logits_j / temperature) after min_p,
# top-k and top-p, exactly what plain sampling uses (sampler.sampling_probs). The logits are
# first processed as plain decoding processes them (services/engine/logits.py): row j with the
# history t, x_1..x_j and the grammar mask after x_1..x_j, so penalties, logit_bias and
# structured output give the same tokens with or without drafts, and a draft the grammar
# forbids has p_{j-1}(x_j) = 0: it is always rejected.
#
# The draft service proposes tokens, not distributions: a proposal is a point mass q(x_j) = 1.
# Speculative sampling accepts x_j with probability min(1, p_j(x_j) / q(x_j)) = p_j(x_j) and on
# rejection samples the residual max(0, p_j - q) normalised, p_j with x_j removed. For a point
# mass the same joint law comes from sampling first and comparing:
#
#     for j in 1..k:
#         y ~ p_{j-1}, drawn with the generator of y's output position (sampler.Draws)
#         if y == x_j:  accept x_j, go on        (probability p_{j-1}(x_j), as above)
#         else:         emit y; stop             (y is p_{j-1} conditioned on y != x_j)
#     all k accepted:   emit y ~ p_k             (the bonus token, same draw rule)
#
# Each emitted token is a plain sample from its row's p, so the output distribution is the
# target's whatever the drafts are, and the acceptance rate is the rejection rule's. And since
# position n's draw uses the same seeded generator as plain decoding's draw at n, a seeded
# request gives the same tokens with or without speculation, whatever the drafts (up to the
# float rounding any change of batch shape brings to the logits: see the runner's NOTE).
# Greedy requests (temperature 0) have p_j = one-hot(argmax_j): accept the longest prefix of
# drafts equal to the target's argmax, then emit the argmax at the first mismatch (or after all
# k) -- token for token what plain greedy decoding produces.


def verify(logits: torch.Tensor, drafts: tuple[int, ...] | list[int], params: SamplingParams,
           draws: Draws | None, position: int = 0) -> Verdict:
    """Applies the acceptance rule (see the NOTE) to one sequence.

    logits: [k + 1, vocab] float32, row j predicting the token after draft j (row 0: after the
    last known token); drafts: the k draft token ids; draws: the request's (None when greedy);
    position: the output position row 0 predicts (the sequence's output tokens so far).
    """
    return verify_batch([logits], [tuple(drafts)], [params], [draws], [position])[0]


def verify_batch(logits: list[torch.Tensor], drafts: list[tuple[int, ...]], params: list[SamplingParams],
                 draws: list[Draws | None], positions: list[int],
                 processing: Processing | None = None) -> list[Verdict]:
    """`verify` for several sequences with one argmax and one sampling_probs over all their rows
    (per-sequence tensor ops cost more than the arithmetic on a CPU), then the rule per sequence.

    processing: the logits processing of every row, in order (see the NOTE), needed when a
    request processes its logits."""
    for rows, d in zip(logits, drafts):
        if rows.dim() != 2 or rows.shape[0] != len(d) + 1:
            raise ValueError(f"expected logits [{len(d) + 1}, vocab] for {len(d)} drafts, got {list(rows.shape)}")
    flat = torch.cat(logits).float()  # [R, V], R = sum of (k + 1)
    if processing is not None:
        flat = processing(flat)
    elif any(p.processes_logits for p in params):
        raise ValueError("a request processes its logits but no row contexts were given")
    starts = [0]
    for rows in logits:
        starts.append(starts[-1] + rows.shape[0])
    argmax = flat.argmax(dim=-1).tolist() if any(p.greedy for p in params) else []  # [R]
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    probs = {}
    if sampled:
        index = torch.tensor([r for i in sampled for r in range(starts[i], starts[i + 1])])
        row_params = [params[i] for i in sampled for _ in range(starts[i], starts[i + 1])]
        p_all = sampling_probs(flat[index], row_params)  # [S, V]
        offset = 0
        for i in sampled:
            n = starts[i + 1] - starts[i]
            probs[i], offset = p_all[offset:offset + n], offset + n
    verdicts = []
    for i, d in enumerate(drafts):
        if params[i].greedy:
            verdicts.append(_accept_greedy(argmax[starts[i]:starts[i + 1]], d))
        elif draws[i] is None:
            raise ValueError("a sampled request (temperature > 0) needs its Draws")
        else:
            verdicts.append(_accept_sampled(probs[i], d, draws[i], positions[i]))
    return verdicts


def _accept_greedy(target: list[int], drafts: tuple[int, ...]) -> Verdict:
    """target: the argmax of each of the k + 1 rows."""
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return Verdict(target[:n + 1], n)


def _accept_sampled(probs: torch.Tensor, drafts: tuple[int, ...], draws: Draws, position: int) -> Verdict:
    """probs: [k + 1, V], row j the distribution p_j of the NOTE; row 0 samples output
    `position`."""
    for j, x in enumerate(drafts):
        y = torch.multinomial(probs[j], 1, generator=draws.at(position + j)).item()
        if y != x:
            return Verdict([*drafts[:j], y], j)
    k = len(drafts)
    bonus = torch.multinomial(probs[k], 1, generator=draws.at(position + k)).item()
    return Verdict([*drafts, bonus], k)
