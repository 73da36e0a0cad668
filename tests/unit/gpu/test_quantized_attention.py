"""kvmesh.gpu.quantized_attention: decode attention over a paged int4/int2 KIVI cache, against
attention over the same cache dequantized by kivi (then paged_decode_attention_ref), and the
quantizer into the cache against kivi.quantize.

Tolerances are test_paged_attention's (fp32 1e-5, fp16 4e-3, bf16 4e-2 absolute): the kernel
dequantizes exactly as kivi.dequantize and rounds to the attention dtype as the reference does, so
what remains is that kernel's float error (summation order, the output's rounding, probabilities
in the KV dtype for the second matmul).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvmesh.kv import kivi

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[test]'")
from kvmesh.gpu import paged_attention as pa  # noqa: E402
from kvmesh.gpu import quantized_attention as qa  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}


def _to(x, device):
    """A QuantizedKVCache or Residual with every tensor moved to ``device``."""
    return dataclasses.replace(x, **{f.name: getattr(x, f.name).to(device) for f in dataclasses.fields(x)
                                     if isinstance(getattr(x, f.name), torch.Tensor)})


def _filled(S, R, Hq, Hkv, D, bs, gk, lens, qlens, bits, dtype, seed=0, device="cpu"):
    """q, a cache whose first qlens[s] positions of each sequence hold quantized KV (through
    quantize_into_cache on ``device``), the rest in the residual; scattered blocks."""
    g = torch.Generator().manual_seed(seed)
    W = max(-(-n // bs) for n in lens) + 1  # one padding column: never read
    nb = S * W + 3
    tables = torch.randperm(nb, generator=g)[:S * W].view(S, W).to(torch.int32)
    cache = qa.QuantizedKVCache.allocate(nb, bs, Hkv, D, bits=bits, key_group=gk, device=device)
    starts = [(s, p) for s, qn in enumerate(qlens) for p in range(0, qn, gk)]  # every whole key group
    if starts:
        k = torch.randn(len(starts), gk, Hkv, D, generator=g)
        v = torch.randn(len(starts), gk, Hkv, D, generator=g)
        blocks = torch.tensor([int(tables[s, p // bs]) for s, p in starts], dtype=torch.int32)
        offsets = torch.tensor([p % bs for _, p in starts], dtype=torch.int32)
        qa.quantize_into_cache(k.to(device), v.to(device), cache, blocks.to(device), offsets.to(device))
    cap = gk + R
    residual = qa.Residual(torch.randn(S, cap, Hkv, D, generator=g).to(dtype),
                           torch.randn(S, cap, Hkv, D, generator=g).to(dtype), torch.tensor(qlens, dtype=torch.int32))
    q = torch.randn(S, R, Hq, D, generator=g).to(dtype)
    return q, _to(cache, "cpu"), residual, tables, torch.tensor(lens, dtype=torch.int32)


# (num_seqs, q_rows, q_heads, kv_heads, head_dim, block_size, key_group, seq_lens, quantized_lens,
#  num_splits, bits)
CASES = [
    (2, 1, 4, 4, 64, 16, 16, [37, 16], [32, 16], 1, 4),      # GQA 1; a partial last block in the residual
    (2, 3, 9, 3, 64, 16, 8, [37, 5], [32, 0], 1, 2),         # SmolLM2's GQA 3, 3 rows, int2; all residual
    (2, 3, 16, 2, 128, 32, 32, [300, 3], [288, 0], 3, 4),    # GQA 8, head_dim 128, block 32, 3 splits
    (1, 1, 8, 1, 128, 32, 16, [129], [128], 2, 2),           # the residual's one token in the last split
]


PARAMS = [(c, torch.float16) for c in CASES] + [(CASES[0], torch.float32), (CASES[0], torch.bfloat16)]
"""Every case at fp16; fp32 and bf16 on the first only (the interpreter is slow)."""


@pytest.mark.parametrize("case,dtype", PARAMS,
                         ids=lambda x: str(x).removeprefix("torch.") if isinstance(x, torch.dtype) else
                         f"S{x[0]}R{x[1]}H{x[2]}/{x[3]}D{x[4]}B{x[5]}g{x[6]}s{x[9]}i{x[10]}")
def test_matches_attention_over_the_dequantized_cache(device, case, dtype):
    S, R, Hq, Hkv, D, bs, gk, lens, qlens, splits, bits = case
    q, cache, residual, tables, seq_lens = _filled(S, R, Hq, Hkv, D, bs, gk, lens, qlens, bits, dtype, device=device)
    scale = D ** -0.5
    ref = qa.quantized_decode_attention_ref(q, cache, residual, tables, seq_lens, scale)
    out = qa.quantized_decode_attention(q.to(device), _to(cache, device), _to(residual, device), tables.to(device),
                                        seq_lens.to(device), scale, num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=ATOL[dtype], rtol=0)


def test_quantize_into_cache_is_kivi(device):
    """Codes, scales and zeros in the cache are kivi.quantize's of the same groups, bit for bit."""
    g = torch.Generator().manual_seed(1)
    N, gk, H, D, bs, bits = 3, 8, 2, 64, 16, 4
    cache = qa.QuantizedKVCache.allocate(5, bs, H, D, bits=bits, key_group=gk, value_group=32, device=device)
    k, v = torch.randn(N, gk, H, D, generator=g), torch.randn(N, gk, H, D, generator=g)
    blocks, offsets = torch.tensor([4, 0, 4], dtype=torch.int32), torch.tensor([8, 0, 0], dtype=torch.int32)
    qa.quantize_into_cache(k.to(device), v.to(device), cache, blocks.to(device), offsets.to(device))
    cache = _to(cache, "cpu")
    for n, (b, o) in enumerate(zip(blocks.tolist(), offsets.tolist())):
        kc, ks, kz = kivi.quantize(k[n].permute(1, 2, 0), bits, gk)  # [H, D, gk] per channel over tokens
        assert torch.equal(cache.k_codes[b, :, :, o // 2:(o + gk) // 2], kivi.pack(kc, bits).view(H, D, gk // 2))
        assert torch.equal(cache.k_scale[b, :, :, o // gk], ks[..., 0])
        assert torch.equal(cache.k_zero[b, :, :, o // gk], kz[..., 0])
        vc, vs, vz = kivi.quantize(v[n], bits, 32)  # [gk, H, D] per token over 32 channels
        assert torch.equal(cache.v_codes[b, o:o + gk], kivi.pack(vc, bits).view(gk, H, D // 2))
        assert torch.equal(cache.v_scale[b, o:o + gk], vs)
        assert torch.equal(cache.v_zero[b, o:o + gk], vz)
    assert not cache.k_codes[1].any() and not cache.v_scale[1].any()  # untouched blocks stay zero


def test_all_residual_is_plain_paged_attention(device):
    """With nothing quantized the kernel is paged_decode_attention over the residual's values."""
    q, cache, residual, tables, seq_lens = _filled(2, 3, 6, 3, 64, 16, 16, [19, 7], [0, 0], 4, torch.float32, seed=2,
                                                   device=device)
    kc, vc = qa.dequantize_cache_ref(cache, torch.float32)
    for s, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        kc[tables[s].long()[pos // 16], pos % 16] = residual.k[s, :n]
        vc[tables[s].long()[pos // 16], pos % 16] = residual.v[s, :n]
    args = [t.to(device) for t in (q, tables, seq_lens)]
    out = qa.quantized_decode_attention(args[0], _to(cache, device), _to(residual, device), *args[1:], 0.125)
    plain = pa.paged_decode_attention(args[0], kc.to(device), vc.to(device), *args[1:], 0.125)
    torch.testing.assert_close(out.cpu(), plain.cpu(), atol=ATOL[torch.float32], rtol=0)


def test_bad_layouts_are_value_errors():
    with pytest.raises(ValueError, match="multiple of key_group"):
        qa.QuantizedKVCache.allocate(4, 16, 1, 64, key_group=12)
    with pytest.raises(ValueError, match="bits"):
        qa.QuantizedKVCache.allocate(4, 16, 1, 64, bits=8)
    cache = qa.QuantizedKVCache.allocate(4, 16, 1, 64)
    residual = qa.Residual(torch.zeros(1, 20, 1, 64), torch.zeros(1, 20, 1, 64), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not fit"):  # a head_dim of 32 against the cache's 64
        qa.quantized_decode_attention(torch.zeros(1, 1, 2, 32), cache, residual, torch.zeros(1, 2, dtype=torch.int32),
                                      torch.ones(1, dtype=torch.int32), 0.125)
