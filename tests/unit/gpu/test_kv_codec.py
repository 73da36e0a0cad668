"""kvmesh.gpu.kv_codec against kvmesh.kv.kivi run on the CPU: bit-exact, since a blob written on
one must read back the same on the other."""
from __future__ import annotations

import pytest
import torch

from kvmesh.kv import kivi

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[test]'")
from kvmesh.gpu import kv_codec  # noqa: E402

# (shape, group): ragged last groups (70 = 4 x 16 + 6, 33 < 64, 130 = 18 x 7 + 4), odd groups,
# a single exact group, and KIVI's two directions (keys [L, C, T] over tokens, values [L, T, C]).
SHAPES = [((3, 5, 70), 16), ((2, 7, 33), 64), ((4, 130), 7), ((1, 64), 64), ((2, 12, 24), 5)]

# Rows of 16 float32 values (bit patterns) on which a fused and an unfused multiply-add give
# different codes (group 16): found by search, about 1 value in 10^6. kivi.quantize's addcmul is
# one FMA on an x86 CPU with FMA; the kernel must round the same way.
FMA_EDGE_ROWS = {
    2: [[-1068161523, -1066190488, -1065532488, -1069128652, -1064681698, -1064910079, -1067588738, -1067174398,
         -1064238995, -1065112514, -1068841693, -1064726631, -1062718543, -1064979456, -1065733724, -1069067650],
        [-1073221708, -1068296287, -1074419227, -1068631040, -1068452549, -1068460822, -1073237960, -1072126348,
         -1070566831, -1067862250, -1068188806, -1069718242, -1067543419, -1069999294, -1070241062, -1073687724]],
    4: [[-1067103743, -1067133230, -1067044607, -1067082381, -1067097919, -1067147034, -1067206830, -1067193768,
         -1067192765, -1067218072, -1067162652, -1067152066, -1067044161, -1067145872, -1067058242, -1067143852],
        [-1057029035, -1057052054, -1056998192, -1057081310, -1057062126, -1057016565, -1057030985, -1057044886,
         -1057005740, -1057037492, -1057076401, -1057043435, -1057042908, -1057027642, -1057052161, -1056997748],
        [1079555476, 1082530221, 1081643515, 1082434292, 1081701438, 1082517309, 1080116864, 1081319671,
         1080176529, 1079383070, 1082233398, 1081470758, 1080540351, 1079563558, 1078482110, 1082315097]],
}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (fp16 compared as int16: -0.0 != 0.0, as in a blob)."""
    a = a.cpu()
    if a.dtype in (torch.float16, torch.bfloat16):
        return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))
    return a.dtype == b.dtype and torch.equal(a, b)


def _data(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3 + torch.randn(shape[:-1] + (1,), generator=g)
    x[..., :3] = 1.25  # a constant run: a constant group where it fills one (scale 0)
    return x.to(dtype)


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("shape,group", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_quantize_is_bit_exact(device, bits, shape, group, dtype):
    x = _data(shape, dtype, seed=group)
    codes, scale, zero = kv_codec.quantize(x.to(device), bits, group)
    ref_codes, ref_scale, ref_zero = kivi.quantize(x, bits, group)
    assert _bits_equal(codes, ref_codes)
    assert _bits_equal(scale, ref_scale)
    assert _bits_equal(zero, ref_zero)


@pytest.mark.parametrize("bits", [2, 4])
def test_quantize_rounds_like_the_cpu_fma(device, bits):
    x = torch.tensor(FMA_EDGE_ROWS[bits], dtype=torch.int32).view(torch.float32)
    codes, _, _ = kv_codec.quantize(x.to(device), bits, 16)
    assert _bits_equal(codes, kivi.quantize(x, bits, 16)[0])


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape,group", SHAPES)
def test_dequantize_is_bit_exact(device, bits, shape, group):
    codes, scale, zero = kivi.quantize(_data(shape, torch.float32, seed=7), bits, group)
    ref = kivi.dequantize(codes, scale, zero, group)
    out = kv_codec.dequantize(codes.to(device), scale.to(device), zero.to(device), group)
    assert _bits_equal(out, ref)
    half = kv_codec.dequantize(codes.to(device), scale.to(device), zero.to(device), group, torch.float16)
    assert _bits_equal(half, ref.half())


def test_dequantize_to_bf16_rounds_to_nearest(device):
    """bf16 output is the round-to-nearest-even cast of the fp32 result: bit-exact on CUDA. Triton
    3.9's interpreter rounds fp32 -> bf16 ties away from zero, not to even, and these values (fp16
    scale times a small code plus an fp16 zero) are often ties: on CPU one bf16 ulp (at most 2^-7
    relative) is allowed."""
    codes, scale, zero = kivi.quantize(_data((6, 96), torch.float32, seed=3), 4, 32)
    ref = kivi.dequantize(codes, scale, zero, 32).bfloat16()
    out = kv_codec.dequantize(codes.to(device), scale.to(device), zero.to(device), 32, torch.bfloat16)
    if device == "cuda":
        assert _bits_equal(out, ref)
    else:
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2**-7, atol=0)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("count", [1, 7, 64, 1001])
def test_pack_and_unpack_are_bit_exact(device, bits, count):
    codes = torch.randint(0, 1 << bits, (count,), generator=torch.Generator().manual_seed(count), dtype=torch.uint8)
    packed = kivi.pack(codes, bits)
    assert _bits_equal(kv_codec.pack(codes.to(device), bits), packed)
    assert _bits_equal(kv_codec.unpack(packed.to(device), bits, count), kivi.unpack(packed, bits, count))


def test_quantize_then_pack_reads_back_with_the_cpu_functions(device):
    """A GPU writer and a CPU reader: the CPU's unpack + dequantize give the CPU's own values."""
    x = _data((2, 48, 40), torch.float16, seed=11)
    codes, scale, zero = kv_codec.quantize(x.to(device), 4, 16)
    packed = kv_codec.pack(codes, 4).cpu()
    back = kivi.dequantize(kivi.unpack(packed, 4, x.numel()).view(x.shape), scale.cpu(), zero.cpu(), 16)
    rc, rs, rz = kivi.quantize(x, 4, 16)
    assert _bits_equal(back, kivi.dequantize(rc, rs, rz, 16))


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match="bits"):
        kv_codec.quantize(torch.zeros(4, 8), 3, 4)
    with pytest.raises(ValueError, match="group"):
        kv_codec.dequantize(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 3, dtype=torch.float16),
                            torch.zeros(4, 3, dtype=torch.float16), 4)
