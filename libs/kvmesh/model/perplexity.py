"""Sliding-window perplexity (the method of HF's perplexity guide) and a fixed reference text."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def reference_text() -> str:
    """A fixed, offline English text for perplexity: Python's bundled pydoc topic help.

    Exact construction: ``"\\n\\n".join(pydoc_data.topics.topics[k] for k in
    sorted(pydoc_data.topics.topics))`` -- the values of the ``topics`` dict, in sorted key order,
    separated by one blank line. (It differs between Python versions; report the version with
    any number measured on it.)
    """
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@torch.inference_mode()
def perplexity(model, token_ids: Sequence[int] | torch.Tensor, window: int = 1024, stride: int = 512) -> float:
    """exp(mean negative log-likelihood) of ``token_ids`` under ``model`` (needs ``forward_dense``).

    Sliding window as in HF's guide: windows of ``window`` tokens start every ``stride`` tokens;
    each window scores only the tokens no earlier window scored (the first window scores all but
    its first token), conditioning on up to ``window - 1`` previous tokens. Every token after the
    first is scored exactly once and the mean is taken over tokens (not over windows), i.e. the
    token-weighted version of the guide's loop.
    """
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride={stride}, window={window}")
    ids = torch.as_tensor(token_ids, dtype=torch.long).flatten()
    n = ids.numel()
    if n < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    device = next(model.parameters()).device
    nll_sum, scored, prev_end = 0.0, 0, 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        chunk = ids[begin:end].to(device)
        logits = model.forward_dense(chunk[None])[0]  # [L, vocab] float32
        # logits at i predict token i+1; score targets at absolute positions max(prev_end, 1)..end-1
        first = max(prev_end, begin + 1) - begin
        logp = torch.log_softmax(logits[first - 1:-1], dim=-1)
        targets = chunk[first:]
        nll_sum += -logp.gather(1, targets[:, None]).sum().item()
        scored += targets.numel()
        prev_end = end
        if end == n:
            break
    return math.exp(nll_sum / scored)
