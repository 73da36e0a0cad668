"""``--weights gguf-a8``: a GGUF file's own blocks times activations rounded to 8 bits per block of
32, multiplied as 8-bit integers (llama.cpp's arithmetic on its CPU backends). Lossy and opt-in.

NOTE (what is computed). For each row of x and each block of 32 inputs, d = max|x| / 127 and
q = round(x / d) in [-127, 127] (ties to even), as llama.cpp's Q8_0/Q8_1 activations; the sum of
q is kept per block. A weight block of Q4_0 (d_w (n - 8)), Q4_1 (d_w n + m_w) or Q8_0 (d_w n)
meets it as one integer dot product, exact in int32: sum q (n - 8), sum q n or sum q n. The
block's contribution is d_w d_x isum (+ m_w d_x sum q for Q4_1), summed over the blocks in fp32.
The integers are llama.cpp's; only the order of the float sums differs (and llama.cpp rounds
d_x to fp16, kvmesh keeps it fp32), so the quality cost is llama.cpp's: measured by
``kvmesh bench quality`` against fp32 (README, the weights table). K-quant blocks (Q4_K, Q6_K)
are not implemented: a file with them is refused at load with the tensor's name.

NOTE (how). The weights are repacked at load into panels of 16 output rows: per panel and block,
groups of 4 consecutive inputs of the 16 rows side by side (64 bytes, one zmm), unsigned (Q8_0's
values + 128, the + 128 taken back with the block's sum of q; Q4_0's - 8 likewise), 4-bit values
two groups to a byte (a 16-row panel of a 4-bit block is 256 bytes, as in the file). One VNNI
``vpdpbusd`` multiplies a group for 16 outputs (64 products into 16 int32 lanes), with the 4
activation bytes broadcast; MR rows of x meet NR panels at a time, int32 accumulators per block,
then one convert and one FMA per (row, panel) and block. x is quantized once per call, and for
long inputs the rows are taken in chunks so a chunk's 8-bit rows stay in L2 while every panel
passes. A row or two of x (decode) take four panels at a time with two int32 sums each, so the
dependency chains of ``vpdpbusd`` (latency ~5) do not bound them. Needs AVX-512 VNNI (Intel Ice
Lake and later, AMD Zen 4); elsewhere the format is refused.

NOTE (measured, one-off, SmolLM2-135M's four decoder matmul shapes in Q4_1, 2 threads of a 2-core
Ice Lake Xeon whose MKL fp32 sgemm runs ~240 GFLOP/s): 2,048 rows 36.6 ms against MKL on the
dequantized weights 59.4 ms and the exact kernel's 71.9 ms (~400 GOP/s: 1.6x and 2.0x); 512 rows
8.2 against 15.1 and 17.4 ms; 32 rows 0.62 against 2.08 ms exact; one row 0.09 against 0.22 ms.
In a 2,048-token prefill (one chunk) the linears then take ~1.2 s and the fp32 attention ~1.7 s.

NOTE (not built yet). The fused decode step (kvmesh.model.gguf_decode) runs the exact kernels
only, so a gguf-a8 engine decodes layer by layer, one torch op after another: faster matmuls, but
a single stream decodes at 0.5-0.67x the default's speed (three engine benches on the Ice Lake).
Its batches and prefill are where it is faster.
"""
from __future__ import annotations

import logging

import torch

from kvmesh.model.native import NativeModule, load_extension

log = logging.getLogger(__name__)

TYPES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
"""ggml block types the 8-bit activation kernel takes (type id -> name)."""

PANEL = 16
"""Output rows per packed panel (one zmm of int32 lanes)."""

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstdint>
#include <vector>

bool available() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int MR = 4, NR = 2;        // rows of x x panels of 16 outputs per tile (16 + 16 accumulators at most)
constexpr int64_t CHUNK_ROWS = 128;  // rows of x per chunk (their 8-bit copy stays in L2)

struct Act {  // x quantized: per row, K int8 (as K/4 dwords) and per block d, sum q, d * sum q
  const int32_t* q; const float* d; const int32_t* sum; const float* ds;
  int64_t ldq, nb;
};

struct Part {  // one packed part: P panels of nb blocks
  const uint8_t* qs; const float* d; const float* m;
  int64_t N, P, nb, type, col;
};

// y[m, 16 p + lane] for mr rows x nr panels. NIB: 4-bit values (two groups a byte); OFF: the
// unsigned offset taken back (8 for Q4_0, 128 for Q8_0, 0 for Q4_1); MIN: Q4_1's m_w term. With
// few accumulators (a row or two of x), two int32 sums per (row, panel) halve the dependency chains.
template <int mr, int nr, bool NIB, int OFF, bool MIN>
static void tile(const Act& a, int64_t m0, const Part& p, int64_t p0, float* y, int64_t ldy) {
  constexpr int S = mr * nr < 8 ? 2 : 1;
  const int64_t pb = NIB ? 256 : 512, pstride = p.nb * pb;
  __m512 f[mr][nr];
  for (int i = 0; i < mr; ++i)
    for (int n = 0; n < nr; ++n) f[i][n] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < p.nb; ++b) {
    __m512i s[S][mr][nr];
    for (int h = 0; h < S; ++h)
      for (int i = 0; i < mr; ++i)
        for (int n = 0; n < nr; ++n) s[h][i][n] = _mm512_setzero_si512();
    const uint8_t* w0 = p.qs + p0 * pstride + b * pb;
    if (NIB) {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[nr], hi[nr];
        for (int n = 0; n < nr; ++n) {
          const __m512i v = _mm512_loadu_si512(w0 + n * pstride + 64 * j);
          lo[n] = _mm512_and_si512(v, low);
          hi[n] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        for (int i = 0; i < mr; ++i) {
          const int32_t* xr = a.q + (m0 + i) * a.ldq + 8 * b;
          const __m512i xl = _mm512_set1_epi32(xr[j]), xh = _mm512_set1_epi32(xr[4 + j]);
          for (int n = 0; n < nr; ++n) {
            s[0][i][n] = _mm512_dpbusd_epi32(s[0][i][n], lo[n], xl);
            s[S - 1][i][n] = _mm512_dpbusd_epi32(s[S - 1][i][n], hi[n], xh);
          }
        }
      }
    } else {
      for (int g = 0; g < 8; ++g) {
        __m512i w[nr];
        for (int n = 0; n < nr; ++n) w[n] = _mm512_loadu_si512(w0 + n * pstride + 64 * g);
        for (int i = 0; i < mr; ++i) {
          const __m512i xg = _mm512_set1_epi32(a.q[(m0 + i) * a.ldq + 8 * b + g]);
          for (int n = 0; n < nr; ++n) s[g % S][i][n] = _mm512_dpbusd_epi32(s[g % S][i][n], w[n], xg);
        }
      }
    }
    __m512 dw[nr], mw[nr];
    for (int n = 0; n < nr; ++n) {
      dw[n] = _mm512_loadu_ps(p.d + ((p0 + n) * p.nb + b) * 16);
      if (MIN) mw[n] = _mm512_loadu_ps(p.m + ((p0 + n) * p.nb + b) * 16);
    }
    for (int i = 0; i < mr; ++i) {
      const int64_t at = (m0 + i) * a.nb + b;
      const __m512 dx = _mm512_set1_ps(a.d[at]);
      const __m512i off = _mm512_set1_epi32(OFF * a.sum[at]);
      for (int n = 0; n < nr; ++n) {
        __m512i si = S == 2 ? _mm512_add_epi32(s[0][i][n], s[S - 1][i][n]) : s[0][i][n];
        if (OFF) si = _mm512_sub_epi32(si, off);
        f[i][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(dw[n], dx), f[i][n]);
        if (MIN) f[i][n] = _mm512_fmadd_ps(mw[n], _mm512_set1_ps(a.ds[at]), f[i][n]);
      }
    }
  }
  for (int i = 0; i < mr; ++i)
    for (int n = 0; n < nr; ++n) {
      const int64_t c0 = (p0 + n) * 16, left = p.N - c0;
      const __mmask16 k = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
      _mm512_mask_storeu_ps(y + (m0 + i) * ldy + p.col + c0, k, f[i][n]);
    }
}

// Rows m0..m1 of x against panels p0 .. p0 + np - 1 (np <= 4; more than 2 only for fewer than MR rows).
template <int mr, bool NIB, int OFF, bool MIN>
static void tile_np(int np, const Act& a, int64_t m, const Part& p, int64_t p0, float* y, int64_t ldy) {
  switch (np) {
    case 1: tile<mr, 1, NIB, OFF, MIN>(a, m, p, p0, y, ldy); break;
    case 2: tile<mr, 2, NIB, OFF, MIN>(a, m, p, p0, y, ldy); break;
    default:
      if constexpr (mr == 1) np == 3 ? tile<1, 3, NIB, OFF, MIN>(a, m, p, p0, y, ldy) : tile<1, 4, NIB, OFF, MIN>(a, m, p, p0, y, ldy);
      break;
  }
}

template <bool NIB, int OFF, bool MIN>
static void tiles(const Act& a, int64_t m0, int64_t m1, const Part& p, int64_t p0, int64_t np, float* y, int64_t ldy) {
  np = std::min<int64_t>(np, p.P - p0);
  if (np > 2) {  // a row at a time (decode): four panels, each its own two chains
    for (int64_t m = m0; m < m1; ++m) tile_np<1, NIB, OFF, MIN>((int)np, a, m, p, p0, y, ldy);
    return;
  }
  int64_t m = m0;
  for (; m + MR <= m1; m += MR) tile_np<MR, NIB, OFF, MIN>((int)np, a, m, p, p0, y, ldy);
  switch (m1 - m) {
    case 1: tile_np<1, NIB, OFF, MIN>((int)np, a, m, p, p0, y, ldy); break;
    case 2: tile_np<2, NIB, OFF, MIN>((int)np, a, m, p, p0, y, ldy); break;
    case 3: tile_np<3, NIB, OFF, MIN>((int)np, a, m, p, p0, y, ldy); break;
    default: break;
  }
}

static void part_tiles(const Act& a, int64_t m0, int64_t m1, const Part& p, int64_t p0, int64_t np, float* y,
                       int64_t ldy) {
  switch (p.type) {
    case 2: tiles<true, 8, false>(a, m0, m1, p, p0, np, y, ldy); break;
    case 3: tiles<true, 0, true>(a, m0, m1, p, p0, np, y, ldy); break;
    default: tiles<false, 128, false>(a, m0, m1, p, p0, np, y, ldy); break;
  }
}

// Row m of x (K floats) into 8-bit blocks: d = max|x| / 127, q = round(x / d) (ties to even).
static void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* sum, float* ds) {
  for (int64_t b = 0; b < K / 32; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + 32 * b), v1 = _mm512_loadu_ps(x + 32 * b + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float db = amax / 127.f, id = db != 0.f ? 1.f / db : 0.f;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * b + 16), _mm512_cvtsepi32_epi8(q1));
    const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
    d[b] = db; sum[b] = s; ds[b] = db * (float)s;
  }
}
#endif

// y [M, sum N] = x [M, K] times the packed parts (a8_pack's qs, d, m of each; types 2, 3, 8).
torch::Tensor a8_mm(torch::Tensor x, std::vector<torch::Tensor> qs, std::vector<torch::Tensor> ds,
                    std::vector<torch::Tensor> ms, std::vector<int64_t> types, std::vector<int64_t> ns) {
#if !(defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__))
  TORCH_CHECK(false, "a8_mm: built without AVX-512 VNNI");
#else
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "a8_mm: x must be contiguous [M, K] fp32 on CPU");
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  TORCH_CHECK(K % 32 == 0, "a8_mm: K must be a multiple of 32");
  const size_t parts = qs.size();
  TORCH_CHECK(ds.size() == parts && ms.size() == parts && types.size() == parts && ns.size() == parts && parts > 0,
              "a8_mm: one qs, d, m, type and N per part");
  std::vector<Part> ps;
  int64_t col = 0;
  for (size_t i = 0; i < parts; ++i) {
    const int64_t t = types[i], N = ns[i], P = (N + 15) / 16;
    TORCH_CHECK(t == 2 || t == 3 || t == 8, "a8_mm: block type ", t, " is not Q4_0, Q4_1 or Q8_0");
    const int64_t pb = t == 8 ? 512 : 256;
    TORCH_CHECK(qs[i].dtype() == torch::kUInt8 && qs[i].is_contiguous() && qs[i].numel() == P * nb * pb,
                "a8_mm: part ", i, " blocks do not match K");
    TORCH_CHECK(ds[i].dtype() == torch::kFloat32 && ds[i].is_contiguous() && ds[i].numel() == P * nb * 16,
                "a8_mm: part ", i, " scales do not match");
    TORCH_CHECK(t != 3 || (ms[i].dtype() == torch::kFloat32 && ms[i].is_contiguous() && ms[i].numel() == P * nb * 16),
                "a8_mm: part ", i, " (Q4_1) minimums do not match");
    ps.push_back({qs[i].data_ptr<uint8_t>(), ds[i].data_ptr<float>(), t == 3 ? ms[i].data_ptr<float>() : nullptr,
                  N, P, nb, t, col});
    col += N;
  }
  auto y = torch::empty({M, col}, x.options());
  std::vector<int8_t> q(M * K);
  std::vector<float> d(M * nb), dsum(M * nb);
  std::vector<int32_t> sum(M * nb);
  const Act a{reinterpret_cast<const int32_t*>(q.data()), d.data(), sum.data(), dsum.data(), K / 4, nb};
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // (part, first panel) work items of np panels (4 for fewer than MR rows); with the row chunks, chunk-major
  const int64_t np = M < MR ? 4 : NR;
  std::vector<std::pair<int32_t, int32_t>> items;
  for (size_t i = 0; i < parts; ++i)
    for (int64_t p0 = 0; p0 < ps[i].P; p0 += np) items.push_back({(int32_t)i, (int32_t)p0});
  const int64_t chunks = (M + CHUNK_ROWS - 1) / CHUNK_ROWS, W = items.size();
  #pragma omp parallel if (M * col * K >= 65536)
  {
    #pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m)
      quantize_row(xp + m * K, K, q.data() + m * K, d.data() + m * nb, sum.data() + m * nb, dsum.data() + m * nb);
    #pragma omp for schedule(static)
    for (int64_t w = 0; w < chunks * W; ++w) {
      const int64_t c = w / W, m0 = c * CHUNK_ROWS, m1 = std::min(M, m0 + CHUNK_ROWS);
      const auto& it = items[w % W];
      part_tiles(a, m0, m1, ps[it.first], it.second, np, yp, col);
    }
  }
  return y;
#endif
}
"""


def _build():
    return load_extension("kvmesh_gguf_a8", _SOURCE, ["available", "a8_mm"], "ggufa8-")


def _accept(module) -> bool:
    return module.available()


_kernels = NativeModule(lambda: _build(), "8-bit activation GGUF kernel", log, accept=_accept)
ops = _kernels.get
"""The compiled module where it builds and the CPU has AVX-512 VNNI, else None."""


def _fp16(rows: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 at byte ``at`` of each block ([..., bytes] uint8) as fp32 [...]."""
    return rows[..., at:at + 2].contiguous().view(torch.float16).squeeze(-1).float()


def pack(qtype: int, rows: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A part's blocks ([N, bytes per row] uint8, ggml type ``qtype``) in the kernel's layout:
    (qs uint8, d fp32 [P, nb, 16], m fp32 [P, nb, 16] or empty), P = ceil(N / 16) panels (the
    last one padded with zero rows). ValueError for a type the kernel does not take."""
    if qtype not in TYPES:
        raise ValueError(f"ggml type {qtype} is not one of {', '.join(TYPES.values())}")
    n, nb = int(rows.shape[0]), in_features // 32
    size = {2: 18, 3: 20, 8: 34}[qtype]
    blocks = rows.reshape(n, nb, size)
    d = _fp16(blocks, 0)
    m = _fp16(blocks, 2) if qtype == 3 else None
    if qtype == 8:
        vals = (blocks[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)  # [n, nb, 32]
    else:
        nib = blocks[..., size - 16:]
        vals = torch.cat([nib & 0x0F, nib >> 4], dim=-1)  # input j < 16: low nibble j, j >= 16: high nibble j - 16
    panels = -(-n // PANEL)
    pad = panels * PANEL - n
    if pad:
        vals = torch.cat([vals, vals.new_zeros(pad, nb, 32)])
        d = torch.cat([d, d.new_zeros(pad, nb)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, nb)])
    # [P, 16 rows, nb, 8 groups, 4] -> [P, nb, 8, 16, 4]: a group of 4 inputs of 16 rows in 64 bytes
    grouped = vals.reshape(panels, PANEL, nb, 8, 4).permute(0, 2, 3, 1, 4).contiguous()
    if qtype != 8:  # groups j and j + 4 share bytes: j in the low nibble, j + 4 in the high one
        grouped = grouped[:, :, :4] | (grouped[:, :, 4:] << 4)
    scale = d.reshape(panels, PANEL, nb).permute(0, 2, 1).contiguous()
    low = torch.empty(0) if m is None else m.reshape(panels, PANEL, nb).permute(0, 2, 1).contiguous()
    return grouped.reshape(-1), scale, low


if __name__ == "__main__":  # `python -m kvmesh.model.gguf_a8`: build (or find) the kernel now
    logging.basicConfig(level=logging.INFO)
    print(f"8-bit activation GGUF kernel: {'ready' if ops() is not None else 'unavailable (needs AVX-512 VNNI)'}")
