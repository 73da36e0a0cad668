"""Load a llama-architecture GGUF file: dequantize to float32, undo llama.cpp's q/k permutation,
rename to HF names, and cache the result as an HF-style folder so a restart skips all of it.

NOTE (cache). Parsing the GGUF metadata alone takes seconds (one Python object per vocabulary
entry) and dequantizing more, so the converted checkpoint is written once to
``<cache_dir>/gguf/<sha256 of the file>-v<CONVERSION_VERSION>/`` (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) and later loads read only that folder. The folder is built
under a temporary name and renamed into place, so a crash or a concurrent loader never leaves a
half-written entry; the loser of a race just uses the winner's folder. Bump CONVERSION_VERSION
whenever the conversion changes, so stale entries are never read.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from kvmesh.model.bundled import default_cache_dir
from kvmesh.model.config import ModelConfig
from kvmesh.model.hf_loader import Checkpoint, load_hf_folder, sha256_file
from kvmesh.model.tokenizer import Tokenizer

CONVERSION_VERSION = 1

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF name; raises ValueError for tensors the model lacks."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama model")


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of q/k rows.

    HF orders each head's rows as [first half | second half] of the rotary pairs; llama.cpp
    interleaves them (row 2i, 2i+1 = pair i). w: [n_heads*head_dim, in].
    """
    rows, cols = w.shape
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, cols).transpose(1, 2).reshape(rows, cols)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field as a plain Python value."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} unsupported (only 'llama')")
    if any(k.startswith("llama.rope.scaling") for k in meta) or "rope_freqs.weight" in tensor_names:
        raise ValueError("GGUF with RoPE scaling is not supported")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    head_dim = int(meta.get("llama.attention.key_length") or meta.get("llama.rope.dimension_count") or hidden // heads)
    vocab = int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        name=str(meta.get("general.name") or "gguf-llama"),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta["llama.feed_forward_length"]),
        num_layers=int(meta["llama.block_count"]),
        num_heads=heads,
        num_kv_heads=int(meta.get("llama.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        max_position_embeddings=int(meta["llama.context_length"]),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def convert_gguf(path: str | Path, out_dir: str | Path, *, progress: bool = True) -> ModelConfig:
    """Dequantize ``path`` into an HF-style checkpoint folder ``out_dir`` (must exist, empty)."""
    reader = GGUFReader(str(path))
    meta = read_metadata(reader)
    config = config_from_metadata(meta, {t.name for t in reader.tensors})
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc="kvmesh: dequantizing GGUF", unit="tensor", file=sys.stderr,
                  disable=not progress):
        name = hf_name(t.name)
        # numpy shape is GGUF's reversed: [out_features, in_features] like torch Linear.
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if name.endswith("q_proj.weight"):
            w = unpermute_rope(w, config.num_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rope(w, config.num_kv_heads)
        state[name] = w.contiguous()
    out_dir = Path(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = {**config.to_hf_config(), "torch_dtype": "float32"}
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    Tokenizer.from_gguf_metadata(meta).save_hf(out_dir)
    return config


def ensure_converted(path: str | Path, *, cache_dir: str | Path | None = None, progress: bool = True,
                     digest: str | None = None) -> tuple[Path, str]:
    """The cache folder holding ``path`` converted (converting it first if needed), and its sha256."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    digest = digest or sha256_file(path)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    entry = root / "gguf" / f"{digest}-v{CONVERSION_VERSION}"
    if not entry.is_dir():
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:16]}-", dir=entry.parent))
        try:
            convert_gguf(path, tmp, progress=progress)
            try:
                os.rename(tmp, entry)  # atomic publish
            except OSError:
                if not entry.is_dir():
                    raise
                # another process published first; its folder is equivalent
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return entry, digest


def load_gguf(path: str | Path, *, cache_dir: str | Path | None = None, progress: bool = True,
              digest: str | None = None) -> Checkpoint:
    """Load a GGUF file, converting it into the cache on first use (see module NOTE)."""
    entry, digest = ensure_converted(path, cache_dir=cache_dir, progress=progress, digest=digest)
    return load_hf_folder(entry, digest=digest)
