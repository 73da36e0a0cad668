"""Weight-only int8/int4 and int4-w8a8: bounded error on the tiny model, exact Q4_1 recovery, kernel == fallback."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kvmesh.model.loader import load_model
from kvmesh.model.quant import SMALL_BATCH, QuantLinear, W8A8Linear, quantize_model, smooth_factors

from .conftest import TinyCheckpoint, make_tiny_hf
from .paged import PagedRunner


@pytest.fixture(scope="module")
def tiny_q(tmp_path_factory) -> TinyCheckpoint:
    """Tiny model at HF's default init scale (0.02): weight statistics like a trained model's."""
    return make_tiny_hf(tmp_path_factory.mktemp("tiny_q"), init=0.02)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("mode, bound", [("int8", 0.02), ("int4", 0.15)])
def test_quantized_forward_close_to_fp32(tiny_q, mode, bound):
    ref = load_model(str(tiny_q.folder)).model
    lm = load_model(str(tiny_q.folder), weights=mode)
    assert lm.weights == mode
    model = lm.model
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down per layer; lm_head and embedding untouched
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.dtype == torch.float32
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (3, 40))
    assert ids.numel() > max(SMALL_BATCH.values())
    want = ref.forward_dense(ids)
    got = model.forward_dense(ids)  # 120 rows per matmul: dequantize path (above SMALL_BATCH)
    assert 0 < _rel_err(got, want) < bound
    # decode path (one row per matmul: the packed kernel where there is one) is close as well
    runner = PagedRunner(model, 1)
    runner.step({0: ids[0, :30].tolist()})
    steps = torch.cat([runner.step({0: [t]})[0] for t in ids[0, 30:].tolist()])
    assert _rel_err(steps, want[0, 30:]) < bound


def _q41_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight with GGUF Q4_1 structure: per 32-group w = d*q + m, d and m fp16, q spanning 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's quantizer puts the group min at 0 and max at 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 1e-3).half().float()
    m = (torch.randn(n, k // 32, 1, generator=g) * 0.05).half().float()
    return (q * d + m).view(n, k), q.view(n, k)


def test_int4_recovers_q4_1_exactly():
    w, q = _q41_weight(96, 128)
    lin = nn.Linear(128, 96, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    ql = QuantLinear.from_linear(lin, "int4")
    assert torch.equal(ql.nibbles().long(), q)
    torch.testing.assert_close(ql.dequantize(), w, rtol=0, atol=1e-7)
    x = torch.randn(max(SMALL_BATCH.values()) + 1, 128)  # dequantize path, fp32: matches the fp32 layer
    torch.testing.assert_close(ql(x), lin(x), rtol=0, atol=2e-5)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_kernel_and_fallback_agree(mode):
    torch.manual_seed(1)
    lin = nn.Linear(256, 192, bias=False)
    ql = QuantLinear.from_linear(lin, mode)
    x = torch.randn(3, 5, 256)
    fallback = torch.nn.functional.linear(x, ql.dequantize())
    got = ql(x)  # 15 rows: kernel path when the device has one
    assert got.shape == (3, 5, 192) and got.dtype == torch.float32
    # the kernel runs on bf16 activations: agreement to bf16 precision
    torch.testing.assert_close(got, fallback, rtol=2e-2, atol=2e-2 * fallback.abs().max().item())
    ql._kernel = None  # a device without the op
    torch.testing.assert_close(ql(x), fallback, rtol=1e-6, atol=1e-5)
    assert _rel_err(ql.dequantize(), lin.weight.detach()) < (0.01 if mode == "int8" else 0.1)


def test_quantize_rejects_bad_input(tiny):
    with pytest.raises(ValueError, match="mode"):
        quantize_model(nn.Sequential(nn.Linear(32, 32, bias=False)), "int3")
    with pytest.raises(ValueError, match="divisible"):
        QuantLinear.from_linear(nn.Linear(48, 8, bias=False), "int4")
    with pytest.raises(ValueError, match="weights='bf16'"):
        load_model(str(tiny.folder), dtype="float32", weights="bf16")
    with pytest.raises(ValueError, match="dtype"):
        load_model(str(tiny.folder), dtype="float64")


def _w8a8_reference(x: torch.Tensor, w: torch.Tensor, smooth: torch.Tensor) -> torch.Tensor:
    """The W8A8 arithmetic written out in float64: x/s per row and W*s per output channel,
    each rounded to int8 steps of max|.|/127, then the exact integer dot products rescaled."""
    xs, ws = x.double() / smooth.double(), w.double() * smooth.double()
    sx = xs.abs().amax(1, keepdim=True) / 127
    sw = ws.abs().amax(1) / 127
    xq = torch.round(xs / sx)
    wq = torch.round(ws / sw[:, None])
    return (xq @ wq.t()) * sx * sw


def test_w8a8_is_per_token_int8_arithmetic_on_both_paths():
    torch.manual_seed(2)
    w = torch.randn(96, 128) * 0.05
    smooth = torch.rand(128) + 0.5
    lin = W8A8Linear(w, smooth)
    x = torch.randn(7, 128)
    want = _w8a8_reference(x, w, smooth).float()
    got = lin(x)
    assert got.shape == (7, 96) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # each row has its own activation scale: a row 1000x larger does not change the others
    big = x.clone()
    big[0] *= 1000
    torch.testing.assert_close(lin(big)[1:], got[1:], rtol=0, atol=0)
    lin._int_mm = False  # a device without the integer matmul: float64 products, same numbers
    torch.testing.assert_close(lin(x), got, rtol=1e-6, atol=1e-6)


def test_smoothing_tames_an_outlier_channel():
    """Activations with one channel 50x the others (as LLM activations have): per-token int8
    spends its range on that channel; SmoothQuant's factors move it into the weights."""
    torch.manual_seed(3)
    lin = nn.Linear(128, 64, bias=False)
    x = torch.randn(256, 128)
    x[:, 5] *= 50
    want = lin(x)
    plain = W8A8Linear(lin.weight)
    smooth = smooth_factors(_OneLinear(lin), x.tolist(), alpha=0.65)["lin"]
    assert smooth.shape == (128,) and smooth[5] == smooth.max()
    smoothed = W8A8Linear(lin.weight, smooth)
    assert _rel_err(smoothed(x), want) < 0.5 * _rel_err(plain(x), want)
    with pytest.raises(ValueError, match="positive"):
        W8A8Linear(lin.weight, torch.zeros(128))
    with pytest.raises(ValueError, match="alpha"):
        smooth_factors(_OneLinear(lin), x.tolist(), alpha=2.0)


class _OneLinear(nn.Module):
    """smooth_factors' model protocol (forward_dense over 'token ids') for one Linear; the
    'ids' are the activation rows themselves."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward_dense(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lin(ids.float())


def test_int4_w8a8_dispatches_by_rows(tiny_q):
    ref = load_model(str(tiny_q.folder)).model
    lm = load_model(str(tiny_q.folder), weights="int4-w8a8")
    assert lm.weights == "int4-w8a8"
    model = lm.model
    assert isinstance(model.lm_head, W8A8Linear)  # the output projection is W8A8 for every row count
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the embedding stays as it was
    layer = model.model.layers[0].mlp.gate_up_proj
    assert isinstance(layer, QuantLinear) and isinstance(layer.large, W8A8Linear)
    n = SMALL_BATCH["int4-w8a8"]
    few, many = torch.randn(n, layer.in_features), torch.randn(n + 1, layer.in_features)
    torch.testing.assert_close(layer(many), layer.large(many), rtol=0, atol=0)
    if layer._kernel is not None:  # the packed int4 kernel (bf16 activations) for decode-sized matmuls
        torch.testing.assert_close(layer(few), layer._kernel_mm(few.to(torch.bfloat16)).float(), rtol=0, atol=0)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (3, 40))
    want = ref.forward_dense(ids)
    assert 0 < _rel_err(model.forward_dense(ids), want) < 0.15
    runner = PagedRunner(model, 1)
    runner.step({0: ids[0, :30].tolist()})
    steps = torch.cat([runner.step({0: [t]})[0] for t in ids[0, 30:].tolist()])
    assert _rel_err(steps, want[0, 30:]) < 0.15
