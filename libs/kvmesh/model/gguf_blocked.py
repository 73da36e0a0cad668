"""The GGUF block kernels' batched path (C++ source composed into kvmesh.model.gguf_native's
extension, after its per-row kernels, whose ``decode_row``, ``Lin``, ``NA`` and ``RB`` it uses):
``mm_rows`` calls ``mm_rows_blocked`` for more than RB rows of x.

NOTE. Re-decoding each block once per RB rows of x (row_dot's way) costs more than the FMAs past
4 rows. Here each weight row is decoded once into a buffer, and 4 rows of x meet 5 weight rows at
a time, one of row_dot's NA chains at a time (20 accumulators in registers), so every (row,
output) pair is summed in row_dot's order: the same bits at any M up to gguf_native's MAX_ROWS.
Measured over SmolLM2-135M's 120 decoder matmuls at 2 threads: 88 -> 48 ms at 32 rows (143
GFLOP/s, ~60% of the FMA peak: the per-chain passes over K = 576 are short, and their stores and
lane sums are the rest), 18 -> 16 ms at 8. Letting the compiler fold loads into the FMAs made
it twice as slow (each vector loaded once per FMA); an empty asm keeps them in registers.
"""
from __future__ import annotations

BLOCKED_SOURCE = r"""
#if defined(__AVX512F__)
// The blocked path (M > RB): each weight row is decoded once into a buffer (decode_row's values),
// then MR rows of x meet NR weight rows at a time, 16 columns per step. Chunk j (columns 16 j ..
// 16 j + 15) goes to the same one of the NA chains as in row_dot -- j % 4, or (j % 8) / 2 for
// Q6_K, whose decode_row emits in that pattern -- each chain in increasing j, and the chains and
// lanes are summed as row_dot sums them: the same bits as row_dot for every (m, n), whatever M.
constexpr int MR = 4, NR = 5;  // one chain at a time: MR x NR accumulators + MR + NR loads in registers
constexpr int64_t TILE_BYTES = 64 * 1024;  // decoded weight rows per tile (per thread), ~L2

// The chunks j of chain c, in increasing order: j = c, c + 4, ... (Q4_0/Q4_1/Q8_0/Q4_K), or
// j = 8 i + 2 c and 8 i + 2 c + 1 (Q6_K).
template <int mr, int nr, bool Q6K>
static void tile_dot(const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  __m512 part[NA][mr][nr];
  const int64_t J = K / 16;
  for (int c = 0; c < NA; ++c) {
    __m512 acc[mr][nr];
    for (int m = 0; m < mr; ++m)
      for (int n = 0; n < nr; ++n) acc[m][n] = _mm512_setzero_ps();
    auto step = [&](int64_t j) __attribute__((always_inline)) {
      __m512 xv[mr], wv[nr];
      for (int m = 0; m < mr; ++m) xv[m] = _mm512_loadu_ps(x + m * K + 16 * j);
      for (int n = 0; n < nr; ++n) wv[n] = _mm512_loadu_ps(w + n * K + 16 * j);
      // each loaded vector in a register, used by all its FMAs (folded into them as a memory
      // operand, it would be loaded once per FMA)
      for (int m = 0; m < mr; ++m) asm volatile("" : "+v"(xv[m]));
      for (int n = 0; n < nr; ++n) asm volatile("" : "+v"(wv[n]));
      for (int m = 0; m < mr; ++m)
        for (int n = 0; n < nr; ++n) acc[m][n] = _mm512_fmadd_ps(xv[m], wv[n], acc[m][n]);
    };
    if (Q6K) {
      for (int64_t j = 2 * c; j < J; j += 8) { step(j); step(j + 1); }
    } else {
      for (int64_t j = c; j < J; j += 4) step(j);
    }
    for (int m = 0; m < mr; ++m)
      for (int n = 0; n < nr; ++n) part[c][m][n] = acc[m][n];
  }
  for (int m = 0; m < mr; ++m)
    for (int n = 0; n < nr; ++n) {
      const __m512 s = _mm512_add_ps(_mm512_add_ps(part[0][m][n], part[1][m][n]), _mm512_add_ps(part[2][m][n], part[3][m][n]));
      out[m * ldo + n] = _mm512_reduce_add_ps(s);
    }
}

template <int mr, bool Q6K>
static void tile_dot_n(int nr, const float* x, int64_t K, const float* w, float* out, int64_t ldo) {
  switch (nr) {
    case 1: tile_dot<mr, 1, Q6K>(x, K, w, out, ldo); break;
    case 2: tile_dot<mr, 2, Q6K>(x, K, w, out, ldo); break;
    case 3: tile_dot<mr, 3, Q6K>(x, K, w, out, ldo); break;
    case 4: tile_dot<mr, 4, Q6K>(x, K, w, out, ldo); break;
    default: tile_dot<mr, NR, Q6K>(x, K, w, out, ldo); break;
  }
}

// dots[m * ldo + i] = x[m] . (decoded row i of w) for m < M, i < nt: w holds nt rows of K floats.
template <bool Q6K>
static void block_dots(const float* x, int64_t M, int64_t K, const float* w, int64_t nt, float* dots, int64_t ldo) {
  for (int64_t i0 = 0; i0 < nt; i0 += NR) {  // NR weight rows stay in L1 while every x pair passes
    const int nr = (int)std::min<int64_t>(NR, nt - i0);
    int64_t m0 = 0;
    for (; m0 + MR <= M; m0 += MR) tile_dot_n<MR, Q6K>(nr, x + m0 * K, K, w + i0 * K, dots + m0 * ldo + i0, ldo);
    float* o = dots + m0 * ldo + i0;
    switch (M - m0) {
      case 1: tile_dot_n<1, Q6K>(nr, x + m0 * K, K, w + i0 * K, o, ldo); break;
      case 2: tile_dot_n<2, Q6K>(nr, x + m0 * K, K, w + i0 * K, o, ldo); break;
      case 3: tile_dot_n<3, Q6K>(nr, x + m0 * K, K, w + i0 * K, o, ldo); break;
      default: break;
    }
  }
}

// mm_rows for M > RB (every part a fast type): the output rows in tiles of decoded weights, the
// tiles split over the calling team (team_for: static ranges, the last tiles stolen); each tile's rows are decoded once (not once per RB rows of
// x, as row_dot would) and meet all M rows in block_dots. Same bits as mm_rows' per-row path.
template <bool ADD>
static void mm_rows_blocked(const float* x, int64_t M, const Lin& L, float* y, int64_t ldy) {
  const int64_t K = L.K;
  const int64_t nt_max = std::max<int64_t>(NR, TILE_BYTES / (4 * K) / NR * NR);
  const int64_t tiles = (L.N + nt_max - 1) / nt_max;
  team_for(tiles, 1, [&](int64_t tile0, int64_t tile1) {
  for (int64_t tile = tile0; tile < tile1; ++tile) {
    thread_local std::vector<float> wbuf, dots;
    const int64_t n0 = tile * nt_max, n1 = std::min(n0 + nt_max, L.N);
    size_t p = 0;
    for (int64_t s0 = n0; s0 < n1;) {  // the tile's runs, one per part it spans (types may differ)
      while (L.first[p + 1] <= s0) ++p;
      const int64_t s1 = std::min(n1, L.first[p + 1]);
      const int64_t nt = s1 - s0, tp = L.type[p];
      wbuf.resize(nt * K);
      dots.resize(M * nt);
      for (int64_t i = 0; i < nt; ++i) {
        const uint8_t* row = L.base[p] + (s0 + i - L.first[p]) * L.stride[p];
        prefetch_ahead(row, s0 + i - L.first[p], L.first[p + 1] - L.first[p], L.stride[p]);
        float* out = wbuf.data() + i * K;
        decode_row(row, tp, K, [&](auto, int64_t k0, __m512 w) { _mm512_storeu_ps(out + k0, w); });
      }
      if (tp == T_Q6_K) block_dots<true>(x, M, K, wbuf.data(), nt, dots.data(), nt);
      else block_dots<false>(x, M, K, wbuf.data(), nt, dots.data(), nt);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t i = 0; i < nt; ++i) {
          const int64_t n = s0 + i;
          const float d = dots[m * nt + i];
          const float v = L.bias ? d + L.bias[n] : d;
          float& o = y[m * ldy + n];
          o = ADD ? v + o : v;
        }
      s0 = s1;
    }
  }
  });
}
#endif
"""
