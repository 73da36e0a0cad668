"""C++ source of the one-row decode matmul (``mm_rows1``), composed into kvmesh.model.gguf_native's
extension after its per-row kernels (it uses ``iota16``, ``bcast_half``, ``q4x_code_bytes``,
``row_dot``, ``prefetch_ahead``, ``Lin``, ``NA``); ``mm_rows`` calls it when x has one row.

NOTE. A decode step multiplies one row of x by every weight row. ``row_dot<1>`` did that one
weight row per call: per row a call, the type switch, the block counts, the partial last quad
set up, four chains summed and reduced. At K = 576 (SmolLM2-135M's q/k/v, o and gate/up rows: 4.5
quads of 128 weights a row) that cost showed: per quad ~27 cycles at K = 576 against ~19 at
K = 1,536 (2-core Ice Lake Xeon, weights in L2). Here R1 consecutive weight rows of one part go
through one loop abreast: x is loaded once for the R1 rows, their independent FMA chains
interleave, and the set-up is paid once per group. Each output keeps row_dot's arithmetic
exactly -- the same table FMA per sub-block, the same slot per 16 weights, the FMAs into a slot
in the same order, the same final sums -- so the same bits as row_dot<1>, row_dot<M> and the
blocked path (tested bit for bit). Types other than the repacked 4-bit rows and Q8_0, and a
part's odd last row, go row by row as before.
Measured (one-off, A/B in one process, 2 threads): the L2-resident matmuls q/k/v 33 -> 28 us,
gate/up 97 -> 81, down 36 -> 34; a whole one-row decode step of SmolLM2-135M (fused decoder +
lm_head, ~100-200 positions) 11.1-11.8 -> 10.5-10.8 ms (medians of three A/B runs). R1 = 4 was
slower (16 accumulators and four rows' codes spill registers: the decoder's matmuls 8.0 -> 9.5
ms); a dynamic schedule was slower too (rows no longer consecutive per thread for the prefetch).
"""

ROWS1_SOURCE = r"""
#if defined(__AVX512F__)
// ---- One row of x against R weight rows at a time (see kvmesh.model.gguf_rows1) ----
constexpr int R1 = 2;  // weight rows per group
constexpr int64_t ROWS1_CHUNK = 16;  // groups a thread claims at a time (kvmesh.model.gguf_team)

template <int B> static inline __m512i shift_bytes(__m512i v) { return B == 0 ? v : _mm512_bsrli_epi128(v, B); }

// out[r] = x . row r for R repacked 4-bit rows (T_Q4X): decode_row's T_Q4X walk, R rows abreast.
template <int R>
static void q4x_rows1(const uint8_t* const* rows, int64_t K, const float* x, float* out) {
  const __m512 codes = iota16();
  const int64_t nblk = K / 32, G = nblk / 4, rest = nblk % 4, cb = q4x_code_bytes(nblk);
  __m512 acc[R][NA];
  const float* scl[R];
  const float* off[R];
  for (int r = 0; r < R; ++r) {
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
    scl[r] = (const float*)(rows[r] + cb);
    off[r] = scl[r] + nblk;
  }
  auto sub = [&](auto s0, auto s1, auto b, const __m512i* v, const __m512i* h, int64_t j0) __attribute__((always_inline)) {
    constexpr int S0 = decltype(s0)::value, S1 = decltype(s1)::value, B = decltype(b)::value;
    const __m512 x0 = _mm512_loadu_ps(x + 32 * (j0 + B)), x1 = _mm512_loadu_ps(x + 32 * (j0 + B) + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 tbl = _mm512_fmadd_ps(codes, _mm512_set1_ps(scl[r][j0 + B]), _mm512_set1_ps(off[r][j0 + B]));
      acc[r][S0] = _mm512_fmadd_ps(x0, _mm512_permutexvar_ps(shift_bytes<B>(v[r]), tbl), acc[r][S0]);
      acc[r][S1] = _mm512_fmadd_ps(x1, _mm512_permutexvar_ps(shift_bytes<B>(h[r]), tbl), acc[r][S1]);
    }
  };
  auto quad = [&](const __m512i* v, int64_t j0, int n) __attribute__((always_inline)) {
    __m512i h[R];
    for (int r = 0; r < R; ++r) h[r] = _mm512_srli_epi32(v[r], 4);
    sub(Slot<0>{}, Slot<1>{}, Slot<0>{}, v, h, j0);
    if (n > 1) sub(Slot<2>{}, Slot<3>{}, Slot<1>{}, v, h, j0);
    if (n > 2) sub(Slot<0>{}, Slot<1>{}, Slot<2>{}, v, h, j0);
    if (n > 3) sub(Slot<2>{}, Slot<3>{}, Slot<3>{}, v, h, j0);
  };
  __m512i v[R];
  for (int64_t g = 0; g < G; ++g) {
    for (int r = 0; r < R; ++r) v[r] = _mm512_loadu_si512(rows[r] + 64 * g);
    quad(v, 4 * g, 4);
  }
  if (rest) {
    for (int r = 0; r < R; ++r) {
      const uint8_t* tail = rows[r] + 64 * G;
      v[r] = rest == 1 ? _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)tail))
           : rest == 2 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)tail))
                       : _mm512_loadu_si512(tail);
    }
    quad(v, 4 * G, (int)rest);
  }
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

// out[r] = x . row r for R Q8_0 rows: decode_row's T_Q8_0 walk, R rows abreast.
template <int R>
static void q8_rows1(const uint8_t* const* rows, int64_t K, const float* x, float* out) {
  __m512 acc[R][NA];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < NA; ++a) acc[r][a] = _mm512_setzero_ps();
  auto block = [&](int64_t b, auto s0, auto s1) __attribute__((always_inline)) {
    constexpr int S0 = decltype(s0)::value, S1 = decltype(s1)::value;
    const __m512 x0 = _mm512_loadu_ps(x + 32 * b), x1 = _mm512_loadu_ps(x + 32 * b + 16);
    for (int r = 0; r < R; ++r) {
      const uint8_t* p = rows[r] + 34 * b;
      const __m512 d = bcast_half(p);
      const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)))), d);
      const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 18)))), d);
      acc[r][S0] = _mm512_fmadd_ps(x0, w0, acc[r][S0]);
      acc[r][S1] = _mm512_fmadd_ps(x1, w1, acc[r][S1]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= K / 32; b += 2) { block(b, Slot<0>{}, Slot<1>{}); block(b + 1, Slot<2>{}, Slot<3>{}); }
  if (b < K / 32) block(b, Slot<0>{}, Slot<1>{});
  for (int r = 0; r < R; ++r)
    out[r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
}

// n (<= R1) weight rows of type t, row i at rows[i]: out[i] = x . row i.
static void rows1(const uint8_t* const* rows, int n, int64_t t, int64_t K, const float* x, float* out) {
  if (n == R1 && t == T_Q4X) { q4x_rows1<R1>(rows, K, x, out); return; }
  if (n == R1 && t == T_Q8_0) { q8_rows1<R1>(rows, K, x, out); return; }
  for (int i = 0; i < n; ++i) row_dot<1>(rows[i], t, K, x, out + i);
}

// mm_rows for one row of x (every part a fast type): y[n] = x . W[n] (+ bias[n]), or with ADD
// y[n] += that. Groups of R1 consecutive rows of one part (a part's last group may be shorter),
// the groups split over the calling team by team_for (static ranges, the last chunks stolen).
template <bool ADD>
static void mm_rows1(const float* x, const Lin& L, float* y) {
  const size_t P = L.base.size();
  int64_t gfirst[17];  // first group of each part, then the total (mm_rows sends at most 16 parts here)
  gfirst[0] = 0;
  for (size_t p = 0; p < P; ++p) gfirst[p + 1] = gfirst[p] + (L.first[p + 1] - L.first[p] + R1 - 1) / R1;
  team_for(gfirst[P], ROWS1_CHUNK, [&](int64_t g0, int64_t g1) __attribute__((always_inline)) {
  for (int64_t g = g0; g < g1; ++g) {
    size_t p = 0;
    while (gfirst[p + 1] <= g) ++p;
    const int64_t rows_p = L.first[p + 1] - L.first[p], i0 = (g - gfirst[p]) * R1;
    const int n = (int)std::min<int64_t>(R1, rows_p - i0);
    const uint8_t* rows[R1];
    for (int i = 0; i < n; ++i) {
      rows[i] = L.base[p] + (i0 + i) * L.stride[p];
      prefetch_ahead(rows[i], i0 + i, rows_p, L.stride[p]);
    }
    float dots[R1];
    rows1(rows, n, L.type[p], L.K, x, dots);
    for (int i = 0; i < n; ++i) {
      const int64_t o = L.first[p] + i0 + i;
      const float v = L.bias ? dots[i] + L.bias[o] : dots[i];
      y[o] = ADD ? v + y[o] : v;
    }
  }
  });
}
#endif
"""
