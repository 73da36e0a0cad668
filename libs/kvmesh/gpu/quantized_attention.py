"""Decode attention computed directly over a paged KIVI int4 (or int2) KV cache (issue 24, kernel 4).

An opt-in, lossy layout: the paged cache holds KIVI codes and fp16 scales/zeros instead of fp16 KV
(KIVI, Liu et al. 2024, decodes this way), so a decode step reads about 3.5x fewer bytes at int4.
`quantized_decode_attention` has `paged_decode_attention`'s interface (GQA heads together, several
causal query rows, block tables read in place, split-K merged by the same kernel) and dequantizes
each tile in registers right after loading it.

NOTE (layout, one layer; ``per = 8 // bits`` codes a byte, lowest bits first as kivi.pack):
    k_codes  uint8 [num_blocks, kv_heads, head_dim, block_size / per]    keys per channel: a channel's
    k_scale  fp16  [num_blocks, kv_heads, head_dim, block_size / key_group]   tokens of a block are
    k_zero   fp16  (as k_scale)                                          contiguous, in groups of tokens
    v_codes  uint8 [num_blocks, block_size, kv_heads, head_dim / per]    values per token, in groups
    v_scale  fp16  [num_blocks, block_size, kv_heads, head_dim / value_group]   of channels of one head
    v_zero   fp16  (as v_scale)
  Groups never cross a block (``block_size % key_group == 0``; ``head_dim % value_group == 0``), so a
  block is self-contained and the block table, allocation and prefix cache work as for fp16 blocks.
  Defaults: key_group = block_size, value_group = head_dim. At block 16, head_dim 64, int4: 0.75
  bytes per key element and 0.5625 per value element, 3.05x fewer than fp16.

NOTE (how blocks are filled: KIVI's residual). A key group can only be quantized once all its
key_group tokens are known and final (min/max over tokens). Each sequence therefore keeps its
newest tokens as they are, in a `Residual` (``k, v [num_seqs, capacity, kv_heads, head_dim]`` in
the attention dtype; position ``p`` at row ``p - quantized_lens[s]``): positions below
``quantized_lens[s]`` (a multiple of key_group) are read from the codes, positions from there to
``seq_lens[s]`` from the residual. When key_group residual tokens are final (accepted, not drafts),
`quantize_into_cache` writes them as one group into their block (keys and values together; values
could go token by token, but one rule keeps a position's K and V in the same place), the caller adds
key_group to quantized_lens and drops them from the residual. Capacity = key_group + the most query
rows a step appends. `quantize_into_cache` is kv_codec.quantize (the Triton quantizer, bit-exact
with kivi.quantize) plus a pack and an indexed store in torch.

NOTE (exactness and quality). The kernel dequantizes exactly as kivi.dequantize does (``code *
scale + zero``, two fp32 roundings, no FMA contraction), rounds to the attention dtype, then runs
the attention of `paged_decode_attention` over it; so it equals attention over the dequantized
cache (`quantized_decode_attention_ref`) within that kernel's float tolerances. Its quality cost is
therefore exactly that of the KIVI codec at the same bits and groups, which the project measures
(``kvmesh bench kvcache``, ``kvmesh bench quality``; the codec NOTEs in kvmesh.kv.codec); no
separate quality number is claimed here. The groups differ from the blob's defaults (key groups of
block_size tokens instead of 64, no outlier channels or fp16 head token), so measure the codec at
these groups before turning this on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvmesh.gpu import kv_codec
from kvmesh.gpu.kv_import import _split_bytes
from kvmesh.gpu.paged_attention import (
    _LOG2E,
    _merge_splits_kernel,
    default_splits,
    load_query_tile,
    online_softmax_step,
    paged_decode_attention_ref,
    store_output,
)
from kvmesh.kv import kivi


@dataclass(frozen=True)
class QuantizedKVCache:
    """One layer's paged KV as KIVI codes (the layout NOTE); the tensors are contiguous."""

    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    bits: int
    """4 or 2."""
    key_group: int
    """Tokens per key scale (divides block_size)."""
    value_group: int
    """Channels per value scale (divides head_dim)."""

    @classmethod
    def allocate(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, *, bits: int = 4,
                 key_group: int | None = None, value_group: int | None = None,
                 device: torch.device | str = "cpu") -> QuantizedKVCache:
        """A zeroed cache (zeros dequantize to 0: never NaN, even where nothing was written)."""
        gk, gv = key_group or block_size, value_group or head_dim
        if bits not in (2, 4):
            raise ValueError(f"bits must be 4 or 2, got {bits}")
        per = 8 // bits
        if block_size % gk or gk % per or head_dim % gv or head_dim % per or block_size & (block_size - 1):
            raise ValueError(f"block_size {block_size} must be a power of 2 and a multiple of key_group {gk} (itself "
                             f"a multiple of {per}); head_dim {head_dim} a multiple of value_group {gv} and of {per}")
        u8, f16 = dict(dtype=torch.uint8, device=device), dict(dtype=torch.float16, device=device)
        kshape, vshape = (num_blocks, kv_heads, head_dim), (num_blocks, block_size, kv_heads)
        return cls(torch.zeros(*kshape, block_size // per, **u8), torch.zeros(*kshape, block_size // gk, **f16),
                   torch.zeros(*kshape, block_size // gk, **f16), torch.zeros(*vshape, head_dim // per, **u8),
                   torch.zeros(*vshape, head_dim // gv, **f16), torch.zeros(*vshape, head_dim // gv, **f16),
                   bits, gk, gv)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(num_blocks, block_size, kv_heads, head_dim), as an fp16 cache of the same blocks."""
        nb, bs, h, _ = self.v_codes.shape
        return nb, bs, h, self.k_codes.shape[2]


@dataclass(frozen=True)
class Residual:
    """Each sequence's newest tokens, not yet quantized (the residual NOTE)."""

    k: torch.Tensor
    """``[num_seqs, capacity, kv_heads, head_dim]`` in the attention dtype: row i = position quantized_lens + i."""
    v: torch.Tensor
    """As k."""
    quantized_lens: torch.Tensor
    """int32 ``[num_seqs]``: positions held as codes, a multiple of key_group."""


@triton.jit
def _quantized_decode_kernel(
        q_ptr, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, rk_ptr, rv_ptr, qlens_ptr,
        tables_ptr, lens_ptr, out_ptr, parts_ptr, num_parts, scale_log2,
        stride_qs, stride_qr, stride_qh, stride_ts, stride_os, stride_or, stride_oh, tiles_per_split,
        Q_ROWS: tl.constexpr, GROUP: tl.constexpr, NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr, NUM_SPLITS: tl.constexpr, BITS: tl.constexpr, KEY_GROUP: tl.constexpr,
        VALUE_GROUP: tl.constexpr, CAPACITY: tl.constexpr, IEEE_DOT: tl.constexpr, UPCAST: tl.constexpr):
    # paged_attention._paged_decode_kernel with the K/V loads replaced by loads of codes dequantized
    # in registers (or of residual rows past quantized_lens); the online softmax is the same.
    per: tl.constexpr = 8 // BITS
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    q_len = tl.load(qlens_ptr + seq)
    row, head, m_valid, offs_d, d_valid, q, q_pos = load_query_tile(
        q_ptr, seq, kvh, seq_len, stride_qs, stride_qr, stride_qh, Q_ROWS, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D, UPCAST)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(seq_len, TILE_N))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    offs_kb = tl.arange(0, TILE_N // per)  # key bytes: per consecutive tokens of one channel
    offs_vb = tl.arange(0, BLOCK_D // per)  # value bytes: per consecutive channels of one token
    for j in range(first, last):
        pos = j * TILE_N + offs_n  # [TILE_N]
        in_seq = pos < seq_len
        quant = pos < q_len
        resid = in_seq & (pos >= q_len)
        block = tl.load(tables_ptr + seq * stride_ts + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        in_blk = pos % BLOCK_SIZE
        # keys, transposed [BLOCK_D, TILE_N]: byte column b holds tokens b*per .. b*per + per - 1
        kb_pos = j * TILE_N + offs_kb * per
        kb_block = tl.load(tables_ptr + seq * stride_ts + kb_pos // BLOCK_SIZE, mask=kb_pos < q_len,
                           other=0).to(tl.int64)
        k_rows = (kb_block[None, :] * KV_HEADS + kvh) * HEAD_DIM + offs_d[:, None]  # [BLOCK_D, TILE_N // per]
        kb = tl.load(kc_ptr + k_rows * (BLOCK_SIZE // per) + ((kb_pos % BLOCK_SIZE) // per)[None, :],
                     mask=d_valid[:, None] & (kb_pos < q_len)[None, :], other=0)
        kq = _split_bytes(kb, BITS, BLOCK_D, TILE_N).to(tl.float32)  # [BLOCK_D, TILE_N]
        k_grp = ((block[None, :] * KV_HEADS + kvh) * HEAD_DIM + offs_d[:, None]) * (BLOCK_SIZE // KEY_GROUP) \
            + (in_blk // KEY_GROUP)[None, :]
        live_k = d_valid[:, None] & quant[None, :]
        ks = tl.load(ks_ptr + k_grp, mask=live_k, other=0.0).to(tl.float32)
        kz = tl.load(kz_ptr + k_grp, mask=live_k, other=0.0).to(tl.float32)
        r_row = (seq * CAPACITY + tl.maximum(pos - q_len, 0)) * KV_HEADS + kvh  # [TILE_N] residual row
        kr = tl.load(rk_ptr + r_row[None, :] * HEAD_DIM + offs_d[:, None], mask=d_valid[:, None] & resid[None, :],
                     other=0.0)
        kt = tl.where(quant[None, :], (kq * ks + kz).to(kr.dtype), kr)  # kivi.dequantize, then the KV dtype
        # values [TILE_N, BLOCK_D]
        v_rows = (block * BLOCK_SIZE + in_blk) * KV_HEADS + kvh  # [TILE_N]
        vb = tl.load(vc_ptr + v_rows[:, None] * (HEAD_DIM // per) + offs_vb[None, :],
                     mask=quant[:, None] & (offs_vb < HEAD_DIM // per)[None, :], other=0)
        vq = _split_bytes(vb, BITS, TILE_N, BLOCK_D).to(tl.float32)
        v_grp = v_rows[:, None] * (HEAD_DIM // VALUE_GROUP) + (offs_d // VALUE_GROUP)[None, :]
        live_v = quant[:, None] & d_valid[None, :]
        vs = tl.load(vs_ptr + v_grp, mask=live_v, other=0.0).to(tl.float32)
        vz = tl.load(vz_ptr + v_grp, mask=live_v, other=0.0).to(tl.float32)
        vr = tl.load(rv_ptr + r_row[:, None] * HEAD_DIM + offs_d[None, :], mask=resid[:, None] & d_valid[None, :],
                     other=0.0)
        v = tl.where(quant[:, None], (vq * vs + vz).to(vr.dtype), vr)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)  # [BLOCK_M, TILE_N], fp32
        m_i, l_i, acc = online_softmax_step(s, v, pos, q_pos, scale_log2, m_i, l_i, acc, IEEE_DOT)
    store = m_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        store_output(out_ptr, acc, l_i, seq, row, head, offs_d, store, stride_os, stride_or, stride_oh)
    else:
        part = ((seq * Q_ROWS + row) * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(parts_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store)
        tl.store(parts_ptr + num_parts * HEAD_DIM + part, m_i, mask=m_valid)
        tl.store(parts_ptr + num_parts * (HEAD_DIM + 1) + part, l_i, mask=m_valid)


def quantized_decode_attention(q: torch.Tensor, cache: QuantizedKVCache, residual: Residual,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               max_seq_len: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """`paged_decode_attention` over a `QuantizedKVCache` plus each sequence's `Residual`.

    q ``[num_seqs, q_rows, num_q_heads, head_dim]`` fp16, bf16 or fp32 (the residual's dtype);
    block_tables and seq_lens as paged_decode_attention's (the tables name the blocks of every
    position, residual ones included), and ``quantized_lens <= seq_lens <= quantized_lens +
    capacity``. Returns ``[num_seqs, q_rows, num_q_heads, head_dim]`` in q's dtype.
    """
    S, R, Hq, D = q.shape
    nb, bs, Hkv, Dc = cache.shape
    cap = residual.k.shape[1]
    if (Dc != D or Hq % Hkv or residual.k.shape != (S, cap, Hkv, D) or residual.v.shape != residual.k.shape
            or residual.k.dtype != q.dtype or residual.v.dtype != q.dtype or block_tables.shape[0] != S
            or seq_lens.shape != (S,) or residual.quantized_lens.shape != (S,)):
        raise ValueError(f"quantized_decode_attention: q {tuple(q.shape)} {q.dtype}, cache {cache.shape}, residual "
                         f"{tuple(residual.k.shape)} {residual.k.dtype}, block_tables {tuple(block_tables.shape)}, "
                         f"seq_lens {tuple(seq_lens.shape)} do not fit together")
    if q.stride(-1) != 1 or block_tables.stride(-1) != 1 or not (residual.k.is_contiguous()
                                                                 and residual.v.is_contiguous()):
        raise ValueError("quantized_decode_attention: q and block_tables need a contiguous last dim, "
                         "the residual tensors must be contiguous")
    group = Hq // Hkv
    upcast = q.dtype == torch.bfloat16 and q.device.type != "cuda"  # the interpreter's bf16 tl.dot (paged_attention)
    out = torch.empty_like(q)
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    tile = max(bs, 64)
    max_tiles = max(1, -(-max_len // tile))
    splits = num_splits or default_splits(S * Hkv, max_tiles, tile, q.device)
    per_split = -(-max_tiles // splits)
    splits = -(-max_tiles // per_split)
    block_m = max(16, triton.next_power_of_2(R * group))
    block_d = max(16, triton.next_power_of_2(D))
    num_parts = S * R * Hq * splits
    parts = torch.empty(num_parts * (D + 2), dtype=torch.float32, device=q.device) if splits > 1 else out
    _quantized_decode_kernel[(S, Hkv, splits)](
        q, cache.k_codes, cache.k_scale, cache.k_zero, cache.v_codes, cache.v_scale, cache.v_zero,
        residual.k, residual.v, residual.quantized_lens, block_tables, seq_lens, out, parts, num_parts,
        scale * _LOG2E, q.stride(0), q.stride(1), q.stride(2), block_tables.stride(0), out.stride(0), out.stride(1),
        out.stride(2), per_split, Q_ROWS=R, GROUP=group, NUM_HEADS=Hq, KV_HEADS=Hkv, HEAD_DIM=D, BLOCK_M=block_m,
        BLOCK_D=block_d, BLOCK_SIZE=bs, TILE_N=tile, NUM_SPLITS=splits, BITS=cache.bits, KEY_GROUP=cache.key_group,
        VALUE_GROUP=cache.value_group, CAPACITY=cap, IEEE_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast,
        enable_fp_fusion=False)
    if splits > 1:
        _merge_splits_kernel[(S * R * Hq,)](
            out, parts, num_parts, out.stride(0), out.stride(1), out.stride(2), Q_ROWS=R, NUM_HEADS=Hq, HEAD_DIM=D,
            BLOCK_D=block_d, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits))
    return out


def _pack_last(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """kivi.pack along the last dim only: ``[..., n]`` -> ``[..., n / per]`` (n a multiple of per)."""
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], -1, per)
    out = c[..., 0].clone()
    for i in range(1, per):
        out |= c[..., i] << (i * bits)
    return out


def quantize_into_cache(k: torch.Tensor, v: torch.Tensor, cache: QuantizedKVCache, block_ids: torch.Tensor,
                        offsets: torch.Tensor) -> None:
    """Quantizes N whole key groups ``k, v [N, key_group, kv_heads, head_dim]`` (any float dtype)
    into ``cache``: group n goes to block ``block_ids[n]`` at tokens ``offsets[n] ..`` (a multiple
    of key_group). Codes, scales and zeros equal kivi.quantize's of the same values, keys grouped
    over the key_group tokens of each channel, values over value_group channels of each token."""
    N, G, H, D = k.shape
    if G != cache.key_group or v.shape != k.shape or (H, D) != cache.shape[2:] or block_ids.shape != (N,) \
            or offsets.shape != (N,):
        raise ValueError(f"quantize_into_cache: k {tuple(k.shape)}, v {tuple(v.shape)}, {tuple(block_ids.shape)} "
                         f"blocks, {tuple(offsets.shape)} offsets do not fit a cache {cache.shape} with key "
                         f"groups of {cache.key_group}")
    bits, per = cache.bits, 8 // cache.bits
    kc, ks, kz = kv_codec.quantize(k.permute(0, 2, 3, 1), bits, G)  # [N, H, D, G], scales [N, H, D, 1]
    vc, vs, vz = kv_codec.quantize(v, bits, cache.value_group)  # [N, G, H, D], scales [N, G, H, D / gv]
    b = block_ids.long()
    off = offsets.long()
    cols = off[:, None] // per + torch.arange(G // per, device=k.device)  # [N, G / per]
    cache.k_codes.permute(0, 3, 1, 2)[b[:, None], cols] = _pack_last(kc, bits).permute(0, 3, 1, 2)
    cache.k_scale.permute(0, 3, 1, 2)[b, off // G] = ks[..., 0]
    cache.k_zero.permute(0, 3, 1, 2)[b, off // G] = kz[..., 0]
    tok = off[:, None] + torch.arange(G, device=k.device)  # [N, G]
    cache.v_codes[b[:, None], tok] = _pack_last(vc, bits)
    cache.v_scale[b[:, None], tok] = vs
    cache.v_zero[b[:, None], tok] = vz


def dequantize_cache_ref(cache: QuantizedKVCache, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole cache through kivi.unpack and kivi.dequantize (float32), cast to ``dtype``:
    ``k, v [num_blocks, block_size, kv_heads, head_dim]``, an ordinary paged cache."""
    nb, bs, H, D = cache.shape
    kc = kivi.unpack(cache.k_codes.reshape(-1), cache.bits, nb * H * D * bs).view(nb, H, D, bs)
    k = kivi.dequantize(kc, cache.k_scale, cache.k_zero, cache.key_group).permute(0, 3, 1, 2)
    vc = kivi.unpack(cache.v_codes.reshape(-1), cache.bits, nb * bs * H * D).view(nb, bs, H, D)
    v = kivi.dequantize(vc, cache.v_scale, cache.v_zero, cache.value_group)
    return k.to(dtype).contiguous(), v.to(dtype).contiguous()


def quantized_decode_attention_ref(q: torch.Tensor, cache: QuantizedKVCache, residual: Residual,
                                   block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch reference (same arguments and result): `dequantize_cache_ref` in q's dtype, each
    sequence's residual rows written into their blocks, then paged_decode_attention_ref."""
    k, v = dequantize_cache_ref(cache, q.dtype)
    bs = k.shape[1]
    for s, (n, qn) in enumerate(zip(seq_lens.tolist(), residual.quantized_lens.tolist())):
        pos = torch.arange(qn, n, device=k.device)
        blocks = block_tables[s].long()[pos // bs]
        k[blocks, pos % bs] = residual.k[s, :n - qn]
        v[blocks, pos % bs] = residual.v[s, :n - qn]
    return paged_decode_attention_ref(q, k, v, block_tables, seq_lens, scale)
