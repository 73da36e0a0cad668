"""`kvmesh bench quant`'s llamacpp row without llama.cpp: a stand-in llama_cpp.Llama whose logits
equal a stand-in model's gives the same perplexity as kvmesh.model.perplexity over the same
windows (so the row scores the same tokens with the same context), and no llama_cpp gives no row."""
from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch

from kvmesh.loadtest import quant_bench
from kvmesh.model.perplexity import perplexity

VOCAB = 23


def _logits(chunk: list[int]) -> np.ndarray:
    """A causal stand-in: position i's logits depend on tokens 0..i of the window."""
    out = np.zeros((len(chunk), VOCAB), dtype=np.float32)
    running = 0.0
    for i, t in enumerate(chunk):
        running = 0.7 * running + t
        out[i] = np.sin(0.37 * np.arange(VOCAB) * (running + 1) + 0.05 * i)
    return out


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward_dense(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(_logits(x[0].tolist()))[None]


class _Llama:
    made: list[dict] = []

    def __init__(self, model_path: str, n_ctx: int, **kw) -> None:
        self.n_ctx, self.evals = n_ctx, []
        _Llama.made.append(dict(model_path=model_path, n_ctx=n_ctx, **kw))
        self.scores = np.zeros((n_ctx, VOCAB), dtype=np.float32)

    def reset(self) -> None:
        self.scores[:] = np.nan  # nothing from an earlier window may be read

    def eval(self, tokens: list[int]) -> None:
        assert len(tokens) <= self.n_ctx
        self.scores[: len(tokens)] = _logits(list(tokens))


@pytest.mark.parametrize("n, window, stride", [(50, 16, 8), (37, 16, 16), (10, 16, 8)])
def test_llamacpp_perplexity_scores_the_windows_of_kvmesh_perplexity(monkeypatch, n, window, stride):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=_Llama))
    ids = [int(x) for x in np.random.default_rng(n).integers(0, VOCAB, n)]
    got = quant_bench.llamacpp_perplexity("m.gguf", ids, window, stride)
    want = perplexity(_Model(), ids, window=window, stride=stride)
    assert math.isfinite(got) and got == pytest.approx(want, rel=1e-6)
    made = _Llama.made[-1]
    assert made["model_path"] == "m.gguf" and made["n_ctx"] == window and made["logits_all"] is True


def test_without_llama_cpp_there_is_no_row(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    assert quant_bench.llamacpp_perplexity("m.gguf", [1, 2, 3], 16, 8) is None
    assert "llamacpp row skipped" in capsys.readouterr().err
