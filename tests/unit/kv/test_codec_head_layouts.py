"""The KV codecs on the head layouts of the supported families (head_dim 64 to 128, 1 to 8 KV
heads, e.g. Qwen2-0.5B's 2 x 64, Llama 3's 8 x 128, and odd ones), not only the bundled model's:
the exact codec gives the bits back, the lossy ones stay within their quantization step."""
from __future__ import annotations

import pytest
import torch

from kvmesh.kv.codec import ChunkMeta, CodecSpec, decode, encode

NS = b"\x01" * 16
STEP = {"fp16": 5e-4, "bf16": 4e-3, "int8": 0.02, "int4": 0.15, "int2": 0.6}  # x the largest |value|


@pytest.mark.parametrize("kv_heads,head_dim", [(2, 64), (8, 128), (1, 80), (5, 96), (4, 16)])
@pytest.mark.parametrize("codec", ["fp32", "fp16", "bf16", "int8", "int4", "int2"])
def test_codecs_take_every_family_head_layout(codec, kv_heads, head_dim):
    g = torch.Generator().manual_seed(kv_heads * head_dim)
    k, v = torch.randn(2, 2, 48, kv_heads, head_dim, generator=g)  # [L, T, H, D] each
    blob = encode(k, v, ChunkMeta(NS, tuple(range(48))), CodecSpec(name=codec))
    k2, v2, _ = decode(blob, namespace=NS)
    assert k2.shape == v2.shape == (2, 48, kv_heads, head_dim)
    if codec == "fp32":
        assert torch.equal(k2, k) and torch.equal(v2, v)
    else:
        for got, want in ((k2, k), (v2, v)):
            assert (got - want).abs().max().item() < STEP[codec] * want.abs().max().item()
