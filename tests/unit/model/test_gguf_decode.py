"""The fused GGUF decode step (kvmesh.model.quant.GGUFDecode): a decode step of the whole decoder
stack in one native call equals the layer-by-layer path up to float rounding, writes the same
keys and values, and computes every row alone (a verified draft gets a plain decode's bits)."""

from __future__ import annotations

import pytest
import torch

import kvmesh.model.gguf_native as gguf_native
from kvmesh.model.loader import load_model
from kvmesh.model.quant import GGUFDecode

from .paged import PagedRunner
from .test_gguf import tiny_gguf  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(gguf_native.gguf_ops() is None, reason="the GGUF kernels could not be built here")


class Counting:
    """Wraps a GGUFDecode, counting the steps it ran."""

    def __init__(self, inner: GGUFDecode) -> None:
        self.inner, self.calls = inner, 0

    def __call__(self, *args):
        self.calls += 1
        return self.inner(*args)


def _models(path, tmp_path, bias: bool = False):
    """(fused, layer-by-layer) loads of the same GGUF file; with `bias`, the same random q/k/v and
    o biases in both (as Qwen2's and Llama's attention_bias)."""
    fused = load_model(str(path), cache_dir=tmp_path, weights="gguf", progress=False).model
    plain = load_model(str(path), cache_dir=tmp_path, weights="gguf", progress=False).model
    if bias:
        g = torch.Generator().manual_seed(3)
        for a, b in zip(fused.model.layers, plain.model.layers):
            for name in ("qkv_proj", "o_proj"):
                la, lb = getattr(a.self_attn, name), getattr(b.self_attn, name)
                v = torch.randn(la.out_features, generator=g) * 0.1
                la._bias, lb._bias = v, v.clone()
    op = GGUFDecode.of(fused)
    assert op is not None
    counter = Counting(op)
    fused.__dict__["_gguf_decode"] = counter
    plain.__dict__["_gguf_decode"] = None  # the layer-by-layer path
    return fused, plain, counter


def decode_alike(runs: list[PagedRunner], toks: dict[int, int], steps: int) -> None:
    """`steps` greedy decode steps of the same sequences in the (fused, layer-by-layer) runners:
    their logits equal up to rounding at every step."""
    for _ in range(steps):
        got, want = (r.step({s: [t] for s, t in toks.items()}) for r in runs)
        for s in toks:
            torch.testing.assert_close(got[s], want[s], rtol=0, atol=1e-5 * want[s].abs().max().item())
        toks = {s: int(want[s][-1].argmax()) for s in toks}


@pytest.mark.parametrize("bias, seqs", [(False, 3), (True, 3), (True, 7)])
def test_fused_decode_equals_the_layer_by_layer_path(tiny_gguf, tmp_path, bias, seqs):  # noqa: F811
    """3 rows: the matmuls' per-row passes; 7: their blocked path (weights decoded once a step)."""
    path, _ = tiny_gguf
    fused, plain, counter = _models(path, tmp_path, bias)
    runs = [PagedRunner(m, seqs, seed=1, num_blocks=32 * seqs) for m in (fused, plain)]
    prompts = {0: [3, 200, 17, 99, 5], 1: [64, 120, 1, 250, 8, 9, 10, 11, 12], 2: [7]}
    prompts.update({s: [(31 * s + j) % 250 for j in range(s + 2)] for s in range(3, seqs)})
    for r in runs:
        r.step(prompts)  # prefill: not a decode step, the layer-by-layer path in both
    assert counter.calls == 0
    decode_alike(runs, {s: 11 * (s + 1) for s in range(seqs)}, 6)
    assert counter.calls == 6
    for (kf, vf), (kp, vp) in zip(runs[0].kv, runs[1].kv):  # the same keys and values cached
        torch.testing.assert_close(kf, kp, rtol=0, atol=1e-5 * kp.abs().max().item())
        torch.testing.assert_close(vf, vp, rtol=0, atol=1e-5 * vp.abs().max().item())


def test_long_contexts_split_attention_and_still_equal_the_layer_by_layer_path(tiny_gguf, tmp_path):  # noqa: F811
    """Rows of ~20, ~260 and ~400 positions in one step: attention per KV head over the whole
    context, and in two and three context splits (merged: the same softmax up to rounding). RoPE
    has no table, so positions past the tiny model's 256 are fine here."""
    path, _ = tiny_gguf
    fused, plain, counter = _models(path, tmp_path)
    runs = [PagedRunner(m, 3, block_size=16, num_blocks=96, max_blocks=30, seed=4) for m in (fused, plain)]
    g = torch.Generator().manual_seed(5)
    prompts = {s: torch.randint(0, 264, (n,), generator=g).tolist() for s, n in ((0, 20), (1, 255), (2, 390))}
    for r in runs:
        r.step(prompts)
    decode_alike(runs, {0: 11, 1: 22, 2: 33}, 4)
    assert counter.calls == 4


def test_a_verified_draft_row_gets_the_bits_of_a_plain_decode(tiny_gguf, tmp_path):  # noqa: F811
    path, _ = tiny_gguf
    fused, _, counter = _models(path, tmp_path)
    one, verify = PagedRunner(fused, 2, seed=2), PagedRunner(fused, 2, seed=2)
    prompt = {0: [3, 200, 17, 99], 1: [5, 64, 120]}
    one.step(prompt)
    verify.step(prompt)
    drafts = [41, 42, 43]
    alone = [one.step({0: [t]})[0][0] for t in drafts]  # three plain decode steps of sequence 0
    # the same three tokens as one verify row (sequence 0) beside a decode of sequence 1
    together = verify.step({0: drafts, 1: [9]})
    assert counter.calls == 4
    for j in range(3):
        assert torch.equal(together[0][j], alone[j])
    k_one, k_ver = one.kv[0][0], verify.kv[0][0]
    for p in range(4, 7):  # the keys the drafts wrote, bit for bit
        slot = int(one.tables[0, p // one.block_size]), p % one.block_size
        assert torch.equal(k_one[slot], k_ver[slot])


def test_a_sequence_decodes_to_the_same_bits_alone_or_in_a_batch(tiny_gguf, tmp_path):  # noqa: F811
    """Decode steps of 9 sequences together (the matmuls' blocked path) and of each alone (the
    per-row path) give every sequence the same logits and KV, bit for bit."""
    path, _ = tiny_gguf
    fused, _, counter = _models(path, tmp_path)
    n = 9
    batch, alone = (PagedRunner(fused, n, seed=4, num_blocks=32 * n) for _ in range(2))
    prompts = {s: [(17 * s + 3 * j) % 250 for j in range(3 + s % 4)] for s in range(n)}
    batch.step(prompts)
    alone.step(prompts)  # the same prefill in both (one step of every prompt)
    toks = {s: 5 + s for s in range(n)}
    for _ in range(4):
        together = batch.step({s: [t] for s, t in toks.items()})
        for s, t in toks.items():
            assert torch.equal(alone.step({s: [t]})[s], together[s]), s
        toks = {s: int(together[s][-1].argmax()) for s in toks}
    assert counter.calls == 4 * (n + 1)
    for (kb, vb), (ka, va) in zip(batch.kv, alone.kv):
        assert torch.equal(kb, ka) and torch.equal(vb, va)


def test_models_it_does_not_fit_take_the_layer_by_layer_path(tiny_gguf, tmp_path):  # noqa: F811
    path, _ = tiny_gguf
    assert GGUFDecode.of(load_model(str(path), cache_dir=tmp_path, progress=False).model) is None  # fp32
    model = load_model(str(path), cache_dir=tmp_path, weights="gguf", progress=False).model
    model.model.layers[1].self_attn.window = 4  # a sliding window: the fused kernel has none
    assert GGUFDecode.of(model) is None


def test_kernel_refuses_bad_metadata(tiny_gguf, tmp_path):  # noqa: F811
    path, _ = tiny_gguf
    fused, _, counter = _models(path, tmp_path)
    run = PagedRunner(fused, 1)
    run.step({0: [3, 4, 5]})
    op = counter.inner
    h = torch.zeros(1, fused.config.hidden_size)
    cos = sin = torch.zeros(1, fused.config.head_dim)
    kv = [(k, v) for k, v in run.kv]

    class Meta:
        slot_mapping = torch.tensor([10 ** 6])  # past the cache
        decode_blocks = run.tables[:1].contiguous()
        decode_ctx = torch.tensor([4])

    with pytest.raises(RuntimeError, match="context or slot out of range"):
        op(h, cos, sin, kv, Meta)
