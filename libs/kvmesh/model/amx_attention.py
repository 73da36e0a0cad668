"""Causal prefill attention on the AMX tile unit (CPU), in bf16 and -- fp32-accurate -- in fp32.

NOTE (why). In the bf16 mode a 2,048-token prompt's forward took ~0.55 s, of which torch's CPU
flash attention was ~0.29 s (30 layers, 9 query heads over 3 KV heads; one-off timing): its
q.k and p.v products go through small GEMM calls per block and its softmax works along rows,
each row needing horizontal max and sum reductions. This kernel computes the same attention with
the products on the tile unit and a softmax that needs no horizontal work. In fp32 (the default
GGUF mode) torch's flash attention was ~1.2 s of a ~2.7 s prompt in 512-token chunks.

NOTE (how). It works on the transposed scores: for 16 queries and 32 keys, S^T [32 keys][16
queries] = K . Q^T is two TDPBF16PS per 32 head dims (A: 16 key rows of K as they lie, B: the
16 queries' dims in the tile unit's pair layout, built once per task). One vector register then
holds one key's scores for the 16 queries, so the running max, the exponentials and the running
sum are plain element-wise ops across registers. The weights of each pair of keys are packed
as bf16 pairs (the B layout), and O^T [head dims][16 queries] += V^T . P^T on the tile unit
(A: V transposed once per KV head). Keys are taken 128 at a time: one online-softmax rescale
of O per 128 keys. Numerics are those of a bf16 flash attention (torch's CPU kernel works the
same way): bf16 q, k, v and weights, fp32 products, sums, softmax and output accumulator, the
output rounded to bf16 once; the exponential is 2^x by a degree-3 polynomial after range
reduction (relative error < 8e-5, under bf16's 4e-3).

NOTE (fp32). The same scheme, with no value rounded to fewer bits than fp32: q, k, v and the
weights are each split into three bf16 numbers that sum to them exactly (8 + 8 + 8 significant
bits), and each dot product takes six of the nine piece products (1·1, 1·2, 2·1, 1·3, 3·1,
2·2). The three left out are each below 2^-24 of |a·b|: fp32's own rounding of one product.
Sums, softmax and the accumulator are fp32, and 2^x is a degree-6 polynomial within 1e-7 (~2
ulp). The tests hold it within torch's own fp32 SDPA error of SDPA in fp64. Six products for one
make the tile work 6x bf16's; K and V are split once per call into per-head piece arrays (in
buffers the calling thread keeps; V^T 32 keys at a time, whole cache lines). Loading A tiles
(the keys' and values' pieces, from L2) bounds it more than the products do: an experiment that
loaded every A tile from one L1-resident address ran 0.73x the time, one with no A loads 0.58x.
So the three B pieces (the queries' for q·k, the weights' for p·v) stay in tiles 4..6 and each
A piece is loaded once for all its products, into tile 7: 12 A loads per 24 products instead of 16 with two B tiles
(0.85x the time, paired with the two-B kernel: 9 rounds of a 2,048-token prompt in 512-token
chunks, 28.0 against 23.9 ms a layer; software prefetching of the A tiles gained nothing
measurable). Earlier one-off, in process, 9 query heads over 3 KV heads: a 512-token chunk at offsets 0 /
512 / 1,536 took ~2.0 / 3.9 / 9.2 ms against SDPA's ~3.7 / 7.6 / 16.2 ms.

NOTE (scope). Causal only, queries at positions ``offset .. offset + Lq - 1`` against keys
``0 .. offset + Lq - 1`` (a prompt's first chunk, or a later chunk over its gathered context);
head dim 64; GQA by query-head groups; q, k, v all bf16 or all fp32. Where it does not apply
(other head dims or dtypes, sliding windows, no AMX, ``KVMESH_AMX=0``, no compiler) the caller
runs torch's SDPA. Tasks are (query head, block of 16 queries) over the calling thread's OpenMP
team: one KV head's query heads after another (its K and V stay in L2), longest first within it.

NOTE (layout of the source). One task loop (`causal_tasks`) runs both kernels; what differs --
how queries and weights are held (one bf16 piece or three) and which tile products make a step's
S^T and O^T -- is a small per-thread struct (`Bf16Pieces`, `F32Pieces`), as is the preparation
of K and V (`kv_bf16`, `kv_f32`).
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from kvmesh.model.gguf_amx import AMX_TILE_SOURCE
from kvmesh.model.native import NativeModule, load_extension

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>
""" + AMX_TILE_SOURCE + r"""

#if defined(KVMESH_AMX)
// 2^x for finite x <= 0: x = n + f, |f| <= 1/2, 2^f by a degree-3 polynomial fitted for
// relative error (< 8e-5, under the bf16 rounding the weights get next), scaled by 2^n (0 far
// below fp32's range).
static inline __m512 exp2_(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(5.5170249e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4260791e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9326091e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992830e-1f));
  return _mm512_scalef_ps(p, n);
}

// 2^x for finite x <= 0 to fp32 accuracy: 2^f by a degree-6 polynomial (relative error < 1e-7,
// ~1.6 ulp), scaled by 2^n.
static inline __m512 exp2_f32(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5345806605e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3399932068e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6184890717e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5503286421e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022646248e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718246e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

constexpr int D = 64, QB = 16, KB = 32, STEP = 128;

// A step's running max m (base-2 units) over its nk keys' scores s[key][query] -- in a diagonal
// step only over the keys each query sees -- and the factor 2^(m_old - m_new) for what came
// before (0 at the first step, m = -1e30).
template <__m512 (*EXP2)(__m512)>
static inline __m512 step_max(const float (*s)[QB], int nk, bool diag, __m512i qpos, int64_t k0, __m512 vc, __m512& m) {
  __m512 mx = _mm512_load_ps(s[0]);
  if (diag) {
    mx = _mm512_set1_ps(-1e30f);
    for (int i = 0; i < nk; ++i)
      mx = _mm512_mask_max_ps(mx, _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32((int)(k0 + i))), mx, _mm512_load_ps(s[i]));
  } else {
    for (int i = 1; i < nk; ++i) mx = _mm512_max_ps(mx, _mm512_load_ps(s[i]));
  }
  const __m512 mnew = _mm512_max_ps(m, _mm512_mul_ps(mx, vc));
  const __m512 alpha = EXP2(_mm512_sub_ps(m, mnew));
  m = mnew;
  return alpha;
}

alignas(64) static const uint16_t PAIR_ORDER[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// ---- K and V as the tile unit reads them, per KV head: K [Lp][64] (keys past Lk zero) and
// V^T [64][Ls]. V^T's rows are Ls = Lp + 32 apart: 4 KiB apart, a tile's 16 rows would all fall
// in one L1 set. bf16: as given; fp32: three pieces of each (NOTE (fp32)).

static void kv_bf16(const uint16_t* k, const uint16_t* v, int64_t sk, int64_t sv, int64_t Lk, int64_t KVH,
                    int64_t Lp, int64_t Ls, uint16_t* Kc, uint16_t* Vt) {  // (Kc, Vt zeroed)
  const int64_t nkb = Lp / KB;
  #pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < KVH * nkb; ++task) {
    const int64_t h = task / nkb, j0 = task % nkb * KB, nj = std::min<int64_t>(KB, Lk - j0);
    if (nj <= 0) continue;
    uint16_t* kc = Kc + h * Lp * D;
    uint16_t* vt = Vt + h * D * Ls;
    alignas(64) uint16_t blk[KB][D];
    for (int64_t j = 0; j < nj; ++j) {
      std::memcpy(kc + (j0 + j) * D, k + (j0 + j) * sk + h * D, D * 2);
      std::memcpy(blk[j], v + (j0 + j) * sv + h * D, D * 2);
    }
    for (int d = 0; d < D; ++d)
      for (int64_t j = 0; j < nj; ++j) vt[d * Ls + j0 + j] = blk[j][d];
  }
}

static void kv_f32(const float* k, const float* v, int64_t sk, int64_t sv, int64_t Lk, int64_t KVH,
                   int64_t Lp, int64_t Ls, uint16_t* Kc, uint16_t* Vt) {  // piece i of head h at (3 h + i)
  const int64_t nkb = Lp / KB;
  #pragma omp parallel for schedule(static) collapse(2)
  for (int64_t jb = 0; jb < nkb; ++jb)
  for (int64_t h = 0; h < KVH; ++h) {
    const int64_t j0 = jb * KB, nj = std::min<int64_t>(KB, Lk - j0);
    // (locals: the stores below may alias anything, and the team's shared copies would be re-read)
    const float* const kk = k; const float* const vv = v;
    uint16_t* const Kh = Kc + h * 3 * Lp * D;
    uint16_t* const Vh = Vt + h * 3 * D * Ls;
    const int64_t ksk = sk, vsv = sv, lp = Lp, ls = Ls;
    if (nj < KB)  // the tail: zero keys (their weights are 0, and 0 * stale bits could be NaN)
      for (int i = 0; i < 3; ++i) {
        const int64_t from = std::max<int64_t>(j0, Lk);
        std::memset(Kh + (i * lp + from) * D, 0, (j0 + KB - from) * D * 2);
        if (nj <= 0)  // (a block with keys writes its zero keys below)
          for (int d = 0; d < D; ++d) std::memset(Vh + (i * D + d) * ls + j0, 0, KB * 2);
      }
    if (nj <= 0) continue;
    for (int64_t j = 0; j < nj; ++j)
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m256i p[3];
        split3(_mm512_loadu_ps(kk + (j0 + j) * ksk + h * D + d0), p[0], p[1], p[2]);
        for (int i = 0; i < 3; ++i)
          _mm256_storeu_si256((__m256i*)(Kh + (i * lp + j0 + j) * D + d0), p[i]);
      }
    // V^T: 32 keys x 16 dims at a time through two register transposes, then split: each
    // piece's row of the block is one whole 64-byte line
    for (int d0 = 0; d0 < D; d0 += 16) {
      __m512 r[2][16];
      for (int half = 0; half < 2; ++half) {
        for (int n = 0; n < 16; ++n) {
          const int64_t j = 16 * half + n;
          r[half][n] = j < nj ? _mm512_loadu_ps(vv + (j0 + j) * vsv + h * D + d0) : _mm512_setzero_ps();
        }
        transpose16(r[half]);
      }
      for (int dd = 0; dd < 16; ++dd) {
        __m256i a[3], b[3];
        split3(r[0][dd], a[0], a[1], a[2]);
        split3(r[1][dd], b[0], b[1], b[2]);
        for (int i = 0; i < 3; ++i)
          _mm512_storeu_si512(Vh + (i * D + d0 + dd) * ls + j0, _mm512_inserti64x4(_mm512_castsi256_si512(a[i]), b[i], 1));
      }
    }
  }
}

// ---- What differs between the two kernels: how queries and weights are held (one bf16 piece,
// or three) and which tile products make a step's S^T and O^T. One object per thread.

struct KvPieces {
  const uint16_t* Kc; const uint16_t* Vt;  // as kv_bf16 / kv_f32 lay them out
  const void* q; int64_t sq, Lp, Ls;
};

// bf16. Tiles: 0..1 S^T, 2..3 A (keys), 4..5 B (Q^T, loaded once per task); then 0..3 O^T,
// 6 A (V^T), 7 B (P^T).
struct Bf16Pieces {
  using Out = uint16_t;
  static inline __m512 exp2(__m512 x) { return exp2_(x); }
  const KvPieces kv;
  const uint16_t* kc = nullptr; const uint16_t* vt = nullptr;
  alignas(64) uint32_t qp[2][16][16];          // B tiles: Q^T of 16 queries, per 32 dims
  alignas(64) uint32_t pp[STEP / KB][16][16];  // B tiles: P^T as bf16 pairs of keys
  explicit Bf16Pieces(const KvPieces& p) : kv(p) {}

  inline __attribute__((always_inline)) void queries(int64_t q0, int64_t nq, int64_t hq, int64_t hk) {
    // Q^T in pair layout: qp[c][r][n] = dims 32c + 2r, 32c + 2r + 1 of query n (zero past Lq)
    const uint16_t* q = (const uint16_t*)kv.q;
    for (int cc = 0; cc < 2; ++cc)
      for (int r = 0; r < 16; ++r)
        for (int n = 0; n < 16; ++n) {
          if (n >= nq) { qp[cc][r][n] = 0; continue; }
          const uint16_t* qr = q + (q0 + n) * kv.sq + hq * D + 32 * cc + 2 * r;
          qp[cc][r][n] = (uint32_t)qr[0] | ((uint32_t)qr[1] << 16);
        }
    _tile_loadd(4, qp[0], 64);
    _tile_loadd(5, qp[1], 64);
    kc = kv.Kc + hk * kv.Lp * D;
    vt = kv.Vt + hk * D * kv.Ls;
  }
  // S^T of the step at k0 into sbuf (its 32-key sub-blocks: as many as reach `last`)
  inline __attribute__((always_inline)) int scores(int64_t k0, int64_t last, float (*sbuf)[QB]) {
    const int nsb = (int)std::min<int64_t>(STEP / KB, (last - k0) / KB + 1);
    const uint16_t* const kh = kc;  // (locals here and below: a vector store may alias a member)
    for (int sb = 0; sb < nsb; ++sb) {
      const uint16_t* kr = kh + (k0 + sb * KB) * D;
      _tile_zero(0); _tile_zero(1);
      _tile_loadd(2, kr, D * 2);
      _tile_loadd(3, kr + 16 * D, D * 2);
      _tile_dpbf16ps(0, 2, 4);
      _tile_dpbf16ps(1, 3, 4);
      _tile_loadd(2, kr + 32, D * 2);
      _tile_loadd(3, kr + 16 * D + 32, D * 2);
      _tile_dpbf16ps(0, 2, 5);
      _tile_dpbf16ps(1, 3, 5);
      _tile_stored(0, sbuf[sb * KB], 64);
      _tile_stored(1, sbuf[sb * KB + 16], 64);
    }
    return nsb;
  }
  // the weights of keys i, i + 1: dword n = (p0[n], p1[n]) as bf16, the pair layout
  inline __attribute__((always_inline)) void weights(int i, __m512 p0, __m512 p1, __m512i pairs) {
    const __m512i w = _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    _mm512_store_si512(pp[i / KB][(i % KB) / 2], w);
  }
  // tiles 0..3 = the step's V^T . P^T
  inline __attribute__((always_inline)) void values(int64_t k0, int nsb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const int64_t Ls = kv.Ls;
    const uint16_t* const vh = vt;
    for (int sb = 0; sb < nsb; ++sb) {
      _tile_loadd(7, pp[sb], 64);
      const uint16_t* va = vh + k0 + sb * KB;
      _tile_loadd(6, va, Ls * 2); _tile_dpbf16ps(0, 6, 7);
      _tile_loadd(6, va + 16 * Ls, Ls * 2); _tile_dpbf16ps(1, 6, 7);
      _tile_loadd(6, va + 32 * Ls, Ls * 2); _tile_dpbf16ps(2, 6, 7);
      _tile_loadd(6, va + 48 * Ls, Ls * 2); _tile_dpbf16ps(3, 6, 7);
    }
  }
  static inline __attribute__((always_inline)) void store(uint16_t* dst, __m512 r) {
    _mm256_storeu_si256((__m256i*)dst, (__m256i)_mm512_cvtneps_pbh(r));
  }
};

// fp32-accurate (NOTE (fp32)): q, k, v, p as three bf16 pieces each, six products per dot
// product. Tiles: 0..3 S^T, 4..6 B (the three Q^T pieces), 7 A (a key piece); then 0..3 O^T,
// 4..6 B (the three P^T pieces), 7 A (a V^T piece). With all three B pieces in tiles each A tile
// -- the step's keys and values, read from L2 -- is loaded once for all its products (12 A loads
// per 24 products, where two B tiles took 16: NOTE (fp32)).
struct F32Pieces {
  using Out = float;
  static inline __m512 exp2(__m512 x) { return exp2_f32(x); }
  const KvPieces kv;
  const uint16_t* kc = nullptr; const uint16_t* vt = nullptr;
  alignas(64) uint32_t qp[3][2][16][16];          // B tiles: Q^T piece i of 16 queries, per 32 dims
  alignas(64) uint16_t qw[3][16][D];              // the queries' pieces as rows
  alignas(64) uint32_t pp[3][STEP / KB][16][16];  // B tiles: P^T pieces as bf16 pairs of keys
  explicit F32Pieces(const KvPieces& p) : kv(p) {}

  inline __attribute__((always_inline)) void queries(int64_t q0, int64_t nq, int64_t hq, int64_t hk) {
    const float* q = (const float*)kv.q;
    for (int n = 0; n < 16; ++n)
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m256i p[3];
        split3(n < nq ? _mm512_loadu_ps(q + (q0 + n) * kv.sq + hq * D + d0) : _mm512_setzero_ps(), p[0], p[1], p[2]);
        for (int i = 0; i < 3; ++i) _mm256_store_si256((__m256i*)(qw[i][n] + d0), p[i]);
      }
    for (int i = 0; i < 3; ++i)
      for (int cc = 0; cc < 2; ++cc)
        for (int r = 0; r < 16; ++r)
          for (int n = 0; n < 16; ++n)
            qp[i][cc][r][n] = (uint32_t)qw[i][n][32 * cc + 2 * r] | ((uint32_t)qw[i][n][32 * cc + 2 * r + 1] << 16);
    kc = kv.Kc + hk * 3 * kv.Lp * D;
    vt = kv.Vt + hk * 3 * D * kv.Ls;
  }
// Key piece i, keys 16 g .. 16 g + 15, into A tile 7, times the first n query pieces (B tiles
// 4, 5, 6) into accumulator g.
#define KVMESH_QK(i, g, n) \
  _tile_loadd(7, kr + (i) * Lp * D + (g) * 16 * D, D * 2); \
  _tile_dpbf16ps(g, 7, 4); if ((n) > 1) _tile_dpbf16ps(g, 7, 5); if ((n) > 2) _tile_dpbf16ps(g, 7, 6);
  // S^T, two sub-blocks of 32 keys at a time: four accumulators (keys 16 g .. 16 g + 15).
  // Products k_1 q_1, k_1 q_2, k_1 q_3, k_2 q_1, k_2 q_2, k_3 q_1 (the three left out are each
  // below 2^-24 of |k q|).
  inline __attribute__((always_inline)) int scores(int64_t k0, int64_t last, float (*sbuf)[QB]) {
    const int nsb = (int)std::min<int64_t>(STEP / KB, (last - k0) / KB + 1);
    const int64_t Lp = kv.Lp;
    const uint16_t* const kh = kc;
    for (int sb = 0; sb < nsb; sb += 2) {  // (an odd last sub-block computes one more: zero keys)
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int cc = 0; cc < 2; ++cc) {
        const uint16_t* kr = kh + (k0 + sb * KB) * D + 32 * cc;
        _tile_loadd(4, qp[0][cc], 64); _tile_loadd(5, qp[1][cc], 64); _tile_loadd(6, qp[2][cc], 64);
        KVMESH_QK(0, 0, 3) KVMESH_QK(0, 1, 3) KVMESH_QK(0, 2, 3) KVMESH_QK(0, 3, 3)
        KVMESH_QK(1, 0, 2) KVMESH_QK(1, 1, 2) KVMESH_QK(1, 2, 2) KVMESH_QK(1, 3, 2)
        KVMESH_QK(2, 0, 1) KVMESH_QK(2, 1, 1) KVMESH_QK(2, 2, 1) KVMESH_QK(2, 3, 1)
      }
      _tile_stored(0, sbuf[sb * KB], 64); _tile_stored(1, sbuf[sb * KB + 16], 64);
      _tile_stored(2, sbuf[sb * KB + 32], 64); _tile_stored(3, sbuf[sb * KB + 48], 64);
    }
    return nsb;
  }
#undef KVMESH_QK
  // the pieces of keys i, i + 1's weights, paired as the B layout wants
  inline __attribute__((always_inline)) void weights(int i, __m512 p0, __m512 p1, __m512i pairs) {
    __m256i a0[3], a1[3];
    split3(p0, a0[0], a0[1], a0[2]);
    split3(p1, a1[0], a1[1], a1[2]);
    for (int pc = 0; pc < 3; ++pc) {
      const __m512i w = _mm512_permutexvar_epi16(pairs, _mm512_inserti64x4(_mm512_castsi256_si512(a0[pc]), a1[pc], 1));
      _mm512_store_si512(pp[pc][i / KB][(i % KB) / 2], w);
    }
  }
// V^T piece i, dims 16 g .. 16 g + 15, into A tile 7, times the first n P^T pieces (B tiles
// 4, 5, 6) into accumulator g.
#define KVMESH_PV(i, g, n) \
  _tile_loadd(7, va + (i) * D * Ls + (g) * 16 * Ls, Ls * 2); \
  _tile_dpbf16ps(g, 7, 4); if ((n) > 1) _tile_dpbf16ps(g, 7, 5); if ((n) > 2) _tile_dpbf16ps(g, 7, 6);
  // tiles 0..3 = the step's V^T . P^T: v_1 p_1, v_1 p_2, v_1 p_3, v_2 p_1, v_2 p_2, v_3 p_1
  inline __attribute__((always_inline)) void values(int64_t k0, int nsb) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const int64_t Ls = kv.Ls;
    const uint16_t* const vh = vt;
    for (int sb = 0; sb < nsb; ++sb) {
      const uint16_t* va = vh + k0 + sb * KB;
      _tile_loadd(4, pp[0][sb], 64); _tile_loadd(5, pp[1][sb], 64); _tile_loadd(6, pp[2][sb], 64);
      KVMESH_PV(0, 0, 3) KVMESH_PV(0, 1, 3) KVMESH_PV(0, 2, 3) KVMESH_PV(0, 3, 3)
      KVMESH_PV(1, 0, 2) KVMESH_PV(1, 1, 2) KVMESH_PV(1, 2, 2) KVMESH_PV(1, 3, 2)
      KVMESH_PV(2, 0, 1) KVMESH_PV(2, 1, 1) KVMESH_PV(2, 2, 1) KVMESH_PV(2, 3, 1)
    }
  }
#undef KVMESH_PV
  static inline __attribute__((always_inline)) void store(float* dst, __m512 r) { _mm512_storeu_ps(dst, r); }
};

// ---- The task loop both kernels share. out [Lq, H, 64] = causal softmax(scale * q k^T) v,
// queries at positions offset + i; token i's heads start at out + i * so, 64 apart. A task is
// (query head, block of 16 queries): one KV head's query heads after another (its K and V stay
// in L2), longest first within it.
template <class Pieces>
static void causal_tasks(const KvPieces& kv, typename Pieces::Out* out, int64_t so, int64_t Lq, int64_t H,
                         int64_t KVH, int64_t offset, float scale) {
  const int64_t G = H / KVH, nqb = (Lq + QB - 1) / QB;
  const __m512 vc = _mm512_set1_ps(scale * 1.4426950408889634f);  // scores in base 2
  #pragma omp parallel
  {
    amx_configure();
    Pieces pc(kv);
    alignas(64) float sd[2][STEP][QB];  // S^T of two steps (the pipeline below)
    alignas(64) float o[D][QB];         // O^T accumulator
    alignas(64) float t[D][QB];         // one step's V^T . P^T
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i pairs = _mm512_load_si512(PAIR_ORDER);  // bf16 weights of two keys -> B pairs
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * nqb; ++task) {
      const int64_t hk = task / (G * nqb), qb = nqb - 1 - task % (G * nqb) / G, hq = hk * G + task % G;
      const int64_t q0 = qb * QB, nq = std::min<int64_t>(QB, Lq - q0);
      pc.queries(q0, nq, hq, hk);
      const int64_t last = offset + q0 + nq - 1;  // the block's last query's position: keys 0..last
      const __m512i qpos = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(offset + q0)));
      __m512 m = _mm512_set1_ps(-1e30f), l = _mm512_setzero_ps();
      for (int d = 0; d < D; ++d) _mm512_store_ps(o[d], _mm512_setzero_ps());
      // Software pipeline: the next step's scores go to the tile unit before this step's
      // softmax, which the vector units run meanwhile.
      int nsb = pc.scores(0, last, sd[0]);
      for (int64_t k0 = 0, j = 0; k0 <= last; k0 += STEP, ++j) {
        float (*s)[QB] = sd[j & 1];
        const int nsb_next = k0 + STEP <= last ? pc.scores(k0 + STEP, last, sd[(j + 1) & 1]) : 0;
        const int nk = nsb * KB;
        // keys k0 + i are masked for queries before them (only in a step past the block's first
        // query: the diagonal). Masked keys stay out of the max too: a block that straddles a
        // step has queries that see no key of the last step, and their max must not move (a
        // masked key's large score would underflow all their weights). Every query sees key 0,
        // so each lane's max is finite from the first step on.
        const bool diag = k0 + nk - 1 > offset + q0;
        auto valid = [&](int i) { return _mm512_cmpge_epi32_mask(qpos, _mm512_set1_epi32((int)(k0 + i))); };
        const __m512 alpha = step_max<Pieces::exp2>(s, nk, diag, qpos, k0, vc, m);
        const __m512 negm = _mm512_sub_ps(_mm512_setzero_ps(), m);
        __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
        for (int i = 0; i < nk; i += 2) {
          __m512 p0 = Pieces::exp2(_mm512_fmadd_ps(_mm512_load_ps(s[i]), vc, negm));
          __m512 p1 = Pieces::exp2(_mm512_fmadd_ps(_mm512_load_ps(s[i + 1]), vc, negm));
          if (diag) { p0 = _mm512_maskz_mov_ps(valid(i), p0); p1 = _mm512_maskz_mov_ps(valid(i + 1), p1); }
          sum0 = _mm512_add_ps(sum0, p0);
          sum1 = _mm512_add_ps(sum1, p1);
          pc.weights(i, p0, p1, pairs);
        }
        l = _mm512_fmadd_ps(l, alpha, _mm512_add_ps(sum0, sum1));
        pc.values(k0, nsb);
        _tile_stored(0, t[0], 64); _tile_stored(1, t[16], 64);
        _tile_stored(2, t[32], 64); _tile_stored(3, t[48], 64);
        for (int d = 0; d < D; ++d)
          _mm512_store_ps(o[d], _mm512_fmadd_ps(_mm512_load_ps(o[d]), alpha, _mm512_load_ps(t[d])));
        nsb = nsb_next;
      }
      // out rows = (O^T / l)^T, 16 dims at a time through a 16 x 16 register transpose
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l);
      for (int d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_mul_ps(_mm512_load_ps(o[d0 + i]), inv);
        transpose16(r);
        for (int n = 0; n < nq; ++n) Pieces::store(out + (q0 + n) * so + hq * D + d0, r[n]);
      }
    }
    _tile_release();
  }
}

// token i's heads start at q + i * sq (k + i * sk, v + i * sv, out + i * so), 64 apart
static void amx_causal(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                       int64_t sq, int64_t sk, int64_t sv, int64_t so,
                       int64_t Lq, int64_t Lk, int64_t H, int64_t KVH, int64_t offset, float scale) {
  const int64_t Lp = (Lk + STEP - 1) / STEP * STEP, Ls = Lp + 32;
  std::vector<uint16_t> Kc(KVH * Lp * D, 0), Vt(KVH * D * Ls, 0);
  kv_bf16(k, v, sk, sv, Lk, KVH, Lp, Ls, Kc.data(), Vt.data());
  causal_tasks<Bf16Pieces>(KvPieces{Kc.data(), Vt.data(), q, sq, Lp, Ls}, out, so, Lq, H, KVH, offset, scale);
}

static void amx_causal_f32(const float* q, const float* k, const float* v, float* out,
                           int64_t sq, int64_t sk, int64_t sv, int64_t so,
                           int64_t Lq, int64_t Lk, int64_t H, int64_t KVH, int64_t offset, float scale) {
  const int64_t Lp = (Lk + STEP - 1) / STEP * STEP, Ls = Lp + 32;
  // the pieces, in buffers the calling thread keeps (no page faults per call)
  thread_local std::vector<uint16_t> kbuf, vbuf;
  if ((int64_t)kbuf.size() < KVH * 3 * Lp * D) kbuf.resize(KVH * 3 * Lp * D);
  if ((int64_t)vbuf.size() < KVH * 3 * D * Ls) vbuf.resize(KVH * 3 * D * Ls);
  kv_f32(k, v, sk, sv, Lk, KVH, Lp, Ls, kbuf.data(), vbuf.data());
  causal_tasks<F32Pieces>(KvPieces{kbuf.data(), vbuf.data(), q, sq, Lp, Ls}, out, so, Lq, H, KVH, offset, scale);
}
#endif

bool available() {
#if defined(KVMESH_AMX)
  return amx_ready();
#else
  return false;
#endif
}

static void check_rows(const torch::Tensor& t, const torch::Tensor& q, const char* what) {
  TORCH_CHECK((t.dtype() == torch::kBFloat16 || t.dtype() == torch::kFloat32) && t.dtype() == q.dtype() && t.dim() == 3
                  && t.size(2) == 64 && t.stride(2) == 1 && t.stride(1) == 64,
              "causal_attention: ", what, " must be [tokens, heads, 64] in q's dtype (bf16 or fp32), each token's heads contiguous");
}

// out [Lq, H, 64] = causal attention of q [Lq, H, 64] over k, v [Lk, KVH, 64] (all bf16 or all
// fp32; each token's heads contiguous, tokens at any stride), Lk = offset + Lq.
void causal_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t offset, double scale) {
  check_rows(out, q, "out"); check_rows(q, q, "q"); check_rows(k, q, "k"); check_rows(v, q, "v");
  TORCH_CHECK(out.sizes() == q.sizes(), "causal_attention: out must be shaped like q");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(1) % k.size(1) == 0, "causal_attention: k, v alike; H a multiple of KVH");
  TORCH_CHECK(offset >= 0 && k.size(0) == offset + q.size(0), "causal_attention: Lk must be offset + Lq");
#if defined(KVMESH_AMX)
  TORCH_CHECK(amx_ready(), "causal_attention: no AMX tile state here");
  if (q.size(0) == 0) return;
  if (q.dtype() == torch::kFloat32)
    amx_causal_f32(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
                   q.stride(0), k.stride(0), v.stride(0), out.stride(0), q.size(0), k.size(0), q.size(1), k.size(1),
                   offset, (float)scale);
  else
    amx_causal((const uint16_t*)q.data_ptr(), (const uint16_t*)k.data_ptr(), (const uint16_t*)v.data_ptr(),
               (uint16_t*)out.data_ptr(), q.stride(0), k.stride(0), v.stride(0), out.stride(0),
               q.size(0), k.size(0), q.size(1), k.size(1), offset, (float)scale);
#else
  TORCH_CHECK(false, "causal_attention: built without AMX");
#endif
}
"""

def _build():
    return load_extension("kvmesh_amx_attention", _SOURCE, ["available", "causal_attention"], "amxattn-")


# the compiled module where it is built and this CPU grants AMX, else None
_kernels = NativeModule(lambda: _build(), "AMX attention kernel", log, accept=lambda m: m.available())
_ops = _kernels.get


HEAD_DIM = 64
"""The one head size the kernel takes."""

DTYPES = (torch.bfloat16, torch.float32)
"""bf16 (a bf16 flash attention's numerics) and fp32 (fp32-accurate: NOTE (fp32))."""


def prepare() -> bool:
    """Build (or find on disk) the kernel now; whether it runs here."""
    return _ops() is not None


def usable(q: torch.Tensor) -> bool:
    """Whether the kernel runs for queries like q: bf16 or fp32 on a CPU with AMX, head dim 64, no
    autograd to record (k, v and out must then have q's dtype too)."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and q.dim() == 3 and q.shape[-1] == HEAD_DIM
            and not (torch.is_grad_enabled() and q.requires_grad) and _ops() is not None)


def kernel_takes(tensors: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...], head_dims: tuple[int, ...]) -> bool:
    """Whether (out, q, k, v) fit a CPU causal-attention kernel (this one or
    kvmesh.model.cpu_attention): all on the CPU in q's dtype, one of `dtypes`, each [tokens, heads,
    d] with d in `head_dims` and each token's heads contiguous, and no autograd to record."""
    q = tensors[1]
    d = q.shape[-1] if q.dim() == 3 else 0
    if d not in head_dims or q.dtype not in dtypes or any(
            t.device.type != "cpu" or t.dtype != q.dtype or t.dim() != 3 or t.shape[-1] != d
            or t.stride(2) != 1 or t.stride(1) != d for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def causal_attention_(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                      scale: float) -> bool:
    """out [Lq, H, 64] = causal attention of q [Lq, H, 64] (positions offset..offset+Lq-1) over
    k, v [Lk, KVH, 64] (Lk = offset + Lq), all bf16 or all fp32, on the tile unit; False (nothing written) where
    the kernel does not apply and the caller runs SDPA. Tokens may lie at any stride (q, k, v
    as slices of a fused projection); each token's heads must be contiguous."""
    if not kernel_takes((out, q, k, v), DTYPES, (HEAD_DIM,)):
        return False
    ops = _ops()
    if ops is None:
        return False
    ops.causal_attention(out, q, k, v, int(offset), float(scale))
    return True


if __name__ == "__main__":  # `python -m kvmesh.model.amx_attention`: build (or find) the kernel now
    logging.basicConfig(level=logging.INFO)
    missing = "unavailable (no AMX here, or KVMESH_AMX=0): the AVX-512 attention or SDPA runs"
    print(f"AMX attention: {'ready' if _ops() is not None else missing}")
