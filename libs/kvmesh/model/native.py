"""Native CPU kernels, compiled on first use: decode attention that reads the paged KV cache in
place, a skinny fp32 matmul for steps of 1-8 rows, and the per-token int8 quantization and
rescale of W8A8 matmuls.

NOTE (why, and what). The torch path of decode attention (kvmesh.model.attention) first copies
every decode row's KV blocks into a dense buffer with ``index_select`` and then runs SDPA over
it: the context is read, written and read again, and on this 2-core CPU that copy was the
largest part of a 32-sequence decode step's attention (~15 ms of ~26 ms, one-off profiling).
``paged_decode_kernel()`` returns a kernel that computes the same attention straight from the cache: one task per
(decode row, KV head), the query heads sharing that KV head together (GQA), scores over the
row's blocks, an exact softmax (max-subtracted, two passes over the scores), then the weighted
sum of values -- keys and values each read once, nothing copied. fp32 only; rows may have
different contexts (no padding, no mask). With AVX-512 and head sizes of 64 or 128, each task is
written with intrinsics for its number of query heads (1-8): the query vectors and the output
accumulators stay in registers, each key row is loaded once for all of them, blocks are walked
without a division per position and the next block's row is prefetched. The plain loops it
replaced (kept for other CPUs and head sizes) kept partial sums and outputs in memory; on the
2-core EPYC (one-off timing, 30 rows x 550 positions x 30 layers of SmolLM2-135M) they took 78-91
ms a step (~10 GB/s of KV), the intrinsics 36-41 ms (~21 GB/s). Decode rows beside a prefill
chunk take this kernel (steps of decodes only take kvmesh.model.gguf_decode's). It is an
ordinary C++ function compiled with ``torch.utils.cpp_extension.load_inline`` (g++, ninja; ~30 s once, then cached under the
kvmesh cache directory), vectorised by the compiler (-O3 -march=native, explicit 16-lane
partial sums; -ffast-math for a vectorised exp) and split over the calling thread's OpenMP team
(the extension links libgomp.so.1 by soname, which resolves to the copy torch already loaded, so
the process keeps one OpenMP runtime and one team; see the comment at the loop for why not
at::parallel_for). Where it cannot be built (no compiler, another
platform) or ``KVMESH_NATIVE=0``, ``paged_decode_kernel()`` is None and the torch path runs:
the kernel is an optimisation, never a requirement -- unless ``KVMESH_NATIVE=1`` asks for it,
and then a build failure is an error carrying the compiler's output (so a broken kernel fails a
test run instead of silently skipping the kernel's tests). Its results match SDPA's to float
rounding (summation order differs), which the tests check.

NOTE (linear_rows). fp32 ``x [M, K] @ w.T`` for 1-8 rows (kvmesh.model.llama.Linear routes
them here): a decode step of a few sequences, or one sequence with its drafts being verified.
MKL runs matrix-vector code up to 3 rows and matrix-matrix code from 4, where the step turns
compute-bound on this 2-core CPU (the 120 decoder matmuls of SmolLM2-135M: 17 / 20 / 30 / 36 ms
for 1 / 3 / 4 / 8 rows, one-off timing). This kernel streams each weight row once for all M rows
-- R weight rows per task with M x R AVX-512 accumulators in registers, software prefetch 4 KiB
ahead so the FMAs overlap the memory traffic -- and takes 15 / 18 / 19 / 23 ms. Each output is
one FMA chain over k then a fixed lane reduction, whatever M and R, so a row's result is the
same bits alone or beside others (tested): a verify step computes every position exactly as
plain decoding would. Without AVX-512 the same loops run as plain C++ (16-lane partial sums).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from kvmesh.model.bundled import default_cache_dir

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
// One decode task (a row's KV head and its G query heads) with explicit AVX-512: the G query
// vectors stay in registers, a key row is loaded once for all of them and each score is one
// in-register reduction; the value pass keeps the G x V output accumulators in registers and
// stores them once. Blocks are walked block by block (no division per position), and the next
// block's row at the same offset is prefetched, since consecutive blocks lie anywhere in the pool.
template <int G, int V>
static void decode_task(const float* __restrict qh, const float* __restrict kc, const float* __restrict vc,
                        const int64_t* __restrict blocks, int64_t ctx, int64_t BS, int64_t row_stride,
                        int64_t hoff, float sc, float* __restrict scores, float* __restrict oh) {
  __m512 qv[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) qv[g][v] = _mm512_loadu_ps(qh + g * V * 16 + v * 16);
  const int64_t nblk = (ctx + BS - 1) / BS;
  for (int64_t b = 0; b < nblk; ++b) {
    const float* base = kc + blocks[b] * BS * row_stride + hoff;
    const float* next = b + 1 < nblk ? kc + blocks[b + 1] * BS * row_stride + hoff : nullptr;
    const int64_t n = std::min(BS, ctx - b * BS);
    float* sb = scores + b * BS;
    for (int64_t p = 0; p < n; ++p) {
      const float* kp = base + p * row_stride;
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + p * row_stride), _MM_HINT_T0);
      __m512 kv[V];
      for (int v = 0; v < V; ++v) kv[v] = _mm512_loadu_ps(kp + v * 16);
      for (int g = 0; g < G; ++g) {
        __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
        for (int v = 1; v < V; ++v) acc = _mm512_fmadd_ps(qv[g][v], kv[v], acc);
        sb[g * ctx + p] = _mm512_reduce_add_ps(acc) * sc;
      }
    }
  }
  for (int g = 0; g < G; ++g) {  // exact softmax per query head
    float* sg = scores + g * ctx;
    const float mx = *std::max_element(sg, sg + ctx);
    float sum = 0.f;
    for (int64_t pos = 0; pos < ctx; ++pos) { sg[pos] = std::exp(sg[pos] - mx); sum += sg[pos]; }
    const float inv = 1.f / sum;
    for (int64_t pos = 0; pos < ctx; ++pos) sg[pos] *= inv;
  }
  __m512 acc[G][V];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) acc[g][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    const float* base = vc + blocks[b] * BS * row_stride + hoff;
    const float* next = b + 1 < nblk ? vc + blocks[b + 1] * BS * row_stride + hoff : nullptr;
    const int64_t n = std::min(BS, ctx - b * BS);
    for (int64_t p = 0; p < n; ++p) {
      const float* vp = base + p * row_stride;
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + p * row_stride), _MM_HINT_T0);
      __m512 vv[V];
      for (int v = 0; v < V; ++v) vv[v] = _mm512_loadu_ps(vp + v * 16);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(scores[g * ctx + b * BS + p]);
        for (int v = 0; v < V; ++v) acc[g][v] = _mm512_fmadd_ps(w, vv[v], acc[g][v]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < V; ++v) _mm512_storeu_ps(oh + g * V * 16 + v * 16, acc[g][v]);
}

using DecodeTask = void (*)(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t,
                            int64_t, float, float*, float*);

template <int V>
static DecodeTask decode_task_for(int64_t G) {
  switch (G) {
    case 1: return decode_task<1, V>;
    case 2: return decode_task<2, V>;
    case 3: return decode_task<3, V>;
    case 4: return decode_task<4, V>;
    case 5: return decode_task<5, V>;
    case 6: return decode_task<6, V>;
    case 7: return decode_task<7, V>;
    case 8: return decode_task<8, V>;
  }
  return nullptr;
}
#endif

// q [D, H, hd] fp32 contiguous; k_cache, v_cache [NB, BS, KVH, hd] fp32 contiguous;
// block_tables [D, W] int64 (row d's blocks); ctx_lens [D] int64 (keys row d attends to).
// Returns [D, H, hd]: softmax(q k^T * scale) v over positions 0..ctx_lens[d]-1 of row d.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor ctx_lens, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32, "paged_decode: fp32 tensors only");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              block_tables.is_contiguous() && ctx_lens.is_contiguous(), "paged_decode: contiguous tensors only");
  const int64_t D = q.size(0), H = q.size(1), hd = q.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), W = block_tables.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == hd && hd % 16 == 0, "paged_decode: bad shapes");
  const int64_t G = H / KVH;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t row_stride = KVH * hd;  // floats between consecutive token slots
  TORCH_CHECK(G <= 8, "paged_decode: at most 8 query heads per KV head");
  for (int64_t d = 0; d < D; ++d)
    TORCH_CHECK(cl[d] >= 1 && cl[d] <= W * BS, "paged_decode: context length out of range");
  // A plain OpenMP loop on the calling thread's team (its nthreads ICV, which torch set), not
  // at::parallel_for: that one's first call on a thread re-initialises the thread count from
  // ATen's process-wide value, which the KV codec threads set to 1 -- it would have left the
  // step loop single-threaded (measured: prefill 1.7x slower once a KV service was linked).
#if defined(__AVX512F__)
  const DecodeTask task = hd == 64 ? decode_task_for<4>(G) : (hd == 128 ? decode_task_for<8>(G) : nullptr);
#endif
  #pragma omp parallel
  {
    std::vector<float> scores;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < D * KVH; ++t) {
      const int64_t d = t / KVH, h = t % KVH;
      const int64_t ctx = cl[d];
      scores.resize(G * ctx);
#if defined(__AVX512F__)
      if (task != nullptr) {
        task(qp + (d * H + h * G) * hd, kc, vc, bt + d * W, ctx, BS, row_stride, h * hd, sc, scores.data(),
             op + (d * H + h * G) * hd);
        continue;
      }
#endif
      const float* qh = qp + (d * H + h * G) * hd;  // the G query heads of KV head h, adjacent
      // scores: each key row is loaded once for all G query heads; 16-lane partial sums
      // (one vector register each) keep the reduction vectorised.
      for (int64_t pos = 0; pos < ctx; ++pos) {
        const float* kp = kc + (bt[d * W + pos / BS] * BS + pos % BS) * row_stride + h * hd;
        float part[8][16] = {};
        for (int64_t i = 0; i < hd; i += 16)
          for (int64_t g = 0; g < G; ++g)
            for (int j = 0; j < 16; ++j) part[g][j] += qh[g * hd + i + j] * kp[i + j];
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          for (int j = 0; j < 16; ++j) s += part[g][j];
          scores[g * ctx + pos] = s * sc;
        }
      }
      for (int64_t g = 0; g < G; ++g) {  // exact softmax per query head
        float* sg = scores.data() + g * ctx;
        const float mx = *std::max_element(sg, sg + ctx);
        float sum = 0.f;
        for (int64_t pos = 0; pos < ctx; ++pos) { sg[pos] = std::exp(sg[pos] - mx); sum += sg[pos]; }
        const float inv = 1.f / sum;
        for (int64_t pos = 0; pos < ctx; ++pos) sg[pos] *= inv;
      }
      float* oh = op + (d * H + h * G) * hd;
      std::fill(oh, oh + G * hd, 0.f);
      for (int64_t pos = 0; pos < ctx; ++pos) {
        const float* vp = vc + (bt[d * W + pos / BS] * BS + pos % BS) * row_stride + h * hd;
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * ctx + pos];
          float* og = oh + g * hd;
          for (int64_t i = 0; i < hd; ++i) og[i] += w * vp[i];
        }
      }
    }
  }
  return out;
}

// Skinny fp32 matmul: y [M, N] = x [M, K] w[N, K]^T for 1 <= M <= 8 rows (a decode step, or a
// decode with its drafts being verified). MKL switches from matrix-vector to matrix-matrix code
// at 4 rows, where a step turns compute-bound on this CPU; this streams each weight row once for
// all M rows (R weight rows per task, M x R accumulators in registers), with software prefetch
// 4 KiB ahead so the few FMAs per loaded line overlap the memory traffic. Every output is one
// accumulation chain over k in a fixed order then a fixed lane reduction, whatever M and R: a
// row's result does not depend on the other rows of the call (tested bit for bit).
#if defined(__AVX512F__)
#include <immintrin.h>
template <int M, int R>
static inline void rows_block(const float* __restrict x, const float* __restrict w, float* __restrict y,
                              int64_t n0, int64_t N, int64_t K) {
  __m512 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (n0 + r) * K + k + 1024), _MM_HINT_T0);
      const __m512 wv = _mm512_loadu_ps(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float s = _mm512_reduce_add_ps(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s += w[(n0 + r) * K + kk] * x[m * K + kk];
      y[m * N + n0 + r] = s;
    }
}
#else
template <int M, int R>
static inline void rows_block(const float* __restrict x, const float* __restrict w, float* __restrict y,
                              int64_t n0, int64_t N, int64_t K) {
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      const float* wr = w + (n0 + r) * K;
      const float* xr = x + m * K;
      float part[16] = {};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16)
        for (int j = 0; j < 16; ++j) part[j] += wr[k + j] * xr[k + j];
      float s = 0.f;
      for (int j = 0; j < 16; ++j) s += part[j];
      for (; k < K; ++k) s += wr[k] * xr[k];
      y[m * N + n0 + r] = s;
    }
}
#endif

template <int M>
static void rows_impl(const float* x, const float* w, float* y, int64_t N, int64_t K) {
  constexpr int R = M <= 2 ? 4 : (M <= 5 ? 2 : 1);  // M x R accumulators stay within the registers
  const int64_t blocks = N / R;
  #pragma omp parallel for schedule(static)  // the calling thread's team, as paged_decode
  for (int64_t b = 0; b < blocks; ++b) rows_block<M, R>(x, w, y, b * R, N, K);
  for (int64_t n = blocks * R; n < N; ++n) rows_block<M, 1>(x, w, y, n, N, K);
}

torch::Tensor linear_rows(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && w.dtype() == torch::kFloat32 && x.dim() == 2 && w.dim() == 2 &&
              x.is_contiguous() && w.is_contiguous() && x.size(1) == w.size(1),
              "linear_rows: x [M, K] and w [N, K], fp32 contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: rows_impl<1>(xp, wp, yp, N, K); break;
    case 2: rows_impl<2>(xp, wp, yp, N, K); break;
    case 3: rows_impl<3>(xp, wp, yp, N, K); break;
    case 4: rows_impl<4>(xp, wp, yp, N, K); break;
    case 5: rows_impl<5>(xp, wp, yp, N, K); break;
    case 6: rows_impl<6>(xp, wp, yp, N, K); break;
    case 7: rows_impl<7>(xp, wp, yp, N, K); break;
    case 8: rows_impl<8>(xp, wp, yp, N, K); break;
    default: TORCH_CHECK(false, "linear_rows: 1 to 8 rows, got ", M);
  }
  return y;
}

// Per-token int8 quantization of x [M, K] fp32 after multiplying by inv_smooth [K]: returns
// (q [M, K] int8, step [M, 1] fp32) with q = round_half_even(x * inv_smooth / step) and
// step = max|x * inv_smooth| / 127 per row (at least 1e-12 / 127) -- the ops of
// kvmesh.model.quant.W8A8Linear's torch path, in one pass per row.
std::vector<torch::Tensor> quantize_rows(torch::Tensor x, torch::Tensor inv_smooth) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && inv_smooth.dtype() == torch::kFloat32 && x.dim() == 2 &&
              x.is_contiguous() && inv_smooth.is_contiguous() && inv_smooth.numel() == x.size(1),
              "quantize_rows: x [M, K] fp32 contiguous and inv_smooth [K] fp32");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto step = torch::empty({M, 1}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* sp = inv_smooth.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* stp = step.data_ptr<float>();
  #pragma omp parallel for if (M >= 8) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k] * sp[k]));
    const float st = std::max(amax, 1e-12f) / 127.f;
    stp[m] = st;
    int8_t* qr = qp + m * K;
    for (int64_t k = 0; k < K; ++k) qr[k] = static_cast<int8_t>(std::nearbyint((row[k] * sp[k]) / st));
  }
  return {q, step};
}

// acc [M, N] int32 -> fp32 acc * step[m] * wscale[n] (the rescale after torch._int_mm).
torch::Tensor rescale_rows(torch::Tensor acc, torch::Tensor step, torch::Tensor wscale) {
  TORCH_CHECK(acc.dtype() == torch::kInt32 && acc.dim() == 2 && acc.is_contiguous() &&
              step.dtype() == torch::kFloat32 && step.numel() == acc.size(0) &&
              wscale.dtype() == torch::kFloat32 && wscale.numel() == acc.size(1) && wscale.is_contiguous(),
              "rescale_rows: acc [M, N] int32, step [M] fp32, wscale [N] fp32");
  const int64_t M = acc.size(0), N = acc.size(1);
  auto y = torch::empty({M, N}, acc.options().dtype(torch::kFloat32));
  const int32_t* ap = acc.data_ptr<int32_t>();
  const float* stp = step.data_ptr<float>();
  const float* wp = wscale.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  #pragma omp parallel for if (M * N >= 65536) schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) yp[m * N + n] = static_cast<float>(ap[m * N + n]) * stp[m] * wp[n];
  return y;
}
"""

def _cpu_flags() -> str:
    """The CPU's feature flags (the build uses -march=native: a cached build is for this CPU only)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


# NOTE (the GIL). Every function of these extensions is bound with wrap_pybind_function_no_gil:
# the call releases the GIL once its arguments are converted and takes it back for the result.
# The bindings `load_inline(functions=...)` generates keep the GIL for the whole call (unlike
# torch's own ops), and a fused decode step or a prefill matmul is one call of 10-100+ ms: the
# engine's event-loop thread -- router probes with a ~0.2 s deadline, health checks, streamed
# tokens, KV fetches -- then waited for it (measured: a 2,048-row gguf_mm_tiled of 86 ms kept
# another Python thread from running for 92 ms; torch's F.linear of 72 ms, 2 ms). The kernels
# touch no Python object, only tensors, so nothing in them needs the GIL.
_BINDINGS = "no-gil-1"
"""Part of every extension's cache key: a build with other bindings is never loaded."""


def extension_dir(source: str, prefix: str = "") -> Path:
    """Where an extension of `source` is built and cached: one folder per source, torch version,
    CPU (-march=native) and Python environment, under the kvmesh cache directory.

    The environment is part of the key because torch writes the building interpreter's include
    and library paths into the folder's build.ninja: two virtual environments sharing one folder
    (a working copy and a CI clone of it) each found the other's build file changed and rebuilt
    the kernel at every load (~35 s each, and a build cut short there left a lock behind)."""
    env = sys.prefix + "\0" + os.path.dirname(torch.__file__)
    digest = hashlib.sha256((source + _BINDINGS + torch.__version__ + _cpu_flags() + env).encode()).hexdigest()[:16]
    return default_cache_dir() / "native" / f"{prefix}{digest}"


def _module_source(source: str, functions: list[str]) -> str:
    defs = "".join(f'  m.def("{f}", torch::wrap_pybind_function_no_gil({f}), "{f}");\n' for f in functions)
    return f"{source}\n\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{defs}}}\n"


def load_extension(name: str, source: str, functions: list[str], prefix: str = "", flags: tuple[str, ...] = ()):
    """Compile (or load the cached build of) a C++ extension of `source` exposing `functions`
    (each call releases the GIL, see the NOTE), -O3 -march=native with OpenMP plus `flags`;
    raises with the compiler's output."""
    from torch.utils.cpp_extension import load_inline

    folder = extension_dir(source, prefix)
    folder.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        return load_inline(name=name, cpp_sources=[_module_source(source, functions)],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", *flags],
                           extra_ldflags=["-fopenmp"], build_directory=str(folder), verbose=False)


_TORCH_LOCK = "lock"
"""The file torch's extension builder creates in the build folder while it builds, and waits on
(forever) while it exists."""


@contextlib.contextmanager
def _build_lock(folder: Path):
    """Hold an exclusive ``flock`` on ``folder/build.flock`` while an extension is built or
    loaded there, and clear a torch build lock that an interrupted build left behind.

    torch's own lock is a file created at the start of a build and removed at its end; a build
    killed in between (a test run stopped, an engine killed while compiling at start) leaves it,
    and every later load in that folder then waits for it forever -- an engine that never
    starts. Every kvmesh build takes this flock first and the kernel drops a flock when its
    holder dies, so a torch lock found while holding the flock belongs to no running build:
    it is removed (and logged) before building."""
    with open(folder / "build.flock", "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as err:  # a filesystem without flock: torch's own lock alone, as before
            log.warning("no flock on %s (%s); a lock left by an interrupted build is not cleared", folder, err)
            yield
            return
        try:
            stale = folder / _TORCH_LOCK
            if stale.exists():
                log.warning("removing %s, left by an interrupted build of this kernel; building it again", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_dir() -> Path:
    return extension_dir(_SOURCE)


def _build():
    return load_extension("kvmesh_native", _SOURCE, ["paged_decode", "linear_rows", "quantize_rows", "rescale_rows"],
                          flags=("-ffast-math",))


def native_mode() -> str:
    """KVMESH_NATIVE: "1" (require the native kernels), "0" (the torch paths) or "" (unset: the
    native kernels where they build); ValueError for anything else."""
    mode = os.environ.get("KVMESH_NATIVE", "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"KVMESH_NATIVE={mode!r}: use 1 (require the native kernels), 0 (the "
                         "torch paths) or leave it unset (the native kernels where they build)")
    return mode


def build_per_mode(build: Callable[[], object], logger: logging.Logger, what: str):
    """``build()`` under KVMESH_NATIVE's semantics (the one place they are written): its module,
    or None with KVMESH_NATIVE=0 or, unset, where the build fails (logged as a warning); with
    KVMESH_NATIVE=1 a failed build raises RuntimeError carrying the compiler's output."""
    mode = native_mode()
    if mode == "0":
        return None
    try:
        return build()
    except Exception as err:
        if mode == "1":
            raise RuntimeError(f"KVMESH_NATIVE=1 but the {what} did not build: {err}") from err
        # no compiler, no ninja, another platform: the torch paths run
        logger.warning("%s unavailable (%s); using the torch paths (KVMESH_NATIVE=1 makes this an error)",
                       what, err)
        return None


class NativeModule:
    """A compiled extension, built (or found on disk) at most once per process: ``get()`` is the
    module, or None with KVMESH_NATIVE=0 or, KVMESH_NATIVE unset, where it cannot be built. With
    KVMESH_NATIVE=1 a failed build raises RuntimeError with the compiler's output (again at every
    call). ``accept(module)`` may turn down a built module (e.g. a kernel this CPU cannot run);
    ``build`` is looked up at each try, so tests may replace it."""

    def __init__(self, build: Callable[[], object], what: str, logger: logging.Logger,
                 accept: Callable[[object], bool] | None = None) -> None:
        self._build, self._what, self._log, self._accept = build, what, logger, accept
        self._lock = threading.Lock()
        self.module = None
        self.tried = False

    def get(self):
        if self.tried:
            return self.module
        with self._lock:
            if not self.tried:
                module = build_per_mode(self._build, self._log, self._what)
                self.module = module if module is None or self._accept is None or self._accept(module) else None
                self.tried = True
            return self.module


_kernels = NativeModule(lambda: _build(), "native kernels", log)
_native = _kernels.get


def paged_decode_kernel() -> Optional[Callable]:
    """``paged_decode(q, k_cache, v_cache, block_tables, ctx_lens, scale)``, or None (see _native)."""
    module = _native()
    return None if module is None else module.paged_decode


LINEAR_ROWS = 8
"""Most rows ``linear_rows`` takes (a decode step's rows for one sequence and its drafts)."""


def linear_rows_kernel() -> Optional[Callable]:
    """``linear_rows(x [M, K], w [N, K]) -> x @ w.T`` for fp32 and 1 <= M <= LINEAR_ROWS, or None."""
    module = _native()
    return None if module is None else module.linear_rows


def w8a8_ops() -> Optional[tuple[Callable, Callable]]:
    """(quantize_rows, rescale_rows), or None (see _native): the per-token quantization and the
    rescale of kvmesh.model.quant.W8A8Linear, each one pass."""
    module = _native()
    return None if module is None else (module.quantize_rows, module.rescale_rows)


if __name__ == "__main__":  # `python -m kvmesh.model.native`: build (or find) the kernel now
    logging.basicConfig(level=logging.INFO)
    built = _native() is not None
    print(f"native kernels: {'ready in ' + str(_build_dir()) if built else 'unavailable, the torch paths run'}")
