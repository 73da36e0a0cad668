"""The GGUF block kernels (kvmesh.model.gguf_native) against gguf-py's own dequantizer: exact
dequantization bit for bit, and matmuls equal to the dequantized weights' up to float rounding,
for every block type, several shapes and row counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

import kvmesh.model.gguf_native as gguf_native
from kvmesh.model.gguf_native import gguf_ops
from kvmesh.model.native import _cpu_flags

ops = gguf_ops()
needs_kernels = pytest.mark.skipif(ops is None, reason="the GGUF kernels could not be built here "
                                   "(no C++ compiler or ninja); weights=gguf runs dequantized")


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(*a.shape, 2)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """A reference Q4_K quantizer from the block spec (ggml's layout, plain min/max search):
    per 256 weights, fp16 d and dmin, 6-bit scale and min per 32, 4-bit codes. [N, K] -> bytes."""
    n, k = w.shape
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub, 32]
    lo = np.minimum(x.min(-1), 0.0)
    scale = (x.max(-1) - lo) / 15.0
    d = (scale.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin == 0, 1, dmin)[:, None]), 0, 63).astype(np.uint8)
    step = np.where(sc == 0, 1, d[:, None] * sc)[..., None]
    q = np.clip(np.round((x + (dmin[:, None] * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    packed = np.zeros((x.shape[0], 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    q = q.reshape(-1, 4, 2, 32)  # 64-weight chunks: low nibbles the first 32, high the next
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([_f16_bytes(d), _f16_bytes(dmin), packed, qs], axis=1)
    return blocks.reshape(n, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """A reference Q6_K quantizer from the block spec: per 256 weights an fp16 d, an int8 scale
    per 16 and 6-bit codes split into low nibbles (ql) and 2 high bits (qh). [N, K] -> bytes."""
    n, k = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31.0
    d = (scale.max(-1) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[:, None]), -128, 127).astype(np.int8)
    step = np.where(sc == 0, 1, d[:, None] * sc)[..., None]
    q = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [b, half, j, l]
    ql = np.concatenate([q[:, :, 0] & 15 | (q[:, :, 2] & 15) << 4, q[:, :, 1] & 15 | (q[:, :, 3] & 15) << 4], axis=2)
    qh = (q[:, :, 0] >> 4) | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)
    return blocks.reshape(n, -1)


def blocks_of(qtype: T, w: np.ndarray) -> np.ndarray:
    if qtype == T.Q4_K:
        return quantize_q4_k(w)
    if qtype == T.Q6_K:
        return quantize_q6_k(w)
    return quantize(w, qtype)


# K = 96 and 576: not multiples of 256 (the 32-blocks allow it); 1536: SmolLM2's down_proj
SHAPES = {T.Q4_0: [(40, 96), (576, 576)], T.Q4_1: [(40, 96), (576, 576), (33, 1536)],
          T.Q8_0: [(40, 96), (300, 576)], T.Q4_K: [(40, 256), (65, 1536)], T.Q6_K: [(40, 256), (65, 1536)]}
CASES = [(t, n, k) for t, shapes in SHAPES.items() for n, k in shapes]


def _weights(n: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.01).astype(np.float32)


@needs_kernels
@pytest.mark.parametrize("qtype, n, k", CASES)
def test_dequantize_is_gguf_py_bit_for_bit(qtype, n, k):
    blocks = blocks_of(qtype, _weights(n, k, 0))
    want = np.asarray(dequantize(blocks, qtype), dtype=np.float32)
    assert np.abs(want - _weights(n, k, 0)).max() < 0.05  # the reference quantizers are sane
    got = ops.gguf_dequant(torch.from_numpy(blocks), int(qtype), k)
    assert torch.equal(got, torch.from_numpy(want))


@needs_kernels
@pytest.mark.parametrize("qtype, n, k", CASES)
def test_matmul_equals_the_dequantized_weights_up_to_rounding(qtype, n, k):
    blocks = torch.from_numpy(blocks_of(qtype, _weights(n, k, 1)))
    w = ops.gguf_dequant(blocks, int(qtype), k).double()
    torch.manual_seed(2)
    for m in (1, 2, 3, 5, 8, 19, 64):  # decode rows, a decode with drafts, batched decode steps
        x = torch.randn(m, k)
        got = ops.gguf_mm(x, [blocks], [int(qtype)])
        want = x.double() @ w.T
        bound = (x.double().abs() @ w.abs().T) * 2e-6  # float rounding of sum |x||w|
        assert got.shape == (m, n)
        assert bool(((got.double() - want).abs() <= bound + 1e-30).all()), (qtype, m)
        tiled = ops.gguf_mm_tiled(x, [blocks], [int(qtype)], 4096)  # several tiles  # the prefill path: same sum, other order
        assert bool(((tiled.double() - want).abs() <= bound + 1e-30).all()), (qtype, m)
        # each row of x gives the same bits alone or beside others: past 4 rows the weights are
        # decoded once into a buffer and met by 4 x 5 blocks of rows, in the same summation order
        alone = torch.cat([ops.gguf_mm(x[i:i + 1].contiguous(), [blocks], [int(qtype)]) for i in range(m)])
        assert torch.equal(alone, got), (qtype, m)


def _repacked(blocks: torch.Tensor, qtype, k: int) -> torch.Tensor:
    """gguf_repack's rows; skips only where the build cannot have the repacked kernel (no
    AVX-512: the extension is compiled for this CPU), and fails where it should and did not."""
    packed = ops.gguf_repack(blocks, int(qtype), k)
    if "avx512f" not in _cpu_flags().split():
        pytest.skip("no AVX-512 on this CPU: 4-bit rows keep the file's layout")
    assert packed.numel() > 0, "an AVX-512 build returned no repacked rows"
    return packed


# every tail a row of 32-weight blocks can have past its quads of four (K / 32 % 4 = 0, 1, 2, 3)
REPACK_CASES = [(T.Q4_0, 7, 96), (T.Q4_0, 9, 576), (T.Q4_1, 5, 32), (T.Q4_1, 6, 64), (T.Q4_1, 7, 96),
                (T.Q4_1, 8, 128), (T.Q4_1, 40, 576), (T.Q4_1, 33, 1536), (T.Q4_K, 11, 256), (T.Q4_K, 13, 1536)]


@needs_kernels
@pytest.mark.parametrize("qtype, n, k", REPACK_CASES)
def test_repacked_rows_are_the_same_weights_and_the_same_sums(qtype, n, k):
    """gguf_repack's layout holds the file's weights bit for bit, and every matmul path over it
    gives the bits the file's own blocks give (same products, same summation order)."""
    blocks = torch.from_numpy(blocks_of(qtype, _weights(n, k, 6)))
    packed = _repacked(blocks, qtype, k)
    rq = gguf_native.REPACKED_Q4
    assert packed.shape[0] == n and packed.dtype == torch.uint8
    assert torch.equal(ops.gguf_dequant(packed, rq, k), ops.gguf_dequant(blocks, int(qtype), k))
    torch.manual_seed(7)
    for m in (1, 2, 4, 5, 13):
        x = torch.randn(m, k)
        assert torch.equal(ops.gguf_mm(x, [packed], [rq]), ops.gguf_mm(x, [blocks], [int(qtype)])), m
    assert ops.gguf_repack(torch.from_numpy(blocks_of(T.Q8_0, _weights(n, k, 6))), int(T.Q8_0), k).numel() == 0
    with pytest.raises(RuntimeError, match="do not hold"):
        ops.gguf_mm(torch.randn(1, k), [packed[:, :-4].contiguous()], [rq])


@needs_kernels
@pytest.mark.parametrize("qtype, n, k", [(T.Q4_0, 40, 96), (T.Q4_1, 70, 576), (T.Q4_1, 33, 1536), (T.Q4_K, 65, 512)])
def test_prefill_over_repacked_rows_is_exact_up_to_rounding(qtype, n, k):
    """Many rows of x over repacked 4-bit parts (the AMX path where the CPU has one: x split into
    three bf16 pieces, against two pieces of each weight or the codes with a per-block scale) equal
    the dequantized weights' matmul within float rounding -- not bf16's -- at row counts that
    fill the tiles and that do not, next to a part the tiles do not take (Q8_0)."""
    blocks = torch.from_numpy(blocks_of(qtype, _weights(n, k, 8)))
    packed = _repacked(blocks, qtype, k)
    q8 = torch.from_numpy(blocks_of(T.Q8_0, _weights(24, k, 9)))
    w = torch.cat([ops.gguf_dequant(blocks, int(qtype), k), ops.gguf_dequant(q8, int(T.Q8_0), k)]).double()
    torch.manual_seed(10)
    for m in (32, 33, 70, 130):
        x = torch.randn(m, k) * torch.logspace(-3, 2, k)  # magnitudes across five decades
        got = ops.gguf_mm_tiled(x, [packed, q8], [gguf_native.REPACKED_Q4, int(T.Q8_0)], 4096)
        want = x.double() @ w.T
        bound = (x.double().abs() @ w.abs().T) * 2e-6  # fp32 rounding; bf16 activations miss it by ~1000x
        assert got.shape == (m, n + 24)
        assert bool(((got.double() - want).abs() <= bound + 1e-30).all()), m


@needs_kernels
def test_fp16_scaled_parts_take_the_two_piece_kernel():
    """Q4_0 and Q4_1 parts (fp16 scales and offsets: each weight exactly two bf16 numbers) go to
    the tile unit in two weight pieces with no per-block step; Q4_K's (scale d * sc, up to 17
    bits) per block. The test above holds both to fp32's bound; this one fails if the fast kernel
    stopped taking the parts it can, or took one it cannot."""
    if not ops.gguf_amx():
        pytest.skip("no tile path on this CPU (or KVMESH_AMX=0)")
    for qtype, n, k in [(T.Q4_0, 40, 96), (T.Q4_1, 70, 576), (T.Q4_1, 33, 1536), (T.Q4_K, 65, 512)]:
        packed = _repacked(torch.from_numpy(blocks_of(qtype, _weights(n, k, 8))), qtype, k)
        assert ops.gguf_amx_two_piece(packed, k) is (qtype != T.Q4_K), qtype


@needs_kernels
def test_the_amx_path_is_on_where_the_cpu_and_kernel_allow_it():
    """The exactness test above passes on the fp32 tiles too; this one fails if the tile path went
    missing on a CPU with AMX-BF16 under a kernel that grants its tile state (Linux >= 5.16)."""
    import os
    import re

    flags = _cpu_flags().split()
    release = tuple(int(v) for v in re.findall(r"\d+", os.uname().release)[:2])
    wanted = ({"amx_tile", "amx_bf16", "avx512_bf16", "avx512f"} <= set(flags) and release >= (5, 16)
              and os.environ.get("KVMESH_AMX", "1") != "0")
    assert ops.gguf_amx() == wanted


@needs_kernels
def test_parts_of_different_types_are_one_matmul():
    """A fused projection whose parts the file holds in different types (Q4_K_M's attn_v in Q6_K)."""
    w1, w2, w3 = _weights(24, 512, 3), _weights(16, 512, 4), _weights(8, 512, 5)
    parts = [(T.Q4_K, w1), (T.Q6_K, w2), (T.Q8_0, w3)]
    blocks = [torch.from_numpy(blocks_of(t, w)) for t, w in parts]
    types = [int(t) for t, _ in parts]
    for m in (3, 13):  # per-row passes, and decoded tiles that span parts of two types
        x = torch.randn(m, 512)
        got = ops.gguf_mm(x, blocks, types)
        want = torch.cat([ops.gguf_mm(x, [b], [t]) for b, t in zip(blocks, types)], dim=1)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        alone = torch.cat([ops.gguf_mm(x[i:i + 1].contiguous(), blocks, types) for i in range(m)])
        assert torch.equal(alone, got)
    torch.testing.assert_close(ops.gguf_mm_tiled(x, blocks, types, 8192), want, rtol=1e-5, atol=1e-5)
    f32 = torch.randn(5, 512)  # F32 rows (the plain path) next to quantized ones
    got = ops.gguf_mm(x, [blocks[0], f32.view(torch.uint8)], [int(T.Q4_K), int(T.F32)])
    torch.testing.assert_close(got[:, 24:], x @ f32.T, rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("k, kinds, nparts", [
    (576, [(T.Q4_1, True), (T.Q8_0, False), (T.Q4_0, False), (T.Q4_0, True)], 4),  # a partial last quad
    (768, [(T.Q4_K, True), (T.Q6_K, False), (T.Q8_0, False)], 5),
    (576, [(T.Q4_1, True), (T.Q8_0, False)], 17),  # past 16 parts: row by row
])
def test_one_row_groups_weight_rows_and_keeps_each_rows_bits(k, kinds, nparts):
    """A decode row (M = 1) walks the weight rows of each part in groups (kvmesh.model.gguf_rows1):
    every output has the bits it has beside other rows of x (row_dot's arithmetic), across parts
    of odd sizes and different types -- a group never spans two parts."""
    blocks, types = [], []
    for i in range(nparts):
        qtype, repack = kinds[i % len(kinds)]
        b = torch.from_numpy(blocks_of(qtype, _weights(2 * (i % 5) + 1, k, 10 + i)))  # 1, 3, 5, ... rows
        blocks.append(_repacked(b, qtype, k) if repack else b)
        types.append(gguf_native.REPACKED_Q4 if repack else int(qtype))
    torch.manual_seed(3)
    x = torch.randn(3, k)
    beside = ops.gguf_mm(x, blocks, types)  # three rows: row_dot<3> per weight row
    alone = torch.cat([ops.gguf_mm(x[i:i + 1].contiguous(), blocks, types) for i in range(3)])
    assert torch.equal(alone, beside)
    per_part = torch.cat([ops.gguf_mm(x[:1].contiguous(), [b], [t]) for b, t in zip(blocks, types)], dim=1)
    assert torch.equal(per_part, alone[:1])


@needs_kernels
def test_kernels_reject_what_they_cannot_compute():
    blocks = torch.from_numpy(quantize(_weights(4, 64, 0), T.Q4_1))
    with pytest.raises(RuntimeError, match="do not hold K = 96"):
        ops.gguf_mm(torch.randn(1, 96), [blocks], [int(T.Q4_1)])
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        ops.gguf_mm(torch.randn(1, 64), [blocks], [int(T.Q5_K)])
    with pytest.raises(RuntimeError, match="fp32"):
        ops.gguf_mm(torch.randn(1, 64).double(), [blocks], [int(T.Q4_1)])


@pytest.fixture
def failing_build(monkeypatch):
    calls = []

    def build():
        calls.append(1)
        raise RuntimeError("Error building extension 'kvmesh_gguf': g++: error: bad kernel")

    monkeypatch.setattr(gguf_native, "_build", build)
    monkeypatch.setattr(gguf_native._kernels, "module", None)
    monkeypatch.setattr(gguf_native._kernels, "tried", False)
    return calls


def test_native_1_makes_a_failed_build_an_error(failing_build, monkeypatch):
    monkeypatch.setenv("KVMESH_NATIVE", "1")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="KVMESH_NATIVE=1 but the GGUF kernels did not build: .*bad kernel"):
            gguf_ops()
    assert len(failing_build) == 2


def test_unset_falls_back_with_a_warning_and_0_never_builds(failing_build, monkeypatch, caplog):
    monkeypatch.delenv("KVMESH_NATIVE", raising=False)
    with caplog.at_level("WARNING", logger="kvmesh.model.gguf_native"):
        assert gguf_ops() is None and gguf_ops() is None
    assert len(failing_build) == 1 and "bad kernel" in caplog.text
    monkeypatch.setattr(gguf_native._kernels, "tried", False)
    monkeypatch.setenv("KVMESH_NATIVE", "0")
    assert gguf_ops() is None and len(failing_build) == 1


@needs_kernels
@pytest.mark.parametrize("n, chunk", [(2, 1), (37, 4), (1001, 16), (1000, 1)])
def test_team_split_gives_every_item_to_one_thread_and_steals(n, chunk):
    """team_for (kvmesh.model.gguf_team): a thread done with its own range takes chunks from the
    back of another's. The probe holds thread 0 back (its range published) until thread 1 has
    taken one of its items: every item is still done exactly once, thread 1's own half by
    thread 1."""
    who = ops.gguf_team_probe(n, chunk)
    assert set(who.tolist()) <= {1, 2}  # 100 added per repeated visit, 0 for an item nobody did
    assert (who[n // 2:] == 2).all()
    assert (who[:n // 2] == 2).any()


@needs_kernels
@pytest.mark.parametrize("m", [1, 9, 32])
def test_rows_have_the_same_bits_whatever_the_team_size(m):
    """The matmuls split their work over the team and steal the last chunks (team_for); which
    thread computes an output must not change it: 1 to 5 threads, one row of x (the grouped
    decode path) and many (the blocked path), parts of odd sizes and several types."""
    k = 768
    blocks, types = [], []
    kinds = [(T.Q4_1, True), (T.Q8_0, False), (T.Q4_0, True), (T.Q6_K, False), (T.Q4_K, True)]
    for i, (qtype, repack) in enumerate(kinds):
        b = torch.from_numpy(blocks_of(qtype, _weights(37 + 64 * i, k, 20 + i)))
        blocks.append(_repacked(b, qtype, k) if repack else b)
        types.append(gguf_native.REPACKED_Q4 if repack else int(qtype))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            results.append(ops.gguf_mm(x, blocks, types))
    finally:
        torch.set_num_threads(before)
    for got in results[1:]:
        assert torch.equal(got, results[0])
