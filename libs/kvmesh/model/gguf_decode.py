"""C++ source of the fused GGUF decode step (``gguf_decode``), compiled into kvmesh.model.gguf_native's
extension after its block kernels (it calls their ``Lin``, ``make_lin`` and ``mm_rows``); the
Python side is kvmesh.model.quant.GGUFDecode.

NOTE (what one call does). A step whose T <= 64 rows (GGUF_ROWS) are all decodes (or tokens of a
draft being verified, each a decode row over the same blocks) runs every decoder layer in one OpenMP region:
RMSNorm, qkv (+bias), RoPE, the new keys/values into the paged cache, attention over each row's
blocks in place, o (+bias) + residual, RMSNorm, gate/up, SiLU * up, down + residual, then the
final norm. Each matmul splits its output rows over the team (an orphaned ``omp for``); norms and
SiLU are computed whole by every thread into its own buffer (cheaper than a barrier at a few
rows); attention is one task per (row, query head) below 256 positions of context, and from
there one per (row, KV head, split of the context), each key and value read from memory once for
the KV head's query heads, then a merge of the splits (see attend_rows). The value pass keeps its
accumulators in registers (value_pass, instantiated per head count and head size): the same FMAs
in the same order as the generic loop, so the same bits (checked against the previous build on
SmolLM2-135M, 1-20 rows, 100-1,000 positions), without a load and a store around each FMA. On the
2-core EPYC a 32-row decode step over 1,000 positions went from ~210 to ~160 ms, over 550 from
~127 to ~111, and one row over 1,000 positions from ~9 to ~7.4 ms (one-off timings of the model's
forward, lm_head not included).
Every row is computed alone, so a row's bits do not depend on the rows beside it.
"""

EXP16_SOURCE = r"""
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

"""
"""e^x for 16 fp32 lanes (AVX-512F), shared with kvmesh.model.fused_rows."""

DECODE_SOURCE = r"""
// ---- One decode step of the whole decoder stack in one call (see kvmesh.model.quant.GGUFDecode) ----

#if defined(__AVX512F__)
""" + EXP16_SOURCE[1:] + r"""// The lanes of a 16-float step at i of n that lie inside n.
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

constexpr int64_t ATT_SPLITS = 4, ATT_GROUPED = 256;
// How a row's attention is cut into tasks, a function of its context alone (so a row's bits never
// depend on the rows beside it: a verified draft row attends exactly as a plain decode at its
// position would). One task per KV head and split of the context, all G query heads of the KV
// head together, so each key and value is read from memory once for them; below ATT_GROUPED
// positions the context whole, from there one split per 128 positions up to ATT_SPLITS. (One task
// per query head below ATT_GROUPED, which read each KV row G times, cost a 32-row step at 64-164
// positions 5-6 ms of ~100 in paired A/Bs and gained nothing at 1, 2 or 8 rows: the grouping does
// not change a bit, each head's sums run in the same order either way.)
static inline int64_t att_splits(int64_t ctx) {
  return ctx < ATT_GROUPED ? 1 : std::min<int64_t>(ATT_SPLITS, ctx / 128);
}

// Attention of every row over its ctx[t] cached keys, in up to two passes over OpenMP tasks.
// 1. One task per (row, KV head with its G query heads, split of the context):
//    scores 16 positions at a time with a transposing sum, walking blocks without a division per
//    position; the exact softmax; every value row read once for the task's heads. A row of one
//    split writes its normalised output; otherwise, per (row, query head, split), the split's max
//    score m, l = sum exp(score - m) and the unnormalised sum of exp(score - m) v (`part`, `ml`).
// 2. One task per (row, query head) of a row with several splits: out = sum_s w_s acc_s /
//    sum_s w_s l_s with w_s = exp(m_s - max_s m_s) (the same softmax, regrouped).
// The phase-1 tasks of a step, 4 ints each: row, first query head, heads, split.
static std::vector<int32_t> att_tasks(const Step& s) {
  const int64_t G = s.H / s.KVH;
  std::vector<int32_t> tasks;
  for (int64_t t = 0; t < s.T; ++t) {
    const int64_t S = att_splits(s.ctx[t]);
    for (int64_t h0 = 0; h0 < s.H; h0 += G)
      for (int64_t sp = 0; sp < S; ++sp) tasks.insert(tasks.end(), {(int32_t)t, (int32_t)h0, (int32_t)G, (int32_t)sp});
  }
  return tasks;
}

// The value pass of one task with its HG x NV accumulators in registers (a runtime-sized array
// lives in memory: a load and a store around every FMA). The same FMAs in the same order as the
// generic loop below, so the same bits; block by block, the next block's row prefetched.
template <int HG, int NV>
static void value_pass(const float* vc, const int64_t* blocks, int64_t BS, int64_t p0, int64_t n, int64_t kvw,
                       int64_t kvo, const float* sc, int64_t ld, __m512* out) {
  __m512 acc[HG][NV];
  for (int g = 0; g < HG; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = out[g * NV + j];
  for (int64_t i = 0; i < n;) {
    const int64_t off = (p0 + i) % BS, m = std::min(BS - off, n - i);
    const float* v = vc + (blocks[(p0 + i) / BS] * BS + off) * kvw + kvo;
    const float* next = i + m < n ? vc + blocks[(p0 + i + m) / BS] * BS * kvw + kvo : nullptr;
    for (int64_t o = 0; o < m; ++o, ++i, v += kvw) {
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + o * kvw), _MM_HINT_T0);
      __m512 vv[NV];
      for (int j = 0; j < NV; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
      for (int g = 0; g < HG; ++g) {
        const __m512 p = _mm512_set1_ps(sc[g * ld + i]);
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
      }
    }
  }
  for (int g = 0; g < HG; ++g)
    for (int j = 0; j < NV; ++j) out[g * NV + j] = acc[g][j];
}

using ValuePass = void (*)(const float*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, const float*,
                           int64_t, __m512*);

template <int NV>
static ValuePass value_pass_hg(int64_t hg) {
  switch (hg) {
    case 1: return value_pass<1, NV>;
    case 2: return value_pass<2, NV>;
    case 3: return value_pass<3, NV>;
    case 4: return value_pass<4, NV>;
    case 5: return value_pass<5, NV>;
    case 6: return value_pass<6, NV>;
    case 7: return value_pass<7, NV>;
    case 8: return value_pass<8, NV>;
  }
  return nullptr;
}

// The register-resident value pass for hg heads of nv 16-float vectors, or nullptr (the generic loop).
static inline ValuePass value_pass_for(int64_t hg, int64_t nv) {
  switch (nv) {
    case 1: return value_pass_hg<1>(hg);
    case 2: return value_pass_hg<2>(hg);
    case 4: return value_pass_hg<4>(hg);
    case 8: return value_pass_hg<8>(hg);
  }
  return nullptr;
}

// `tasks`: att_tasks(s); `several`: whether any row has more than one split.
static void attend_rows(const float* qkv, int64_t ldq, const Step& s, const float* kc, const float* vc,
                        const std::vector<int32_t>& tasks, float* part, float* ml, bool several, float* out) {
  const int64_t G = s.H / s.KVH, kvw = s.KVH * s.hd, nv = s.hd / 16;
  #pragma omp for schedule(dynamic, 1)
  for (int64_t task = 0; task < (int64_t)tasks.size() / 4; ++task) {
    const int64_t t = tasks[4 * task], h0 = tasks[4 * task + 1], hg = tasks[4 * task + 2], sp = tasks[4 * task + 3];
    const int64_t ctx = s.ctx[t], S = att_splits(ctx);
    const int64_t p0 = ctx * sp / S, n = ctx * (sp + 1) / S - p0, kvo = (h0 / G) * s.hd;
    const int64_t* blocks = s.bt + t * s.W;
    thread_local std::vector<float> sc;
    sc.resize(hg * (n + 16));
    float mg[64], lg[64];  // per query head of the task (G <= 64)
    for (int64_t g = 0; g < hg; ++g) {
      const float* q = qkv + t * ldq + (h0 + g) * s.hd;
      float* scg = sc.data() + g * (n + 16);
      __m512 qv[16];
      for (int64_t j = 0; j < nv; ++j) qv[j] = _mm512_loadu_ps(q + 16 * j);
      __m512 mxv = _mm512_set1_ps(-INFINITY);
      int64_t blk = p0 / s.BS, off = p0 % s.BS;  // the block and offset of position p0 + i, walked forward
      for (int64_t i0 = 0; i0 < n; i0 += 16) {
        __m512 a[16];
        for (int i = 0; i < 16; ++i) {
          if (i0 + i >= n) { a[i] = _mm512_setzero_ps(); continue; }
          const float* k = kc + (blocks[blk] * s.BS + off) * kvw + kvo;
          if (++off == s.BS) { off = 0; ++blk; }
          __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
          for (int64_t j = 1; j < nv; ++j) acc = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k + 16 * j), acc);
          a[i] = acc;
        }
        const __mmask16 mk = lanes(i0, n);
        const __m512 v = _mm512_mul_ps(sum16(a), _mm512_set1_ps(s.scale));
        _mm512_mask_storeu_ps(scg + i0, mk, v);
        mxv = _mm512_mask_max_ps(mxv, mk, mxv, v);
      }
      const float mx = _mm512_reduce_max_ps(mxv);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i0 = 0; i0 < n; i0 += 16) {
        const __mmask16 mk = lanes(i0, n);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mk, scg + i0), _mm512_set1_ps(mx)));
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(mk, e));
        _mm512_mask_storeu_ps(scg + i0, mk, e);
      }
      mg[g] = mx;
      lg[g] = _mm512_reduce_add_ps(sum);
    }
    // the values, block by block, each row read once for the task's heads; acc[g * nv + j]
    __m512 accs[64];
    thread_local std::vector<__m512> accv;
    __m512* acc = accs;
    if (hg * nv > 64) {
      accv.resize(hg * nv);
      acc = accv.data();
    }
    for (int64_t j = 0; j < hg * nv; ++j) acc[j] = _mm512_setzero_ps();
    const ValuePass fixed = value_pass_for(hg, nv);
    if (fixed != nullptr) fixed(vc, blocks, s.BS, p0, n, kvw, kvo, sc.data(), n + 16, acc);
    for (int64_t i = fixed != nullptr ? n : 0; i < n;) {
      const int64_t off = (p0 + i) % s.BS, m = std::min(s.BS - off, n - i);
      const float* v = vc + (blocks[(p0 + i) / s.BS] * s.BS + off) * kvw + kvo;
      if (hg == 1) {
        for (int64_t o = 0; o < m; ++o, ++i, v += kvw) {
          const __m512 p = _mm512_set1_ps(sc[i]);
          for (int64_t j = 0; j < nv; ++j) acc[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * j), acc[j]);
        }
        continue;
      }
      for (int64_t o = 0; o < m; ++o, ++i, v += kvw) {
        __m512 vv[16];
        for (int64_t j = 0; j < nv; ++j) vv[j] = _mm512_loadu_ps(v + 16 * j);
        for (int64_t g = 0; g < hg; ++g) {
          const __m512 p = _mm512_set1_ps(sc[g * (n + 16) + i]);
          for (int64_t j = 0; j < nv; ++j) acc[g * nv + j] = _mm512_fmadd_ps(p, vv[j], acc[g * nv + j]);
        }
      }
    }
    for (int64_t g = 0; g < hg; ++g) {
      const int64_t head = h0 + g;
      if (S == 1) {  // the whole context: normalise into the output now
        const __m512 inv = _mm512_set1_ps(1.f / lg[g]);
        float* o = out + t * s.H * s.hd + head * s.hd;
        for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(o + 16 * j, _mm512_mul_ps(acc[g * nv + j], inv));
        continue;
      }
      const int64_t at = (t * s.H + head) * ATT_SPLITS + sp;
      for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(part + at * s.hd + 16 * j, acc[g * nv + j]);
      ml[2 * at] = mg[g];
      ml[2 * at + 1] = lg[g];
    }
  }
  if (!several) return;
  #pragma omp for schedule(static)
  for (int64_t task = 0; task < s.T * s.H; ++task) {
    const int64_t t = task / s.H, S = att_splits(s.ctx[t]);
    if (S == 1) continue;
    const float* m = ml + 2 * task * ATT_SPLITS;
    float mx = m[0];
    for (int64_t sp = 1; sp < S; ++sp) mx = std::max(mx, m[2 * sp]);
    __m512 o[16];
    for (int64_t j = 0; j < nv; ++j) o[j] = _mm512_setzero_ps();
    float l = 0.f;
    for (int64_t sp = 0; sp < S; ++sp) {
      const float w = std::exp(m[2 * sp] - mx);
      l += w * m[2 * sp + 1];
      const float* a = part + (task * ATT_SPLITS + sp) * s.hd;
      for (int64_t j = 0; j < nv; ++j) o[j] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(a + 16 * j), o[j]);
    }
    const __m512 inv = _mm512_set1_ps(1.f / l);
    float* dst = out + t * s.H * s.hd + (task % s.H) * s.hd;
    for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(dst + 16 * j, _mm512_mul_ps(o[j], inv));
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
  std::vector<float> att_part(T * heads * ATT_SPLITS * hd), att_ml(T * heads * ATT_SPLITS * 2);
  bool several = false;  // a row whose attention is split (then a merge pass runs)
  for (int64_t t = 0; t < T; ++t) several = several || att_splits(s.ctx[t]) > 1;
  const std::vector<int32_t> tasks = att_tasks(s);
  TORCH_CHECK(heads / kv_heads <= 64, "gguf_decode: at most 64 query heads per KV head");
  auto out = torch::empty({T, D}, h.options());
  float* hp = h.data_ptr<float>();
  const float e = (float)eps;
  TeamSlots team;  // the matmuls' work split (kvmesh.model.gguf_team)
  #pragma omp parallel
  {
    team_begin(&team);
    // per thread: the normed rows and the SiLU products, which every thread computes whole and
    // reads whole (the matmuls that follow need all of them): two barriers a layer fewer
    std::vector<float> xn(T * D), act(T * I);
    for (int64_t l = 0; l < L; ++l) {
      float* kc = k_caches[l].data_ptr<float>();
      float* vc = v_caches[l].data_ptr<float>();
      rms_rows(hp, norms[2 * l].data_ptr<float>(), T, D, e, xn.data());
      mm_rows<false>(xn.data(), T, lins[4 * l], qkv.data(), Nqkv);
      rope_store(qkv.data(), Nqkv, s, kc, vc);
      attend_rows(qkv.data(), Nqkv, s, kc, vc, tasks, att_part.data(), att_ml.data(), several, att.data());
      mm_rows<true>(att.data(), T, lins[4 * l + 1], hp, D);
      rms_rows(hp, norms[2 * l + 1].data_ptr<float>(), T, D, e, xn.data());
      mm_rows<false>(xn.data(), T, lins[4 * l + 2], gu.data(), 2 * I);
      silu_mul_rows(gu.data(), T, I, act.data());
      mm_rows<true>(act.data(), T, lins[4 * l + 3], hp, D);
    }
    #pragma omp single
    rms_rows(hp, norms[2 * L].data_ptr<float>(), T, D, e, out.data_ptr<float>());
    team_end();
  }
  return out;
#endif
}
"""
