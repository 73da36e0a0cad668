"""Packed KIVI codes of a KV chunk expanded straight into paged blocks on the device (issue 24, kernel 2).

Today the engine imports fetched KV by decoding the blob on the CPU (kvmesh.kv.codec.decode: unpack,
dequantize to float32 ``k, v [L, T, H, D]``) and copying that into the paged cache
(ModelRunner.execute -> write_kv_range). Here the blob's quantized sections go to the device as
they are stored -- packed codes, fp16 scales and zeros, 4-8x smaller than fp16 KV -- and one launch
per part writes the reconstructed values into the blocks of the sequence's block table, in the
cache's dtype. The inputs are exactly the blob sections (kvmesh.kv.codec's format NOTE):

    keys    codes [L, rows, Q] packed, scale/zero [L, rows, ceil(Q/group)]  (per channel, over tokens)
    values  codes [L, Q, C] packed,    scale/zero [L, Q, ceil(C/group)]     (per token, over channels)

with ``C = kv_heads * head_dim``. Key rows are channels ``h * head_dim + d``; with key outliers a
blob has two key parts (the plain channels at ``bits``, the outliers at ``2 * bits``), each with a
row -> channel map from `outlier_channel_maps`. The fp16 head/residual tokens of a blob are plain
copies and are not handled here. Values equal kvmesh.kv.kivi.dequantize's float32 bit for bit,
then rounded to nearest-even into the cache dtype (as ``write_kv_range``'s cast does).

The cache is one layer ``[num_blocks, block_size, kv_heads, head_dim]`` (then ``layer`` names which
of the part's layers to write) or all layers at once as ``[L, num_blocks, ...]`` (one launch for the
whole chunk, when the engine allocates its layers as views of one tensor).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvmesh.gpu.kv_codec import unpack_codes
from kvmesh.kv import kivi


@dataclass(frozen=True)
class PackedPart:
    """One quantized part (keys or values) of a KV chunk as a blob stores it, on the device."""

    packed: torch.Tensor
    """uint8, the part's codes flattened and packed ``8 // bits`` per byte, lowest bits first (kivi.pack)."""
    scale: torch.Tensor
    """fp16 ``[L, rows, groups]``: one per group of ``group`` codes along the last code dim."""
    zero: torch.Tensor
    """fp16, the shape of ``scale``."""
    bits: int
    """2, 4 or 8."""
    group: int
    """Codes per group (tokens for keys, channels for values)."""

    def __post_init__(self) -> None:
        if self.bits not in (2, 4, 8) or self.group < 1:
            raise ValueError(f"PackedPart: bits must be 2, 4 or 8 and group >= 1, got {self.bits}, {self.group}")
        if self.scale.dim() != 3 or self.zero.shape != self.scale.shape:
            raise ValueError(f"PackedPart: scale and zero must both be [L, rows, groups], got "
                             f"{tuple(self.scale.shape)} and {tuple(self.zero.shape)}")


@triton.jit
def _split_bytes(b, BITS: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Packed bytes ``[ROWS, COLS // (8 // BITS)]`` -> codes ``[ROWS, COLS]``, lowest bits first (kivi.pack)."""
    if BITS == 8:
        codes = b
    elif BITS == 4:
        codes = tl.reshape(tl.join(b & 15, b >> 4), [ROWS, COLS])  # [R, C/2, 2]: byte j -> codes 2j, 2j + 1
    else:  # join(join(c0, c2), join(c1, c3))[.., j, i, o] is code 2i + o of byte j
        codes = tl.reshape(tl.join(tl.join(b & 3, (b >> 4) & 3), tl.join((b >> 2) & 3, b >> 6)), [ROWS, COLS])
    return codes


@triton.jit
def _dequantize_paged_kernel(packed_ptr, scale_ptr, zero_ptr, chan_ptr, cache_ptr, blocks_ptr, start, first_layer,
                             nrows, ncols, stride_layer, stride_block, stride_token,
                             BITS: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
                             HAS_MAP: tl.constexpr, BYTE_TILES: tl.constexpr, ROW_GROUPS: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    # One layer's codes are [nrows, ncols] with groups of GROUP along ncols: keys are [channels,
    # tokens], values [tokens, channels]. A program dequantizes a [BLOCK_R, BLOCK_K] tile in that
    # order (reads along the stored rows), keys are transposed to [tokens, channels] for the store.
    # Offsets inside a layer are int32; the layer's base offset is int64 (all layers may pass 2^31).
    per: tl.constexpr = 8 // BITS
    z = tl.program_id(2)
    layer = (first_layer + z).to(tl.int64)
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_valid = offs_r < nrows
    k_valid = offs_k < ncols
    valid = r_valid[:, None] & k_valid[None, :]  # [BLOCK_R, BLOCK_K]
    if BYTE_TILES:  # every row starts on a byte: load BLOCK_K // per bytes per row, split them in registers
        row_bytes = ncols // per
        offs_b = tl.program_id(1) * (BLOCK_K // per) + tl.arange(0, BLOCK_K // per)
        b = tl.load(packed_ptr + layer * nrows * row_bytes + offs_r[:, None] * row_bytes + offs_b[None, :],
                    mask=r_valid[:, None] & (offs_b < row_bytes)[None, :], other=0)  # [BLOCK_R, BLOCK_K // per]
        c = _split_bytes(b, BITS, BLOCK_R, BLOCK_K)
    else:  # rows straddle bytes: one code per lane
        idx = layer * nrows * ncols + (offs_r[:, None] * ncols + offs_k[None, :])
        c = unpack_codes(packed_ptr, idx, valid, BITS)
    ng = tl.cdiv(ncols, GROUP)
    if ROW_GROUPS:  # the tile's columns lie in one group: one scale and zero per row
        grp = layer * nrows * ng + (offs_r * ng + tl.program_id(1) * BLOCK_K // GROUP)
        s = tl.load(scale_ptr + grp, mask=r_valid, other=0.0).to(tl.float32)[:, None]
        zr = tl.load(zero_ptr + grp, mask=r_valid, other=0.0).to(tl.float32)[:, None]
    else:
        grp = layer * nrows * ng + (offs_r[:, None] * ng + offs_k[None, :] // GROUP)
        s = tl.load(scale_ptr + grp, mask=valid, other=0.0).to(tl.float32)
        zr = tl.load(zero_ptr + grp, mask=valid, other=0.0).to(tl.float32)
    x = c.to(tl.float32) * s + zr  # kivi.dequantize: two roundings (launched without FMA contraction)
    if PER_CHANNEL:
        x = tl.trans(x)  # [tokens, channels]
        offs_t = offs_k
        t_valid = k_valid
        offs_c = offs_r
        c_valid = r_valid
    else:
        offs_t = offs_r
        t_valid = r_valid
        offs_c = offs_k
        c_valid = k_valid
    if HAS_MAP:
        dest = tl.load(chan_ptr + layer * nrows + offs_c, mask=c_valid, other=0)
    else:
        dest = offs_c
    pos = start + offs_t
    block = tl.load(blocks_ptr + pos // BLOCK_SIZE, mask=t_valid, other=0).to(tl.int64)
    slot = block * stride_block + (pos % BLOCK_SIZE) * stride_token  # [tokens]
    tl.store(cache_ptr + z.to(tl.int64) * stride_layer + slot[:, None] + dest[None, :],
             x.to(cache_ptr.dtype.element_ty), mask=t_valid[:, None] & c_valid[None, :])


def _launch(part: PackedPart, cache: torch.Tensor, block_ids: torch.Tensor, start: int, layer: int | None,
            tokens: int, nchan: int, per_channel: bool, channels: torch.Tensor | None) -> None:
    L = part.scale.shape[0]
    if cache.dim() == 4:
        if layer is None or not 0 <= layer < L:
            raise ValueError(f"a one-layer cache needs layer in 0..{L - 1}, got {layer}")
        first, layers, cache5 = layer, 1, cache[None]
    elif cache.dim() == 5 and cache.shape[0] == L and layer is None:
        first, layers, cache5 = 0, L, cache
    else:
        raise ValueError(f"cache must be [num_blocks, block_size, kv_heads, head_dim] with a layer, or "
                         f"[{L}, num_blocks, ...] without; got {tuple(cache.shape)} and layer {layer}")
    _, _, bs, H, D = cache5.shape
    if cache5.stride(-1) != 1 or cache5.stride(-2) != D:
        raise ValueError("the cache's (kv_heads, head_dim) dims must be contiguous")
    if block_ids.numel() * bs < start + tokens:
        raise ValueError(f"{block_ids.numel()} blocks of {bs} cannot hold tokens {start}..{start + tokens}")
    need = -(-L * tokens * nchan * part.bits // 8)
    if part.packed.numel() < need:
        raise ValueError(f"the packed codes hold {part.packed.numel()} bytes, the part needs {need}")
    if tokens * nchan >= 2**31:
        raise ValueError(f"one layer of {tokens} tokens x {nchan} channels passes int32 offsets")
    nrows, ncols = (nchan, tokens) if per_channel else (tokens, nchan)  # the stored code order
    block_r, block_k = 64, 64  # 4,096 values a program; a key tile reads 64 channel rows of 64 tokens
    grid = (triton.cdiv(nrows, block_r), triton.cdiv(ncols, block_k), layers)
    _dequantize_paged_kernel[grid](
        part.packed, part.scale.contiguous(), part.zero.contiguous(),
        channels if channels is not None else block_ids, cache5, block_ids, start, first, nrows, ncols,
        cache5.stride(0), cache5.stride(1), cache5.stride(2), BITS=part.bits, GROUP=part.group,
        PER_CHANNEL=per_channel, HAS_MAP=channels is not None, BYTE_TILES=ncols % (8 // part.bits) == 0,
        ROW_GROUPS=part.group % block_k == 0, BLOCK_SIZE=bs, BLOCK_R=block_r, BLOCK_K=block_k, enable_fp_fusion=False)


def dequantize_keys_into_paged(part: PackedPart, k_cache: torch.Tensor, block_ids: torch.Tensor, start: int,
                               tokens: int, *, layer: int | None = None,
                               channels: torch.Tensor | None = None) -> None:
    """Writes a key part (codes ``[L, rows, tokens]``, groups over tokens) into ``k_cache`` at
    positions ``start .. start + tokens`` of the sequence whose blocks are ``block_ids`` (int32, in
    order, the first holding position 0). Row r goes to channel ``channels[l, r]`` (int32 ``[L,
    rows]``, see `outlier_channel_maps`) or, without a map, to channel r of all ``kv_heads * head_dim``."""
    rows = part.scale.shape[1]
    if part.scale.shape[2] != -(-tokens // part.group):
        raise ValueError(f"key scale {tuple(part.scale.shape)} does not fit {tokens} tokens in groups of {part.group}")
    if channels is None and rows != k_cache.shape[-2] * k_cache.shape[-1]:
        raise ValueError(f"{rows} key rows without a channel map, the cache has {k_cache.shape[-2]} x {k_cache.shape[-1]}")
    if channels is not None and tuple(channels.shape) != tuple(part.scale.shape[:2]):
        raise ValueError(f"channels {tuple(channels.shape)} must be [L, rows] = {tuple(part.scale.shape[:2])}")
    _launch(part, k_cache, block_ids, start, layer, tokens, rows, True,
            None if channels is None else channels.to(torch.int32).contiguous())


def dequantize_values_into_paged(part: PackedPart, v_cache: torch.Tensor, block_ids: torch.Tensor, start: int, *,
                                 layer: int | None = None) -> None:
    """Writes a value part (codes ``[L, tokens, kv_heads * head_dim]``, groups over channels) into
    ``v_cache`` at positions ``start ..`` of the sequence whose blocks are ``block_ids``."""
    tokens = part.scale.shape[1]
    nchan = v_cache.shape[-2] * v_cache.shape[-1]
    if part.scale.shape[2] != -(-nchan // part.group):
        raise ValueError(f"value scale {tuple(part.scale.shape)} does not fit {nchan} channels in groups of {part.group}")
    _launch(part, v_cache, block_ids, start, layer, tokens, nchan, False, None)


def outlier_channel_maps(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row -> channel maps of a blob's two key parts, from its outlier mask ``[L, H, D]`` (1 = outlier):
    (plain ``[L, H * (D - m)]``, outliers ``[L, H * m]``), int32 channels ``h * D + d``."""
    L, H, D = mask.shape
    m = int(mask[0, 0].sum())
    order = kivi.channel_order(mask) + torch.arange(H, device=mask.device)[:, None] * D  # [L, H, D]
    return (order[..., :D - m].reshape(L, -1).to(torch.int32).contiguous(),
            order[..., D - m:].reshape(L, -1).to(torch.int32).contiguous())


def dequantize_into_paged_ref(part: PackedPart, cache: torch.Tensor, block_ids: torch.Tensor, start: int,
                              tokens: int, *, keys: bool, layer: int | None = None,
                              channels: torch.Tensor | None = None) -> None:
    """The torch reference of both launchers (``keys`` picks the code layout): kivi.unpack,
    kivi.dequantize, then an indexed write, as the CPU decode path and write_kv_range do."""
    L, rows, _ = part.scale.shape
    cache5 = cache[None] if cache.dim() == 4 else cache
    bs, H, D = cache5.shape[2:]
    cols = tokens if keys else H * D
    codes = kivi.unpack(part.packed, part.bits, L * rows * cols).view(L, rows, cols)
    x = kivi.dequantize(codes, part.scale, part.zero, part.group)  # [L, rows, cols] float32
    if keys:
        x = x.transpose(1, 2)  # [L, tokens, rows]
    dest = (channels.long() if channels is not None
            else torch.arange(x.shape[2], device=x.device).expand(L, -1))  # [L, rows or C]
    pos = start + torch.arange(tokens, device=x.device)
    blocks = block_ids.long()[pos // bs]
    flat = cache5.view(*cache5.shape[:3], H * D)  # [layers, num_blocks, block_size, C]
    for i, l in enumerate(range(L) if layer is None else [layer]):
        flat[i, blocks[:, None], (pos % bs)[:, None], dest[l][None, :]] = x[l].to(cache.dtype)
