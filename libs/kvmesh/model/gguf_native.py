"""Native CPU kernels over a GGUF file's own quantized blocks: matmul and exact dequantization
for Q4_0, Q4_1, Q8_0, Q4_K and Q6_K (plus F32/F16 rows), the bytes exactly as the file holds them.

NOTE (what is computed). A GGUF weight row is a run of blocks: Q4_0/Q4_1/Q8_0 blocks of 32
weights (an fp16 scale d, Q4_1 also an fp16 offset m; 4-bit or 8-bit codes), K-quant
super-blocks of 256 (Q4_K: eight sub-blocks of 32 with 6-bit scales and mins under fp16 d and
dmin; Q6_K: sixteen sub-blocks of 16 with int8 scales under an fp16 d). ``gguf_dequant`` writes
the fp32 weights gguf-py's (and ggml's) dequantizers write, bit for bit (tested). Every product
in those formulas is exact in fp32 (a code of at most 8 bits times an fp16 scale, or an fp16
scale times a sub-scale of at most 8 bits), so each weight has a single rounding, which one FMA
reproduces; the extension is compiled with -ffp-contract=off so the compiler fuses nothing else.
``gguf_mm(x [M, K] fp32, parts)`` multiplies x by exactly those weights, dequantized block by
block in registers and never stored: x @ W.T of the dequantized file, in another summation
order (4 FMA chains per row, fixed by the position in the row, so a row's result is the same
bits whatever M -- a draft-verify step computes each row as a plain decode step would).
Activations stay fp32: nothing is quantized at run time (llama.cpp rounds them to 8 bits).

NOTE (speed). A decode step (1-8 rows) streams ~70 MB of Q4_1 decoder weights plus ~30 MB of
the Q8_0 output projection for SmolLM2-135M, a quarter of the fp32 bytes. With fp32 activations
it is compute-bound on this CPU rather than bound by memory (one core: ~7 ms for the 66 MB of
Q4_1 whether the blocks come from DRAM or L2; a read-only pass over 100 MB takes ~3.3 ms): per
block of 32, a 16-entry table of the block's weights (one FMA: d*q + m for q = 0..15) indexed
by the nibbles (vpermps), then one FMA per 16 weights per row. Rows of x are taken 4 at a time
so each weight row is read from DRAM once per call whatever M. Rows are split over the calling
thread's OpenMP team (as kvmesh.model.native). Without AVX-512 each row is dequantized into a
buffer and dotted in plain C++: same numbers up to rounding, slower. Many rows (prefill) are
compute-bound on the matmul itself: ``gguf_mm_tiled`` dequantizes a cache-sized tile of weight
rows at a time and multiplies each tile with torch's dense matmul, never holding the fp32
weights whole (measured at 2 threads: faster than fp32 weights at 32 rows, ~10-15% slower at
512, where the dequantization is extra work). Build, cache and KVMESH_NATIVE semantics are
kvmesh.model.native's (one function applies them to both extensions).
"""
from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from kvmesh.model.bundled import default_cache_dir
from kvmesh.model.native import _cpu_flags, build_per_mode

log = logging.getLogger(__name__)

KERNEL_TYPES = frozenset({0, 1, 2, 3, 8, 12, 14})
"""ggml type ids (gguf.GGMLQuantizationType) the kernels take: F32, F16, Q4_0, Q4_1, Q8_0, Q4_K,
Q6_K (F32/F16 on the plain path)."""

_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14 };

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0x1f) bits = sign | 0x7f800000u | (mant << 13);
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (mant << 13);
  else if (mant == 0) bits = sign;
  else {  // subnormal half: normalise
    exp = 113;
    while (!(mant & 0x400)) { mant <<= 1; --exp; }
    bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
  }
  float f; std::memcpy(&f, &bits, 4); return f;
#endif
}
static inline float fp16_at(const uint8_t* p) { uint16_t h; std::memcpy(&h, p, 2); return half_to_float(h); }

static int64_t block_elems(int64_t t) { return t == T_F32 || t == T_F16 ? 1 : (t == T_Q4_K || t == T_Q6_K ? 256 : 32); }
static int64_t block_bytes(int64_t t) {
  switch (t) { case T_F32: return 4; case T_F16: return 2; case T_Q4_0: return 18; case T_Q4_1: return 20;
               case T_Q8_0: return 34; case T_Q4_K: return 144; case T_Q6_K: return 210; }
  return 0;
}

// Q4_K's packed 6-bit scales and mins of sub-block j (ggml's get_scale_min_k4).
static inline void q4k_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* mn) {
  if (j < 4) { *sc = q[j] & 63; *mn = q[j + 4] & 63; }
  else { *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4); *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }
}

// One weight row of K elements -> fp32, the operations of gguf-py's dequantize_blocks (two
// roundings where it has two; compiled with -ffp-contract=off so none is fused).
static void dequant_row(const uint8_t* r, int64_t t, int64_t K, float* out) {
  switch (t) {
    case T_F32: std::memcpy(out, r, K * 4); break;
    case T_F16: for (int64_t k = 0; k < K; ++k) out[k] = fp16_at(r + 2 * k); break;
    case T_Q4_0:
      for (int64_t b = 0; b < K / 32; ++b, r += 18, out += 32) {
        const float d = fp16_at(r);
        for (int i = 0; i < 16; ++i) {
          out[i] = d * (float)((int)(r[2 + i] & 15) - 8);
          out[i + 16] = d * (float)((int)(r[2 + i] >> 4) - 8);
        }
      }
      break;
    case T_Q4_1:
      for (int64_t b = 0; b < K / 32; ++b, r += 20, out += 32) {
        const float d = fp16_at(r), m = fp16_at(r + 2);
        for (int i = 0; i < 16; ++i) {
          const float lo = d * (float)(r[4 + i] & 15), hi = d * (float)(r[4 + i] >> 4);
          out[i] = lo + m;
          out[i + 16] = hi + m;
        }
      }
      break;
    case T_Q8_0:
      for (int64_t b = 0; b < K / 32; ++b, r += 34, out += 32) {
        const float d = fp16_at(r);
        for (int i = 0; i < 32; ++i) out[i] = (float)(int8_t)r[2 + i] * d;
      }
      break;
    case T_Q4_K:
      for (int64_t b = 0; b < K / 256; ++b, r += 144, out += 256) {
        const float d = fp16_at(r), dmin = fp16_at(r + 2);
        const uint8_t* sc = r + 4;
        const uint8_t* qs = r + 16;
        for (int c = 0; c < 4; ++c) {
          uint8_t s0, m0, s1, m1;
          q4k_scale_min(2 * c, sc, &s0, &m0);
          q4k_scale_min(2 * c + 1, sc, &s1, &m1);
          const float d0 = d * (float)s0, o0 = dmin * (float)m0, d1 = d * (float)s1, o1 = dmin * (float)m1;
          for (int l = 0; l < 32; ++l) {
            const float a = d0 * (float)(qs[32 * c + l] & 15), b2 = d1 * (float)(qs[32 * c + l] >> 4);
            out[64 * c + l] = a - o0;
            out[64 * c + 32 + l] = b2 - o1;
          }
        }
      }
      break;
    case T_Q6_K:
      for (int64_t b = 0; b < K / 256; ++b, r += 210, out += 256) {
        const float d = fp16_at(r + 208);
        const int8_t* sc = (const int8_t*)(r + 192);
        for (int n = 0; n < 2; ++n) {
          const uint8_t* ql = r + 64 * n;
          const uint8_t* qh = r + 128 + 32 * n;
          float* y = out + 128 * n;
          for (int l = 0; l < 32; ++l) {
            const int is = 8 * n + l / 16;
            const int q1 = (int)((ql[l] & 15) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = (int)((ql[l + 32] & 15) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = (d * (float)sc[is]) * (float)q1;
            y[l + 32] = (d * (float)sc[is + 2]) * (float)q2;
            y[l + 64] = (d * (float)sc[is + 4]) * (float)q3;
            y[l + 96] = (d * (float)sc[is + 6]) * (float)q4;
          }
        }
      }
      break;
  }
}

#if defined(__AVX512F__)
// M (<= RB) rows of x (row stride K) against one weight row of blocks: y[m * ldy] = dot.
// Each block is dequantized in registers to exactly the fp32 values dequant_row writes (every
// product there is exact in fp32 -- a 4-8 bit code times an fp16 scale, or an fp16 scale times
// a 6-8 bit sub-scale -- so one FMA gives dequant_row's single rounding), then multiplied into
// NA accumulators per row, chosen by the position of the 16 weights in the row alone: a row's
// result is the same bits whatever M (a verify step computes each row as a plain decode).
constexpr int NA = 4;  // independent FMA chains per row: hides the FMA latency at one row
constexpr int RB = 4;  // rows of x per pass over a weight row (RB x NA accumulators in registers)
static inline __m512i bytes16(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)); }
static inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
static inline __m512 bcast_half(const uint8_t* p) {
  uint16_t h; std::memcpy(&h, p, 2); return _mm512_cvtph_ps(_mm256_set1_epi16((short)h));
}

// Slot S (a compile-time constant) of the NA accumulator chains.
template <int S> using Slot = std::integral_constant<int, S>;

// Walks one weight row, calling emit(Slot<s>{}, k0, w) with w the 16 dequantized fp32 weights
// at columns k0..k0+15 (exactly dequant_row's values, see above); the slot depends only on the
// position in the row.
template <class Emit>
static inline void decode_row(const uint8_t* r, int64_t t, int64_t K, Emit&& emit) {
  switch (t) {
    case T_Q4_0: {
      const __m512 codes = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.f));  // q - 8 for q = 0..15
      auto block = [&](const uint8_t* p, int64_t k0, auto s0, auto s1) {
        const __m512 tbl = _mm512_mul_ps(bcast_half(p), codes);  // the block's 16 possible weights
        const __m512i v = bytes16(p + 2);
        emit(s0, k0, _mm512_permutexvar_ps(v, tbl));  // vpermps reads the low 4 bits: low nibbles
        emit(s1, k0 + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl));
      };
      int64_t b = 0;  // blocks in pairs, so that every slot is a constant
      for (; b + 2 <= K / 32; b += 2) { block(r + b * 18, b * 32, Slot<0>{}, Slot<1>{}); block(r + b * 18 + 18, b * 32 + 32, Slot<2>{}, Slot<3>{}); }
      if (b < K / 32) block(r + b * 18, b * 32, Slot<0>{}, Slot<1>{});
      break;
    }
    case T_Q4_1: {
      const __m512 codes = iota16();
      auto block = [&](const uint8_t* p, int64_t k0, auto s0, auto s1) {
        int32_t dm; std::memcpy(&dm, p, 4);  // d and m converted in one go: [d, m, 0, 0]
        const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
        const __m512 tbl = _mm512_fmadd_ps(codes, _mm512_broadcastss_ps(f), _mm512_broadcastss_ps(_mm_movehdup_ps(f)));
        const __m512i v = bytes16(p + 4);
        emit(s0, k0, _mm512_permutexvar_ps(v, tbl));
        emit(s1, k0 + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), tbl));
      };
      int64_t b = 0;
      for (; b + 2 <= K / 32; b += 2) { block(r + b * 20, b * 32, Slot<0>{}, Slot<1>{}); block(r + b * 20 + 20, b * 32 + 32, Slot<2>{}, Slot<3>{}); }
      if (b < K / 32) block(r + b * 20, b * 32, Slot<0>{}, Slot<1>{});
      break;
    }
    case T_Q8_0: {
      auto block = [&](const uint8_t* p, int64_t k0, auto s0, auto s1) {
        const __m512 d = bcast_half(p);
        emit(s0, k0, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)))), d));
        emit(s1, k0 + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 18)))), d));
      };
      int64_t b = 0;
      for (; b + 2 <= K / 32; b += 2) { block(r + b * 34, b * 32, Slot<0>{}, Slot<1>{}); block(r + b * 34 + 34, b * 32 + 32, Slot<2>{}, Slot<3>{}); }
      if (b < K / 32) block(r + b * 34, b * 32, Slot<0>{}, Slot<1>{});
      break;
    }
    case T_Q4_K: {
      const __m512 codes = iota16();
      for (int64_t b = 0; b < K / 256; ++b, r += 144) {
        const float d = fp16_at(r), dmin = fp16_at(r + 2);
        const uint8_t* sc = r + 4;
        const uint8_t* qs = r + 16;
        for (int c = 0; c < 4; ++c) {
          uint8_t s0, m0, s1, m1;
          q4k_scale_min(2 * c, sc, &s0, &m0);
          q4k_scale_min(2 * c + 1, sc, &s1, &m1);
          // d*sc*q - dmin*m: the sub-block's 16 possible weights
          const __m512 t0 = _mm512_fmadd_ps(codes, _mm512_set1_ps(d * (float)s0), _mm512_set1_ps(-(dmin * (float)m0)));
          const __m512 t1 = _mm512_fmadd_ps(codes, _mm512_set1_ps(d * (float)s1), _mm512_set1_ps(-(dmin * (float)m1)));
          const __m512i v0 = bytes16(qs + 32 * c), v1 = bytes16(qs + 32 * c + 16);
          const int64_t k0 = b * 256 + 64 * c;
          emit(Slot<0>{}, k0, _mm512_permutexvar_ps(v0, t0));
          emit(Slot<1>{}, k0 + 16, _mm512_permutexvar_ps(v1, t0));
          emit(Slot<2>{}, k0 + 32, _mm512_permutexvar_ps(_mm512_srli_epi32(v0, 4), t1));
          emit(Slot<3>{}, k0 + 48, _mm512_permutexvar_ps(_mm512_srli_epi32(v1, 4), t1));
        }
      }
      break;
    }
    case T_Q6_K: {
      const __m512i three = _mm512_set1_epi32(3), f15 = _mm512_set1_epi32(15), c32 = _mm512_set1_epi32(32);
      for (int64_t b = 0; b < K / 256; ++b, r += 210) {
        const float d = fp16_at(r + 208);
        const int8_t* sc = (const int8_t*)(r + 192);
        for (int n = 0; n < 2; ++n)
          for (int h = 0; h < 2; ++h) {  // l = 16 h .. 16 h + 15 of this half's 32
            const __m512i a = bytes16(r + 64 * n + 16 * h), c = bytes16(r + 64 * n + 32 + 16 * h);
            const __m512i hb = bytes16(r + 128 + 32 * n + 16 * h);
            // sub-block 8 n + h + 2 j holds the 16 weights from k0 + 32 j; each is (q - 32) * (d * sc)
            const int64_t k0 = b * 256 + 128 * n + 16 * h;
            auto w = [&](__m512i q, int j) {
              return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, c32)), _mm512_set1_ps(d * (float)sc[8 * n + h + 2 * j]));
            };
            emit(Slot<0>{}, k0, w(_mm512_or_si512(_mm512_and_si512(a, f15), _mm512_slli_epi32(_mm512_and_si512(hb, three), 4)), 0));
            emit(Slot<1>{}, k0 + 32, w(_mm512_or_si512(_mm512_and_si512(c, f15),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 2), three), 4)), 1));
            emit(Slot<2>{}, k0 + 64, w(_mm512_or_si512(_mm512_srli_epi32(a, 4),
                                        _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hb, 4), three), 4)), 2));
            emit(Slot<3>{}, k0 + 96, w(_mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_slli_epi32(_mm512_srli_epi32(hb, 6), 4)), 3));
          }
      }
      break;
    }
  }
}

// M (<= RB) rows of x (row stride K) against one weight row: out[m] = dot.
template <int M>
static void row_dot(const uint8_t* r, int64_t t, int64_t K, const float* x, float* out) {
  __m512 acc[M][NA];
  for (int m = 0; m < M; ++m)
    for (int a = 0; a < NA; ++a) acc[m][a] = _mm512_setzero_ps();
  decode_row(r, t, K, [&](auto slot, int64_t k0, __m512 w) {
    constexpr int S = decltype(slot)::value;
    for (int m = 0; m < M; ++m) acc[m][S] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k0), w, acc[m][S]);
  });
  for (int m = 0; m < M; ++m) {
    const __m512 s = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
    out[m] = _mm512_reduce_add_ps(s);
  }
}
#endif

static bool fast_type(int64_t t) {
#if defined(__AVX512F__)
  return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q6_K;
#else
  return false;
#endif
}

// The plain path (other types, no AVX-512): the row dequantized exactly, then dotted.
static void row_dot_plain(const uint8_t* r, int64_t t, int64_t K, const float* x, int64_t M, float* out) {
  thread_local std::vector<float> buf;
  buf.resize(K);
  dequant_row(r, t, K, buf.data());
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float part[16] = {};
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      for (int j = 0; j < 16; ++j) part[j] += buf[k + j] * xr[k + j];
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += part[j];
    for (; k < K; ++k) s += buf[k] * xr[k];
    out[m] = s;
  }
}

// One linear's weights as the kernels walk them: parts stacked along the output rows.
struct Lin {
  int64_t K = 0, N = 0;
  std::vector<const uint8_t*> base;
  std::vector<int64_t> stride, type, first;  // first: output row of each part's row 0, then N
  const float* bias = nullptr;               // [N] or none
};

constexpr int64_t MAX_ROWS = 64;  // rows of x one mm_rows call takes

// y[m * ldy + n] = x[m] . W[n] (+ bias[n]) for m < M, n < N, or with ADD y[...] += that (a
// residual: (dot + bias) + y, the unfused path's order). An orphaned `omp for` over the output
// rows: the calling team splits them (a lone thread outside a parallel region), and each output
// is computed alone -- a row's result does not depend on M.
template <bool ADD>
static void mm_rows(const float* x, int64_t M, const Lin& L, float* y, int64_t ldy) {
  const int64_t K = L.K;
  #pragma omp for schedule(static)
  for (int64_t n = 0; n < L.N; ++n) {
    size_t p = 0;
    while (L.first[p + 1] <= n) ++p;
    const uint8_t* row = L.base[p] + (n - L.first[p]) * L.stride[p];
    const int64_t t = L.type[p];
    float dots[MAX_ROWS];
    if (!fast_type(t)) {
      row_dot_plain(row, t, K, x, M, dots);
    } else {
#if defined(__AVX512F__)
      for (int64_t m0 = 0; m0 < M; m0 += RB) {  // RB rows of x at a time; the weight row stays in L1
        const float* xm = x + m0 * K;
        switch (std::min<int64_t>(RB, M - m0)) {
          case 1: row_dot<1>(row, t, K, xm, dots + m0); break;
          case 2: row_dot<2>(row, t, K, xm, dots + m0); break;
          case 3: row_dot<3>(row, t, K, xm, dots + m0); break;
          default: row_dot<4>(row, t, K, xm, dots + m0); break;
        }
      }
#endif
    }
    for (int64_t m = 0; m < M; ++m) {
      const float v = L.bias ? dots[m] + L.bias[n] : dots[m];
      float& out = y[m * ldy + n];
      out = ADD ? v + out : v;
    }
  }
}

static void check_part(const torch::Tensor& w, int64_t t, int64_t K) {
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "gguf: blocks must be uint8 [N, row_bytes] contiguous");
  TORCH_CHECK(block_bytes(t) > 0, "gguf: unsupported ggml type ", t);
  TORCH_CHECK(K % block_elems(t) == 0 && w.size(1) == K / block_elems(t) * block_bytes(t),
              "gguf: rows of ", w.size(1), " bytes do not hold K = ", K, " weights of ggml type ", t);
}

static Lin make_lin(const std::vector<torch::Tensor>& parts, const std::vector<int64_t>& types, size_t p0,
                    size_t np, int64_t K) {
  Lin L;
  L.K = K;
  L.first.push_back(0);
  for (size_t i = p0; i < p0 + np; ++i) {
    check_part(parts[i], types[i], K);
    L.base.push_back(parts[i].data_ptr<uint8_t>());
    L.stride.push_back(parts[i].size(1));
    L.type.push_back(types[i]);
    L.first.push_back(L.first.back() + parts[i].size(0));
  }
  L.N = L.first.back();
  return L;
}

// x [M, K] fp32 contiguous; parts[i] uint8 [N_i, row_bytes_i] of ggml type types[i], all with K
// weights per row. Returns y [M, sum N_i] = x @ concat(parts dequantized).T (see the NOTE).
torch::Tensor gguf_mm(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "gguf_mm: x must be [M, K] fp32 contiguous");
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "gguf_mm: one type per part");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(M <= MAX_ROWS, "gguf_mm: at most ", MAX_ROWS, " rows (use gguf_mm_tiled)");
  const Lin L = make_lin(parts, types, 0, parts.size(), K);
  auto y = torch::empty({M, L.N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // The calling thread's OpenMP team (see kvmesh.model.native's paged_decode for why not
  // at::parallel_for); output rows n are independent, each computed alone.
  #pragma omp parallel
  mm_rows<false>(xp, M, L, yp, L.N);
  return y;
}

// Rows [n0, n0 + rows) of blocks -> out [rows, K] fp32, bit for bit gguf-py's dequantize.
static void dequant_rows(const uint8_t* bp, int64_t rb, int64_t t, int64_t K, int64_t n0, int64_t rows, float* out) {
  #pragma omp parallel for schedule(static) if (rows * K >= 65536)
  for (int64_t n = n0; n < n0 + rows; ++n) {
    float* o = out + (n - n0) * K;
#if defined(__AVX512F__)
    if (fast_type(t)) {
      decode_row(bp + n * rb, t, K, [&](auto, int64_t k0, __m512 w) { _mm512_storeu_ps(o + k0, w); });
      continue;
    }
#endif
    dequant_row(bp + n * rb, t, K, o);
  }
}

torch::Tensor gguf_dequant(torch::Tensor blocks, int64_t t, int64_t K) {
  check_part(blocks, t, K);
  const int64_t N = blocks.size(0);
  auto out = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kFloat32));
  dequant_rows(blocks.data_ptr<uint8_t>(), blocks.size(1), t, K, 0, N, out.data_ptr<float>());
  return out;
}

// x [M, K] fp32 @ (parts dequantized).T for many rows (prefill): the weights are dequantized
// tile_floats at a time (rows of a part) into a buffer that stays in cache, and each tile is one
// dense matmul (torch's, i.e. MKL) -- the fp32 weights never go to memory whole. Returns y [M, sum N_i].
torch::Tensor gguf_mm_tiled(torch::Tensor x, std::vector<torch::Tensor> parts, std::vector<int64_t> types,
                            int64_t tile_floats) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "gguf_mm_tiled: x must be [M, K] fp32 contiguous");
  TORCH_CHECK(parts.size() == types.size() && !parts.empty(), "gguf_mm_tiled: one type per part");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t N = 0;
  for (size_t i = 0; i < parts.size(); ++i) { check_part(parts[i], types[i], K); N += parts[i].size(0); }
  const int64_t tile = std::max<int64_t>(16, (tile_floats / K) / 16 * 16);
  auto buf = torch::empty({tile, K}, x.options());
  auto yt = torch::empty({N, M}, x.options());  // y transposed: each tile's output rows are contiguous
  const auto xt = x.t();
  int64_t off = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t Ni = parts[i].size(0);
    for (int64_t n0 = 0; n0 < Ni; n0 += tile) {
      const int64_t nt = std::min(tile, Ni - n0);
      dequant_rows(parts[i].data_ptr<uint8_t>(), parts[i].size(1), types[i], K, n0, nt, buf.data_ptr<float>());
      auto out = yt.narrow(0, off + n0, nt);
      at::mm_out(out, buf.narrow(0, 0, nt), xt);
    }
    off += Ni;
  }
  return yt.t().contiguous();
}

// ---- One decode step of the whole decoder stack in one call (see kvmesh.model.quant.GGUFDecode) ----

#if defined(__AVX512F__)
// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial (Cephes expf's
// coefficients), times 2^n by vscalefps (which also gives 0 and inf past the float range).
// Within 2 ulp of the correctly rounded value over the float range.
static inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.f)), _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

// The lanes of a 16-float step at i of n that lie inside n.
static inline __mmask16 lanes(int64_t i, int64_t n) {
  return n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
}

// out[m] = x[m] * (1 / sqrt(mean(x[m]^2) + eps)) * w for each of the M rows of D floats, all of
// them by the calling thread: a step's few rows cost less than a barrier would (every thread
// computes them into its own buffer, then reads only that).
static void rms_rows(const float* x, const float* w, int64_t M, int64_t D, float eps, float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * D;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) { const __m512 v = _mm512_maskz_loadu_ps(lanes(i, D), xm + i); ss = _mm512_fmadd_ps(v, v, ss); }
    const float r = 1.f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)D + eps);
    const __m512 rv = _mm512_set1_ps(r);
    for (int64_t i = 0; i < D; i += 16) {
      const __mmask16 k = lanes(i, D);
      _mm512_mask_storeu_ps(out + m * D + i, k, _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, xm + i), rv), _mm512_maskz_loadu_ps(k, w + i)));
    }
  }
}

// act[m, i] = silu(gu[m, i]) * gu[m, I + i] (gate rows, then up rows), all rows by the calling
// thread (as rms_rows).
static void silu_mul_rows(const float* gu, int64_t M, int64_t I, float* act) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 k = lanes(i, I);
      const __m512 g = _mm512_maskz_loadu_ps(k, gu + m * 2 * I + i), u = _mm512_maskz_loadu_ps(k, gu + m * 2 * I + I + i);
      const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
      _mm512_mask_storeu_ps(act + m * I + i, k, _mm512_mul_ps(s, u));
    }
}

struct Step {  // the step's shapes and where its rows' keys go
  int64_t T, H, KVH, hd, BS, W;
  const float *cos, *sin;
  const int64_t *slots, *bt, *ctx;
  float scale;
};

// RoPE on the q and k heads of each row (x cos + rotate_half(x) sin, the unfused path's two
// roundings and one add), then the row's keys and values into its cache slot.
static void rope_store(float* qkv, int64_t ldq, const Step& s, float* kc, float* vc) {
  const int64_t half = s.hd / 2, kvw = s.KVH * s.hd;
  #pragma omp for schedule(static)
  for (int64_t t = 0; t < s.T; ++t) {
    const float* c = s.cos + t * s.hd;
    const float* sn = s.sin + t * s.hd;
    float* row = qkv + t * ldq;
    for (int64_t head = 0; head < s.H + s.KVH; ++head) {
      float* x = row + head * s.hd;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 k = lanes(i, half);
        const __m512 a = _mm512_maskz_loadu_ps(k, x + i), b = _mm512_maskz_loadu_ps(k, x + half + i);
        const __m512 lo = _mm512_sub_ps(_mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, c + i)), _mm512_mul_ps(b, _mm512_maskz_loadu_ps(k, sn + i)));
        const __m512 hi = _mm512_add_ps(_mm512_mul_ps(b, _mm512_maskz_loadu_ps(k, c + half + i)), _mm512_mul_ps(a, _mm512_maskz_loadu_ps(k, sn + half + i)));
        _mm512_mask_storeu_ps(x + i, k, lo);
        _mm512_mask_storeu_ps(x + half + i, k, hi);
      }
    }
    std::memcpy(kc + s.slots[t] * kvw, row + s.H * s.hd, kvw * sizeof(float));
    std::memcpy(vc + s.slots[t] * kvw, row + (s.H + s.KVH) * s.hd, kvw * sizeof(float));
  }
}

// r[i] = the sum of v[i]'s 16 lanes, for 16 vectors at once (a transposing add tree: 30 ops
// where 16 separate reductions take ~130).
static inline __m512 sum16(const __m512 v[16]) {
  __m512 u[8], w[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane L: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i] = a, v[2i+1] = b
    u[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {  // lane L: lane L's sums of v[4j..4j+3]
    const __m512d x = _mm512_castps_pd(u[2 * j]), y = _mm512_castps_pd(u[2 * j + 1]);
    w[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(w[2], w[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(s01, s23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Query head `head` of row t over the row's ctx[t] cached keys (KV head head / G):
// softmax(q k * scale) v. One task per row and query head, so that a single row's heads keep
// every thread busy; the keys are walked block by block (no division per position).
static void attend_rows(const float* qkv, int64_t ldq, const Step& s, const float* kc, const float* vc, float* out) {
  const int64_t G = s.H / s.KVH, kvw = s.KVH * s.hd, nv = s.hd / 16;
  #pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < s.T * s.H; ++task) {
    const int64_t t = task / s.H, head = task % s.H, ctx = s.ctx[t], kvo = (head / G) * s.hd;
    const int64_t* blocks = s.bt + t * s.W;
    thread_local std::vector<float> sc;
    sc.resize(ctx + 16);
    const float* q = qkv + t * ldq + head * s.hd;
    __m512 qv[16];
    for (int64_t j = 0; j < nv; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
    // scores, 16 positions at a time: 16 dot products' lane vectors, then one transposing sum
    __m512 mxv = _mm512_set1_ps(-INFINITY);
    int64_t blk = 0, off = 0;  // the block and offset of position pos + i, walked forward
    for (int64_t pos = 0; pos < ctx; pos += 16) {
      __m512 a[16];
      for (int i = 0; i < 16; ++i) {
        if (pos + i >= ctx) { a[i] = _mm512_setzero_ps(); continue; }
        const float* k = kc + (blocks[blk] * s.BS + off) * kvw + kvo;
        if (++off == s.BS) { off = 0; ++blk; }
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int64_t j = 1; j < nv; ++j) acc = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k + 16 * j), acc);
        a[i] = acc;
      }
      const __mmask16 mk = lanes(pos, ctx);
      const __m512 v = _mm512_mul_ps(sum16(a), _mm512_set1_ps(s.scale));
      _mm512_mask_storeu_ps(sc.data() + pos, mk, v);
      mxv = _mm512_mask_max_ps(mxv, mk, mxv, v);
    }
    const float mx = _mm512_reduce_max_ps(mxv);
    __m512 sum = _mm512_setzero_ps();  // exact softmax
    for (int64_t pos = 0; pos < ctx; pos += 16) {
      const __mmask16 mk = lanes(pos, ctx);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, sc.data() + pos), _mm512_set1_ps(mx)));
      sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, e));
      _mm512_mask_storeu_ps(sc.data() + pos, mk, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
    __m512 acc[16];
    for (int64_t j = 0; j < nv; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < ctx; b0 += s.BS) {
      const float* v = vc + blocks[b0 / s.BS] * s.BS * kvw + kvo;
      const int64_t n = std::min(s.BS, ctx - b0);
      for (int64_t o = 0; o < n; ++o, v += kvw) {
        const __m512 p = _mm512_set1_ps(sc[b0 + o]);
        for (int64_t j = 0; j < nv; ++j) acc[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * j), acc[j]);
      }
    }
    float* o = out + t * s.H * s.hd + head * s.hd;
    for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[j], inv));
  }
}
#endif

// One decode step through every decoder layer and the final norm, for T rows that each bring one
// new token (a decode, or one token of a verified draft row), all in one OpenMP region:
// per layer norm, qkv (+bias), RoPE and the new keys/values into the paged cache, attention over
// each row's context, o (+bias) + residual, norm, gate/up, silu * up, down + residual.
// h [T, D] (the embeddings; overwritten with the residual stream); cos/sin [T, hd]; per layer 4
// linears (qkv, o, gate_up, down) of nparts[i] parts each, biases[i] ([N] or empty), norms
// (2 per layer, then the final one); k/v caches [NB, BS, KVH, hd]; slots [T]; block_tables
// [T, W]; ctx [T] (keys row t attends to, its own included). Returns the final-normed [T, D].
torch::Tensor gguf_decode(torch::Tensor h, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> blocks,
                          std::vector<int64_t> types, std::vector<int64_t> nparts, std::vector<torch::Tensor> biases,
                          std::vector<torch::Tensor> norms, std::vector<torch::Tensor> k_caches,
                          std::vector<torch::Tensor> v_caches, torch::Tensor slots, torch::Tensor block_tables,
                          torch::Tensor ctx, int64_t heads, int64_t kv_heads, double scale, double eps) {
#if !defined(__AVX512F__)
  TORCH_CHECK(false, "gguf_decode: built without AVX-512");
#else
  auto f32 = [](const torch::Tensor& t, const char* what) {
    TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), "gguf_decode: ", what, " must be contiguous fp32 on CPU");
  };
  f32(h, "h"); f32(cos, "cos"); f32(sin, "sin");
  const int64_t L = k_caches.size(), T = h.size(0), D = h.size(1), hd = cos.size(1);
  TORCH_CHECK(L > 0 && (int64_t)v_caches.size() == L && (int64_t)nparts.size() == 4 * L && (int64_t)biases.size() == 4 * L
              && (int64_t)norms.size() == 2 * L + 1, "gguf_decode: per layer 4 linears, 4 biases, 2 norms, a k and a v cache");
  TORCH_CHECK(T >= 1 && T <= MAX_ROWS && cos.size(0) == T && sin.size(0) == T, "gguf_decode: 1..", MAX_ROWS, " rows with cos/sin each");
  TORCH_CHECK(heads % kv_heads == 0 && hd % 16 == 0 && hd <= 256, "gguf_decode: unsupported head shape");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && block_tables.dtype() == torch::kInt64 && ctx.dtype() == torch::kInt64 &&
              slots.is_contiguous() && block_tables.is_contiguous() && ctx.is_contiguous() &&
              slots.numel() == T && ctx.numel() == T && block_tables.dim() == 2 && block_tables.size(0) == T, "gguf_decode: bad step metadata");
  std::vector<Lin> lins;
  size_t p = 0;
  for (int64_t i = 0; i < 4 * L; ++i) {
    const int64_t kind = i % 4;  // qkv, o, gate_up, down
    int64_t K = kind == 1 ? heads * hd : kind == 3 ? -1 : D;
    if (kind == 3) K = lins.back().N / 2;
    TORCH_CHECK(p + nparts[i] <= blocks.size() && nparts[i] >= 1, "gguf_decode: parts out of range");
    lins.push_back(make_lin(blocks, types, p, nparts[i], K));
    p += nparts[i];
    if (biases[i].numel()) {
      f32(biases[i], "a bias");
      TORCH_CHECK(biases[i].numel() == lins.back().N, "gguf_decode: bias size");
      lins.back().bias = biases[i].data_ptr<float>();
    }
  }
  for (int64_t l = 0; l < L; ++l) {
    TORCH_CHECK(lins[4 * l].N == (heads + 2 * kv_heads) * hd && lins[4 * l + 1].N == D && lins[4 * l + 3].N == D &&
                lins[4 * l + 2].N % 2 == 0, "gguf_decode: layer ", l, " shapes");
    for (const auto& c : {k_caches[l], v_caches[l]}) {
      f32(c, "a KV cache");
      TORCH_CHECK(c.dim() == 4 && c.size(2) == kv_heads && c.size(3) == hd, "gguf_decode: KV cache shape");
    }
  }
  for (const auto& n : norms) { f32(n, "a norm weight"); TORCH_CHECK(n.numel() == D, "gguf_decode: norm size"); }
  Step s{T, heads, kv_heads, hd, k_caches[0].size(1), block_tables.size(1), cos.data_ptr<float>(), sin.data_ptr<float>(),
         slots.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), (float)scale};
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s.ctx[t] >= 1 && s.ctx[t] <= s.W * s.BS && s.slots[t] >= 0 && s.slots[t] < k_caches[0].size(0) * s.BS,
                "gguf_decode: row ", t, " context or slot out of range");
  const int64_t Nqkv = lins[0].N, I = lins[2].N / 2;
  std::vector<float> qkv(T * Nqkv), att(T * heads * hd), gu(T * 2 * I);
  auto out = torch::empty({T, D}, h.options());
  float* hp = h.data_ptr<float>();
  const float e = (float)eps;
  #pragma omp parallel
  {
    // per thread: the normed rows and the SiLU products, which every thread computes whole and
    // reads whole (the matmuls that follow need all of them): two barriers a layer fewer
    std::vector<float> xn(T * D), act(T * I);
    for (int64_t l = 0; l < L; ++l) {
      float* kc = k_caches[l].data_ptr<float>();
      float* vc = v_caches[l].data_ptr<float>();
      rms_rows(hp, norms[2 * l].data_ptr<float>(), T, D, e, xn.data());
      mm_rows<false>(xn.data(), T, lins[4 * l], qkv.data(), Nqkv);
      rope_store(qkv.data(), Nqkv, s, kc, vc);
      attend_rows(qkv.data(), Nqkv, s, kc, vc, att.data());
      mm_rows<true>(att.data(), T, lins[4 * l + 1], hp, D);
      rms_rows(hp, norms[2 * l + 1].data_ptr<float>(), T, D, e, xn.data());
      mm_rows<false>(xn.data(), T, lins[4 * l + 2], gu.data(), 2 * I);
      silu_mul_rows(gu.data(), T, I, act.data());
      mm_rows<true>(act.data(), T, lins[4 * l + 3], hp, D);
    }
    #pragma omp single
    rms_rows(hp, norms[2 * L].data_ptr<float>(), T, D, e, out.data_ptr<float>());
  }
  return out;
#endif
}
"""

_lock = threading.Lock()
_module = None
_tried = False


def _build_dir() -> Path:
    described = _SOURCE + torch.__version__ + _cpu_flags()
    return default_cache_dir() / "native" / ("gguf-" + hashlib.sha256(described.encode()).hexdigest()[:16])


def _build():
    """Compile (or load the cached build of) the extension; raises with the compiler's output."""
    from torch.utils.cpp_extension import load_inline

    folder = _build_dir()
    folder.mkdir(parents=True, exist_ok=True)
    # -ffp-contract=off: no fused multiply-adds the source does not write (dequantize is bit-exact)
    return load_inline(name="kvmesh_gguf", cpp_sources=[_SOURCE], functions=["gguf_mm", "gguf_dequant", "gguf_mm_tiled", "gguf_decode"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
                       extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


def _native():
    """The compiled module or None, under KVMESH_NATIVE's semantics (kvmesh.model.native)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _module = build_per_mode(_build, log, "GGUF kernels")
        _tried = True
        return _module


def gguf_ops():
    """The module with ``gguf_mm(x, parts, types)`` and ``gguf_dequant(blocks, type, K)``, or None."""
    return _native()


if __name__ == "__main__":  # `python -m kvmesh.model.gguf_native`: build (or find) the kernels now
    logging.basicConfig(level=logging.INFO)
    print(f"GGUF kernels: {'ready in ' + str(_build_dir()) if _native() is not None else 'unavailable'}")
