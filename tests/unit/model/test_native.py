"""The native decode-attention kernel against SDPA, and the model's decode path with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvmesh.model.attention as attention
import kvmesh.model.native as native
from kvmesh.model.attention import AttentionMetadata, paged_attention
from kvmesh.model.native import LINEAR_ROWS, linear_rows_kernel, paged_decode_kernel

kernel = paged_decode_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="the native kernel could not be built here "
                                  "(no C++ compiler or ninja); the torch path is what runs")


def _reference(q, k_cache, v_cache, tables, ctx, scale):
    """Each row alone: its keys/values gathered slot by slot, KV heads repeated (HF's repeat_kv
    order), plain SDPA."""
    _, bs, kvh, hd = k_cache.shape
    g = q.shape[1] // kvh
    out = []
    for d in range(q.shape[0]):
        slots = (tables[d][:, None] * bs + torch.arange(bs)).reshape(-1)[: int(ctx[d])]
        k = k_cache.view(-1, kvh, hd)[slots].repeat_interleave(g, dim=1).transpose(0, 1)
        v = v_cache.view(-1, kvh, hd)[slots].repeat_interleave(g, dim=1).transpose(0, 1)
        out.append(F.scaled_dot_product_attention(q[d][:, None], k, v, scale=scale)[:, 0])
    return torch.stack(out)


@needs_kernel
def test_kernel_matches_sdpa_on_scattered_blocks_and_uneven_contexts():
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, 64, 16, 3, 64).unbind(0)
    ctx = torch.tensor([1, 16, 17, 100, 128])  # one key, block edges, a full table
    tables = torch.stack([torch.randperm(64)[:8] for _ in range(5)])
    q = torch.randn(5, 9, 64) * 3
    got = kernel(q, k_cache.contiguous(), v_cache.contiguous(), tables, ctx, 0.125)
    want = _reference(q, k_cache, v_cache, tables, ctx, 0.125)
    assert got.shape == (5, 9, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a row attends to its own blocks only: changing another row's keys leaves it unchanged
    k2 = k_cache.clone()
    k2[tables[4]] += 1.0
    shared = set(tables[4].tolist()) & set(tables[0, :1].tolist())
    if not shared:
        torch.testing.assert_close(kernel(q, k2, v_cache.contiguous(), tables, ctx, 0.125)[0], got[0], rtol=0, atol=0)


@needs_kernel
@pytest.mark.parametrize("groups, kvh, hd", [(1, 2, 64), (3, 3, 64), (8, 1, 64), (2, 2, 128), (5, 1, 128), (2, 2, 32)])
def test_kernel_every_group_size_and_head_dim(groups, kvh, hd):
    """Query heads per KV head 1-8 and head sizes 64/128 (the explicit AVX-512 tasks) and 32
    (the plain loops) against SDPA; each row's output is the same bits alone as beside others."""
    torch.manual_seed(groups * 1000 + hd)
    k_cache, v_cache = torch.randn(2, 40, 16, kvh, hd).unbind(0)
    ctx = torch.tensor([1, 15, 16, 17, 63, 80])
    tables = torch.stack([torch.randperm(40)[:5] for _ in range(6)])
    q = torch.randn(6, groups * kvh, hd) * 2
    got = kernel(q, k_cache.contiguous(), v_cache.contiguous(), tables, ctx, hd ** -0.5)
    torch.testing.assert_close(got, _reference(q, k_cache, v_cache, tables, ctx, hd ** -0.5), rtol=1e-5, atol=1e-5)
    alone = kernel(q[3:4].contiguous(), k_cache.contiguous(), v_cache.contiguous(), tables[3:4].contiguous(),
                   ctx[3:4].contiguous(), hd ** -0.5)
    assert torch.equal(alone[0], got[3])


@needs_kernel
def test_kernel_rejects_what_it_cannot_compute():
    k_cache = torch.randn(4, 16, 3, 64)
    q = torch.randn(1, 9, 64)
    tables = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="context length"):
        kernel(q, k_cache, k_cache, tables, torch.tensor([33]), 0.1)  # 2 blocks of 16 hold 32 keys
    with pytest.raises(RuntimeError, match="fp32"):
        kernel(q.double(), k_cache, k_cache, tables, torch.tensor([3]), 0.1)


@needs_kernel
@pytest.mark.parametrize("heads, kvh, hd", [(9, 3, 64), (4, 2, 16)])  # SmolLM2-135M's, the tiny test model's
def test_paged_attention_same_with_and_without_the_kernel(heads, kvh, hd, monkeypatch):
    """A decode batch with uneven contexts next to a prefill chunk, through paged_attention:
    the kernel's outputs equal the gather + SDPA path's to float rounding."""
    torch.manual_seed(1)
    kc, vc = torch.randn(2, 16, 4, kvh, hd).unbind(0)
    # rows: decode (context 5), decode (context 11), a 3-token chunk (context 7)
    tables = torch.tensor([[1, 2, 0], [3, 4, 5], [6, 7, 0]])
    slots = torch.tensor([2 * 4 + 0, 5 * 4 + 2, 7 * 4 + 0, 7 * 4 + 1, 7 * 4 + 2])
    q = torch.randn(5, heads, hd)
    k, v = torch.randn(2, 5, kvh, hd).unbind(0)

    def run():
        meta = AttentionMetadata.build(slots, [1, 1, 3], [5, 11, 7], tables, 4)
        return paged_attention(q, k, v, kc.clone(), vc.clone(), meta, hd ** -0.5)

    with_kernel = run()
    monkeypatch.setattr(attention, "paged_decode_kernel", lambda: None)
    without = run()
    torch.testing.assert_close(with_kernel, without, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [True, False])
def test_short_rows_over_context_attend_as_decode_rows(kernel, monkeypatch):
    """A decode plus drafts being verified (a 4-token row over earlier context) goes through the
    decode path, one row per token with its own causal context; it equals the masked-SDPA path
    that longer chunks take, next to a plain decode and a fresh prompt."""
    if kernel and paged_decode_kernel() is None:
        pytest.skip("native kernel not built here")
    if not kernel:
        monkeypatch.setattr(attention, "paged_decode_kernel", lambda: None)
    torch.manual_seed(2)
    heads, kvh, hd = 9, 3, 64
    kc, vc = torch.randn(2, 16, 4, kvh, hd).unbind(0)
    # rows: decode (context 5), 4 tokens over 9 earlier (context 13), a fresh 2-token prompt
    tables = torch.tensor([[1, 2, 0, 0], [3, 4, 5, 6], [7, 0, 0, 0]])
    slots = torch.tensor([2 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0, 7 * 4 + 0, 7 * 4 + 1])
    q = torch.randn(7, heads, hd)
    k, v = torch.randn(2, 7, kvh, hd).unbind(0)

    def run():
        meta = AttentionMetadata.build(slots, [1, 4, 2], [5, 13, 2], tables, 4)
        return meta, paged_attention(q, k, v, kc.clone(), vc.clone(), meta, hd ** -0.5)

    meta, short = run()
    assert meta.decode_rows == [0, 1, 1, 1, 1] and meta.decode_ctx.tolist() == [5, 10, 11, 12, 13]
    monkeypatch.setattr(attention, "SHORT_ROWS", 1)  # every multi-token row takes the prefill path
    meta, chunked = run()
    assert meta.decode_rows == [0] and len(meta.prefills) == 2
    torch.testing.assert_close(short, chunked, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_kernel_leaves_the_calling_threads_torch_threads_alone():
    """Another thread setting torch to one thread (the KV codec threads do) must not make the
    kernel's first call drop the calling thread to one thread (it did through at::parallel_for,
    halving prefill speed in an engine linked to a KV service). In a fresh process: the thread
    counts are per-process state."""
    code = """
import threading, torch
from kvmesh.model.native import LINEAR_ROWS, linear_rows_kernel, paged_decode_kernel
torch.set_num_threads(2)
def step_loop():
    torch.ones(4).sum()  # this thread's first torch op, as the engine's step loop does at build
    other = threading.Thread(target=torch.set_num_threads, args=(1,))
    other.start(); other.join()
    k = paged_decode_kernel()
    cache = torch.randn(4, 16, 3, 64)
    k(torch.randn(2, 9, 64), cache, cache, torch.zeros(2, 1, dtype=torch.long), torch.tensor([3, 5]), 0.1)
    assert torch.get_num_threads() == 2, torch.get_num_threads()
t = threading.Thread(target=step_loop); t.start(); t.join()
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@needs_kernel
def test_native_w8a8_ops_equal_the_torch_arithmetic():
    from kvmesh.model.native import w8a8_ops

    quantize_rows, rescale_rows = w8a8_ops()
    torch.manual_seed(4)
    x = torch.randn(37, 96) * torch.rand(96) * 5
    x[3] = 0  # an all-zero row: step clamped, codes 0
    inv = torch.rand(96) + 0.5
    q, step = quantize_rows(x, inv)
    xs = x * inv
    want_step = xs.abs().amax(1, keepdim=True).clamp_min(1e-12) / 127.0
    torch.testing.assert_close(step, want_step, rtol=1e-6, atol=0)
    want_q = torch.round(xs / want_step)
    assert q.dtype == torch.int8 and (q.float() - want_q).abs().max() <= 1  # a .5 tie may round apart
    assert (q.float() == want_q).float().mean() > 0.99 and int(q[3].abs().max()) == 0
    acc = torch.randint(-2**20, 2**20, (37, 50), dtype=torch.int32)
    w = torch.rand(50)
    torch.testing.assert_close(rescale_rows(acc, step, w), acc.float() * step * w, rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="quantize_rows"):
        quantize_rows(x.double(), inv)


@needs_kernel
@pytest.mark.parametrize("K,N", [(576, 960), (100, 37), (16, 5), (7, 3)])
def test_linear_rows_equals_f_linear_and_each_row_is_independent_of_the_others(K, N):
    """1..8 rows against F.linear, for widths with and without a 16-float tail and weight counts
    that do not fill its blocks; and every row of an M-row call is bit for bit the 1-row call."""
    torch.manual_seed(3)
    w, x = torch.randn(N, K), torch.randn(LINEAR_ROWS, K)
    kernel = linear_rows_kernel()
    for m in range(1, LINEAR_ROWS + 1):
        y = kernel(x[:m].contiguous(), w)
        torch.testing.assert_close(y, F.linear(x[:m], w), rtol=1e-5, atol=1e-4)
        for i in range(m):
            assert torch.equal(y[i], kernel(x[i:i + 1].contiguous(), w)[0])


@needs_kernel
def test_linear_rows_refuses_what_it_cannot_compute():
    kernel = linear_rows_kernel()
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        kernel(torch.randn(LINEAR_ROWS + 1, 16), torch.randn(4, 16))
    with pytest.raises(RuntimeError, match="fp32"):
        kernel(torch.randn(2, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        kernel(torch.randn(2, 16), torch.randn(4, 8))


def test_model_linear_takes_the_kernel_only_where_it_applies(monkeypatch):
    """kvmesh's Linear: 2-D fp32 CPU inputs of at most LINEAR_ROWS rows without autograd go to
    the kernel; more rows, 3-D, bf16 and autograd go to F.linear."""
    import kvmesh.model.llama as llama

    calls = []
    monkeypatch.setattr(llama, "linear_rows_kernel", lambda: lambda x, w: calls.append(x.shape) or F.linear(x, w))
    lin = llama.Linear(16, 8, bias=False)
    with torch.inference_mode():
        for shape in [(1, 16), (LINEAR_ROWS, 16), (LINEAR_ROWS + 1, 16), (2, 3, 16)]:
            lin(torch.randn(*shape))
        lin.to(torch.bfloat16)(torch.randn(2, 16, dtype=torch.bfloat16))
    lin.float()
    lin(torch.randn(2, 16))  # grad enabled, weight requires grad
    assert calls == [(1, 16), (LINEAR_ROWS, 16)]


@needs_kernel
def test_verifying_drafts_computes_each_row_as_a_plain_decode_would(tmp_path):
    """fp32 on CPU, one sequence: a step of 1 + k tokens over its context (a decode plus k drafts
    being verified) gives, row for row, the same logits bit for bit as k + 1 single-token decode
    steps -- skinny matmuls and per-row decode attention make a row independent of its step. So
    greedy speculative decoding reproduces plain decoding exactly, not only up to ties."""
    from engine_utils import load_tiny, make_tiny_checkpoint

    lm = load_tiny(make_tiny_checkpoint(tmp_path))
    kv = attention.allocate_kv_cache(lm.config, 8, 16, torch.float32, "cpu")
    table = torch.arange(8)[None]
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(4))

    def step(tokens, start):
        pos = torch.arange(start, start + len(tokens))
        meta = AttentionMetadata(slot_mapping=pos.clone(), query_lens=[len(tokens)], context_lens=[start + len(tokens)],
                                 block_tables=table)
        return lm.model.compute_logits(lm.model(tokens, pos, kv, meta))

    with torch.inference_mode():
        step(ids[:30], 0)
        single = torch.cat([step(ids[30 + i:31 + i], 30 + i) for i in range(LINEAR_ROWS)])
        verify = step(ids[30:30 + LINEAR_ROWS], 30)  # the same positions, rewritten with the same KV
    assert torch.equal(single, verify)


@pytest.fixture
def failing_build(monkeypatch):
    """A fresh loader whose build fails as a compiler error does; returns the build calls."""
    calls = []

    def build():
        calls.append(1)
        raise RuntimeError("Error building extension 'kvmesh_native': g++: error: bad kernel")

    monkeypatch.setattr(native, "_build", build)
    monkeypatch.setattr(native._kernels, "module", None)
    monkeypatch.setattr(native._kernels, "tried", False)
    return calls


def test_native_1_makes_a_failed_build_an_error_with_the_compilers_output(failing_build, monkeypatch):
    monkeypatch.setenv("KVMESH_NATIVE", "1")
    for _ in range(2):  # every call, not only the first
        with pytest.raises(RuntimeError, match="KVMESH_NATIVE=1 .* did not build: .*g\\+\\+: error: bad kernel"):
            paged_decode_kernel()
    assert len(failing_build) == 2


def test_unset_falls_back_to_the_torch_paths_with_a_warning(failing_build, monkeypatch, caplog):
    monkeypatch.delenv("KVMESH_NATIVE", raising=False)
    with caplog.at_level("WARNING", logger="kvmesh.model.native"):
        assert paged_decode_kernel() is None and linear_rows_kernel() is None
    assert len(failing_build) == 1  # tried once per process
    assert "bad kernel" in caplog.text and "KVMESH_NATIVE=1" in caplog.text


def test_native_0_never_builds(failing_build, monkeypatch):
    monkeypatch.setenv("KVMESH_NATIVE", "0")
    assert paged_decode_kernel() is None and failing_build == []


def test_other_values_of_native_are_refused(failing_build, monkeypatch):
    monkeypatch.setenv("KVMESH_NATIVE", "yes")
    with pytest.raises(ValueError, match="KVMESH_NATIVE='yes': use 1"):
        paged_decode_kernel()
    assert failing_build == []
