"""kvmesh.model.amx_attention: causal attention on the AMX tile unit -- bf16 against SDPA in fp32
on the same bf16 inputs (and no further from it than torch's own bf16 SDPA), fp32 against SDPA
in fp64 (and no further from it than torch's own fp32 SDPA) -- its masking, and its use by
paged_attention for prefill chunks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.model import amx_attention, attention
from kvmesh.model.attention import AttentionMetadata, paged_attention

needs_amx = pytest.mark.skipif(amx_attention._ops() is None,
                               reason="no AMX tile unit here (or the kernel could not be built)")


def reference(q, k, v, offset, scale, dtype=torch.float32):
    """SDPA of q [Lq, H, hd] at positions offset.. over k, v [Lk, KVH, hd], causal, in `dtype`."""
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= (offset + torch.arange(lq))[:, None]
    o = F.scaled_dot_product_attention(*(t.to(dtype).transpose(0, 1)[None] for t in (q, k, v)),
                                       attn_mask=mask, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1).to(torch.float64 if dtype == torch.float64 else torch.float32)


def fused(lq: int, offset: int, heads: int, kvh: int, spread: float = 1.0, seed: int = 0,
          dtype: torch.dtype = torch.bfloat16):
    """q, k, v as strided views of one [tokens, heads + 2 kvh, 64] projection (as a model's
    fused qkv gives them): q the last lq tokens."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(offset + lq, heads + 2 * kvh, 64, generator=g) * spread).to(dtype)
    return qkv[offset:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]


SHAPES = [(1, 0, 9, 3), (15, 0, 9, 3), (16, 0, 9, 3), (17, 0, 9, 3), (200, 0, 9, 3),  # whole prompts
          (40, 300, 9, 3), (1, 129, 4, 1), (130, 127, 2, 2), (64, 200, 9, 3)]  # chunks over context


@needs_amx
@pytest.mark.parametrize("lq, offset, heads, kvh", SHAPES)
def test_matches_sdpa_in_fp32(lq, offset, heads, kvh):
    q, k, v = fused(lq, offset, heads, kvh, spread=2.0)
    out = torch.full((lq, heads, 64), float("nan"), dtype=torch.bfloat16)
    assert amx_attention.causal_attention_(out, q, k, v, offset, 0.125)
    exact = reference(q, k, v, offset, 0.125)
    err = (out.float() - exact).abs().max().item()
    torch_bf16 = (reference(q, k, v, offset, 0.125, torch.bfloat16) - exact).abs().max().item()
    assert err <= 2 * torch_bf16 + 1e-3, (err, torch_bf16)  # bf16 rounding of the output and of p
    assert err < 3e-2


@needs_amx
@pytest.mark.parametrize("lq, offset, heads, kvh", SHAPES)
def test_fp32_is_as_close_to_exact_as_torch_fp32(lq, offset, heads, kvh):
    """fp32 in: q, k, v and the weights each three bf16 pieces (six products per dot product),
    fp32 softmax with an exp within 2 ulp. Its error against SDPA in fp64 stays within torch's
    own fp32 SDPA error, ~1e-6..1e-5 -- where bf16 anywhere would show as ~1e-3, and one 2^-16
    piece product left out of one 16-dim group (v_2 p_2) as 1.2-2x torch's error: the bound
    has no factor 2, so that is caught too (checked by dropping it)."""
    q, k, v = fused(lq, offset, heads, kvh, spread=2.0, dtype=torch.float32)
    out = torch.full((lq, heads, 64), float("nan"))
    assert amx_attention.causal_attention_(out, q, k, v, offset, 0.125)
    exact = reference(q, k, v, offset, 0.125, torch.float64)
    err = (out - exact).abs().max().item()
    torch_fp32 = (reference(q, k, v, offset, 0.125) - exact).abs().max().item()
    assert err <= torch_fp32 + 1e-6, (err, torch_fp32)  # (+ a few ulp: one key alone is exact in torch)
    assert err < 2e-5


@needs_amx
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_later_keys_never_reach_earlier_queries(dtype):
    """Changing the keys and values after position p leaves the outputs of queries up to p
    bit for bit: the causal mask, including inside a 32-key block and a 128-key step."""
    check_later_keys(amx_attention, *fused(150, 0, 9, 3, seed=1, dtype=dtype))


def check_later_keys(kernel, q, k, v):
    """`kernel`'s outputs for queries up to 69 stay bit for bit when keys and values from 70 on change."""
    before = torch.empty_like(q)
    kernel.causal_attention_(before, q, k, v, 0, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[70:] = 5.0
    v2[70:] = -3.0
    after = torch.empty_like(q)
    kernel.causal_attention_(after, q, k2, v2, 0, 0.125)
    assert torch.equal(before[:70], after[:70])
    assert not torch.equal(before[70:], after[70:])


@needs_amx
def test_large_score_ranges_stay_finite():
    """Scores spanning hundreds of units (sharp softmax, a max that moves late) give finite
    outputs close to the reference."""
    q, k, v = fused(300, 0, 9, 3, spread=6.0, seed=2)
    out = torch.empty_like(q)
    amx_attention.causal_attention_(out, q, k, v, 0, 0.125)
    assert torch.isfinite(out.float()).all()
    exact = reference(q, k, v, 0, 0.125)
    assert (out.float() - exact).abs().max().item() <= 2 * (
        reference(q, k, v, 0, 0.125, torch.bfloat16) - exact).abs().max().item() + 2e-2


def test_refuses_what_it_does_not_compute():
    """fp16, mixed dtypes, head dims other than 64 and tokens whose heads are not contiguous
    return False (the caller runs SDPA) and write nothing."""
    q, k, v = fused(8, 0, 4, 2)
    out = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    assert not amx_attention.causal_attention_(out.half(), q.half(), k.half(), v.half(), 0, 0.125)
    assert not amx_attention.causal_attention_(out.float(), q.float(), k, v, 0, 0.125)
    q128 = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    assert not amx_attention.causal_attention_(q128.clone(), q128, q128[:, :1], q128[:, :1], 0, 0.1)
    assert not amx_attention.causal_attention_(out, q.transpose(0, 1).contiguous().transpose(0, 1), k, v, 0, 0.1)
    assert not amx_attention.usable(q.half()) and not amx_attention.usable(q128)
    assert torch.count_nonzero(out) == 0


@needs_amx
def test_bad_shapes_get_a_clear_error():
    q, k, v = fused(8, 4, 4, 2)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="Lk must be offset"):
        amx_attention.causal_attention_(out, q, k, v, 0, 0.125)
    with pytest.raises(RuntimeError, match="multiple of KVH"):
        amx_attention.causal_attention_(out[:, :3], q[:, :3], k, v, 4, 0.125)


@needs_amx
@pytest.mark.parametrize("chunks", [[37], [20, 17]])  # one whole prompt; a chunk over cached context
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 3e-2), (torch.float32, 2e-5)])
def test_paged_attention_uses_it_for_prefill(chunks, dtype, atol, monkeypatch):
    """paged_attention in bf16 and fp32 on CPU sends prefill chunks to the kernel, and its
    outputs match the SDPA path's to the dtype's rounding."""
    check_paged_attention_uses(amx_attention, chunks, dtype, atol, monkeypatch)


def check_paged_attention_uses(kernel, chunks, dtype, atol, monkeypatch):
    """paged_attention sends each prefill chunk to `kernel` at its offset, and matches the SDPA
    path's outputs (`kernel.usable` turned off) within atol."""
    heads, kvh, hd, bs = 9, 3, 64, 4
    total = sum(chunks)
    g = torch.Generator().manual_seed(3)
    q_all = torch.randn(total, heads, hd, generator=g).to(dtype)
    k_all, v_all = torch.randn(2, total, kvh, hd, generator=g).to(dtype).unbind(0)
    tables = torch.randperm(16, generator=g)[None]

    def run():
        kc, vc = torch.zeros(2, 16, bs, kvh, hd, dtype=dtype).unbind(0)
        outs, start = [], 0
        for n in chunks:
            pos = torch.arange(start, start + n)
            slots = tables[0, pos // bs] * bs + pos % bs
            meta = AttentionMetadata.build(slots, [n], [start + n], tables, bs)
            sl = slice(start, start + n)
            outs.append(paged_attention(q_all[sl], k_all[sl], v_all[sl], kc, vc, meta, hd ** -0.5))
            start += n
        return torch.cat(outs)

    calls = []
    real = kernel.causal_attention_
    monkeypatch.setattr(kernel, "causal_attention_", lambda *a: calls.append(a[4]) or real(*a))
    with_kernel = run()
    assert calls == [sum(chunks[:i]) for i in range(len(chunks))]  # each chunk, at its offset
    monkeypatch.setattr(kernel, "usable", lambda q: False)
    without = run()
    torch.testing.assert_close(with_kernel.float(), without.float(), rtol=0, atol=atol)
    assert getattr(attention, kernel.__name__.rsplit(".", 1)[1]) is kernel  # the module attention.py calls


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_cpu_engine_builds_the_kernel_at_start(dtype, tmp_path, monkeypatch):
    """build_core builds (or finds) the kernel while the engine starts on CPU, in bf16 and fp32,
    so the first prompt does not wait for a compiler."""
    from engine_utils import make_tiny_checkpoint
    from kvmesh.services.engine.build import build_core
    from kvmesh.services.engine.config import EngineConfig

    folder = make_tiny_checkpoint(tmp_path, num_layers=1)
    calls = []
    monkeypatch.setattr(amx_attention, "prepare", lambda: calls.append(1) or True)
    build_core(EngineConfig(model=str(folder), dtype=dtype, num_blocks=8, block_size=16,
                            max_num_batched_tokens=16, max_num_seqs=2))
    assert calls == [1]


@needs_amx
@pytest.mark.parametrize("offset", [120, 7])
@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 3e-2), (torch.float32, 2e-5)])
def test_a_masked_key_with_a_huge_score_changes_nothing(offset, dtype, atol):
    """A chunk whose 16-query blocks straddle a 128-key step (offset 120: queries 120..127 see
    no key of the step at 128): a later key whose score dwarfs every other is masked for them,
    so their outputs stay finite and equal the reference."""
    check_masked_huge_score(amx_attention, offset, dtype, atol)


def check_masked_huge_score(kernel, offset, dtype, atol):
    """40 queries at `offset` and a key (at 128, or offset + 20) whose score (~320) dwarfs every
    other: `kernel` masks it for the queries before it (finite outputs within atol of fp64)."""
    g = torch.Generator().manual_seed(4)
    lq, heads, kvh = 40, 2, 1
    u = torch.randn(64, generator=g).sign()  # every query points the same way
    q = (u.expand(lq, heads, 64) + 0.1 * torch.randn(lq, heads, 64, generator=g)).to(dtype)
    k = (0.3 * torch.randn(offset + lq, kvh, 64, generator=g)).to(dtype)
    v = torch.randn(offset + lq, kvh, 64, generator=g).to(dtype)
    k[128 if offset == 120 else offset + 20] = (40 * u).to(dtype)  # score ~320 for every query
    out = torch.empty_like(q)
    assert kernel.causal_attention_(out, q, k, v, offset, 0.125)
    exact = reference(q, k, v, offset, 0.125, torch.float64)
    assert torch.isfinite(out.float()).all()
    assert (out.double() - exact).abs().max().item() < atol
