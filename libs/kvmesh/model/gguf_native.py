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

NOTE (the repacked layout): kvmesh.model.gguf_repack.

NOTE (speed). A decode step (1-8 rows) streams ~80 MB of repacked decoder weights plus ~30 MB of
the Q8_0 output projection for SmolLM2-135M, about a quarter of the fp32 bytes: per block of 32,
a 16-entry table of the block's weights (one FMA: d*q + m for q = 0..15) indexed by the nibbles
(vpermps), then one FMA per 16 weights per row. On a 2-core Xeon the step is neither at the
compute bound (~3.5 ms with the weights in L2) nor at the read bound (~2.3 ms for 110 MB from
L3) but was at their sum and more (~9 ms): each row's blocks arrived one L3 latency at a time.
Rows are therefore prefetched 4 KB ahead (``prefetch_ahead``): ~9 -> ~6 ms a step.
Rows of x are taken 4 at a time
so each weight row is read from DRAM once per call whatever M; a lone row of x (a decode step)
meets the weight rows two at a time (kvmesh.model.gguf_rows1), with the same bits. Rows are split over the calling
thread's OpenMP team (as kvmesh.model.native; in the decode step and gguf_mm as ranges whose last
chunks a thread done early takes, kvmesh.model.gguf_team). Past 4 rows the weights are decoded once into a
buffer instead (kvmesh.model.gguf_blocked), with the same bits. Without AVX-512 each row is dequantized into a
buffer and dotted in plain C++: same numbers up to rounding, slower. Many rows (prefill) are
compute-bound on the matmul itself: ``gguf_mm_tiled`` dequantizes a cache-sized tile of weight
rows at a time and multiplies each tile with torch's dense matmul, never holding the fp32
weights whole (measured at 2 threads: ~15% slower than fp32 weights at 512 rows, where the
dequantization is extra work; MKL's outer-product kernel beats the 4-chain dot order there);
where the CPU has AMX, repacked parts go to the tile unit instead, exactly (kvmesh.model.gguf_amx).
Build, cache and KVMESH_NATIVE semantics are
kvmesh.model.native's (one function applies them to both extensions).
The fused decode step (``gguf_decode``) is compiled into the same extension; its source and
NOTE are kvmesh.model.gguf_decode's.
"""
from __future__ import annotations

import logging
from pathlib import Path

from kvmesh.model.gguf_amx import AMX_SOURCE
from kvmesh.model.gguf_blocked import BLOCKED_SOURCE
from kvmesh.model.gguf_decode import DECODE_SOURCE
from kvmesh.model.gguf_repack import REPACK_SOURCE, REPACKED_Q4  # noqa: F401 (REPACKED_Q4 re-exported)
from kvmesh.model.gguf_rows1 import ROWS1_SOURCE
from kvmesh.model.gguf_team import TEAM_SOURCE
from kvmesh.model.native import NativeModule, extension_dir, load_extension

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

enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14,
       T_Q4X = 1000 };  // T_Q4X: kvmesh's repacked 4-bit rows (gguf_repack), not a ggml type

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

// A T_Q4X row of K weights (nblk = K / 32 sub-blocks of 32, each weight fma(code, scale, offset)
// of its sub-block): first the 4-bit codes, 64 bytes per quad of sub-blocks, where nibble j of
// dword i (byte 4 i + j / 2, low nibble for even j) is the code of weight 16 j + i of the quad; a
// last quad of n < 4 sub-blocks keeps only bytes s < n of each dword (16 bytes for n = 1, 32 for
// n = 2, all 64 for n = 3). Then nblk fp32 scales, then nblk fp32 offsets.
static int64_t q4x_code_bytes(int64_t nblk) {
  const int64_t n = nblk % 4;
  return nblk / 4 * 64 + (n == 0 ? 0 : n == 1 ? 16 : n == 2 ? 32 : 64);
}
static int64_t block_bytes(int64_t t) {
  switch (t) { case T_F32: return 4; case T_F16: return 2; case T_Q4_0: return 18; case T_Q4_1: return 20;
               case T_Q8_0: return 34; case T_Q4_K: return 144; case T_Q6_K: return 210; }
  return 0;
}
static int64_t row_bytes(int64_t t, int64_t K) {
  if (t == T_Q4X) return q4x_code_bytes(K / 32) + K / 32 * 8;
  return K / block_elems(t) * block_bytes(t);
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
// Always inlined: as a call of its own it keeps the caller's accumulators in memory, storing
// each after every FMA (measured: 9.1 -> 7.5 cycles per Q4_1 block at one row, and the 4-row
// pass 12.8 -> 8.5 ms over SmolLM2-135M's decoder, when inlined).
template <class Emit>
__attribute__((always_inline)) static inline void decode_row(const uint8_t* r, int64_t t, int64_t K, Emit&& emit) {
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
    case T_Q4X: {
      // A quad's codes in one 512-bit v: sub-block b's low 16 codes are the low nibbles of byte b
      // of each dword, its high 16 the high nibbles; vpermps reads only the low 4 bits of each
      // index, so a byte shift within the 128-bit lanes (vpsrldq, port 5) brings byte b down, and
      // one dword shift (port 0) the high nibbles: no masking, and the FMA port keeps the FMAs.
      const __m512 codes = iota16();
      const int64_t nblk = K / 32, G = nblk / 4, rest = nblk % 4;
      const float* scl = (const float*)(r + q4x_code_bytes(nblk));
      const float* off = scl + nblk;
      auto quad = [&](__m512i v, int64_t j0, int n) __attribute__((always_inline)) {
        const __m512i h = _mm512_srli_epi32(v, 4);
        auto sub = [&](auto s0, auto s1, __m512i lo, __m512i hi, int b) __attribute__((always_inline)) {
          // the sub-block's 16 possible weights: fma(q, scale, offset), dequant_row's bits
          const __m512 tbl = _mm512_fmadd_ps(codes, _mm512_set1_ps(scl[j0 + b]), _mm512_set1_ps(off[j0 + b]));
          emit(s0, 32 * (j0 + b), _mm512_permutexvar_ps(lo, tbl));
          emit(s1, 32 * (j0 + b) + 16, _mm512_permutexvar_ps(hi, tbl));
        };
        sub(Slot<0>{}, Slot<1>{}, v, h, 0);
        if (n > 1) sub(Slot<2>{}, Slot<3>{}, _mm512_bsrli_epi128(v, 1), _mm512_bsrli_epi128(h, 1), 1);
        if (n > 2) sub(Slot<0>{}, Slot<1>{}, _mm512_bsrli_epi128(v, 2), _mm512_bsrli_epi128(h, 2), 2);
        if (n > 3) sub(Slot<2>{}, Slot<3>{}, _mm512_bsrli_epi128(v, 3), _mm512_bsrli_epi128(h, 3), 3);
      };
      for (int64_t g = 0; g < G; ++g) quad(_mm512_loadu_si512(r + 64 * g), 4 * g, 4);
      const uint8_t* tail = r + 64 * G;
      if (rest == 1) quad(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)tail)), 4 * G, 1);
      else if (rest == 2) quad(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)tail)), 4 * G, 2);
      else if (rest == 3) quad(_mm512_loadu_si512(tail), 4 * G, 3);
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
  return t == T_Q4_0 || t == T_Q4_1 || t == T_Q8_0 || t == T_Q4_K || t == T_Q6_K || t == T_Q4X;
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

// Software prefetch of the weight row PREFETCH_BYTES ahead of row i (of a part's `rows` rows of
// `stride` bytes) into L1. Measured over SmolLM2-135M's decode step at 2 threads on a Xeon
// (weights from L3, ~110 MB a token): the decoder's matmuls 7.5 -> ~5 ms and the output
// projection 2.1 -> ~1.2 ms. Without it a row's blocks arrive one L3 latency at a time: the
// kernel is compute-heavy, so few loads are in flight, and the hardware prefetcher does not
// run far enough ahead (a plain read of the same bytes runs at ~45 GB/s, the kernel ran at ~12).
constexpr int64_t PREFETCH_BYTES = 4096;
static inline void prefetch_ahead(const uint8_t* row, int64_t i, int64_t rows, int64_t stride) {
  const int64_t ahead = (PREFETCH_BYTES + stride - 1) / stride;
  if (i + ahead >= rows) return;
  const char* q = (const char*)(row + ahead * stride);
  for (int64_t o = 0; o < stride; o += 64) __builtin_prefetch(q + o, 0, 3);
}

// One linear's weights as the kernels walk them: parts stacked along the output rows.
struct Lin {
  int64_t K = 0, N = 0;
  std::vector<const uint8_t*> base;
  std::vector<int64_t> stride, type, first;  // first: output row of each part's row 0, then N
  const float* bias = nullptr;               // [N] or none
};

constexpr int64_t MAX_ROWS = 64;  // rows of x one mm_rows call takes

"""

_SOURCE += TEAM_SOURCE  # the matmuls' work split inside a team, kvmesh.model.gguf_team
_SOURCE += BLOCKED_SOURCE  # the batched path, kvmesh.model.gguf_blocked (uses decode_row, Lin)
_SOURCE += ROWS1_SOURCE  # one row of x, weight rows in groups, kvmesh.model.gguf_rows1 (uses row_dot, Lin)

_SOURCE += r"""

// y[m * ldy + n] = x[m] . W[n] (+ bias[n]) for m < M, n < N, or with ADD y[...] += that (a
// residual: (dot + bias) + y, the unfused path's order). An orphaned `omp for` over the output
// rows: the calling team splits them (a lone thread outside a parallel region), and each output
// is computed alone -- a row's result does not depend on M.
template <bool ADD>
static void mm_rows(const float* x, int64_t M, const Lin& L, float* y, int64_t ldy) {
  const int64_t K = L.K;
#if defined(__AVX512F__)
  if (M > RB || (M == 1 && L.base.size() <= 16)) {
    bool fast = true;
    for (int64_t t : L.type) fast = fast && fast_type(t);
    if (fast && M == 1) { mm_rows1<ADD>(x, L, y); return; }
    if (fast) { mm_rows_blocked<ADD>(x, M, L, y, ldy); return; }
  }
#endif
  #pragma omp for schedule(static)
  for (int64_t n = 0; n < L.N; ++n) {
    size_t p = 0;
    while (L.first[p + 1] <= n) ++p;
    const uint8_t* row = L.base[p] + (n - L.first[p]) * L.stride[p];
    const int64_t t = L.type[p];
    prefetch_ahead(row, n - L.first[p], L.first[p + 1] - L.first[p], L.stride[p]);
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
  TORCH_CHECK(t == T_Q4X ? fast_type(t) : block_bytes(t) > 0, "gguf: unsupported ggml type ", t);
  TORCH_CHECK(K % block_elems(t) == 0 && w.size(1) == row_bytes(t, K),
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
  TeamSlots team;
  #pragma omp parallel
  {
    team_begin(&team);
    mm_rows<false>(xp, M, L, yp, L.N);
    team_end();
  }
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

"""

_SOURCE += REPACK_SOURCE  # 4-bit rows into the kernels' layout at load, kvmesh.model.gguf_repack
_SOURCE += AMX_SOURCE  # the prefill path (tiles through MKL or the tile unit), kvmesh.model.gguf_amx
_SOURCE += DECODE_SOURCE  # one extension: the decode step calls the matmul kernels above

def _build_dir() -> Path:
    return extension_dir(_SOURCE, "gguf-")


def _build():
    # -ffp-contract=off: no fused multiply-adds the source does not write (dequantize is bit-exact)
    return load_extension("kvmesh_gguf", _SOURCE, ["gguf_mm", "gguf_dequant", "gguf_mm_tiled", "gguf_decode", "gguf_team_probe",
                                                   "gguf_repack", "gguf_amx", "gguf_amx_two_piece"], "gguf-", ("-ffp-contract=off",))


_kernels = NativeModule(lambda: _build(), "GGUF kernels", log)
_native = _kernels.get


def gguf_ops():
    """The module with ``gguf_mm(x, parts, types)`` and ``gguf_dequant(blocks, type, K)``, or None."""
    return _native()


if __name__ == "__main__":  # `python -m kvmesh.model.gguf_native`: build (or find) the kernels now
    logging.basicConfig(level=logging.INFO)
    print(f"GGUF kernels: {'ready in ' + str(_build_dir()) if _native() is not None else 'unavailable'}")
