"""``weights="gguf-a8"``: the GGUF file's own blocks times 8-bit activations (llama.cpp's
arithmetic). The kernel equals the same integer arithmetic done in torch; the mode is lossy
(never the exact path), loads only where it can run, refuses block types it lacks by name, and
never shares KV with the exact formats."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvmesh.model import gguf_a8
from kvmesh.model.loader import build_model, load_model, read_checkpoint
from kvmesh.model.gguf_loader import load_quantized
from kvmesh.model.quant import GGUFDecode, GGUFLinear

from .test_gguf import tiny_gguf  # noqa: F401 (fixture)

needs_kernel = pytest.mark.skipif(gguf_a8.ops() is None, reason="no AVX-512 VNNI kernel here")


def reference(x: torch.Tensor, qtype: int, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """gguf_a8's arithmetic in torch (float64 sums of the exact integer products): x [M, K] fp32 -> [M, N]."""
    n, nb = int(rows.shape[0]), in_features // 32
    size = {2: 18, 3: 20, 8: 34}[qtype]
    blocks = rows.reshape(n, nb, size)
    d = gguf_a8._fp16(blocks, 0).double()
    if qtype == 8:
        w = blocks[..., 2:].view(torch.int8).long()
    else:
        nib = blocks[..., size - 16:].long()
        w = torch.cat([nib & 0x0F, nib >> 4], dim=-1) - (8 if qtype == 2 else 0)
    xb = x.reshape(x.shape[0], nb, 32)
    dx = xb.abs().amax(-1) / 127  # fp32, as the kernel rounds each step
    inv = torch.where(dx != 0, 1 / dx, torch.zeros_like(dx))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127).long()  # torch.round: ties to even
    isum = torch.einsum("mbk,nbk->mnb", q.double(), w.double())  # exact: integers below 2^53
    y = (isum * dx.double()[:, None, :] * d[None]).sum(-1)
    if qtype == 3:
        y += (gguf_a8._fp16(blocks, 2).double()[None] * (dx.double() * q.sum(-1).double())[:, None, :]).sum(-1)
    return y.float()


def _blocks(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * 0.05 + (0.01 if qtype == 3 else 0)).astype(np.float32)
    return torch.from_numpy(quantize(w, qtype))


@needs_kernel
@pytest.mark.parametrize("qtype", [2, 3, 8])
@pytest.mark.parametrize("m, n, k", [(1, 40, 64), (3, 16, 96), (5, 33, 576), (130, 50, 128), (257, 17, 64)])
def test_kernel_equals_the_integer_arithmetic(qtype, m, n, k):
    """Every row count (the 4-row tiles and their tails, the row chunks), outputs not a multiple
    of the 16-row panel, a block of zeros: the reference's exact integer sums, scaled in fp64."""
    rows = _blocks(qtype, n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0  # d = 0: the block contributes nothing
    if m > 1:
        x[1, 5] = 40.0  # one outlier: the rest of its block keeps few levels
    qs, d, mins = gguf_a8.pack(qtype, rows, k)
    got = gguf_a8.ops().a8_mm(x, [qs], [d], [mins], [qtype], [n])
    want = reference(x, qtype, rows, k)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernel
def test_parts_of_different_types_fill_their_own_columns():
    parts = [(3, _blocks(3, 20, 64, 1)), (8, _blocks(8, 7, 64, 2)), (2, _blocks(2, 16, 64, 3))]
    x = torch.randn(6, 64)
    packed = [gguf_a8.pack(t, r, 64) for t, r in parts]
    got = gguf_a8.ops().a8_mm(x, [p[0] for p in packed], [p[1] for p in packed], [p[2] for p in packed],
                              [t for t, _ in parts], [int(r.shape[0]) for _, r in parts])
    want = torch.cat([reference(x, t, r, 64) for t, r in parts], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@needs_kernel
def test_the_layer_is_lossy_by_the_8_bit_rounding_only():
    """Against the exact layer (fp32 activations): different beyond float rounding (the mode never
    runs the exact path silently), and within what 8-bit activations cost; bias and leading dims."""
    from gguf import GGMLQuantizationType as T

    parts = [(int(T.Q4_1), _blocks(3, 48, 256, 4))]
    bias = torch.randn(48)
    exact = GGUFLinear(parts, 256, bias)
    a8 = GGUFLinear(parts, 256, bias, act8=True)
    assert "gguf-a8" in a8.extra_repr()
    x = torch.randn(2, 9, 256)
    want, got = exact(x), a8(x)
    assert got.shape == (2, 9, 48)
    err = (got - want).abs().max().item()
    scale = (want - bias).abs().max().item()
    assert 1e-4 * scale < err < 0.03 * scale
    want_int = reference(x.reshape(-1, 256), int(T.Q4_1), parts[0][1], 256) + bias
    torch.testing.assert_close(got.reshape(-1, 48), want_int, rtol=1e-5, atol=1e-5 * scale)
    with pytest.raises(ValueError, match="keeps only its repacked blocks"):
        a8.dequantize()


def test_pack_refuses_a_type_it_has_no_kernel_for():
    with pytest.raises(ValueError, match="ggml type 14 is not one of Q4_0, Q4_1, Q8_0"):
        gguf_a8.pack(14, torch.zeros(16, 210, dtype=torch.uint8), 256)


@needs_kernel
def test_tiny_model_loads_lossy_and_apart_from_the_exact_formats(tiny_gguf, tmp_path):  # noqa: F811
    path, _ = tiny_gguf
    exact = load_model(str(path), cache_dir=tmp_path, weights="gguf", progress=False)
    a8 = load_model(str(path), cache_dir=tmp_path, weights="gguf-a8", progress=False)
    layers = [m for m in a8.model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 2 * 4 + 1 and all("gguf-a8" in m.extra_repr() for m in layers)
    assert a8.weights == "gguf-a8" and a8.identity != exact.identity  # its KV never mixes with the exact path's
    assert GGUFDecode.of(a8.model) is None  # the fused exact decode step is not used for it
    ids = torch.tensor([[3, 200, 17, 99, 5, 64, 120, 1, 250]])
    with torch.inference_mode():
        want, got = exact.model.forward_dense(ids), a8.model.forward_dense(ids)
    assert not torch.equal(got, want)
    assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.99


def test_a_block_type_without_an_8_bit_kernel_is_refused_by_name(tiny_gguf, tmp_path):  # noqa: F811
    path, _ = tiny_gguf
    checkpoint = read_checkpoint(str(path), cache_dir=tmp_path, progress=False)
    tensors = dict(load_quantized(path, cache_dir=tmp_path, digest=checkpoint.digest))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = dataclasses.replace(tensors[name], qtype=14)  # as a Q6_K tensor would be
    with pytest.raises(ValueError, match=f"takes Q4_0, Q4_1, Q8_0 blocks; this file's {name} is Q6_K: use weights='gguf'"):
        build_model(checkpoint, dtype=torch.float32, device=torch.device("cpu"), weights="gguf-a8", gguf_tensors=tensors)


def test_gguf_a8_is_refused_for_an_hf_folder(tiny):
    with pytest.raises(ValueError, match="weights='gguf-a8' runs a GGUF file's own quantized blocks.*not a GGUF file"):
        load_model(str(tiny.folder), weights="gguf-a8", progress=False)


def test_without_the_kernel_the_mode_is_refused_with_what_to_use(monkeypatch):
    monkeypatch.setattr(gguf_a8._kernels, "module", None)
    monkeypatch.setattr(gguf_a8._kernels, "tried", True)  # no VNNI, KVMESH_NATIVE=0 or a failed build
    with pytest.raises(ValueError, match="needs the native kernels on a CPU with AVX-512 VNNI.*use 'gguf'"):
        GGUFLinear([(3, _blocks(3, 16, 64, 5))], 64, act8=True)


@needs_kernel
def test_an_engine_serves_it_and_says_so(tiny_gguf, tmp_path):  # noqa: F811
    """Through the engine's step loop (chunked prefill, batched decode): two prompts, greedy, each
    alone and side by side give the same tokens (rows are quantized one by one, so a row's result
    does not depend on its batch), and GetModelInfo names the lossy format."""
    from engine_utils import greedy, make_core, run_all
    from kvmesh.engine.v1 import engine_pb2
    from kvmesh.services.engine.config import EngineConfig
    from kvmesh.services.engine.servicer import model_info

    path, _ = tiny_gguf
    loaded = load_model(str(path), cache_dir=tmp_path, weights="gguf-a8", progress=False)
    prompts = {"a": [3, 200, 17, 99, 5, 64, 120, 1, 250, 7, 8, 9], "b": [11, 12, 13, 14, 15]}
    together = run_all(make_core(loaded, speculation="off"), prompts, greedy(8))
    for rid, ids in prompts.items():
        alone = run_all(make_core(loaded, speculation="off"), {rid: ids}, greedy(8))
        assert alone[rid]["tokens"] == together[rid]["tokens"] and len(alone[rid]["tokens"]) == 8
    info = model_info(make_core(loaded), EngineConfig(model=str(path), weights="gguf-a8"))
    assert info.weights == engine_pb2.WEIGHT_FORMAT_GGUF_A8
