"""The GGUF kernels' prefill path, ``gguf_mm_tiled`` (C++ source composed into
kvmesh.model.gguf_native's extension after its kernels, whose ``q4x_code_bytes``,
``check_part`` and ``dequant_rows`` it uses): a matmul of many rows, part by part, either a
cache-sized tile of dequantized weights at a time through torch's dense matmul (see
gguf_native's NOTE), or -- a repacked 4-bit part (``T_Q4X``) where the CPU has AMX-BF16 and
Linux grants the process its tile state -- on the tile unit, exactly, as below.

NOTE (exact, not bf16). A weight of a ``T_Q4X`` row is ``code * scale + offset`` for its block of
32, the code an integer 0..15 -- exact in bf16. Each activation x is split into three bf16 numbers
whose sum is x exactly (x1 = bf16(x), x2 = bf16(x - x1), x3 = x - x1 - x2: 8 + 8 + 8 significant
bits cover fp32's 24), so every product a tile multiply forms (bf16 x bf16, exact in fp32) is a
product of the fp32 activation with the code, summed in fp32. Per block of 32: the tile unit
sums x . codes over the block (three TDPBF16PS, one per piece, into one accumulator tile), then
AVX-512 multiplies that by the block's scale and adds offset * (sum of x over the block): the
dequantized model's dot product up to float rounding (summation order and the distributive law),
with no activation or weight rounded to fewer bits. ``KVMESH_AMX=0`` turns the path off.

NOTE (layout). C[m][n] = sum_k A[m][k] B[k][n]: A tiles are 16 rows of x's pieces (bf16, row
major, 32 columns = one block), B tiles the block's codes of 16 weight rows in the tile unit's
pair layout (row r holds the codes of columns 2r and 2r + 1 for each of the 16 weight rows),
built once per 32 weight rows for all blocks and reused by every 32 rows of x. Four accumulator
tiles (2 x 16 rows of x by 2 x 16 weight rows) keep four independent chains in the tile unit;
their block sums go through L1 to the scale FMAs, which run beside the next block's tile work.
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
  _tile_loadconfig(&cfg);
}
#endif
"""
"""The tile unit's set-up, shared by the AMX kernels (this one and kvmesh.model.amx_attention):
where the compiler targets AMX-BF16 it defines KVMESH_AMX, ``amx_ready()`` (Linux granted the
tile state and KVMESH_AMX is not 0) and ``amx_configure()`` (8 tiles of 16 rows x 64 bytes)."""

AMX_SOURCE = AMX_TILE_SOURCE + r"""
#if defined(KVMESH_AMX)
// Tiles here: 0..3 the accumulators, 4..5 A (x pieces), 6..7 B (codes).

static inline __m512 bf16_widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// x [M, K] fp32 -> three bf16 pieces [3][Mp][K] summing to x exactly (rows M..Mp zero), and the
// block sums S [Mp][K / 32] (fp32).
static void split_x(const float* x, int64_t M, int64_t Mp, int64_t K, uint16_t* pieces, float* S) {
  const int64_t nblk = K / 32;
  #pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < Mp; ++m) {
    uint16_t* p0 = pieces + m * K;
    uint16_t* p1 = pieces + (Mp + m) * K;
    uint16_t* p2 = pieces + (2 * Mp + m) * K;
    if (m >= M) {
      std::memset(p0, 0, K * 2); std::memset(p1, 0, K * 2); std::memset(p2, 0, K * 2);
      for (int64_t b = 0; b < nblk; ++b) S[m * nblk + b] = 0.f;
      continue;
    }
    const float* xm = x + m * K;
    for (int64_t b = 0; b < nblk; ++b) {
      __m512 sum = _mm512_setzero_ps();
      for (int h = 0; h < 2; ++h) {
        const int64_t k = 32 * b + 16 * h;
        const __m512 v = _mm512_loadu_ps(xm + k);
        sum = _mm512_add_ps(sum, v);
        const __m256i a = (__m256i)_mm512_cvtneps_pbh(v);
        const __m512 r1 = _mm512_sub_ps(v, bf16_widen(a));
        const __m256i b2 = (__m256i)_mm512_cvtneps_pbh(r1);
        const __m512 r2 = _mm512_sub_ps(r1, bf16_widen(b2));
        const __m256i c = (__m256i)_mm512_cvtneps_pbh(r2);
        _mm256_storeu_si256((__m256i*)(p0 + k), a);
        _mm256_storeu_si256((__m256i*)(p1 + k), b2);
        _mm256_storeu_si256((__m256i*)(p2 + k), c);
      }
      S[m * nblk + b] = _mm512_reduce_add_ps(sum);
    }
  }
}

// The B tiles of weight rows n0..n0+31 of a T_Q4X part (rows past N: zero codes and scales) for
// every block: B[b][t] (t = 0, 1: rows n0 + 16 t ..) is 16 rows r of 16 dwords, dword n the
// bf16 codes of columns 2 r, 2 r + 1 of weight row n0 + 16 t + n; scl/off [b][32].
static void build_b(const uint8_t* base, int64_t stride, int64_t N, int64_t K, int64_t n0, uint32_t* B, float* scl, float* off) {
  const int64_t nblk = K / 32, G = nblk / 4, rest = nblk % 4, cb = q4x_code_bytes(nblk);
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
      const int64_t g = b / 4, s = b % 4;
      __m512i v;
      if (g < G) v = _mm512_loadu_si512(row + 64 * g);
      else if (rest == 1) v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + 64 * G)));
      else if (rest == 2) v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(row + 64 * G)));
      else v = _mm512_loadu_si512(row + 64 * G);
      const __m512i lo = _mm512_srli_epi32(v, (unsigned)(8 * s));  // lane i: code of column i (low 4 bits)
      const __m512i hi = _mm512_srli_epi32(v, (unsigned)(8 * s + 4));  // lane i: column 16 + i
      // columns 0..15 then 16..31 as 32 bf16 words = 16 dwords, dword r = columns 2r, 2r + 1
      const __m256i wl = _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(_mm512_and_si512(lo, _mm512_set1_epi32(15)), tbl));
      const __m256i wh = _mm512_cvtepi32_epi16(_mm512_permutexvar_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(15)), tbl));
      const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(wl), wh, 1);
      uint32_t* tile = B + (b * 2 + t) * 256;
      _mm512_i32scatter_epi32(tile + col, rows16, pairs, 4);
      scl[b * 32 + nn] = rs[b];
      off[b * 32 + nn] = rs[nblk + b];
    }
  }
}

// y[m * ldy + n] = x[m] . W[n] for a T_Q4X part of N rows (see the NOTE), m < M, n < N.
static void amx_q4x(const uint16_t* pieces, const float* S, int64_t M, int64_t Mp, int64_t K,
                    const uint8_t* base, int64_t stride, int64_t N, float* y, int64_t ldy) {
  const int64_t nblk = K / 32, npairs = (N + 31) / 32;
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
            const uint16_t* a = pieces + (i * Mp + m0) * K + 32 * b;
            _tile_loadd(4, a, K * 2);
            _tile_loadd(5, a + 16 * K, K * 2);
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
        const int64_t nn = std::min<int64_t>(32, N - n0);
        const __mmask16 k0 = nn >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nn) - 1);
        const __mmask16 k1 = nn >= 32 ? (__mmask16)0xFFFF : (nn <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nn - 16)) - 1));
        for (int r = 0; r < 32 && m0 + r < M; ++r) {
          _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0, k0, _mm512_load_ps(acc[r]));
          _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0 + 16, k1, _mm512_load_ps(acc[r] + 16));
        }
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
  // repacked 4-bit parts on the tile unit, exact (kvmesh.model.gguf_amx); x split once for all
  std::vector<uint16_t> pieces;
  std::vector<float> sums;
  const int64_t Mp = (M + 31) / 32 * 32;
#endif
  int64_t off = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t Ni = parts[i].size(0);
#if defined(KVMESH_AMX)
    if (types[i] == T_Q4X && M >= 32 && amx_ready()) {
      if (pieces.empty()) {
        pieces.resize(3 * Mp * K);
        sums.resize(Mp * (K / 32));
        split_x(x.data_ptr<float>(), M, Mp, K, pieces.data(), sums.data());
      }
      amx_q4x(pieces.data(), sums.data(), M, Mp, K, parts[i].data_ptr<uint8_t>(), parts[i].size(1), Ni,
              y.data_ptr<float>() + off, N);
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
