"""``weights="gguf"``: the model running a GGUF file's own blocks equals the dequantized fp32
model up to float rounding (tiny synthetic file and the bundled SmolLM2), greedy decoding agrees,
and anything but a GGUF source is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvmesh.model.gguf_native as gguf_native
from kvmesh.model.loader import load_model
from kvmesh.model.quant import GGUF_ROWS, GGUFLinear

from .paged import greedy_paged
from .test_gguf import tiny_gguf  # noqa: F401 (fixture)


def _gguf_linears(loaded) -> list[GGUFLinear]:
    return [m for m in loaded.model.modules() if isinstance(m, GGUFLinear)]


def test_tiny_gguf_model_equals_its_dequantized_weights(tiny_gguf, tmp_path):  # noqa: F811
    path, _ = tiny_gguf
    ref = load_model(str(path), cache_dir=tmp_path, progress=False)
    got = load_model(str(path), cache_dir=tmp_path, weights="gguf", progress=False)
    linears = _gguf_linears(got)
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the tied output projection
    assert got.weights == "gguf" and got.identity != ref.identity  # its KV never mixes with fp32's
    ref_linears = dict(ref.model.named_modules())
    for name, m in got.model.named_modules():  # every weight the file's, bit for bit as the fp32 conversion's
        if isinstance(m, GGUFLinear):
            assert torch.equal(m.dequantize(), ref_linears[name].weight), name
    ids = torch.tensor([[3, 200, 17, 99, 5, 64, 120, 1, 250]])
    with torch.inference_mode():
        for rows in (ids[:, :1], ids[:, :5], ids):  # the block kernel and, past GGUF_ROWS, dequantize
            want, have = ref.model.forward_dense(rows), got.model.forward_dense(rows)
            torch.testing.assert_close(have, want, rtol=0, atol=1e-5 * want.abs().max().item())
        long = torch.randint(0, 264, (1, GGUF_ROWS + 3), generator=torch.Generator().manual_seed(0))
        want, have = ref.model.forward_dense(long), got.model.forward_dense(long)
        torch.testing.assert_close(have, want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_without_the_kernels_the_layers_hold_the_dequantized_weights(tiny_gguf, tmp_path, monkeypatch):  # noqa: F811
    path, _ = tiny_gguf
    ref = load_model(str(path), cache_dir=tmp_path, progress=False)
    monkeypatch.setattr(gguf_native._kernels, "module", None)
    monkeypatch.setattr(gguf_native._kernels, "tried", True)  # as after KVMESH_NATIVE=0 or a failed build
    got = load_model(str(path), cache_dir=tmp_path, weights="gguf", progress=False)
    assert all("dequantized" in m.extra_repr() for m in _gguf_linears(got))
    ids = torch.tensor([[3, 200, 17, 99]])
    with torch.inference_mode():
        torch.testing.assert_close(got.model.forward_dense(ids), ref.model.forward_dense(ids), rtol=0, atol=0)


def test_gguf_weights_are_refused_for_an_hf_folder(tiny):
    with pytest.raises(ValueError, match="weights='gguf' runs a GGUF file's own quantized blocks.*not a GGUF file"):
        load_model(str(tiny.folder), weights="gguf", progress=False)


@pytest.mark.slow
@pytest.mark.skipif(gguf_native.gguf_ops() is None, reason="the GGUF kernels could not be built here")
def test_bundled_model_logits_and_greedy_agree_with_fp32(real_model):
    loaded = load_model("bundled", weights="gguf", progress=False)
    kinds = {m.extra_repr().split("gguf ")[1].split(",")[0] for m in _gguf_linears(loaded)}
    assert kinds == {"Q4_1+Q4_1+Q4_1", "Q4_1+Q4_1", "Q4_1", "Q8_0"}  # the file's own types, no re-quantization
    tok = loaded.tokenizer
    prompt = torch.tensor([tok.encode("The capital of France is Paris. The capital of Italy is")])
    with torch.inference_mode():
        want, have = real_model.model.forward_dense(prompt), loaded.model.forward_dense(prompt)
    torch.testing.assert_close(have, want, rtol=0, atol=2e-5 * want.abs().max().item())
    prompts = [tok.encode(t) for t in ("def fibonacci(n):", "Once upon a time, there was",
                                       "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n")]
    assert greedy_paged(loaded.model, prompts, 16) == greedy_paged(real_model.model, prompts, 16)


@pytest.mark.skipif(gguf_native.gguf_ops() is None, reason="the GGUF kernels could not be built here")
def test_gguf_linear_bias_dtypes_and_row_counts():
    """A Qwen2-style bias is added after the blocks' matmul; bf16 activations and every path
    (kernel, tiled prefill) give the dequantized weight's F.linear up to rounding."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    q, k = (quantize((rng.standard_normal((n, 96)) * 0.1).astype(np.float32), T.Q4_1) for n in (32, 16))
    bias = torch.randn(48)
    layer = GGUFLinear([(int(T.Q4_1), torch.from_numpy(q)), (int(T.Q4_1), torch.from_numpy(k))], 96, bias)
    w = layer.dequantize()
    for rows in (1, GGUF_ROWS, GGUF_ROWS + 1, 70):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 3, 96)  # leading dims and bf16 activations
    got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16 and got.shape == (2, 3, 48)
    torch.testing.assert_close(got.float(), F.linear(x.bfloat16().float(), w, bias), rtol=2e-2, atol=2e-2)


def test_a_block_type_without_a_kernel_runs_dequantized():
    """Q5_0 has no kernel: the layer holds gguf-py's dequantized weights (the file's model, fp32 speed)."""
    import numpy as np
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    blocks = quantize((np.random.default_rng(1).standard_normal((8, 64)) * 0.1).astype(np.float32), T.Q5_0)
    layer = GGUFLinear([(int(T.Q5_0), torch.from_numpy(blocks))], 64)
    assert layer.extra_repr().endswith("gguf Q5_0, dequantized")
    w = torch.from_numpy(np.asarray(dequantize(blocks, T.Q5_0), dtype=np.float32))
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), F.linear(x, w), rtol=0, atol=0)


@pytest.mark.parametrize("name, kw", [("llama", dict(family="llama")),
                                      ("llama-bias-tied", dict(family="llama", attention_bias=True, tie=True)),
                                      ("qwen2", dict(family="qwen2")), ("mistral", dict(family="mistral"))])
def test_every_family_runs_its_gguf_tensors(name, kw, tmp_path):
    """llama.cpp's layouts of each family (llama's permuted q/k rows, Qwen2's biases, an untied
    output projection; F32 tensors, as test_families writes them) give the fp32 load's logits."""
    from model_families import family_model, write_gguf

    m = family_model(tmp_path / "hf", seed=3, **kw)
    path = write_gguf(tmp_path / f"{name}.gguf", m)
    ref = load_model(str(path), cache_dir=tmp_path / "cache", progress=False)
    got = load_model(str(path), cache_dir=tmp_path / "cache", weights="gguf", progress=False)
    assert len(_gguf_linears(got)) == 4 * got.config.num_layers + 1
    ids = torch.randint(0, got.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for rows in (ids[:, :3], ids):
            want = ref.model.forward_dense(rows)
            torch.testing.assert_close(got.model.forward_dense(rows), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_blocks_are_cached_next_to_the_conversion(tiny_gguf, tmp_path, monkeypatch):  # noqa: F811
    from kvmesh.model import gguf_loader

    path, _ = tiny_gguf
    want = gguf_loader.read_quantized(path)
    first = gguf_loader.load_quantized(path, cache_dir=tmp_path)
    assert list((tmp_path / "gguf").glob(f"*/{gguf_loader.BLOCKS_FILE}"))

    def unexpected(_):
        raise AssertionError("the GGUF header was parsed again")

    monkeypatch.setattr(gguf_loader, "read_quantized", unexpected)
    again = gguf_loader.load_quantized(path, cache_dir=tmp_path)
    for got in (first, again):
        assert got.keys() == want.keys()
        for name, q in want.items():
            assert (got[name].qtype, got[name].in_features) == (q.qtype, q.in_features)
            assert torch.equal(got[name].rows, q.rows), name
