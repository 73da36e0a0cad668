"""KIVI quantize / dequantize and code packing in Triton, bit-exact with kvmesh.kv.kivi.

The references are kvmesh.kv.kivi's own `quantize`, `dequantize`, `pack` and `unpack`: a blob
written by the CPU codec (kvmesh.kv.codec) must read back the same on a GPU and vice versa, so
codes, scales, zeros and packed bytes here equal theirs bit for bit, and dequantized values too.

NOTE (bit-exactness): kivi.quantize computes, per group of the last dim,
``mn, mx`` (clamped to the fp16 range), ``scale = fp16((mx - mn) * fp32((1 + 2**-10) / qmax))``,
``zero = fp16(mn)``, ``inv = 1 / fp32(scale)`` (1 where the scale is 0) and
``code = uint8(clamp(addcmul(0.5 - fp32(zero) * inv, x, inv), 0, qmax))``. On this CPU (and any
x86 with FMA) ATen's vectorised addcmul is one fused multiply-add, so the kernel uses `tl.fma`
there and only there; every other step is one IEEE-rounded op, so launches pass
``enable_fp_fusion=False`` (no contraction into FMAs on the GPU) and divide with `div_rn` (not the
GPU's approximate division). kivi.dequantize is ``code * scale`` then ``+ zero``, two roundings,
likewise unfused here. A ragged last group is padded with its last element (min and max unchanged).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_NO_FMA = {"enable_fp_fusion": False}
"""Launch option of every codec kernel: keep each op separately rounded, as the torch reference is."""


@triton.jit
def _quantize_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, rows, n, scale_factor,
                     QMAX: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_R: tl.constexpr):
    g = tl.program_id(1)
    num_groups = tl.cdiv(n, GROUP)
    offs_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    r_valid = offs_r < rows
    j = tl.arange(0, GROUP_P2)
    j_valid = j < GROUP
    col = g * GROUP + j
    src = tl.minimum(col, n - 1)  # a ragged last group repeats its last element
    x = tl.load(x_ptr + offs_r[:, None] * n + src[None, :], mask=r_valid[:, None] & j_valid[None, :],
                other=0.0).to(tl.float32)  # [BLOCK_R, GROUP_P2]
    mn = tl.min(tl.where(j_valid[None, :], x, float("inf")), 1)
    mx = tl.max(tl.where(j_valid[None, :], x, float("-inf")), 1)
    mn = tl.minimum(tl.maximum(mn, -65504.0), 65504.0)
    mx = tl.minimum(tl.maximum(mx, -65504.0), 65504.0)
    scale = ((mx - mn) * scale_factor).to(tl.float16)  # [BLOCK_R]
    zero = mn.to(tl.float16)
    s = scale.to(tl.float32)
    inv = tl.math.div_rn(tl.full([BLOCK_R], 1.0, tl.float32), tl.where(s > 0, s, 1.0))  # 1 for a constant group
    bias = 0.5 - zero.to(tl.float32) * inv
    q = tl.math.fma(x, inv[:, None], bias[:, None])  # ATen's addcmul: one rounding
    q = tl.minimum(tl.maximum(q, 0.0), QMAX)
    tl.store(codes_ptr + offs_r[:, None] * n + col[None, :], q.to(tl.uint8),
             mask=r_valid[:, None] & (j_valid & (col < n))[None, :])
    tl.store(scale_ptr + offs_r * num_groups + g, scale, mask=r_valid)
    tl.store(zero_ptr + offs_r * num_groups + g, zero, mask=r_valid)


@triton.jit
def _dequantize_kernel(codes_ptr, scale_ptr, zero_ptr, out_ptr, total, n,
                       GROUP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < total
    grp = (offs // n) * tl.cdiv(n, GROUP) + (offs % n) // GROUP
    c = tl.load(codes_ptr + offs, mask=valid, other=0).to(tl.float32)
    s = tl.load(scale_ptr + grp, mask=valid, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + grp, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (c * s + z).to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _pack_kernel(codes_ptr, packed_ptr, count, BITS: tl.constexpr, BLOCK: tl.constexpr):
    per: tl.constexpr = 8 // BITS
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # output bytes
    byte = tl.zeros([BLOCK], tl.uint8)
    for i in tl.static_range(per):
        idx = offs * per + i
        c = tl.load(codes_ptr + idx, mask=idx < count, other=0)
        byte = byte | (c << (i * BITS)).to(tl.uint8)
    tl.store(packed_ptr + offs, byte, mask=offs < tl.cdiv(count, per))


@triton.jit
def unpack_codes(packed_ptr, idx, valid, BITS: tl.constexpr):
    """Codes at flat indices ``idx`` of a packed stream (``8 // BITS`` per byte, lowest bits first)."""
    per: tl.constexpr = 8 // BITS
    byte = tl.load(packed_ptr + idx // per, mask=valid, other=0)
    return (byte >> ((idx % per) * BITS).to(tl.uint8)) & ((1 << BITS) - 1)


@triton.jit
def _unpack_kernel(packed_ptr, codes_ptr, count, BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < count
    tl.store(codes_ptr + offs, unpack_codes(packed_ptr, offs, valid, BITS), mask=valid)


def _check_bits(bits: int, allowed: tuple[int, ...]) -> None:
    if bits not in allowed:
        raise ValueError(f"bits must be one of {allowed}, got {bits}")


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kivi.quantize on the device of ``x [..., n]``: uint8 codes ``[..., n]``, fp16 scale and zero
    ``[..., ceil(n/group)]``, equal bit for bit to kivi.quantize's."""
    _check_bits(bits, (1, 2, 4, 8))
    if group < 1:
        raise ValueError(f"group must be >= 1, got {group}")
    *lead, n = x.shape
    ng = -(-n // group)
    x2 = x.reshape(-1, n).contiguous()  # [rows, n]
    rows = x2.shape[0]
    codes = torch.empty(x2.shape, dtype=torch.uint8, device=x.device)
    scale = torch.empty(rows, ng, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    qmax = (1 << bits) - 1
    group_p2 = triton.next_power_of_2(group)
    block_r = max(1, min(64, 2048 // group_p2, triton.next_power_of_2(rows)))
    if rows and n:
        # the factor as torch applies a Python float to a float32 tensor: rounded to fp32 once
        factor = float(torch.tensor((1 + 2**-10) / qmax, dtype=torch.float32))
        _quantize_kernel[(triton.cdiv(rows, block_r), ng)](
            x2, codes, scale, zero, rows, n, factor, QMAX=qmax, GROUP=group, GROUP_P2=group_p2,
            BLOCK_R=block_r, **_NO_FMA)
    return codes.view(*lead, n), scale.view(*lead, ng), zero.view(*lead, ng)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kivi.dequantize on the device of ``codes [..., n]`` (fp16 ``scale, zero [..., ceil(n/group)]``):
    ``[..., n]`` of ``dtype``; float32 equals kivi.dequantize bit for bit, other dtypes are its
    round-to-nearest-even cast."""
    n = codes.shape[-1]
    if scale.shape[-1] != -(-n // group) or scale.shape != zero.shape or scale.shape[:-1] != codes.shape[:-1]:
        raise ValueError(f"codes {tuple(codes.shape)}, scale {tuple(scale.shape)}, zero {tuple(zero.shape)} "
                         f"do not fit group {group}")
    out = torch.empty(codes.shape, dtype=dtype, device=codes.device)
    total = codes.numel()
    block = 1024
    if total:
        _dequantize_kernel[(triton.cdiv(total, block),)](
            codes.contiguous(), scale.contiguous(), zero.contiguous(), out, total, n, GROUP=group, BLOCK=block,
            **_NO_FMA)
    return out


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """kivi.pack on the device: ``bits``-bit codes (any shape, flattened) -> uint8 ``[ceil(N*bits/8)]``."""
    _check_bits(bits, (1, 2, 4, 8))
    flat = codes.reshape(-1).contiguous()
    if bits == 8:
        return flat
    count = flat.numel()
    out = torch.empty(-(-count * bits // 8), dtype=torch.uint8, device=codes.device)
    block = 1024
    if count:
        _pack_kernel[(triton.cdiv(out.numel(), block),)](flat, out, count, BITS=bits, BLOCK=block)
    return out


def unpack(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """kivi.unpack on the device: uint8 ``[ceil(count*bits/8)]`` -> uint8 codes ``[count]``."""
    _check_bits(bits, (1, 2, 4, 8))
    if bits == 8:
        return packed[:count]
    if packed.numel() * (8 // bits) < count:
        raise ValueError(f"{packed.numel()} packed bytes hold fewer than {count} {bits}-bit codes")
    out = torch.empty(count, dtype=torch.uint8, device=packed.device)
    block = 1024
    if count:
        _unpack_kernel[(triton.cdiv(count, block),)](packed.contiguous(), out, count, BITS=bits, BLOCK=block)
    return out
