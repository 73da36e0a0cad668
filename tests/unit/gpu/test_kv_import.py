"""kvmesh.gpu.kv_import: packed KIVI codes expanded into paged blocks, against the CPU decode path.

fp32 and fp16 caches: bit-exact (kivi.dequantize's fp32 values, then their round-to-nearest-even
cast). bf16 caches: bit-exact on CUDA; under triton 3.9's interpreter, whose fp32 -> bf16 cast
rounds ties away from zero, within one bf16 ulp (2^-7 relative).
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.kv import kivi

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[test]'")
from kvmesh.gpu import kv_import as ki  # noqa: E402


def _assert_written(out: torch.Tensor, ref: torch.Tensor, device: str) -> None:
    out = out.cpu()
    if out.dtype == torch.bfloat16 and device == "cpu":
        torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


def _parts(L, Q, H, D, bits, group, seed=0):
    """k, v [L, Q, H, D] and their key/value PackedParts, quantized as kvmesh.kv.codec does."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(L, Q, H, D, generator=g), torch.randn(L, Q, H, D, generator=g)
    kc, ks, kz = kivi.quantize(k.permute(0, 2, 3, 1).reshape(L, H * D, Q), bits, group)  # [L, C, Q]
    vc, vs, vz = kivi.quantize(v.reshape(L, Q, H * D), bits, group)  # [L, Q, C]
    return (k, v, ki.PackedPart(kivi.pack(kc, bits), ks, kz, bits, group),
            ki.PackedPart(kivi.pack(vc, bits), vs, vz, bits, group))


def _to(part, device):
    return ki.PackedPart(part.packed.to(device), part.scale.to(device), part.zero.to(device), part.bits, part.group)


# (layers, tokens, kv_heads, head_dim, block_size, start, group): starts mid-block and ends in a
# partial block; ragged groups (21 tokens / 16, 160 channels / 48). Rows of 21 or 7 codes straddle
# bytes (the kernel's one-code-per-lane path); the last case's rows start on bytes at both widths and
# group 64 spans whole 64-wide tiles (its byte-tile, one-scale-per-row path), over partial tiles.
CASES = [(2, 21, 2, 16, 16, 9, 16), (1, 40, 2, 80, 32, 32, 48), (2, 7, 1, 64, 16, 0, 64),
         (2, 100, 3, 48, 32, 16, 64)]


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_all_layers_in_one_launch(device, bits, case, dtype):
    L, Q, H, D, bs, start, group = case
    _, _, kp, vp = _parts(L, Q, H, D, bits, group)
    blocks = torch.tensor([6, 1, 4, 3], dtype=torch.int32)[:-(-(start + Q) // bs)]
    for part, keys in ((kp, True), (vp, False)):
        ref = torch.zeros(L, 8, bs, H, D, dtype=dtype)
        ki.dequantize_into_paged_ref(part, ref, blocks, start, Q, keys=keys)
        cache = torch.zeros(L, 8, bs, H, D, dtype=dtype, device=device)
        if keys:
            ki.dequantize_keys_into_paged(_to(part, device), cache, blocks.to(device), start, Q)
        else:
            ki.dequantize_values_into_paged(_to(part, device), cache, blocks.to(device), start)
        _assert_written(cache, ref, device)


def test_one_layer_of_a_per_layer_cache(device):
    """The engine's cache today: one [num_blocks, block_size, H, D] tensor per layer."""
    L, Q, H, D, bs = 3, 20, 3, 64, 16
    _, _, kp, vp = _parts(L, Q, H, D, 4, 64)
    blocks = torch.tensor([2, 0], dtype=torch.int32)
    for part, keys in ((kp, True), (vp, False)):
        for layer in range(L):
            ref = torch.zeros(4, bs, H, D, dtype=torch.float16)
            ki.dequantize_into_paged_ref(part, ref, blocks, 5, Q, keys=keys, layer=layer)
            cache = torch.zeros(4, bs, H, D, dtype=torch.float16, device=device)
            if keys:
                ki.dequantize_keys_into_paged(_to(part, device), cache, blocks.to(device), 5, Q, layer=layer)
            else:
                ki.dequantize_values_into_paged(_to(part, device), cache, blocks.to(device), 5, layer=layer)
            _assert_written(cache, ref, device)


def test_key_outlier_channels_land_where_the_mask_says(device):
    """int2 keys with the 4 widest channels of each head at int4 (the blob's two key parts)."""
    L, Q, H, D, bs, m = 2, 18, 2, 16, 16, 4
    g = torch.Generator().manual_seed(5)
    k = torch.randn(L, Q, H, D, generator=g)
    xc = k.permute(0, 2, 3, 1)  # [L, H, D, Q]
    mask = torch.zeros(L, H, D, dtype=torch.uint8)
    mask.scatter_(-1, (xc.amax(-1) - xc.amin(-1)).topk(m, dim=-1).indices, 1)
    blocks = torch.tensor([3, 0], dtype=torch.int32)
    ref = torch.zeros(L, 4, bs, H, D)
    cache = torch.zeros(L, 4, bs, H, D, device=device)
    for channels, bits in zip(ki.outlier_channel_maps(mask), (2, 4)):
        rows = k.permute(0, 2, 3, 1).reshape(L, H * D, Q).gather(1, channels.long()[..., None].expand(-1, -1, Q))
        codes, scale, zero = kivi.quantize(rows, bits, 8)
        part = ki.PackedPart(kivi.pack(codes, bits), scale, zero, bits, 8)
        ki.dequantize_into_paged_ref(part, ref, blocks, 2, Q, keys=True, channels=channels)
        ki.dequantize_keys_into_paged(_to(part, device), cache, blocks.to(device), 2, Q, channels=channels.to(device))
    _assert_written(cache, ref, device)
    written = ref[:, [3, 0]].reshape(L, 2 * bs, H, D)[:, 2:2 + Q]  # every channel written, none left 0
    assert (written - k).abs().max() < 1.0


def test_a_blob_written_on_the_cpu_reads_back_the_same(device):
    """The sections of a real int4 blob (kvmesh.kv.codec.encode, no head/residual/zstd) give
    exactly what codec.decode + the engine's write give."""
    pytest.importorskip("zstandard", reason="kvmesh.kv.codec needs zstandard")
    from kvmesh.kv import codec
    from kvmesh.model.attention import write_kv_range

    L, T, H, D, bs = 2, 32, 3, 64, 16
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(L, T, H, D, generator=g), torch.randn(L, T, H, D, generator=g)
    meta = codec.ChunkMeta(bytes(16), tuple(range(T)))
    blob = codec.encode(k, v, meta, codec.CodecSpec("int4", zstd=False, group_size=32))
    dk, dv, header = codec.decode(blob, namespace=bytes(16), dtype=torch.float16)
    start = len(blob) - 16 - header.payload_bytes
    raw = torch.frombuffer(bytearray(blob[start:start + header.payload_bytes]), dtype=torch.uint8)
    sec = list(torch.split(raw, codec._section_sizes(header)))
    C, ng = H * D, -(-T // 32)
    kp = ki.PackedPart(sec[3], codec._unshuffle(sec[1], torch.float16).view(L, C, ng),
                       codec._unshuffle(sec[2], torch.float16).view(L, C, ng), 4, 32)
    vp = ki.PackedPart(sec[9], codec._unshuffle(sec[7], torch.float16).view(L, T, -(-C // 32)),
                       codec._unshuffle(sec[8], torch.float16).view(L, T, -(-C // 32)), 4, 32)
    blocks = torch.tensor([4, 1, 2], dtype=torch.int32)
    ref = [(torch.zeros(6, bs, H, D, dtype=torch.float16), torch.zeros(6, bs, H, D, dtype=torch.float16))
           for _ in range(L)]
    write_kv_range(ref, blocks.tolist(), 8, dk, dv)
    kc = torch.zeros(L, 6, bs, H, D, dtype=torch.float16, device=device)
    vc = torch.zeros_like(kc)
    ki.dequantize_keys_into_paged(_to(kp, device), kc, blocks.to(device), 8, T)
    ki.dequantize_values_into_paged(_to(vp, device), vc, blocks.to(device), 8)
    for layer in range(L):
        _assert_written(kc[layer], ref[layer][0], device)
        _assert_written(vc[layer], ref[layer][1], device)


def test_bad_arguments_are_value_errors():
    _, _, kp, _ = _parts(1, 8, 1, 16, 4, 8)
    with pytest.raises(ValueError, match="cannot hold"):
        ki.dequantize_keys_into_paged(kp, torch.zeros(1, 4, 16, 1, 16), torch.tensor([0], dtype=torch.int32), 10, 8)
    with pytest.raises(ValueError, match="layer"):
        ki.dequantize_keys_into_paged(kp, torch.zeros(4, 16, 1, 16), torch.tensor([0], dtype=torch.int32), 0, 8)
