"""Load a GGUF file of the llama (Llama 2/3/3.1+, Mistral) or qwen2 (Qwen2, Qwen2.5) architecture:
dequantize to float32, undo llama.cpp's q/k permutation (llama only: qwen2 keeps HF's order),
rename to HF names, and cache the result as an HF-style folder so a restart skips all of it.

RoPE scaling comes from ``<arch>.rope.scaling.*`` (linear) or from the ``rope_freqs.weight``
tensor llama.cpp writes for Llama 3.1's llama3 scaling (kept as per-frequency divisors); other
scaling types (YaRN, LongRoPE) are refused.

NOTE (cache). Parsing the GGUF metadata alone takes seconds (one Python object per vocabulary
entry) and dequantizing more, so the converted checkpoint is written once to
``<cache_dir>/gguf/<sha256 of the file>-v<CONVERSION_VERSION>/`` (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json) and later loads read only that folder. The folder is built
under a temporary name and renamed into place, so a crash or a concurrent loader never leaves a
half-written entry; the loser of a race just uses the winner's folder. Bump CONVERSION_VERSION
whenever the conversion changes, so stale entries are never read.

NOTE (the file's own blocks). ``read_quantized`` is the other way in, for ``weights="gguf"``
(kvmesh.model.quant.GGUFLinear): each 2-D weight exactly as the file stores it, rows of
quantized blocks, nothing dequantized. llama's q/k un-permutation is a permutation of whole
rows, so it moves rows of blocks just as it moves rows of floats.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from kvmesh.model.bundled import default_cache_dir
from kvmesh.model.config import SUPPORTED, ModelConfig, RopeScaling, UnsupportedModelError
from kvmesh.model.hf_loader import Checkpoint, load_hf_folder, sha256_file
from kvmesh.model.tokenizer import Tokenizer

CONVERSION_VERSION = 2

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
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
"""``general.architecture`` values that load, and their family (Mistral files say llama)."""
ROPE_FREQS = "rope_freqs.weight"


def hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF name; raises ValueError for tensors the model lacks."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r} for a llama-family model")


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of q/k rows.

    HF orders each head's rows as [first half | second half] of the rotary pairs; llama.cpp
    interleaves them (row 2i, 2i+1 = pair i). w: [n_heads*head_dim, in].
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class QuantizedTensor:
    """One weight matrix as a GGUF file holds it."""

    qtype: int  # ggml type id (gguf.GGMLQuantizationType)
    rows: torch.Tensor  # [out_features, bytes per row] uint8: each row its run of blocks
    in_features: int


def read_quantized(path: str | Path) -> dict[str, QuantizedTensor]:
    """The 2-D weights of a GGUF file by HF name (``lm_head.weight`` absent when tied), as the
    file's own blocks; llama's q/k rows un-permuted as ``convert_gguf`` does (see the NOTE).
    gguf-py parses the whole header, vocabulary included (~1.5 s for SmolLM2's): serving loads
    go through ``load_quantized``'s cache instead."""
    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(ARCHITECTURES)} ({SUPPORTED})")
    heads = int(reader.fields[f"{arch}.attention.head_count"].contents())
    kv_field = reader.fields.get(f"{arch}.attention.head_count_kv")
    kv_heads = heads if kv_field is None else int(kv_field.contents())
    out: dict[str, QuantizedTensor] = {}
    for t in reader.tensors:
        if len(t.shape) != 2 or t.name == ROPE_FREQS:
            continue
        name = hf_name(t.name)
        rows = torch.from_numpy(np.ascontiguousarray(t.data).view(np.uint8).reshape(int(t.shape[1]), -1).copy())
        if arch == "llama" and ".q_proj." in name:
            rows = unpermute_rope(rows, heads).contiguous()
        elif arch == "llama" and ".k_proj." in name:
            rows = unpermute_rope(rows, kv_heads).contiguous()
        out[name] = QuantizedTensor(int(t.tensor_type), rows, int(t.shape[0]))
    return out


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """Every key/value field as a plain Python value."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def config_from_metadata(meta: dict[str, Any], tensor_names: set[str],
                         rope_freqs: tuple[float, ...] = ()) -> ModelConfig:
    """The ModelConfig of a GGUF file's metadata; UnsupportedModelError for an architecture or RoPE
    scaling this model code does not run. ``rope_freqs``: the values of its rope_freqs.weight."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} is not supported; supported: "
                                    f"{', '.join(ARCHITECTURES)} ({SUPPORTED})")

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads)
    vocab = int(key("vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    eos = [int(meta[k]) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    bos = meta.get("tokenizer.ggml.bos_token_id")
    window = key("attention.sliding_window")
    family = ARCHITECTURES[arch]
    if family == "llama" and window:
        family = "mistral"  # llama.cpp writes Mistral as llama; a window is Mistral's
    has_bias = "blk.0.attn_q.bias" in tensor_names
    return ModelConfig(
        name=str(meta.get("general.name") or f"gguf-{arch}"),
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv") or heads),
        head_dim=head_dim,
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        family=family,
        qkv_bias=has_bias,
        o_bias=has_bias and "blk.0.attn_output.bias" in tensor_names,
        rope_scaling=_rope_scaling(key, rope_freqs),
        sliding_window=int(window) if window and family == "mistral" else None,
    )


def _rope_scaling(key: Callable[..., Any], rope_freqs: tuple[float, ...]) -> RopeScaling | None:
    kind = key("rope.scaling.type", "none")
    factor = float(key("rope.scaling.factor", 0.0) or 0.0)
    if rope_freqs:
        if kind not in ("none", "linear") or (kind == "linear" and factor not in (0.0, 1.0)):
            raise UnsupportedModelError(f"GGUF with both rope_freqs and rope scaling {kind!r} is not supported")
        return RopeScaling("llama3", freq_factors=rope_freqs)
    if kind == "none" or (kind == "linear" and factor in (0.0, 1.0)):
        return None
    if kind != "linear":
        raise UnsupportedModelError(f"GGUF rope scaling {kind!r} is not supported; supported: linear and "
                                    "llama3 (rope_freqs)")
    return RopeScaling("linear", factor)


def convert_gguf(path: str | Path, out_dir: str | Path, *, progress: bool = True) -> ModelConfig:
    """Dequantize ``path`` into an HF-style checkpoint folder ``out_dir`` (must exist, empty)."""
    reader = GGUFReader(str(path))
    meta = read_metadata(reader)
    # numpy shape is GGUF's reversed: [out_features, in_features] like torch Linear.
    tensors = {t.name: t for t in reader.tensors}
    freqs = tensors.pop(ROPE_FREQS, None)
    rope_freqs = () if freqs is None else tuple(
        float(f) for f in np.array(dequantize(freqs.data, freqs.tensor_type), dtype=np.float32).reshape(-1))
    config = config_from_metadata(meta, set(tensors) | ({ROPE_FREQS} if freqs is not None else set()), rope_freqs)
    permuted = meta.get("general.architecture") == "llama"  # llama.cpp interleaves llama's q/k rows
    state: dict[str, torch.Tensor] = {}
    for t in tqdm(tensors.values(), desc="kvmesh: dequantizing GGUF", unit="tensor", file=sys.stderr,
                  disable=not progress):
        name = hf_name(t.name)
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if permuted and ".q_proj." in name:
            w = unpermute_rope(w, config.num_heads)
        elif permuted and ".k_proj." in name:
            w = unpermute_rope(w, config.num_kv_heads)
        state[name] = w.contiguous()
    out_dir = Path(out_dir)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_cfg = {**config.to_hf_config(), "torch_dtype": "float32"}
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    Tokenizer.from_gguf_metadata(meta).save_hf(out_dir)
    return config


def conversion_folder(digest: str, cache_dir: str | Path | None = None) -> Path:
    """The cache folder of the GGUF file whose sha256 is ``digest`` (a folder once converted)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return root / "gguf" / f"{digest}-v{CONVERSION_VERSION}"


def ensure_converted(path: str | Path, *, cache_dir: str | Path | None = None, progress: bool = True,
                     digest: str | None = None) -> tuple[Path, str]:
    """The cache folder holding ``path`` converted (converting it first if needed), and its sha256."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    digest = digest or sha256_file(path)
    entry = conversion_folder(digest, cache_dir)
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


BLOCKS_FILE = "gguf-blocks.safetensors"


def load_quantized(path: str | Path, *, cache_dir: str | Path | None = None,
                   digest: str | None = None) -> dict[str, QuantizedTensor]:
    """``read_quantized`` through the conversion cache: the first load saves the blocks in the
    file's cache folder (one safetensors file, type and row length in its metadata, published
    atomically), later loads read them from there without parsing the GGUF header."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    entry, _ = ensure_converted(path, cache_dir=cache_dir, progress=False, digest=digest)
    saved = entry / BLOCKS_FILE
    if saved.is_file():
        out = {}
        with safe_open(str(saved), framework="pt") as f:
            meta = f.metadata()
            for name in f.keys():
                qtype, in_features = (int(v) for v in meta[name].split(","))
                out[name] = QuantizedTensor(qtype, f.get_tensor(name), in_features)
        return out
    out = read_quantized(path)
    fd, tmp = tempfile.mkstemp(prefix=".blocks-", suffix=".safetensors", dir=entry)
    os.close(fd)
    try:
        save_file({n: q.rows for n, q in out.items()}, tmp,
                  metadata={n: f"{q.qtype},{q.in_features}" for n, q in out.items()})
        os.replace(tmp, saved)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load_gguf(path: str | Path, *, cache_dir: str | Path | None = None, progress: bool = True,
              digest: str | None = None) -> Checkpoint:
    """Load a GGUF file, converting it into the cache on first use (see module NOTE)."""
    entry, digest = ensure_converted(path, cache_dir=cache_dir, progress=progress, digest=digest)
    return load_hf_folder(entry, digest=digest)
