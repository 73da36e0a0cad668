"""Stored keys are position-free: rotated back to position 0 before encoding, and rotated to
their positions again after decoding.

NOTE (why). The paged cache holds keys after RoPE, which rotates each pair of channels by a
position-dependent angle; that smears a channel's magnitude into its partner, token by token, and
per-channel quantization (KIVI) then fits its min/max over a mix. Un-rotated ("pre-RoPE", as
KVQuant quantizes) a channel is consistent across tokens. Measured on the bundled model, 2,048
prompt tokens, int2 min/max groups of 64: continuation perplexity +23% with post-RoPE keys vs +10%
pre-RoPE (keys only quantized); int2 keys and values +32% -> +18%. A stored chunk is also then
usable at any position (blending re-rotates it to where it lands).

Rotation is exact up to float32 rounding (round trip error ~4e-6 on this model's keys).

The rotation is the model's own (``model.rotary``: its base and RoPE scaling -- linear, dynamic,
llama3), so a key un-rotated here and rotated again lands where the model itself would put it;
`stored_keys_rope` names that rotation in the KV layout, so keys un-rotated under one scaling are
never read back under another.
"""
from __future__ import annotations

import torch

from kvmesh.model.config import ModelConfig
from kvmesh.model.llama import RotaryEmbedding, apply_rope

STORED_KEYS = "pre-rope-hf"
"""KvLayout.rope of chunks stored this way (HF rotate-half convention, un-rotated)."""


def stored_keys_rope(config: ModelConfig) -> str:
    """KvLayout.rope of a model's stored keys: the convention plus every parameter of its rotation
    (base, scaling type and parameters), e.g. ``pre-rope-hf theta=500000 llama3 factor=8 ...``."""
    return f"{STORED_KEYS} {config.rope_description()}"


def _tables(rotary: RotaryEmbedding, start: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(start, start + n, device=device)
    return rotary(positions, torch.float32)  # [n, hd] each


def unrotate_keys(k: torch.Tensor, start: int, rotary: RotaryEmbedding) -> torch.Tensor:
    """Keys ``[layers, n, kv_heads, hd]`` at positions start.. -> as if at position 0 (float32)."""
    cos, sin = _tables(rotary, start, k.shape[1], k.device)
    return apply_rope(k.float(), cos, -sin)  # the inverse rotation: angle -theta


def rotate_keys(k: torch.Tensor, start: int, rotary: RotaryEmbedding) -> torch.Tensor:
    """Position-free keys ``[layers, n, kv_heads, hd]`` -> rotated to positions start.. (float32)."""
    cos, sin = _tables(rotary, start, k.shape[1], k.device)
    return apply_rope(k.float(), cos, sin)
