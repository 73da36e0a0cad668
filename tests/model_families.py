"""Test helpers: tiny random models of each supported family (scripts/make_tiny_model.py, the script
users run too), saved as HF folders and written as GGUF files the way llama.cpp's converter lays
them out (float32 tensors, so the GGUF model must equal the transformers one to float rounding)."""
from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "make_tiny_model.py"
_spec = importlib.util.spec_from_file_location("make_tiny_model", _SCRIPT)
tiny_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny_models)

make_model = tiny_models.make_model
build_tokenizer = tiny_models.build_tokenizer

_GGUF_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
               "post_attention_layernorm": "ffn_norm"}
PRE_TOKENIZER = {"llama": "llama-bpe", "qwen2": "qwen2"}


@dataclass(frozen=True)
class FamilyModel:
    """A tiny model on disk and its transformers twin."""

    folder: Path
    hf_model: torch.nn.Module
    family: str
    rope_scaling: str | None


def family_model(folder: Path, family: str, rope_scaling: str | None = None, **kw) -> FamilyModel:
    return FamilyModel(folder, make_model(folder, family, rope_scaling=rope_scaling, **kw), family, rope_scaling)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (interleaved rotary pairs), written out."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for llama3 scaling (per-frequency divisors)."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high, old = rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * base ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def tokenizer_metadata(family: str, pre: str | None = None) -> dict:
    """GGUF tokenizer.* metadata of the family's tokenizer, as llama.cpp's converter writes it."""
    tok = build_tokenizer(family)
    spec = json.loads(tok.to_str())
    size = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(size)]
    specials = {t["id"] for t in spec["added_tokens"]}
    bos, eos = (None if n is None else tok.token_to_id(n) for n in tiny_models.SPECIAL_ROLES[family])
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.chat_template": tiny_models.TEMPLATES[family],
            "tokenizer.ggml.eos_token_id": eos}
    if bos is not None:
        meta["tokenizer.ggml.bos_token_id"] = bos
    if family == "mistral":
        types = [2 if t == "<unk>" else 3 if i in specials else 6 if t.startswith("<0x") else 1
                 for i, t in enumerate(tokens)]
        meta.update({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
                     "tokenizer.ggml.token_type": types,
                     # SentencePiece scores: earlier merges score higher
                     "tokenizer.ggml.scores": [0.0 if ty != 1 else -float(i) for i, ty in enumerate(types)],
                     "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": True,
                     "tokenizer.ggml.unknown_token_id": tok.token_to_id("<unk>")})
    else:
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        meta.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre or PRE_TOKENIZER[family],
                     "tokenizer.ggml.token_type": [3 if i in specials else 1 for i in range(size)],
                     "tokenizer.ggml.merges": merges,
                     "tokenizer.ggml.add_bos_token": family == "llama"})
    return meta


def _add_tokenizer(w, meta: dict) -> None:
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if "tokenizer.ggml.merges" in meta:
        w.add_token_merges(meta["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in meta:
        w.add_token_scores(meta["tokenizer.ggml.scores"])
        w.add_add_space_prefix(meta["tokenizer.ggml.add_space_prefix"])
        w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    if "tokenizer.ggml.bos_token_id" in meta:
        w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
    w.add_chat_template(meta["tokenizer.chat_template"])


def write_gguf(path: Path, m: FamilyModel) -> Path:
    """Write `m` as llama.cpp's converter would (arch llama for Llama/Mistral with q/k rows
    interleaved, qwen2 as is), float32 tensors. Not for dynamic RoPE: GGUF has no such type."""
    from gguf import GGUFWriter, RopeScalingType

    cfg = m.hf_model.config
    arch = "qwen2" if m.family == "qwen2" else "llama"
    w = GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{m.family}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if m.family == "mistral" and cfg.sliding_window:
        w.add_sliding_window(cfg.sliding_window)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(rope, cfg.head_dim))
    elif rope.get("rope_type", "default") != "default":
        raise ValueError(f"GGUF has no {rope['rope_type']} RoPE")
    _add_tokenizer(w, tokenizer_metadata(m.family))
    for name, t in m.hf_model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.float().numpy().copy()
        if name == "model.embed_tokens.weight":
            w.add_tensor("token_embd.weight", arr)
        elif name == "model.norm.weight":
            w.add_tensor("output_norm.weight", arr)
        elif name == "lm_head.weight":
            w.add_tensor("output.weight", arr)
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            key = _GGUF_LAYER[module]
            if arch == "llama" and key == "attn_q":
                arr = llama_cpp_permute(arr, cfg.num_attention_heads)
            elif arch == "llama" and key == "attn_k":
                arr = llama_cpp_permute(arr, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{layer}.{key}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
