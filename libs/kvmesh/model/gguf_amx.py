"""The GGUF kernels' prefill path, ``gguf_mm_tiled`` (C++ source composed into
kvmesh.model.gguf_native's extension after its kernels, whose ``q4x_code_bytes``,
``check_part`` and ``dequant_rows`` it uses): a matmul of many rows, part by part, either a
cache-sized tile of dequantized weights at a time through torch's dense matmul (see
gguf_native's NOTE), or -- a repacked 4-bit part (``T_Q4X``) where the CPU has AMX-BF16 and
Linux grants the process its tile state -- on the tile unit, exactly, as below.

NOTE (exact, not bf16). A weight of a ``T_Q4X`` row is ``code * scale + offset`` for its block of
32, the code an integer 0..15 -- exact in bf16. Each activation x is split into three bf16 numbers
whose sum is x exactly (x1 = bf16(x), x2 = bf16(x - x1), x3 = x - x1 - x2: 8 + 8 + 8 significant
bits cover fp32's 24), so the products a tile multiply forms (bf16 x bf16, exact in fp32) are
products of the fp32 activation, summed in fp32. No activation or weight is rounded to fewer
bits. ``KVMESH_AMX=0`` turns the path off. Two kernels:

- Two weight pieces (``amx_q4x2``; Q4_0 and Q4_1, whose scale and offset are fp16 values). Then
  w = code * scale has at most 11 + 4 significant bits, so it is exactly w1 + w2, two bf16 numbers,
  and so is each offset. Per block, five TDPBF16PS: x1 w1, x1 w2, x2 w1, x2 w2, x3 w1. The one
  left out, x3 w2, is below 2^-24 |x w|: at most what fp32's own rounding of the product x * w
  changes. The offsets ride along as extra blocks: the offsets of 32 blocks against x's 32 block
  sums (split in three the same way). So the whole dot product, scale and offset, stays in the
  accumulator tiles from the first block to the last, with nothing between blocks off the tile
  unit. The summation is one fp32 chain per output, in tile order; its error measured ~2-3x
  MKL's (both ~1e-7 of sum |x w|).
- Per block (``amx_q4x``; every other part: Q4_K's scale d * sc can have 17 bits, and the two
  pieces would not be exact). The tile unit sums x . codes over each block (three TDPBF16PS, one
  per piece), and AVX-512 multiplies that by the block's scale and adds offset * (the block's sum
  of x). The per-block step costs about as much as the tile work.

Both give the dequantized model's dot product up to float rounding (summation order and the
distributive law). Which one a part gets is decided per call (``build_w2`` checks every weight;
``gguf_amx_two_piece`` says so for tests). One-off timing at 512 rows (a prefill chunk), SmolLM2's
four matmuls of a layer: ~9.0 ms two-piece, ~11.6 ms per block.

NOTE (layout). C[m][n] = sum_k A[m][k] B[k][n]: A tiles are 16 rows of x's pieces by one block of
32 columns, stored tile by tile (``split_x``); B tiles hold 16 weight rows in the tile unit's pair
layout (row r: columns 2r and 2r + 1 of each of the 16 rows), built once per call for each 32
weight rows. Four accumulator tiles (2 x 16 rows of x by 2 x 16 weight rows) keep four
independent chains in the tile unit. Two-piece tasks are (4 x 32 rows of x, 32 weight rows), so
the x pieces of a task stay in L2 across the weight rows.
"""
from __future__ import annotations

AMX_TILE_SOURCE = r"""
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define KVMESH_AMX 1

// Linux hands a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); false where it refuses (an old kernel, a VM without it) or KVMESH_AMX=0.
static bool amx_ready() {
  static const bool ok = [] {
    const char* env = getenv("KVMESH_AMX");
    if (env && env[0] == '0') return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows of 64 bytes (what each kernel keeps in which tile: at the kernel).
static void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.colsb[t] = 64; cfg.rows[t] = 16; }
  // GCC does not always count LDTILECFG as reading all 64 bytes: inlined into a big function it
  // dropped the colsb stores (a #GP on the load). The barrier makes every store happen first.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

static inline __m512 bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// v = a + b + c exactly, each bf16 (a = bf16(v), b = bf16(v - a), c = v - a - b).
static inline void split3(__m512 v, __m256i& a, __m256i& b, __m256i& c) {
  a = (__m256i)_mm512_cvtneps_pbh(v);
  const __m512 r1 = _mm512_sub_ps(v, bf16_widen(a));
  b = (__m256i)_mm512_cvtneps_pbh(r1);
  c = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(r1, bf16_widen(b)));
}

// r[i][j] -> r[j][i] for a 16 x 16 block of floats (one register a row).
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // pairs of rows: 2 x 2 blocks of single floats
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks
    const __m512d a = _mm512_castps_pd(t[i]), b = _mm512_castps_pd(t[i + 2]);
    const __m512d c = _mm512_castps_pd(t[i + 1]), d = _mm512_castps_pd(t[i + 3]);
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 4; ++i) {  // 8 x 8, then 16 x 16: whole 128-bit lanes
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}
#endif
"""
"""The tile unit's set-up, shared by the AMX kernels (this one and kvmesh.model.amx_attention):
where the compiler targets AMX-BF16 it defines KVMESH_AMX, ``amx_ready()`` (Linux granted the
tile state and KVMESH_AMX is not 0) and ``amx_configure()`` (8 tiles of 16 rows x 64 bytes)."""

AMX_SOURCE = AMX_TILE_SOURCE + r"""
#if defined(KVMESH_AMX)
// Blocks along K of the tile work: nblk = K / 32 of x, then ceil(nblk / 32) of x's block sums.
static inline int64_t tile_blocks(int64_t K) { return K / 32 + (K / 32 + 31) / 32; }

// x [M, K] fp32 -> its three bf16 pieces in tile order: P + ((mt * nb + b) * 3 + i) * 512 is the
// 16 x 32 tile of piece i, rows 16 mt .. 16 mt + 15, block b (nb = tile_blocks(K); blocks past
// nblk hold the pieces of S, 32 blocks' sums to a tile row); rows M..Mp zero. S [Mp][nblk]: the
// fp32 sum of x over each block.
static void split_x(const float* x, int64_t M, int64_t Mp, int64_t K, uint16_t* P, float* S) {
  const int64_t nblk = K / 32, nb = tile_blocks(K);
  #pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < Mp; ++m) {
    uint16_t* row = P + (m / 16) * nb * 3 * 512 + (m % 16) * 32;  // + (b * 3 + i) * 512
    float* s = S + m * nblk;
    for (int64_t b = 0; b < nb; ++b) {
      __m512 v[2];
      if (m >= M) { v[0] = v[1] = _mm512_setzero_ps(); if (b < nblk) s[b] = 0.f; }
      else if (b < nblk) {
        v[0] = _mm512_loadu_ps(x + m * K + 32 * b);
        v[1] = _mm512_loadu_ps(x + m * K + 32 * b + 16);
        s[b] = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
      } else {  // block sums 32 e .. 32 e + 31 (zero past nblk), after all of this row's
        const int64_t k = 32 * (b - nblk);
        for (int h = 0; h < 2; ++h) {
          const int64_t n = std::max<int64_t>(0, std::min<int64_t>(16, nblk - k - 16 * h));
          v[h] = _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), s + k + 16 * h);
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m256i a, c1, c2;
        split3(v[h], a, c1, c2);
        _mm256_storeu_si256((__m256i*)(row + (b * 3 + 0) * 512 + 16 * h), a);
        _mm256_storeu_si256((__m256i*)(row + (b * 3 + 1) * 512 + 16 * h), c1);
        _mm256_storeu_si256((__m256i*)(row + (b * 3 + 2) * 512 + 16 * h), c2);
      }
    }
  }
}

// Codes of block b of a T_Q4X row (cb code bytes, nblk blocks): lanes i -> columns i, 16 + i.
static inline void q4x_codes(const uint8_t* row, int64_t nblk, int64_t b, __m512i& lo, __m512i& hi) {
  const int64_t G = nblk / 4, rest = nblk % 4, g = b / 4, s = b % 4;
  __m512i v;
  if (g < G) v = _mm512_loadu_si512(row + 64 * g);
  else if (rest == 1) v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + 64 * G)));
  else if (rest == 2) v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 64 * G)));
  else v = _mm512_loadu_si512(row + 64 * G);
  lo = _mm512_and_si512(_mm512_srli_epi32(v, (unsigned)(8 * s)), _mm512_set1_epi32(15));
  hi = _mm512_and_si512(_mm512_srli_epi32(v, (unsigned)(8 * s + 4)), _mm512_set1_epi32(15));
}

// The B tiles of weight rows n0..n0+31 (rows past N: zero) for the two-piece kernel (NOTE
// (two pieces)): W + ((b * 2 + p) * 2 + t) * 256 is piece p (0: bf16(w), 1: w - bf16(w)) of
// rows n0 + 16 t .. for block b in the tile unit's pair layout (row r: columns 2 r, 2 r + 1 of
// each of the 16 weight rows), w = code * scale for b < nblk and the offsets of 32 blocks after
// (block nblk + e: offsets of blocks 32 e ..). False where some w is not exactly its two pieces.
static bool build_w2(const uint8_t* base, int64_t stride, int64_t N, int64_t K, int64_t n0, uint32_t* W) {
  const int64_t nblk = K / 32, nb = tile_blocks(K), cb = q4x_code_bytes(nblk);
  __mmask16 bad = 0;
  for (int t = 0; t < 2; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      __m512 rows[2][16];
      for (int col = 0; col < 16; ++col) {
        const int64_t n = n0 + 16 * t + col;
        __m512 w[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        if (n < N) {
          const uint8_t* row = base + n * stride;
          const float* rs = (const float*)(row + cb);
          if (b < nblk) {
            __m512i c[2];
            q4x_codes(row, nblk, b, c[0], c[1]);
            const __m512 d = _mm512_set1_ps(rs[b]);
            for (int h = 0; h < 2; ++h) {
              const __m512 cf = _mm512_cvtepi32_ps(c[h]);
              w[h] = _mm512_mul_ps(cf, d);
              bad |= _mm512_cmp_ps_mask(_mm512_fmsub_ps(cf, d, w[h]), _mm512_setzero_ps(), _CMP_NEQ_UQ);
            }
          } else {
            const int64_t k = 32 * (b - nblk);
            for (int h = 0; h < 2; ++h) {
              const int64_t cnt = std::max<int64_t>(0, std::min<int64_t>(16, nblk - k - 16 * h));
              w[h] = _mm512_maskz_loadu_ps((__mmask16)((1u << cnt) - 1), rs + nblk + k + 16 * h);
            }
          }
        }
        __m256i hi[2], lo[2];
        for (int h = 0; h < 2; ++h) {
          hi[h] = (__m256i)_mm512_cvtneps_pbh(w[h]);
          const __m512 r = _mm512_sub_ps(w[h], bf16_widen(hi[h]));
          lo[h] = (__m256i)_mm512_cvtneps_pbh(r);
          bad |= _mm512_cmp_ps_mask(bf16_widen(lo[h]), r, _CMP_NEQ_UQ);
        }
        rows[0][col] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(hi[0]), hi[1], 1));
        rows[1][col] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(lo[0]), lo[1], 1));
      }
      for (int p = 0; p < 2; ++p) {
        transpose16(rows[p]);  // rows[p][r]: dword r (columns 2 r, 2 r + 1) of the 16 weight rows
        float* tile = (float*)(W + ((b * 2 + p) * 2 + t) * 256);
        for (int r = 0; r < 16; ++r) _mm512_storeu_ps(tile + 16 * r, rows[p][r]);
      }
    }
  }
  return bad == 0;
}

// The rows m0.. (< M) and columns n0.. (< N) of a 32 x 32 result into y; row(r, h) points at
// result row r's columns 16 h .. 16 h + 15.
template <typename Row>
static inline void store_edge(float* y, int64_t ldy, int64_t m0, int64_t M, int64_t n0, int64_t N, Row row) {
  const int64_t nn = std::min<int64_t>(32, N - n0);
  const __mmask16 k0 = nn >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nn) - 1);
  const __mmask16 k1 = nn >= 32 ? (__mmask16)0xFFFF : (nn <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nn - 16)) - 1));
  for (int r = 0; r < 32 && m0 + r < M; ++r) {
    _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, k0, _mm512_loadu_ps(row(r, 0)));
    _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0 + 16, k1, _mm512_loadu_ps(row(r, 1)));
  }
}

// y[m * ldy + n] = x[m] . W[n] (m < M, n < N) from x's pieces P (split_x) and the parts' two-piece
// tiles W (build_w2, all 32-row groups one after another): per block five TDPBF16PS into each of
// four accumulator tiles (2 x 16 rows of x by 2 x 16 weight rows), kept on the tile unit over
// all blocks. Tiles: 0..3 accumulators, 4..5 A (x pieces), 6..7 B (weight pieces).
static void amx_q4x2(const uint16_t* P, int64_t M, int64_t Mp, int64_t K, const uint32_t* W, int64_t N,
                     float* y, int64_t ldy) {
  const int64_t nb = tile_blocks(K), npairs = (N + 31) / 32, mpairs = Mp / 32;
  constexpr int64_t CHUNK = 4;  // pairs of x's row tiles per task: their pieces stay in L2 over the groups
  const int64_t nchunks = (mpairs + CHUNK - 1) / CHUNK;
  #pragma omp parallel
  {
    amx_configure();
    alignas(64) float cbuf[4][16][16];
    #pragma omp for schedule(static)
    for (int64_t task = 0; task < nchunks * npairs; ++task) {
      const int64_t mc = task / npairs, np = task % npairs, n0 = 32 * np;
      const uint32_t* Wn = W + np * nb * 4 * 256;
      for (int64_t mp = mc * CHUNK; mp < std::min(mpairs, (mc + 1) * CHUNK); ++mp) {
        const int64_t m0 = 32 * mp;
        const uint16_t* A0 = P + (2 * mp) * nb * 3 * 512;
        const uint16_t* A1 = A0 + nb * 3 * 512;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t b = 0; b < nb; ++b) {
          const uint16_t* a0 = A0 + b * 3 * 512;
          const uint16_t* a1 = A1 + b * 3 * 512;
          const uint32_t* w = Wn + b * 4 * 256;
          // x1 w1, x1 w2, x2 w2, x2 w1, x3 w1 (x3 w2 is below fp32's rounding of the product)
          _tile_loadd(4, a0, 64); _tile_loadd(5, a1, 64);
          _tile_loadd(6, w, 64); _tile_loadd(7, w + 256, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          _tile_loadd(6, w + 512, 64); _tile_loadd(7, w + 768, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          _tile_loadd(4, a0 + 512, 64); _tile_loadd(5, a1 + 512, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          _tile_loadd(6, w, 64); _tile_loadd(7, w + 256, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
          _tile_loadd(4, a0 + 1024, 64); _tile_loadd(5, a1 + 1024, 64);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        if (m0 + 32 <= M && n0 + 32 <= N) {  // straight into y
          float* o = y + m0 * ldy + n0;
          _tile_stored(0, o, ldy * 4); _tile_stored(1, o + 16, ldy * 4);
          _tile_stored(2, o + 16 * ldy, ldy * 4); _tile_stored(3, o + 16 * ldy + 16, ldy * 4);
          continue;
        }
        _tile_stored(0, cbuf[0], 64); _tile_stored(1, cbuf[1], 64);
        _tile_stored(2, cbuf[2], 64); _tile_stored(3, cbuf[3], 64);
        store_edge(y, ldy, m0, M, n0, N, [&](int r, int h) { return cbuf[2 * (r / 16) + h][r % 16]; });
      }
    }
    _tile_release();
  }
}

// The B tiles of weight rows n0..n0+31 of a T_Q4X part (rows past N: zero codes and scales) for
// every block: B[b][t] (t = 0, 1: rows n0 + 16 t ..) is 16 rows r of 16 dwords, dword n the
// bf16 codes of columns 2 r, 2 r + 1 of weight row n0 + 16 t + n; scl/off [b][32].
static void build_b(const uint8_t* base, int64_t stride, int64_t N, int64_t K, int64_t n0, uint32_t* B, float* scl, float* off) {
  const int64_t nblk = K / 32, cb = q4x_code_bytes(nblk);
  // bf16 of 0..15 in the low half of each dword
  const __m512i tbl = _mm512_setr_epi32(0, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100,
                                        0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170);
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(16));
  for (int nn = 0; nn < 32; ++nn) {
    const int64_t n = n0 + nn;
    const int t = nn / 16, col = nn % 16;
    if (n >= N) {
      for (int64_t b = 0; b < nblk; ++b) {
        uint32_t* tile = B + (b * 2 + t) * 256;
        for (int r = 0; r < 16; ++r) tile[r * 16 + col] = 0;
        scl[b * 32 + nn] = 0.f; off[b * 32 + nn] = 0.f;
      }
      continue;
    }
    const uint8_t* row = base + n * stride;
    const float* rs = (const float*)(row + cb);
    for (int64_t b = 0; b < nblk; ++b) {
      __m512i lo, hi;  // lane i: the codes of columns i and 16 + i
      q4x_codes(row, nblk, b, lo, hi);
      // columns 0..15 then 16..31 as 32 bf16 words = 16 dwords, dword r = columns 2r, 2r + 1
      const __m256i wl = _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(lo, tbl));
      const __m256i wh = _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(hi, tbl));
      const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(wl), wh, 1);
      uint32_t* tile = B + (b * 2 + t) * 256;
      _mm512_i32scatter_epi32(tile + col, rows16, pairs, 4);
      scl[b * 32 + nn] = rs[b];
      off[b * 32 + nn] = rs[nblk + b];
    }
  }
}

// y[m * ldy + n] = x[m] . W[n] for a T_Q4X part of N rows (see the NOTE), m < M, n < N.
static void amx_q4x(const uint16_t* P, const float* S, int64_t M, int64_t Mp, int64_t K,
                    const uint8_t* base, int64_t stride, int64_t N, float* y, int64_t ldy) {
  const int64_t nblk = K / 32, nb = tile_blocks(K), npairs = (N + 31) / 32;
  #pragma omp parallel
  {
    amx_configure();
    std::vector<uint32_t> B(nblk * 2 * 256);
    std::vector<float> scl(nblk * 32), off(nblk * 32);
    alignas(64) float cbuf[2][4][16][16];  // block b's sums in cbuf[b % 2], scaled while b + 1 is on the tile unit
    alignas(64) float acc[32][32];
    // acc += block b's sums * its scales + offsets * x's block sums (AVX-512)
    auto scale_add = [&](int64_t m0, int64_t b) __attribute__((always_inline)) {
      float (*c)[16][16] = cbuf[b % 2];
      const __m512 d0 = _mm512_loadu_ps(scl.data() + b * 32), d1 = _mm512_loadu_ps(scl.data() + b * 32 + 16);
      const __m512 o0 = _mm512_loadu_ps(off.data() + b * 32), o1 = _mm512_loadu_ps(off.data() + b * 32 + 16);
      for (int r = 0; r < 32; ++r) {
        const int mt = r / 16, rr = r % 16;
        const __m512 sx = _mm512_set1_ps(S[(m0 + r) * nblk + b]);
        __m512 a0 = _mm512_load_ps(acc[r]), a1 = _mm512_load_ps(acc[r] + 16);
        a0 = _mm512_fmadd_ps(_mm512_load_ps(c[2 * mt][rr]), d0, a0);
        a1 = _mm512_fmadd_ps(_mm512_load_ps(c[2 * mt + 1][rr]), d1, a1);
        _mm512_store_ps(acc[r], _mm512_fmadd_ps(sx, o0, a0));
        _mm512_store_ps(acc[r] + 16, _mm512_fmadd_ps(sx, o1, a1));
      }
    };
    #pragma omp for schedule(static)
    for (int64_t np = 0; np < npairs; ++np) {
      const int64_t n0 = np * 32;
      build_b(base, stride, N, K, n0, B.data(), scl.data(), off.data());
      for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
        for (int r = 0; r < 32; ++r) { _mm512_store_ps(acc[r], _mm512_setzero_ps()); _mm512_store_ps(acc[r] + 16, _mm512_setzero_ps()); }
        for (int64_t b = 0; b < nblk; ++b) {
          _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
          _tile_loadd(6, B.data() + (b * 2) * 256, 64);
          _tile_loadd(7, B.data() + (b * 2 + 1) * 256, 64);
          for (int i = 0; i < 3; ++i) {
            const uint16_t* a = P + ((m0 / 16) * nb + b) * 3 * 512 + i * 512;
            _tile_loadd(4, a, 64);
            _tile_loadd(5, a + nb * 3 * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          if (b > 0) scale_add(m0, b - 1);  // independent of the tile work just issued
          float (*c)[16][16] = cbuf[b % 2];
          _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
        }
        scale_add(m0, nblk - 1);
        store_edge(y, ldy, m0, M, n0, N, [&](int r, int h) { return acc[r] + 16 * h; });
      }
    }
    _tile_release();
  }
}
#endif

// Whether many-row matmuls over repacked parts run on AMX here (kvmesh.model.gguf_amx).
bool gguf_amx() {
#if defined(KVMESH_AMX)
  return amx_ready();
#else
  return false;
#endif
}

// Whether the tile path takes this repacked part in two weight pieces (amx_q4x2), not per block.
bool gguf_amx_two_piece(torch::Tensor part, int64_t K) {
  check_part(part, T_Q4X, K);
#if defined(KVMESH_AMX)
  if (!amx_ready()) return false;
  std::vector<uint32_t> W(tile_blocks(K) * 4 * 256);
  for (int64_t n0 = 0; n0 < part.size(0); n0 += 32)
    if (!build_w2(part.data_ptr<uint8_t>(), part.size(1), part.size(0), K, n0, W.data())) return false;
  return true;
#else
  return false;
#endif
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
  auto y = torch::empty({M, N}, x.options());
#if defined(KVMESH_AMX)
  // repacked 4-bit parts on the tile unit (kvmesh.model.gguf_amx); x split once for all parts,
  // into buffers this thread keeps between calls (no page faults per call)
  thread_local std::vector<uint16_t> pieces;
  thread_local std::vector<float> sums;
  thread_local std::vector<uint32_t> wt;
  const int64_t Mp = (M + 31) / 32 * 32, nb = tile_blocks(K);
  bool split = false;
#endif
  int64_t off = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t Ni = parts[i].size(0);
#if defined(KVMESH_AMX)
    if (types[i] == T_Q4X && M >= 32 && amx_ready()) {
      if (!split) {
        if ((int64_t)pieces.size() < 3 * Mp * nb * 32) pieces.resize(3 * Mp * nb * 32);
        if ((int64_t)sums.size() < Mp * (K / 32)) sums.resize(Mp * (K / 32));
        split_x(x.data_ptr<float>(), M, Mp, K, pieces.data(), sums.data());
        split = true;
      }
      const uint8_t* base = parts[i].data_ptr<uint8_t>();
      const int64_t stride = parts[i].size(1), npairs = (Ni + 31) / 32;
      if ((int64_t)wt.size() < npairs * nb * 4 * 256) wt.resize(npairs * nb * 4 * 256);
      uint32_t* W = wt.data();  // (thread_local: named here, not on the team's threads)
      bool two = true;
      #pragma omp parallel for schedule(static) reduction(&& : two)
      for (int64_t np = 0; np < npairs; ++np)
        two = two && build_w2(base, stride, Ni, K, 32 * np, W + np * nb * 4 * 256);
      if (two) amx_q4x2(pieces.data(), M, Mp, K, W, Ni, y.data_ptr<float>() + off, N);
      else amx_q4x(pieces.data(), sums.data(), M, Mp, K, base, stride, Ni, y.data_ptr<float>() + off, N);
      off += Ni;
      continue;
    }
#endif
    for (int64_t n0 = 0; n0 < Ni; n0 += tile) {
      const int64_t nt = std::min(tile, Ni - n0);
      dequant_rows(parts[i].data_ptr<uint8_t>(), parts[i].size(1), types[i], K, n0, nt, buf.data_ptr<float>());
      // the tile's columns of y in place (a strided output BLAS writes directly): no transpose after
      auto out = y.narrow(1, off + n0, nt);
      at::mm_out(out, x, buf.narrow(0, 0, nt).t());
    }
    off += Ni;
  }
  return y;
}
"""
