"""Position-free keys re-rotated to where a chunk lands, written into paged blocks (issue 24, kernel 3).

A stored chunk's keys are position-free (kvmesh.kv.rope: un-rotated to position 0 before encoding),
and blending puts each cached chunk at a new place in the prompt (kvmesh.kv.blend, step 1: "each
cached segment's keys are rotated to the positions where it now lands"). On the CPU that is
codec.decode (unpack, dequantize to float32) then rope.rotate_keys then a copy into the cache. Here
one launch does all three for a chunk's keys, all layers: the blob's packed key codes and fp16
scales/zeros (kv_import's `PackedPart`, with the int2 blob's outlier part when it has one) are
dequantized in registers, rotated to positions ``start ..`` and stored in the cache's dtype.
Values need no rotation: they are kv_import's `dequantize_values_into_paged` as they are.
`rotate_keys_into_paged` is the same without the codes, for keys stored exactly (the fp16/bf16/fp32
codecs, the deployment default -- ``CodecSpec.storage`` EXACT -- and the fp16 head/residual tokens
of a quantized blob): what blend fetches is decoded float keys either way.

NOTE (the rotation is the model's). kvmesh's model uses HF's rotate-half RoPE (kvmesh.model.llama:
``apply_rope(x) = x * cos + rotate_half(x) * sin``, ``rotate_half(x) = cat(-x[D/2:], x[:D/2])``,
channel d paired with d + D/2) with ``cos, sin = cos/sin(position * inv_freq)`` for both halves.
Every RoPE scaling kvmesh supports (linear, dynamic NTK, llama3 and GGUF's freq_factors; no
attention factor) lives in the inverse frequencies alone (RotaryEmbedding.inv_freq), so the kernel
takes that ``[D/2]`` fp32 vector from the model (``model.rotary.inv_freq()``) and any scaling
comes with it. The angle ``float32(position) * inv_freq`` is one IEEE product as in
RotaryEmbedding.forward, and the launches keep every op separately rounded (no FMA contraction), so
the kernel's result differs from rope.rotate_keys only through cos/sin themselves: torch's CPU
cos/sin, numpy's (the interpreter) and libdevice's ``__nv_cosf``/``__nv_sinf`` (CUDA) are each
within about 2 ulp, so an output differs by at most about ``2^-21 * max|k|`` plus its own
rounding (the tolerance argument is in tests/unit/gpu/test_kv_rerotate.py). `rotate_keys_ref` is
rope.rotate_keys's arithmetic on an ``inv_freq`` (kvmesh.kv.rope imports kvmesh.model.llama and through it
the tokenizer's dependencies, which a bare GPU box lacks; the CPU suite checks the two are bit-identical).

A dense ``[L, T, H, D]`` tensor (blend's ``out_k``) is the one-block case: pass it as
``[L, 1, T, H, D]`` with ``block_ids = [0]``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvmesh.gpu.kv_codec import unpack_codes
from kvmesh.gpu.kv_import import PackedPart, _split_bytes, outlier_channel_maps
from kvmesh.kv import kivi


@triton.jit
def _dequant_key_rows(packed_ptr, scale_ptr, zero_ptr, layer, nrows, row, row_ok, t0, t, t_valid, tokens,
                      BITS: tl.constexpr, GROUP: tl.constexpr, BYTE_TILES: tl.constexpr, BLOCK_T: tl.constexpr,
                      BLOCK_C: tl.constexpr):
    """kivi.dequantize of key codes ``[L, nrows, tokens]`` at rows ``row [C]`` (those with
    ``row_ok``) and tokens ``t = t0 + arange(BLOCK_T)`` of ``layer``: float32 ``[T, C]`` (two
    roundings, as kivi: launched without FMA contraction)."""
    if BYTE_TILES:  # every row starts on a byte: BLOCK_T // per bytes of each row, split in registers
        per: tl.constexpr = 8 // BITS
        row_bytes = tokens // per
        offs_b = t0 // per + tl.arange(0, BLOCK_T // per)
        b = tl.load(packed_ptr + layer * nrows * row_bytes + (row[:, None] * row_bytes + offs_b[None, :]),
                    mask=row_ok[:, None] & (offs_b < row_bytes)[None, :], other=0)  # [C, T // per]
        c = tl.trans(_split_bytes(b, BITS, BLOCK_C, BLOCK_T))  # [T, C]
    else:  # rows straddle bytes: one code per lane
        idx = layer * nrows * tokens + (row[None, :] * tokens + t[:, None])  # [T, C]
        c = unpack_codes(packed_ptr, idx, t_valid[:, None] & row_ok[None, :], BITS)
    valid = t_valid[:, None] & row_ok[None, :]
    ng = tl.cdiv(tokens, GROUP)
    grp = layer * nrows * ng + (row[None, :] * ng + (t // GROUP)[:, None])
    s = tl.load(scale_ptr + grp, mask=valid, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + grp, mask=valid, other=0.0).to(tl.float32)
    return c.to(tl.float32) * s + z


@triton.jit
def _load_keys(src_ptr, scale_a, zero_a, packed_b, scale_b, zero_b, map_ptr, layer, t0, t, t_valid, chan, c_valid,
               tokens, rows_a, rows_b, NUM_CHANNELS: tl.constexpr, QUANT: tl.constexpr, HAS_B: tl.constexpr,
               BITS_A: tl.constexpr, BITS_B: tl.constexpr, GROUP: tl.constexpr, BYTE_TILES: tl.constexpr,
               BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Position-free keys at tokens ``t [T]`` and channels ``chan [C]`` (``h * D + d``) of
    ``layer``: float32 ``[T, C]``, from float keys ``[L, tokens, H*D]`` or from the codes."""
    if QUANT:
        if HAS_B:  # map: channel -> row r >= 0 of part a, or -(r + 1) of part b (the outliers)
            m = tl.load(map_ptr + layer * NUM_CHANNELS + chan, mask=c_valid, other=0)
            in_b = m < 0
            xa = _dequant_key_rows(src_ptr, scale_a, zero_a, layer, rows_a, tl.maximum(m, 0), c_valid & ~in_b, t0, t,
                                   t_valid, tokens, BITS_A, GROUP, BYTE_TILES, BLOCK_T, BLOCK_C)
            xb = _dequant_key_rows(packed_b, scale_b, zero_b, layer, rows_b, tl.maximum(-m - 1, 0), c_valid & in_b,
                                   t0, t, t_valid, tokens, BITS_B, GROUP, BYTE_TILES, BLOCK_T, BLOCK_C)
            x = tl.where(in_b[None, :], xb, xa)
        else:
            x = _dequant_key_rows(src_ptr, scale_a, zero_a, layer, rows_a, chan, c_valid, t0, t, t_valid, tokens,
                                  BITS_A, GROUP, BYTE_TILES, BLOCK_T, BLOCK_C)
    else:
        x = tl.load(src_ptr + layer * tokens * NUM_CHANNELS + (t[:, None] * NUM_CHANNELS + chan[None, :]),
                    mask=t_valid[:, None] & c_valid[None, :], other=0.0).to(tl.float32)
    return x


@triton.jit
def _rotate_into_paged_kernel(src_ptr, scale_a, zero_a, packed_b, scale_b, zero_b, map_ptr, inv_freq_ptr,
                              cache_ptr, blocks_ptr, start, first_layer, tokens, rows_a, rows_b,
                              stride_layer, stride_block, stride_token,
                              NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_P2: tl.constexpr,
                              QUANT: tl.constexpr, HAS_B: tl.constexpr, BITS_A: tl.constexpr, BITS_B: tl.constexpr,
                              GROUP: tl.constexpr, BYTE_TILES: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                              BLOCK_T: tl.constexpr):
    # One program: BLOCK_T tokens of one (layer, KV head); channel d and its partner d + D/2 together.
    half: tl.constexpr = HEAD_DIM // 2
    head = tl.program_id(1)
    z = tl.program_id(2)
    layer = (first_layer + z).to(tl.int64)
    t0 = tl.program_id(0) * BLOCK_T
    t = t0 + tl.arange(0, BLOCK_T)  # [T] token of the chunk
    d = tl.arange(0, HALF_P2)  # [C] channel of the first half
    t_valid = t < tokens
    d_valid = d < half
    c1 = head * HEAD_DIM + d
    x1 = _load_keys(src_ptr, scale_a, zero_a, packed_b, scale_b, zero_b, map_ptr, layer, t0, t, t_valid, c1,
                    d_valid, tokens, rows_a, rows_b, NUM_HEADS * HEAD_DIM, QUANT, HAS_B, BITS_A, BITS_B, GROUP,
                    BYTE_TILES, BLOCK_T, HALF_P2)
    x2 = _load_keys(src_ptr, scale_a, zero_a, packed_b, scale_b, zero_b, map_ptr, layer, t0, t, t_valid, c1 + half,
                    d_valid, tokens, rows_a, rows_b, NUM_HEADS * HEAD_DIM, QUANT, HAS_B, BITS_A, BITS_B, GROUP,
                    BYTE_TILES, BLOCK_T, HALF_P2)
    pos = start + t
    inv = tl.load(inv_freq_ptr + d, mask=d_valid, other=0.0)
    angle = pos.to(tl.float32)[:, None] * inv[None, :]  # [T, C], RotaryEmbedding.forward's fp32 product
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    o1 = x1 * cos - x2 * sin  # apply_rope: x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1)
    o2 = x2 * cos + x1 * sin
    block = tl.load(blocks_ptr + pos // BLOCK_SIZE, mask=t_valid, other=0).to(tl.int64)
    slot = z.to(tl.int64) * stride_layer + block * stride_block + (pos % BLOCK_SIZE) * stride_token  # [T]
    dest = cache_ptr + slot[:, None] + c1[None, :]
    valid = t_valid[:, None] & d_valid[None, :]
    tl.store(dest, o1.to(cache_ptr.dtype.element_ty), mask=valid)
    tl.store(dest + half, o2.to(cache_ptr.dtype.element_ty), mask=valid)


def _cache5(cache: torch.Tensor, L: int, layer: int | None) -> tuple[int, int, torch.Tensor]:
    if cache.dim() == 4:
        if layer is None or not 0 <= layer < L:
            raise ValueError(f"a one-layer cache needs layer in 0..{L - 1}, got {layer}")
        return layer, 1, cache[None]
    if cache.dim() == 5 and cache.shape[0] == L and layer is None:
        return 0, L, cache
    raise ValueError(f"cache must be [num_blocks, block_size, kv_heads, head_dim] with a layer, or "
                     f"[{L}, num_blocks, ...] without; got {tuple(cache.shape)} and layer {layer}")


def _launch(cache: torch.Tensor, block_ids: torch.Tensor, start: int, tokens: int, inv_freq: torch.Tensor,
            L: int, layer: int | None, src: torch.Tensor, a: PackedPart | None, b: PackedPart | None,
            chan_map: torch.Tensor | None) -> None:
    first, layers, cache5 = _cache5(cache, L, layer)
    _, _, bs, H, D = cache5.shape
    if D % 2 or inv_freq.shape != (D // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"inv_freq must be float32 [head_dim / 2] = [{D // 2}] (model.rotary.inv_freq()), "
                         f"got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if cache5.stride(-1) != 1 or cache5.stride(-2) != D:
        raise ValueError("the cache's (kv_heads, head_dim) dims must be contiguous")
    if block_ids.numel() * bs < start + tokens:
        raise ValueError(f"{block_ids.numel()} blocks of {bs} cannot hold tokens {start}..{start + tokens}")
    if start + tokens > 1 << 24:
        raise ValueError(f"position {start + tokens} is past 2^24: float32 positions are no longer exact")
    if tokens * H * D >= 2**31:
        raise ValueError(f"one layer of {tokens} tokens x {H * D} channels passes int32 offsets")
    if not tokens:
        return
    block_t = 32
    grid = (triton.cdiv(tokens, block_t), H, layers)
    dummy = inv_freq
    _rotate_into_paged_kernel[grid](
        src, a.scale if a else dummy, a.zero if a else dummy, b.packed if b else dummy, b.scale if b else dummy,
        b.zero if b else dummy, chan_map if chan_map is not None else block_ids, inv_freq, cache5, block_ids,
        start, first, tokens, a.scale.shape[1] if a else 0, b.scale.shape[1] if b else 0,
        cache5.stride(0), cache5.stride(1), cache5.stride(2), NUM_HEADS=H, HEAD_DIM=D,
        HALF_P2=triton.next_power_of_2(D // 2), QUANT=a is not None, HAS_B=b is not None,
        BITS_A=a.bits if a else 8, BITS_B=b.bits if b else 8, GROUP=a.group if a else 1,
        BYTE_TILES=all(tokens % (8 // p.bits) == 0 for p in (a, b) if p is not None), BLOCK_SIZE=bs,
        BLOCK_T=block_t, enable_fp_fusion=False)


def rotate_keys_into_paged(k: torch.Tensor, k_cache: torch.Tensor, block_ids: torch.Tensor, start: int,
                           inv_freq: torch.Tensor, *, layer: int | None = None) -> None:
    """Position-free keys ``k [L, n, kv_heads, head_dim]`` (any float dtype) rotated to positions
    ``start .. start + n`` and written there in ``k_cache`` (one layer ``[num_blocks, block_size, H,
    D]`` with ``layer``, or ``[L, num_blocks, ...]``), the sequence's blocks being ``block_ids``
    (int32, in order). ``inv_freq``: the model's float32 ``[D / 2]`` (``model.rotary.inv_freq()``)."""
    L, n, H, D = k.shape
    if tuple(k_cache.shape[-2:]) != (H, D):
        raise ValueError(f"keys {tuple(k.shape)} do not fit a cache of {tuple(k_cache.shape)}")
    _launch(k_cache, block_ids, start, n, inv_freq, L, layer, k.contiguous(), None, None, None)


def dequantize_rotate_keys_into_paged(part: PackedPart, k_cache: torch.Tensor, block_ids: torch.Tensor, start: int,
                                      tokens: int, inv_freq: torch.Tensor, *, outliers: PackedPart | None = None,
                                      outlier_mask: torch.Tensor | None = None, layer: int | None = None) -> None:
    """A blob's quantized keys (codes ``[L, rows, tokens]`` per channel, kv_import's format)
    dequantized, rotated to positions ``start .. start + tokens`` and written there in ``k_cache``
    (shapes as `rotate_keys_into_paged`). With key outliers (the int2 default) ``part`` holds the
    plain channels, ``outliers`` the marked ones at twice the bits, and ``outlier_mask [L, H, D]``
    (uint8, 1 = outlier) says which are which, as the blob does."""
    H, D = k_cache.shape[-2:]
    L = part.scale.shape[0]
    ng = -(-tokens // part.group)
    if (outliers is None) != (outlier_mask is None):
        raise ValueError("key outliers need both their part and the outlier mask")
    if part.scale.shape[2] != ng or (outliers is not None and (outliers.group != part.group
                                                                or outliers.scale.shape[2] != ng)):
        raise ValueError(f"key scales do not fit {tokens} tokens in groups of {part.group}")
    chan_map = None
    if outliers is None:
        if part.scale.shape[1] != H * D:
            raise ValueError(f"{part.scale.shape[1]} key rows without outliers, the cache has {H} x {D} channels")
    else:
        plain, marked = outlier_channel_maps(outlier_mask)  # row -> channel, [L, rows_a], [L, rows_b]
        if plain.shape != part.scale.shape[:2] or marked.shape != outliers.scale.shape[:2]:
            raise ValueError(f"outlier mask {tuple(outlier_mask.shape)} does not fit the key parts' rows "
                             f"{part.scale.shape[1]} and {outliers.scale.shape[1]}")
        chan_map = torch.empty(L, H * D, dtype=torch.int32, device=plain.device)  # channel -> row (see _load_keys)
        chan_map.scatter_(1, plain.long(), torch.arange(plain.shape[1], dtype=torch.int32,
                                                        device=plain.device).expand(L, -1).contiguous())
        chan_map.scatter_(1, marked.long(), -1 - torch.arange(marked.shape[1], dtype=torch.int32,
                                                              device=plain.device).expand(L, -1).contiguous())
    for p in (part, outliers):
        if p is not None and p.packed.numel() < -(-L * p.scale.shape[1] * tokens * p.bits // 8):
            raise ValueError(f"the packed key codes hold {p.packed.numel()} bytes, fewer than {tokens} tokens need")
    contiguous = [PackedPart(p.packed, p.scale.contiguous(), p.zero.contiguous(), p.bits, p.group) if p else None
                  for p in (part, outliers)]
    _launch(k_cache, block_ids, start, tokens, inv_freq, L, layer, part.packed, contiguous[0], contiguous[1], chan_map)


def rotate_keys_ref(k: torch.Tensor, start: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """rope.rotate_keys's arithmetic with the model's ``inv_freq``: keys ``[L, n, H, D]`` -> float32
    rotated to positions ``start ..`` (RotaryEmbedding.forward's tables, then apply_rope)."""
    positions = torch.arange(start, start + k.shape[1], device=k.device)
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(k.device)  # [n, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [n, 1, D]
    x = k.float()
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def dequantize_keys_ref(part: PackedPart, tokens: int, H: int, D: int, *, outliers: PackedPart | None = None,
                        outlier_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU decode of a blob's key parts (kivi.unpack, kivi.dequantize, outlier channels put
    back where the mask says): float32 ``[L, tokens, H, D]``, position-free."""
    L = part.scale.shape[0]
    dev = part.scale.device
    x = torch.empty(L, H * D, tokens, device=dev)  # [L, C, tokens]
    maps = (outlier_channel_maps(outlier_mask) if outliers is not None
            else (torch.arange(H * D, device=dev).expand(L, -1),))
    for p, rows_to_chan in zip((part, outliers), maps):
        rows = p.scale.shape[1]
        codes = kivi.unpack(p.packed, p.bits, L * rows * tokens).view(L, rows, tokens)
        vals = kivi.dequantize(codes, p.scale, p.zero, p.group)  # [L, rows, tokens]
        x.scatter_(1, rows_to_chan.long()[..., None].expand(-1, -1, tokens), vals)
    return x.view(L, H, D, tokens).permute(0, 3, 1, 2)


def write_paged_ref(x: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, start: int, *,
                    layer: int | None = None) -> None:
    """``x [L, n, H, D]`` written at positions ``start ..`` of the blocks ``block_ids`` in ``cache``
    (shapes as `rotate_keys_into_paged`), cast to its dtype as write_kv_range does."""
    cache5 = cache[None] if cache.dim() == 4 else cache
    bs = cache5.shape[2]
    pos = start + torch.arange(x.shape[1], device=cache.device)
    blocks = block_ids.long().to(cache.device)[pos // bs]
    for i, l in enumerate(range(x.shape[0]) if layer is None else [layer]):
        cache5[i, blocks, pos % bs] = x[l].to(cache.dtype)
