"""kvmesh.model.amx_attention: causal bf16 attention on the AMX tile unit, against SDPA in fp32
on the same bf16 inputs (and no further from it than torch's own bf16 SDPA), its masking, and
its use by paged_attention for bf16 prefill chunks."""

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
    return o[0].transpose(0, 1).float()


def fused(lq: int, offset: int, heads: int, kvh: int, spread: float = 1.0, seed: int = 0):
    """q, k, v as strided views of one [tokens, heads + 2 kvh, 64] bf16 projection (as a model's
    fused qkv gives them): q the last lq tokens."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(offset + lq, heads + 2 * kvh, 64, generator=g) * spread).bfloat16()
    return qkv[offset:, :heads], qkv[:, heads:heads + kvh], qkv[:, heads + kvh:]


@needs_amx
@pytest.mark.parametrize("lq, offset, heads, kvh", [
    (1, 0, 9, 3), (15, 0, 9, 3), (16, 0, 9, 3), (17, 0, 9, 3), (200, 0, 9, 3),  # whole prompts
    (40, 300, 9, 3), (1, 129, 4, 1), (130, 127, 2, 2),  # chunks over earlier context
])
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
def test_later_keys_never_reach_earlier_queries():
    """Changing the keys and values after position p leaves the outputs of queries up to p
    bit for bit: the causal mask, including inside a 32-key block and a 128-key step."""
    q, k, v = fused(150, 0, 9, 3, seed=1)
    before = torch.empty_like(q)
    amx_attention.causal_attention_(before, q, k, v, 0, 0.125)
    k2, v2 = k.clone(), v.clone()
    k2[70:] = 5.0
    v2[70:] = -3.0
    after = torch.empty_like(q)
    amx_attention.causal_attention_(after, q, k2, v2, 0, 0.125)
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
    """fp32, head dims other than 64 and tokens whose heads are not contiguous return False
    (the caller runs SDPA) and write nothing."""
    q, k, v = fused(8, 0, 4, 2)
    out = torch.zeros(8, 4, 64, dtype=torch.bfloat16)
    assert not amx_attention.causal_attention_(out.float(), q.float(), k.float(), v.float(), 0, 0.125)
    q128 = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    assert not amx_attention.causal_attention_(q128.clone(), q128, q128[:, :1], q128[:, :1], 0, 0.1)
    assert not amx_attention.causal_attention_(out, q.transpose(0, 1).contiguous().transpose(0, 1), k, v, 0, 0.1)
    assert not amx_attention.usable(q.float()) and not amx_attention.usable(q128)
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
def test_paged_attention_uses_it_for_bf16_prefill(chunks, monkeypatch):
    """paged_attention in bf16 on CPU sends prefill chunks to the kernel, and its outputs match
    the SDPA path's to bf16 rounding."""
    heads, kvh, hd, bs = 9, 3, 64, 4
    total = sum(chunks)
    g = torch.Generator().manual_seed(3)
    q_all = torch.randn(total, heads, hd, generator=g).bfloat16()
    k_all, v_all = torch.randn(2, total, kvh, hd, generator=g).bfloat16().unbind(0)
    tables = torch.randperm(16, generator=g)[None]

    def run():
        kc, vc = torch.zeros(2, 16, bs, kvh, hd, dtype=torch.bfloat16).unbind(0)
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
    real = amx_attention.causal_attention_
    monkeypatch.setattr(amx_attention, "causal_attention_", lambda *a: calls.append(a[4]) or real(*a))
    with_kernel = run()
    assert calls == [sum(chunks[:i]) for i in range(len(chunks))]  # each chunk, at its offset
    monkeypatch.setattr(amx_attention, "usable", lambda q: False)
    without = run()
    torch.testing.assert_close(with_kernel.float(), without.float(), rtol=0, atol=3e-2)
    assert attention.amx_attention is amx_attention


@pytest.mark.parametrize("dtype, builds", [("bfloat16", True), ("float32", False)])
def test_a_bf16_engine_builds_the_kernel_at_start(dtype, builds, tmp_path, monkeypatch):
    """build_core builds (or finds) the kernel while the engine starts when it serves bf16 on
    CPU, so the first prompt does not wait for a compiler; other dtypes never touch it."""
    from engine_utils import make_tiny_checkpoint
    from kvmesh.services.engine.build import build_core
    from kvmesh.services.engine.config import EngineConfig

    folder = make_tiny_checkpoint(tmp_path, num_layers=1)
    calls = []
    monkeypatch.setattr(amx_attention, "prepare", lambda: calls.append(1) or True)
    build_core(EngineConfig(model=str(folder), dtype=dtype, num_blocks=8, block_size=16,
                            max_num_batched_tokens=16, max_num_seqs=2))
    assert calls == ([1] if builds else [])


@needs_amx
@pytest.mark.parametrize("offset", [120, 7])
def test_a_masked_key_with_a_huge_score_changes_nothing(offset):
    """A chunk whose 16-query blocks straddle a 128-key step (offset 120: queries 120..127 see
    no key of the step at 128): a later key whose score dwarfs every other is masked for them,
    so their outputs stay finite and equal the reference."""
    g = torch.Generator().manual_seed(4)
    lq, heads, kvh = 40, 2, 1
    u = torch.randn(64, generator=g).sign()  # every query points the same way
    q = (u.expand(lq, heads, 64) + 0.1 * torch.randn(lq, heads, 64, generator=g)).bfloat16()
    k = (0.3 * torch.randn(offset + lq, kvh, 64, generator=g)).bfloat16()
    v = torch.randn(offset + lq, kvh, 64, generator=g).bfloat16()
    k[128 if offset == 120 else offset + 20] = (40 * u).bfloat16()  # score ~320 for every query
    out = torch.empty_like(q)
    assert amx_attention.causal_attention_(out, q, k, v, offset, 0.125)
    exact = reference(q, k, v, offset, 0.125)
    assert torch.isfinite(out.float()).all()
    assert (out.float() - exact).abs().max().item() < 3e-2
