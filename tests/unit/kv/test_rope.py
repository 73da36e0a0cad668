"""Stored keys are un-rotated exactly the way the model rotates them."""
import torch

from kvmesh.kv.rope import rotate_keys, unrotate_keys
from kvmesh.model.llama import RotaryEmbedding, apply_rope


def test_rotation_matches_the_model_and_round_trips():
    rotary = RotaryEmbedding(64, 100000.0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 40, 3, 64, generator=g)  # [layers, tokens, kv_heads, head_dim], position-free
    cos, sin = rotary(torch.arange(1000, 1040), torch.float32)
    as_cached = apply_rope(x, cos, sin)  # what the paged cache holds for positions 1000..1039
    assert torch.allclose(rotate_keys(x, 1000, rotary), as_cached, atol=1e-6)
    assert torch.allclose(unrotate_keys(as_cached, 1000, rotary), x, atol=1e-5)
    assert not torch.allclose(unrotate_keys(as_cached, 999, rotary), x, atol=1e-3)  # position matters
