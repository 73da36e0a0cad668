"""kvmesh.gpu.kv_rerotate: keys dequantized and re-rotated into paged blocks, against the CPU path
(kivi.unpack + kivi.dequantize, then rope.rotate_keys's arithmetic, then the indexed write).

Tolerance. The dequantized keys are bit-exact (kv_import's arithmetic), and so is the angle
``float32(position) * inv_freq``; only cos/sin differ: torch's (the reference), numpy's (the
interpreter) and libdevice's (CUDA) are each within ~2 ulp of the true value (2^-23 absolute, as
|cos|, |sin| <= 1). An output ``x1 * cos - x2 * sin`` then differs by at most ``(|x1| + |x2|) *
2^-23`` before its roundings, and the two products' roundings (half an ulp each, from different
operands) add about as much: ``<= 2^-21 * max|k|`` in all. Allowed: ``atol = 2^-20 * max|k|``
(a factor 2 of margin), plus one ulp of the cache dtype relative (the two results may round to
neighbouring values: 2^-23 fp32, 2^-10 fp16, 2^-7 bf16). The same bound is kvmesh bench gpu's check.
"""
from __future__ import annotations

import pytest
import torch

from kvmesh.kv import kivi

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[test]'")
from kvmesh.gpu import kv_import as ki  # noqa: E402
from kvmesh.gpu import kv_rerotate as kr  # noqa: E402

ULP = {torch.float32: 2**-23, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _inv_freq(D: int, theta: float = 10000.0) -> torch.Tensor:
    """An inverse-frequency vector like a scaled model's: HF's formula, low frequencies divided by 8
    (as llama3 scaling does). The kernel takes any vector; test_reference_is_rope_rotate_keys ties
    the reference to the model's own scalings."""
    inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).to(torch.float) / D))
    return torch.where(torch.arange(D // 2) >= D // 4, inv / 8, inv)


def _assert_close(out: torch.Tensor, ref: torch.Tensor, kmax: float) -> None:
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2**-20 * kmax, rtol=ULP[ref.dtype])


def _to(part, device):
    return ki.PackedPart(part.packed.to(device), part.scale.to(device), part.zero.to(device), part.bits, part.group)


def _key_part(k: torch.Tensor, bits: int, group: int) -> ki.PackedPart:
    L, Q, H, D = k.shape
    codes, scale, zero = kivi.quantize(k.permute(0, 2, 3, 1).reshape(L, H * D, Q), bits, group)  # [L, C, Q]
    return ki.PackedPart(kivi.pack(codes, bits), scale, zero, bits, group)


def test_reference_is_rope_rotate_keys():
    """`rotate_keys_ref` on a model's inv_freq is bit for bit kvmesh.kv.rope.rotate_keys, for every
    RoPE scaling the model supports (the scaling lives in inv_freq alone)."""
    rope = pytest.importorskip("kvmesh.kv.rope", reason="kvmesh.kv.rope needs the model package's dependencies")
    from kvmesh.model.config import RopeScaling
    from kvmesh.model.llama import RotaryEmbedding

    g = torch.Generator().manual_seed(0)
    for D, theta, scaling in [(64, 10000.0, None), (64, 100000.0, RopeScaling("linear", factor=4.0)),
                              (128, 500000.0, RopeScaling("llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=8192)),
                              (64, 10000.0, RopeScaling("dynamic", factor=2.0))]:
        rotary = RotaryEmbedding(D, theta, scaling, max_position_embeddings=2048)
        k = torch.randn(2, 19, 3, D, generator=g)
        for start in (0, 37, 70001):
            assert torch.equal(kr.rotate_keys_ref(k, start, rotary.inv_freq()), rope.rotate_keys(k, start, rotary))


# (layers, tokens, kv_heads, head_dim, block_size, start): mid-block starts, partial last blocks,
# 3 KV heads (SmolLM2), head_dim 128 at block 32, and a start past 2^16 (llama3-scaled contexts).
CASES = [(2, 21, 1, 64, 16, 9), (1, 40, 3, 64, 16, 16), (2, 33, 2, 128, 32, 70000)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_exact_keys_rotated_into_blocks(device, case, dtype):
    L, n, H, D, bs, start = case
    g = torch.Generator().manual_seed(1)
    k = torch.randn(L, n, H, D, generator=g).to(dtype)  # as decoded: the blob's raw keys
    inv = _inv_freq(D)
    first, nblk = start // bs, -(-(start + n) // bs)
    table = torch.zeros(nblk, dtype=torch.int32)  # a sequence's table; entries before the chunk unused here
    table[first:] = torch.tensor([5, 1, 4, 0, 2, 7], dtype=torch.int32)[:nblk - first]
    ref = torch.zeros(L, 8, bs, H, D, dtype=dtype)
    kr.write_paged_ref(kr.rotate_keys_ref(k, start, inv), ref, table, start)
    cache = torch.zeros(L, 8, bs, H, D, dtype=dtype, device=device)
    kr.rotate_keys_into_paged(k.to(device), cache, table.to(device), start, inv.to(device))
    _assert_close(cache, ref, float(k.float().abs().max()))


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("case", [(2, 21, 1, 64, 16, 9, 16), (1, 40, 3, 128, 32, 32, 64)], ids=str)
def test_quantized_keys_dequantized_and_rotated(device, bits, case):
    """Rows of 21 codes straddle bytes; ragged last groups (21 / 16, 40 / 64)."""
    L, Q, H, D, bs, start, group = case
    g = torch.Generator().manual_seed(2)
    k = torch.randn(L, Q, H, D, generator=g)
    part = _key_part(k, bits, group)
    inv = _inv_freq(D)
    nblk = -(-(start + Q) // bs)
    blocks = torch.randperm(8, generator=g)[:nblk].to(torch.int32)
    ref = torch.zeros(L, 8, bs, H, D, dtype=torch.float16)
    kr.write_paged_ref(kr.rotate_keys_ref(kr.dequantize_keys_ref(part, Q, H, D), start, inv), ref, blocks, start)
    cache = torch.zeros(L, 8, bs, H, D, dtype=torch.float16, device=device)
    kr.dequantize_rotate_keys_into_paged(_to(part, device), cache, blocks.to(device), start, Q, inv.to(device))
    _assert_close(cache, ref, float(k.abs().max()) * 1.1)
    # and the CPU decode it replaces: kv_import's dequantization then the rotation
    deq = torch.zeros(L, 8, bs, H, D)
    ki.dequantize_into_paged_ref(part, deq, blocks, start, Q, keys=True)
    pos = start + torch.arange(Q)
    dense = deq[:, blocks.long()[pos // bs], pos % bs]  # [L, Q, H, D]
    assert torch.equal(dense, kr.dequantize_keys_ref(part, Q, H, D))


def test_int2_keys_with_outlier_channels(device):
    """The int2 blob's default: in each (layer, head) the widest channels at int4, in a part of their own."""
    L, Q, H, D, bs, m, group = 2, 18, 3, 64, 16, 16, 8
    g = torch.Generator().manual_seed(3)
    k = torch.randn(L, Q, H, D, generator=g) * torch.linspace(0.2, 3, D)  # some channels much wider
    xc = k.permute(0, 2, 3, 1)  # [L, H, D, Q]
    mask = torch.zeros(L, H, D, dtype=torch.uint8)
    mask.scatter_(-1, (xc.amax(-1) - xc.amin(-1)).topk(m, dim=-1).indices, 1)
    parts = []
    for channels, bits in zip(ki.outlier_channel_maps(mask), (2, 4)):
        rows = xc.reshape(L, H * D, Q).gather(1, channels.long()[..., None].expand(-1, -1, Q))
        codes, scale, zero = kivi.quantize(rows, bits, group)
        parts.append(ki.PackedPart(kivi.pack(codes, bits), scale, zero, bits, group))
    inv = _inv_freq(D)
    blocks = torch.tensor([3, 0], dtype=torch.int32)
    keys = kr.dequantize_keys_ref(parts[0], Q, H, D, outliers=parts[1], outlier_mask=mask)
    ref = torch.zeros(L, 4, bs, H, D)
    kr.write_paged_ref(kr.rotate_keys_ref(keys, 5, inv), ref, blocks, 5)
    cache = torch.zeros(L, 4, bs, H, D, device=device)
    kr.dequantize_rotate_keys_into_paged(_to(parts[0], device), cache, blocks.to(device), 5, Q, inv.to(device),
                                         outliers=_to(parts[1], device), outlier_mask=mask.to(device))
    _assert_close(cache, ref, float(keys.abs().max()))


def test_one_layer_of_a_per_layer_cache_and_a_dense_tensor(device):
    """The engine's per-layer cache, and blend's dense ``[L, T, H, D]`` as one block of T tokens."""
    L, Q, H, D = 3, 20, 3, 64
    g = torch.Generator().manual_seed(4)
    k = torch.randn(L, Q, H, D, generator=g)
    part, inv = _key_part(k, 4, 64), _inv_freq(D)
    keys = kr.rotate_keys_ref(kr.dequantize_keys_ref(part, Q, H, D), 7, inv)  # [L, Q, H, D]
    blocks = torch.tensor([2, 0], dtype=torch.int32)
    for layer in range(L):
        ref = torch.zeros(4, 16, H, D)
        kr.write_paged_ref(keys, ref, blocks, 7, layer=layer)
        cache = torch.zeros(4, 16, H, D, device=device)
        kr.dequantize_rotate_keys_into_paged(_to(part, device), cache, blocks.to(device), 7, Q, inv.to(device),
                                             layer=layer)
        _assert_close(cache, ref, float(k.abs().max()) * 1.1)
    dense = torch.zeros(L, 7 + Q, H, D, device=device)  # blend's out_k: the chunk lands at 7
    kr.dequantize_rotate_keys_into_paged(_to(part, device), dense[:, None], torch.zeros(1, dtype=torch.int32,
                                         device=device), 7, Q, inv.to(device))
    _assert_close(dense[:, 7:], keys, float(k.abs().max()) * 1.1)


def test_an_int2_blob_written_on_the_cpu_lands_where_blend_puts_it(device):
    """The sections of a real int2 blob (kvmesh.kv.codec defaults: the first token in fp16, 16
    outlier key channels per head at int4): its head token through `rotate_keys_into_paged`, the
    rest through `dequantize_rotate_keys_into_paged`, equal codec.decode + rope.rotate_keys."""
    pytest.importorskip("zstandard", reason="kvmesh.kv.codec needs zstandard")
    rope = pytest.importorskip("kvmesh.kv.rope", reason="kvmesh.kv.rope needs the model package's dependencies")
    from kvmesh.kv import codec
    from kvmesh.model.llama import RotaryEmbedding

    L, T, H, D, bs, start = 2, 40, 3, 64, 16, 21
    g = torch.Generator().manual_seed(6)
    k, v = torch.randn(L, T, H, D, generator=g), torch.randn(L, T, H, D, generator=g)
    blob = codec.encode(k, v, codec.ChunkMeta(bytes(16), tuple(range(T))), codec.CodecSpec("int2", zstd=False))
    dk, _, header = codec.decode(blob, namespace=bytes(16), dtype=torch.float32)
    head, m, group, Q = header.head, header.key_outliers, header.group_size, T - header.head - header.residual
    assert (head, m, header.residual) == (1, 16, 0)
    first = len(blob) - 16 - header.payload_bytes
    raw = torch.frombuffer(bytearray(blob[first:first + header.payload_bytes]), dtype=torch.uint8)
    sec = list(torch.split(raw, codec._section_sizes(header)))
    ng = -(-Q // group)

    def part(i, rows, bits):
        return ki.PackedPart(sec[i + 2], codec._unshuffle(sec[i], torch.float16).view(L, rows, ng),
                             codec._unshuffle(sec[i + 1], torch.float16).view(L, rows, ng), bits, group)

    mask = kivi.unpack(sec[0], 1, L * H * D).view(L, H, D)
    plain, outliers = part(1, H * (D - m), 2), part(4, H * m, 4)
    k_head = codec._unshuffle(sec[10], torch.float16).view(L, head, H, D)
    rotary = RotaryEmbedding(D, 100000.0)
    inv = rotary.inv_freq()
    blocks = torch.tensor([6, 5, 2, 7], dtype=torch.int32)  # positions 21..60: table entries 1..3
    ref = torch.zeros(L, 8, bs, H, D)
    kr.write_paged_ref(rope.rotate_keys(dk, start, rotary), ref, blocks, start)
    cache = torch.zeros(L, 8, bs, H, D, device=device)
    kr.rotate_keys_into_paged(k_head.to(device), cache, blocks.to(device), start, inv.to(device))
    kr.dequantize_rotate_keys_into_paged(_to(plain, device), cache, blocks.to(device), start + head, Q,
                                         inv.to(device), outliers=_to(outliers, device), outlier_mask=mask.to(device))
    _assert_close(cache, ref, float(dk.abs().max()))


def test_bad_arguments_are_value_errors():
    part = _key_part(torch.randn(1, 8, 1, 16), 4, 8)
    cache = torch.zeros(1, 2, 16, 1, 16)
    blocks = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="inv_freq"):
        kr.dequantize_rotate_keys_into_paged(part, cache, blocks, 0, 8, torch.ones(16))
    with pytest.raises(ValueError, match="cannot hold"):
        kr.dequantize_rotate_keys_into_paged(part, cache, blocks, 10, 8, torch.ones(8))
    with pytest.raises(ValueError, match="outliers need both"):
        kr.dequantize_rotate_keys_into_paged(part, cache, blocks, 0, 8, torch.ones(8), outliers=part)
