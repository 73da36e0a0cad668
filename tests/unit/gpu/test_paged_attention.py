"""kvmesh.gpu.paged_attention against its torch reference (gather + SDPA in fp32).

Tolerances (absolute, outputs are averages of N(0,1) values so |out| < 4): fp32 1e-5 (IEEE fp32
dots; only summation order differs); fp16 4e-3 and bf16 4e-2: the output's own rounding (half an
ulp: 2^-11 / 2^-8 relative) plus the probabilities rounded to the KV dtype before the second
matmul, as flash attention does (another ulp of the weights).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: pip install -e '.[test]'")
from kvmesh.gpu import paged_attention as pa  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}

# (num_seqs, q_rows, q_heads, kv_heads, head_dim, block_size, seq_lens, num_splits)
CASES = [
    (2, 1, 4, 4, 64, 16, [37, 16], 1),      # GQA 1, one full last block, one partial
    (2, 3, 6, 3, 64, 16, [37, 5], 1),       # GQA 2, SmolLM2's 3 KV heads, 3 draft rows
    (3, 1, 8, 1, 80, 32, [150, 1, 33], 2),  # GQA 8, head_dim 80 (padded to 128), a 1-token sequence
    (2, 3, 16, 2, 128, 32, [300, 3], 3),    # GQA 8, 3 rows, 3 splits; a sequence shorter than a split
    (1, 3, 4, 2, 80, 16, [129], 3),         # rows 126, 127 see nothing of the last 64-key split
]
# (splits are of 64-key tiles: 150 keys = 3 tiles in 2 splits, 300 = 5 in 3, 129 = 3 in 3)


def _case(S, R, Hq, Hkv, D, bs, lens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = max(-(-n // bs) for n in lens) + 1  # one padding column: never read
    nb = S * W + 3
    tables = torch.randperm(nb, generator=g)[:S * W].view(S, W).to(torch.int32)  # scattered blocks
    k_cache = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
    v_cache = torch.randn(nb, bs, Hkv, D, generator=g).to(dtype)
    q = torch.randn(S, R, Hq, D, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"S{c[0]}R{c[1]}H{c[2]}/{c[3]}D{c[4]}B{c[5]}s{c[7]}")
def test_matches_the_reference(device, case, dtype):
    S, R, Hq, Hkv, D, bs, lens, splits = case
    q, kc, vc, tables, seq_lens = _case(S, R, Hq, Hkv, D, bs, lens, dtype)
    scale = D ** -0.5
    ref = pa.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, scale)
    out = pa.paged_decode_attention(*(t.to(device) for t in (q, kc, vc, tables, seq_lens)), scale,
                                    num_splits=splits)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=ATOL[dtype], rtol=0)


def test_rows_past_the_sequence_are_never_read(device):
    """The tail of a partial last block (stale or never written) may hold anything, NaN included."""
    q, kc, vc, tables, seq_lens = _case(2, 3, 4, 2, 64, 16, [21, 40], torch.float32, seed=1)
    ref = pa.paged_decode_attention_ref(q, kc, vc, tables, seq_lens, 0.125)
    for s, n in enumerate(seq_lens.tolist()):
        last = tables[s, (n - 1) // 16]
        kc[last, n % 16 or 16:] = float("nan")
        vc[last, n % 16 or 16:] = float("nan")
        kc[tables[s, -1]] = float("nan")  # the padding column of the block table
    out = pa.paged_decode_attention(*(t.to(device) for t in (q, kc, vc, tables, seq_lens)), 0.125,
                                    max_seq_len=40, num_splits=2)
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL[torch.float32], rtol=0)


def test_one_row_is_plain_decode_and_rows_are_causal(device):
    """Row r of q_rows sees exactly the keys a single-row decode at that length sees."""
    q, kc, vc, tables, seq_lens = _case(1, 3, 4, 2, 64, 16, [30], torch.float32, seed=2)
    args = [t.to(device) for t in (q, kc, vc, tables, seq_lens)]
    out = pa.paged_decode_attention(*args, 0.125)
    for r in range(3):
        one = pa.paged_decode_attention(args[0][:, r:r + 1].contiguous(), *args[1:4],
                                        args[4] - 2 + r, 0.125)
        torch.testing.assert_close(out[:, r:r + 1].cpu(), one.cpu(), atol=ATOL[torch.float32], rtol=0)


def test_bad_shapes_are_value_errors():
    q, kc, vc, tables, seq_lens = _case(1, 1, 3, 2, 64, 16, [5], torch.float32)
    with pytest.raises(ValueError, match="do not fit"):
        pa.paged_decode_attention(q, kc, vc, tables, seq_lens, 0.125)  # 3 query heads over 2 KV heads


def test_int64_block_tables_as_the_engine_builds_them(device):
    q, kc, vc, tables, seq_lens = _case(2, 1, 6, 3, 64, 16, [40, 9], torch.float16, seed=3)
    args = [t.to(device) for t in (q, kc, vc)]
    a = pa.paged_decode_attention(*args, tables.to(device), seq_lens.to(device), 0.125)
    b = pa.paged_decode_attention(*args, tables.long().to(device), seq_lens.long().to(device), 0.125)
    assert torch.equal(a, b)
