"""Paged decode attention in Triton: a few query rows per sequence against its paged KV, read in place.

The cache layout is the engine's (kvmesh.model.attention.allocate_kv_cache): per layer
``k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]``, a sequence's tokens in the
blocks its block-table row names, in order. One program handles one (sequence, KV head, split):
the ``q_rows * group`` query rows that share that KV head (all GQA heads, all draft rows) form one
``[BLOCK_M, head_dim]`` tile, so each KV block is read once for all of them (vLLM's and SGLang's
GQA-grouped decode kernels do the same).

NOTE (split-K, flash-decoding): with few sequences there are too few (sequence, KV head) programs to
fill a GPU, so the context may be cut into ``num_splits`` ranges of whole tiles (``TILE_N`` keys, a
whole number of blocks, gathered through the block table in one load). Each split keeps its own
running max ``m``, normaliser ``l`` and fp32 accumulator, and a second kernel merges them:
``out = sum_i 2^(m_i - M) acc_i / sum_i 2^(m_i - M) l_i`` with ``M = max_i m_i``. A split whose
rows see no key (causal rows before its first tile, or no tile at all) has ``m = -inf`` and
weight 0; split 0 always holds position 0, which every row sees, so ``M`` is finite.

Query row ``r`` of a sequence of length ``n`` is at position ``n - q_rows + r`` and sees keys at
positions ``<= n - q_rows + r`` (causal among the rows: draft verification). Scores and
accumulation are fp32; probabilities are cast to the KV dtype for the second matmul (as flash
attention does), and fp32 KV uses IEEE fp32 dots, not TF32.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def load_query_tile(q_ptr, seq, kvh, seq_len, stride_qs, stride_qr, stride_qh, Q_ROWS: tl.constexpr,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                    UPCAST: tl.constexpr):
    """The query tile of one (sequence, KV head): tile row = query row * GROUP + head within the
    group. Returns each tile row's query row, head and validity, the head-dim offsets and their
    validity, q [BLOCK_M, BLOCK_D] and each row's position (the last Q_ROWS of the sequence).
    Shared by the paged kernels over plain and quantized KV."""
    offs_m = tl.arange(0, BLOCK_M)
    row = offs_m // GROUP
    head = kvh * GROUP + offs_m % GROUP
    m_valid = offs_m < Q_ROWS * GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + row[:, None] * stride_qr + head[:, None] * stride_qh + offs_d[None, :],
                mask=m_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    return row, head, m_valid, offs_d, d_valid, q, seq_len - Q_ROWS + row


@triton.jit
def online_softmax_step(s, v, pos, q_pos, scale_log2, m_i, l_i, acc, IEEE_DOT: tl.constexpr):
    """One tile of keys in flash attention's online softmax: scores `s` [BLOCK_M, TILE_N] (causal
    by `pos` against each row's `q_pos`) and values `v` [TILE_N, BLOCK_D] folded into the running
    max `m_i` (base-2 logits), denominator `l_i` and unnormalised output `acc`. Shared by the
    paged kernels over plain and quantized KV."""
    s = tl.where(pos[None, :] <= q_pos[:, None], s * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE_DOT:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def store_output(out_ptr, acc, l_i, seq, row, head, offs_d, mask, stride_os, stride_or, stride_oh):
    """The normalised output of one (sequence, KV head) tile when the context was not split."""
    o = acc / l_i[:, None]
    tl.store(out_ptr + seq * stride_os + row[:, None] * stride_or + head[:, None] * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, parts_ptr, num_parts, scale_log2,
        stride_qs, stride_qr, stride_qh, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
        stride_ts, stride_os, stride_or, stride_oh, tiles_per_split,
        Q_ROWS: tl.constexpr, GROUP: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        IEEE_DOT: tl.constexpr, UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    row, head, m_valid, offs_d, d_valid, q, q_pos = load_query_tile(
        q_ptr, seq, kvh, seq_len, stride_qs, stride_qr, stride_qh, Q_ROWS, GROUP, HEAD_DIM, BLOCK_M, BLOCK_D, UPCAST)
    first = split * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(seq_len, TILE_N))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, TILE_N)
    for j in range(first, last):
        pos = j * TILE_N + offs_n  # [TILE_N], whole blocks: TILE_N is a multiple of BLOCK_SIZE
        in_seq = pos < seq_len
        block = tl.load(tables_ptr + seq * stride_ts + pos // BLOCK_SIZE, mask=in_seq, other=0).to(tl.int64)
        live = in_seq[:, None] & d_valid[None, :]  # never read a stale row: 0 * NaN = NaN
        k_row = block * stride_kb + (pos % BLOCK_SIZE) * stride_kn + kvh * stride_kh  # [TILE_N]
        v_row = block * stride_vb + (pos % BLOCK_SIZE) * stride_vn + kvh * stride_vh
        k = tl.load(k_ptr + k_row[:, None] + offs_d[None, :], mask=live, other=0.0)  # [TILE_N, BLOCK_D]
        v = tl.load(v_ptr + v_row[:, None] + offs_d[None, :], mask=live, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [BLOCK_M, TILE_N], fp32
        m_i, l_i, acc = online_softmax_step(s, v, pos, q_pos, scale_log2, m_i, l_i, acc, IEEE_DOT)
    store = m_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS == 1:
        store_output(out_ptr, acc, l_i, seq, row, head, offs_d, store, stride_os, stride_or, stride_oh)
    else:
        part = ((seq * Q_ROWS + row) * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(parts_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=store)  # acc first: aligned
        tl.store(parts_ptr + num_parts * HEAD_DIM + part, m_i, mask=m_valid)
        tl.store(parts_ptr + num_parts * (HEAD_DIM + 1) + part, l_i, mask=m_valid)


@triton.jit
def _merge_splits_kernel(out_ptr, parts_ptr, num_parts, stride_os, stride_or, stride_oh,
                         Q_ROWS: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    pid = tl.program_id(0)  # = (seq * Q_ROWS + row) * NUM_HEADS + head
    head = pid % NUM_HEADS
    row = (pid // NUM_HEADS) % Q_ROWS
    seq = pid // (NUM_HEADS * Q_ROWS)
    offs_s = tl.arange(0, SPLITS_P2)
    s_valid = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    d_valid = offs_d < HEAD_DIM
    m = tl.load(parts_ptr + num_parts * HEAD_DIM + pid * NUM_SPLITS + offs_s, mask=s_valid,
                other=float("-inf"))  # [SPLITS_P2]
    l = tl.load(parts_ptr + num_parts * (HEAD_DIM + 1) + pid * NUM_SPLITS + offs_s, mask=s_valid, other=0.0)
    w = tl.where(m == float("-inf"), 0.0, tl.math.exp2(m - tl.max(m, 0)))
    acc = tl.load(parts_ptr + (pid * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                  mask=s_valid[:, None] & d_valid[None, :], other=0.0)  # [SPLITS_P2, BLOCK_D]
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + seq * stride_os + row * stride_or + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty), mask=d_valid)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_splits(programs: int, max_tiles: int, tile: int, device: torch.device) -> int:
    """Context splits so that about two programs run per SM, each over at least 128 keys; 1 off CUDA."""
    if device.type != "cuda":
        return 1
    return max(1, min(-(-2 * _sm_count(device) // programs), -(-max_tiles * tile // 128)))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           max_seq_len: int | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Attention of the last ``q_rows`` positions of each sequence over its paged KV.

    q ``[num_seqs, q_rows, num_q_heads, head_dim]``; k_cache, v_cache ``[num_blocks, block_size,
    num_kv_heads, head_dim]`` (same dtype as q: fp16, bf16 or fp32); block_tables ``[num_seqs,
    max_blocks]`` and seq_lens ``[num_seqs]`` int32 or int64, each length >= q_rows (the rows included).
    ``max_seq_len`` (an upper bound of seq_lens) spares a device sync; ``num_splits`` overrides
    the split-K heuristic. Returns ``[num_seqs, q_rows, num_q_heads, head_dim]`` in q's dtype.
    """
    S, R, Hq, D = q.shape
    _, bs, Hkv, Dk = k_cache.shape
    if (Dk != D or v_cache.shape != k_cache.shape or Hq % Hkv or k_cache.dtype != q.dtype
            or v_cache.dtype != q.dtype or block_tables.shape[0] != S or seq_lens.shape != (S,)):
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} {q.dtype}, k/v cache {tuple(k_cache.shape)} "
                         f"{k_cache.dtype}/{tuple(v_cache.shape)} {v_cache.dtype}, block_tables "
                         f"{tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} do not fit together")
    if bs & (bs - 1):
        raise ValueError(f"paged_decode_attention: block_size must be a power of 2, got {bs}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("paged_decode_attention: q, the caches and block_tables need a contiguous last dim")
    group = Hq // Hkv
    # triton 3.9's interpreter multiplies bf16 tiles as raw integers in tl.dot: on CPU, bf16 tiles
    # are widened to fp32 (exactly) first; on CUDA the dots run on bf16.
    upcast = q.dtype == torch.bfloat16 and q.device.type != "cuda"
    out = torch.empty_like(q)
    max_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    tile = max(bs, 64)  # keys per loop step: whole blocks, gathered through the table in one load
    max_tiles = max(1, -(-max_len // tile))
    splits = num_splits or default_splits(S * Hkv, max_tiles, tile, q.device)
    per_split = -(-max_tiles // splits)
    splits = -(-max_tiles // per_split)  # no split left without a tile to read
    block_m = max(16, triton.next_power_of_2(R * group))
    block_d = max(16, triton.next_power_of_2(D))
    # one fp32 workspace per call (one allocation, not three): acc [parts, D], then m [parts], l [parts],
    # parts = (seq, row, head, split) in that order
    num_parts = S * R * Hq * splits
    parts = torch.empty(num_parts * (D + 2), dtype=torch.float32, device=q.device) if splits > 1 else out
    _paged_decode_kernel[(S, Hkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, parts, num_parts, scale * _LOG2E,
        q.stride(0), q.stride(1), q.stride(2), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1), out.stride(2), per_split,
        Q_ROWS=R, GROUP=group, NUM_HEADS=Hq, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_SIZE=bs, TILE_N=tile,
        NUM_SPLITS=splits, IEEE_DOT=q.dtype == torch.float32 or upcast, UPCAST=upcast)
    if splits > 1:
        _merge_splits_kernel[(S * R * Hq,)](
            out, parts, num_parts, out.stride(0), out.stride(1), out.stride(2), Q_ROWS=R, NUM_HEADS=Hq, HEAD_DIM=D,
            BLOCK_D=block_d, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits))
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                               upcast: bool = True) -> torch.Tensor:
    """The torch reference of `paged_decode_attention` (same arguments and result): gather every
    sequence's blocks into a padded contiguous KV, mask, SDPA. ``upcast`` computes in fp32 (the
    test reference); without it SDPA runs in the input dtype (the bench's torch baseline)."""
    S, R, Hq, D = q.shape
    _, bs, Hkv, _ = k_cache.shape
    W = block_tables.shape[1]
    k = k_cache[block_tables.long()].view(S, W * bs, Hkv, D).transpose(1, 2)  # [S, Hkv, W*bs, D]
    v = v_cache[block_tables.long()].view(S, W * bs, Hkv, D).transpose(1, 2)
    q_pos = seq_lens.long()[:, None] - R + torch.arange(R, device=q.device)  # [S, R]
    mask = torch.arange(W * bs, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [S, R, W*bs]
    dt = torch.float32 if upcast else q.dtype
    o = F.scaled_dot_product_attention(q.transpose(1, 2).to(dt), k.to(dt), v.to(dt), attn_mask=mask[:, None],
                                       scale=scale, enable_gqa=True)  # [S, Hq, R, D]
    return o.transpose(1, 2).to(q.dtype)

