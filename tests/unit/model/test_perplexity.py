"""Sliding-window perplexity against HF's guide loop (token-weighted), on the tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from kvmesh.model.loader import load_model
from kvmesh.model.perplexity import perplexity, reference_text


def hf_guide_perplexity(hf_model, ids: torch.Tensor, window: int, stride: int) -> float:
    """HF's perplexity guide loop (labels=-100 outside the new tokens), weighting each window's
    mean loss by the number of tokens it actually scored."""
    n = ids.numel()
    nll, count, prev_end = 0.0, 0, 0
    for begin in range(0, n, stride):
        end = min(begin + window, n)
        trg_len = end - prev_end
        x = ids[None, begin:end]
        labels = x.clone()
        labels[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf_model(x, labels=labels).loss.item()
        scored = int((labels[:, 1:] != -100).sum())  # the model shifts labels by one
        nll += loss * scored
        count += scored
        prev_end = end
        if end == n:
            break
    return math.exp(nll / count)


@pytest.mark.parametrize("window, stride", [(64, 64), (32, 16), (40, 7), (200, 100)])
def test_matches_hf_guide(tiny, window, stride):
    model = load_model(str(tiny.folder)).model
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (150,))
    want = hf_guide_perplexity(tiny.hf_model, ids, window, stride)
    assert perplexity(model, ids.tolist(), window=window, stride=stride) == pytest.approx(want, rel=1e-5)


def test_full_window_is_plain_perplexity(tiny):
    model = load_model(str(tiny.folder)).model
    ids = torch.arange(3, 60) % 128
    logp = torch.log_softmax(model.forward_dense(ids[None])[0, :-1], -1)
    want = math.exp(-logp.gather(1, ids[1:, None]).mean().item())
    assert perplexity(model, ids, window=1024, stride=512) == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError):
        perplexity(model, ids, window=8, stride=16)


def test_reference_text_construction():
    from pydoc_data.topics import topics

    text = reference_text()
    assert text == "\n\n".join(topics[k] for k in sorted(topics))
    assert len(text) > 100_000 and text == reference_text()
