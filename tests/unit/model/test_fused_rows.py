"""kvmesh.model.fused_rows against the torch ops it replaces, and the model with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvmesh.model.fused_rows as fused_rows
from kvmesh.model.config import ModelConfig
from kvmesh.model.llama import LlamaForCausalLM, RotaryEmbedding, apply_rope

needs_kernels = pytest.mark.skipif(fused_rows._ops() is None, reason="the fused row kernels could not be "
                                   "built here (no C++ compiler or ninja); the torch ops are what runs")
DTYPES = [torch.float32, torch.bfloat16]


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> int:
    """Largest distance in units in the last place of the dtype (same-sign values)."""
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    return int((got.view(bits).long() - ref.view(bits).long()).abs().max())


def _torch_rms(x, w, eps):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (7, 40), (300, 576), (64, 1000)])  # tails of 16 lanes, threaded
def test_rms_norm_is_torch_within_an_ulp(dtype, rows, dim):
    torch.manual_seed(rows + dim)
    x = (torch.randn(rows, dim) * 4).to(dtype)
    w = (torch.rand(dim) + 0.5).to(dtype)  # positive, so an ulp compares same-sign values
    with torch.no_grad():
        got = fused_rows.rms_norm(x, w, 1e-5)
        ref = _torch_rms(x, w, 1e-5)
    assert got is not None and got.dtype == dtype and got.shape == x.shape
    pos = ref.float().abs() > 0
    assert _ulps(got.abs()[pos], ref.abs()[pos]) <= (4 if dtype == torch.float32 else 1)  # fp32: the sum's order
    assert torch.equal(torch.sign(got), torch.sign(ref))


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hd", [(5, 64), (257, 80), (3, 16)])
def test_rope_in_place_is_apply_rope_bit_for_bit(dtype, rows, hd):
    torch.manual_seed(hd)
    heads, kv = 9, 3
    qkv = (torch.randn(2, rows, heads + 2 * kv, hd) * 3).to(dtype)
    cos, sin = RotaryEmbedding(hd, 10000.0)(torch.arange(rows) * 7, dtype)  # one table for the batch
    ref = apply_rope(qkv[..., :heads + kv, :], cos, sin)
    got = qkv.clone()
    with torch.no_grad():
        assert fused_rows.rope_(got, cos, sin, heads + kv)
    assert torch.equal(got[..., :heads + kv, :], ref)
    assert torch.equal(got[..., heads + kv:, :], qkv[..., heads + kv:, :])  # values untouched


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 100), (400, 1536)])
def test_silu_mul_is_torch_within_an_ulp(dtype, rows, inter):
    torch.manual_seed(inter)
    gate = (torch.randn(rows, inter) * 4).to(dtype)
    up = (torch.rand(rows, inter) + 0.5).to(dtype)  # positive: the product's sign is silu's
    with torch.no_grad():
        got = fused_rows.silu_mul(torch.cat([gate, up], dim=1))
    ref = F.silu(gate) * up
    assert got.shape == ref.shape and got.dtype == dtype
    nz = ref != 0
    assert torch.equal(torch.sign(got), torch.sign(ref))
    assert _ulps(got.abs()[nz], ref.abs()[nz]) <= (4 if dtype == torch.float32 else 1)


@needs_kernels
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Threaded splits never change a row: each row alone gives the bits it gets in a batch."""
    torch.manual_seed(1)
    x, w = torch.randn(200, 576), torch.randn(576)
    gu = torch.randn(200, 3072)
    with torch.no_grad():
        batch_norm, batch_act = fused_rows.rms_norm(x, w, 1e-6), fused_rows.silu_mul(gu)
        for i in (0, 99, 199):
            assert torch.equal(fused_rows.rms_norm(x[i:i + 1], w, 1e-6)[0], batch_norm[i])
            assert torch.equal(fused_rows.silu_mul(gu[i:i + 1])[0], batch_act[i])


def test_the_torch_ops_run_where_the_kernels_do_not_apply():
    x = torch.randn(4, 32)
    w = torch.ones(32, requires_grad=True)
    assert fused_rows.rms_norm(x, w, 1e-6) is None  # autograd would be lost
    assert fused_rows.rms_norm(x.half(), w.detach().half(), 1e-6) is None  # fp16
    assert fused_rows.rms_norm(x, w.detach().bfloat16(), 1e-6) is None  # mixed dtypes
    assert fused_rows.silu_mul(torch.randn(4, 8).t()) is None  # columns not contiguous
    qkv = torch.randn(4, 3, 8)
    assert not fused_rows.rope_(qkv.transpose(0, 1), torch.ones(3, 8), torch.zeros(3, 8), 2)


def test_kvmesh_native_0_turns_the_kernels_off(monkeypatch):
    monkeypatch.setenv("KVMESH_NATIVE", "0")
    monkeypatch.setattr(fused_rows._kernels, "tried", False)
    monkeypatch.setattr(fused_rows._kernels, "module", None)
    with torch.no_grad():
        assert fused_rows.rms_norm(torch.randn(4, 32), torch.ones(32), 1e-6) is None
    monkeypatch.setattr(fused_rows._kernels, "tried", False)  # the next test builds (or finds) the kernels again


@needs_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_model_with_the_kernels_matches_the_torch_ops(monkeypatch, dtype):
    cfg = ModelConfig(name="tiny", bos_token_id=1, eos_token_ids=(2,), vocab_size=256, hidden_size=96, intermediate_size=200, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=10000.0,
                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    ids = torch.randint(0, 256, (2, 37))
    calls, ops = [], fused_rows._ops()
    monkeypatch.setattr(fused_rows, "_ops", lambda: calls.append(1) or ops)
    with torch.inference_mode():
        fused = model.forward_dense(ids)
        assert len(calls) == 2 * 4 + 1  # per layer two norms, RoPE and SwiGLU; then the final norm
        monkeypatch.setattr(fused_rows, "_ops", lambda: None)
        plain = model.forward_dense(ids)
    tol = 1e-4 if dtype == torch.float32 else 0.15  # bf16: one ulp somewhere moves later roundings
    assert (fused - plain).abs().max() <= tol * plain.abs().max()
    assert (fused.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.95
