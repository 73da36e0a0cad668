"""Causal prefill attention in fp32 with AVX-512 FMAs, for CPUs without AMX (kvmesh.model.amx_attention
runs where the tile unit is).

NOTE (why). On a 2-core AMD EPYC (Zen 4: AVX-512, no AMX) torch's CPU flash attention ran a
430-token prompt's 30 layers in ~170 ms of a ~1,000 ms forward (one-off profile), 30-80 GFLOP/s
of causal work depending on the length (430 tokens were slower than 512: its blocking fits some
lengths badly), and 2,048 tokens in ~47 ms a layer. Prefill compute is what bounds time to first
token on that CPU (fp32 matmuls at the FMA bound), so the attention's share is worth taking back.

NOTE (how). The scheme of kvmesh.model.amx_attention, with FMAs instead of tiles: a task is one
query head and a block of 48 queries, three vector registers of 16; it works on transposed
scores, so that one register holds one key's scores for 16 queries and the online softmax
(running max, exponentials, running sum) is element-wise across registers, never a horizontal
reduction. The queries are transposed once per task (Q^T [head dims][48], scaled), each score is
a chain of FMAs over the head dims in order (a broadcast key element times a Q^T row), and O^T
[head dims][48] += the broadcast value element times the key's weights, 4 head dims at a time in
registers. Each broadcast element feeds three registers' FMAs: with one register of queries a
task (16 queries) the loop loaded about one operand per FMA and ran at 84-106 GFLOP/s of causal
work at 2,048 tokens on a 2-core Ice Lake (below torch's SDPA there, 96-113); with three, 128-166
(paired, same bits; two registers gave 108-144, four 128-154 with spilled accumulators). Keys are
taken 16 at a time from key 0; keys past a query's position are left out of its max and get
weight 0, and a block with no key a query sees leaves its max, sum and output unchanged bit for
bit (a factor of exactly 1, additions of 0). So a query's output depends only on its own
position's keys, not on where its chunk starts or ends: a prompt attended in one chunk or in
several over cached context gives the same bits (tested). Numerics are fp32 throughout, with e^x
within 2 ulp (kvmesh.model.gguf_decode's exp16); the tests hold it within torch's own fp32 SDPA
error of SDPA in fp64.

NOTE (scope). Causal only, queries at positions ``offset .. offset + Lq - 1`` against keys ``0 ..
offset + Lq - 1``; fp32, and bf16 converted to fp32 for it (the output rounded to bf16 once: closer
to fp32 attention than a bf16 flash attention, whose weights are bf16); head dims 16, 32, 64, 80,
96 and 128; GQA by query-head groups. Elsewhere (fp16, other head dims, sliding windows, no
AVX-512, ``KVMESH_CPU_ATTENTION=0`` or ``KVMESH_NATIVE=0``, no compiler) the caller runs torch's
SDPA. Tasks are spread over the calling thread's OpenMP team, the blocks with the most keys first.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

import torch

from kvmesh.model.amx_attention import kernel_takes
from kvmesh.model.gguf_decode import EXP16_SOURCE
from kvmesh.model.native import NativeModule, load_extension

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>

#if defined(__AVX512F__)
""" + EXP16_SOURCE + r"""
constexpr int QB = 16, NQ = 3, QW = QB * NQ, KB = 16;  // a register's queries, registers of queries
// per task, queries per task, keys per step

// Rows of token i: q + i * sq + head * D (k, v, out likewise); Lk = offset + Lq keys.
template <int D>
static void causal_f32(const float* q, const float* k, const float* v, float* out, int64_t sq, int64_t sk,
                       int64_t sv, int64_t so, int64_t Lq, int64_t H, int64_t KVH, int64_t offset, float scale) {
  const int64_t G = H / KVH, nqb = (Lq + QW - 1) / QW;
  #pragma omp parallel
  {
    alignas(64) float qt[D][QW];
    alignas(64) float o[D][QW];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    #pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < H * nqb; ++task) {
      const int64_t qb = nqb - 1 - task / H, hq = task % H, hk = hq / G;  // the most keys first
      const int64_t q0 = qb * QW, nq = std::min<int64_t>(QW, Lq - q0);
      for (int d = 0; d < D; ++d)
        for (int i = 0; i < QW; ++i) qt[d][i] = i < nq ? q[(q0 + i) * sq + hq * D + d] * scale : 0.f;
      for (int d = 0; d < D; ++d)
        for (int r = 0; r < NQ; ++r) _mm512_store_ps(o[d] + QB * r, _mm512_setzero_ps());
      const int64_t last = offset + q0 + nq - 1;  // the task's last query's position: keys 0..last
      __m512i qpos[NQ];
      __m512 m[NQ], l[NQ];
      for (int r = 0; r < NQ; ++r) {
        qpos[r] = _mm512_add_epi32(lane, _mm512_set1_epi32((int)(offset + q0 + QB * r)));
        m[r] = _mm512_set1_ps(-1e30f);
        l[r] = _mm512_setzero_ps();
      }
      const float* kh = k + hk * D;
      const float* vh = v + hk * D;
      for (int64_t k0 = 0; k0 <= last; k0 += KB) {
        __m512 s[NQ][KB];
        for (int j0 = 0; j0 < KB; j0 += 8) {
          const float* kp[8];
          for (int j = 0; j < 8; ++j) kp[j] = kh + std::min<int64_t>(k0 + j0 + j, last) * sk;
          // 8 keys x NQ registers of queries: each broadcast key element feeds NQ FMAs (24
          // accumulators of the 32 vector registers)
          __m512 a[NQ][8];
          for (int r = 0; r < NQ; ++r)
            for (int j = 0; j < 8; ++j) a[r][j] = _mm512_setzero_ps();
          for (int d = 0; d < D; ++d) {
            __m512 qv[NQ];
            for (int r = 0; r < NQ; ++r) qv[r] = _mm512_load_ps(qt[d] + QB * r);
            for (int j = 0; j < 8; ++j) {
              const __m512 kb = _mm512_set1_ps(kp[j][d]);
              for (int r = 0; r < NQ; ++r) a[r][j] = _mm512_fmadd_ps(qv[r], kb, a[r][j]);
            }
          }
          for (int r = 0; r < NQ; ++r)
            for (int j = 0; j < 8; ++j) s[r][j0 + j] = a[r][j];
        }
        // Masked keys (past a query's position) stay out of the max (a later key's large score must
        // not underflow the weights of queries before it) and get weight 0. Every query sees key
        // 0, so each real lane's max is finite from the first step on. A register whose queries
        // all precede the block has nothing valid: alpha exactly 1 and weights 0, so its max, sum
        // and output stay as they were, bit for bit (as if the task had stopped at its keys).
        __m512 alpha[NQ];
        for (int r = 0; r < NQ; ++r) {
          const bool diag = k0 + KB - 1 > offset + q0 + QB * r;
          __mmask16 valid[KB];
          __m512 mx = m[r];
          for (int j = 0; j < KB; ++j) {
            valid[j] = diag ? _mm512_cmpge_epi32_mask(qpos[r], _mm512_set1_epi32((int)(k0 + j))) : (__mmask16)0xFFFF;
            mx = _mm512_mask_max_ps(mx, valid[j], mx, s[r][j]);
          }
          alpha[r] = exp16(_mm512_sub_ps(m[r], mx));
          m[r] = mx;
          __m512 sum = _mm512_setzero_ps();
          for (int j = 0; j < KB; ++j) {
            s[r][j] = _mm512_maskz_mov_ps(valid[j], exp16(_mm512_sub_ps(s[r][j], mx)));
            sum = _mm512_add_ps(sum, s[r][j]);
          }
          l[r] = _mm512_fmadd_ps(l[r], alpha[r], sum);
        }
        for (int d0 = 0; d0 < D; d0 += 4) {  // each broadcast value element times NQ registers of weights
          __m512 a[NQ][4];
          for (int r = 0; r < NQ; ++r)
            for (int dd = 0; dd < 4; ++dd) a[r][dd] = _mm512_mul_ps(_mm512_load_ps(o[d0 + dd] + QB * r), alpha[r]);
          for (int j = 0; j < KB; ++j) {
            const float* vp = vh + std::min<int64_t>(k0 + j, last) * sv + d0;
            for (int dd = 0; dd < 4; ++dd) {
              const __m512 vb = _mm512_set1_ps(vp[dd]);
              for (int r = 0; r < NQ; ++r) a[r][dd] = _mm512_fmadd_ps(vb, s[r][j], a[r][dd]);
            }
          }
          for (int r = 0; r < NQ; ++r)
            for (int dd = 0; dd < 4; ++dd) _mm512_store_ps(o[d0 + dd] + QB * r, a[r][dd]);
        }
      }
      for (int r = 0; r < NQ; ++r) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), l[r]);
        for (int d = 0; d < D; ++d) _mm512_store_ps(o[d] + QB * r, _mm512_mul_ps(_mm512_load_ps(o[d] + QB * r), inv));
      }
      for (int64_t i = 0; i < nq; ++i) {
        float* dst = out + (q0 + i) * so + hq * D;
        for (int d = 0; d < D; ++d) dst[d] = o[d][i];
      }
    }
  }
}
#endif

bool available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

static bool head_dim_ok(int64_t d) { return d == 16 || d == 32 || d == 64 || d == 80 || d == 96 || d == 128; }

static void check_rows(const torch::Tensor& t, int64_t d, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 3 && t.size(2) == d && t.stride(2) == 1 && t.stride(1) == d,
              "causal_attention: ", what, " must be fp32 [tokens, heads, head_dim], each token's heads contiguous");
}

// out [Lq, H, D] = causal attention of q [Lq, H, D] over k, v [Lk, KVH, D] (fp32; each token's
// heads contiguous, tokens at any stride), Lk = offset + Lq.
void causal_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t offset, double scale) {
  const int64_t D = q.dim() == 3 ? q.size(2) : 0;
  TORCH_CHECK(head_dim_ok(D), "causal_attention: head_dim must be 16, 32, 64, 80, 96 or 128");
  check_rows(out, D, "out"); check_rows(q, D, "q"); check_rows(k, D, "k"); check_rows(v, D, "v");
  TORCH_CHECK(out.sizes() == q.sizes(), "causal_attention: out must be shaped like q");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(1) % k.size(1) == 0, "causal_attention: k, v alike; H a multiple of KVH");
  TORCH_CHECK(offset >= 0 && k.size(0) == offset + q.size(0), "causal_attention: Lk must be offset + Lq");
#if defined(__AVX512F__)
  if (q.size(0) == 0) return;
  auto run = [&](auto kernel) {
    kernel(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), q.stride(0),
           k.stride(0), v.stride(0), out.stride(0), q.size(0), q.size(1), k.size(1), offset, (float)scale);
  };
  switch (D) {
    case 16: run(causal_f32<16>); break;
    case 32: run(causal_f32<32>); break;
    case 64: run(causal_f32<64>); break;
    case 80: run(causal_f32<80>); break;
    case 96: run(causal_f32<96>); break;
    default: run(causal_f32<128>); break;
  }
#else
  TORCH_CHECK(false, "causal_attention: built without AVX-512");
#endif
}
"""


def _build():
    return load_extension("kvmesh_cpu_attention", _SOURCE, ["available", "causal_attention"], "cpuattn-")


def _accept(module) -> bool:
    """A built module runs where the CPU has AVX-512, unless KVMESH_CPU_ATTENTION=0 (comparisons)."""
    return module.available() and os.environ.get("KVMESH_CPU_ATTENTION", "1") != "0"


# the compiled module where it is built and accepted, else None
_kernels = NativeModule(lambda: _build(), "AVX-512 attention kernel", log, accept=_accept)
_ops = _kernels.get

HEAD_DIMS = (16, 32, 64, 80, 96, 128)
"""The head sizes the kernel is instantiated for."""


def prepare() -> bool:
    """Build (or find on disk) the kernel now; whether it runs here."""
    return _ops() is not None


DTYPES = (torch.float32, torch.bfloat16)
"""fp32, and bf16 attended in fp32 (converted on the way in, the output rounded to bf16 once)."""


def usable(q: torch.Tensor) -> bool:
    """Whether the kernel runs for queries like q: fp32 or bf16 on a CPU with AVX-512, a head
    size it takes, no autograd to record (k, v and out must have q's dtype)."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and q.dim() == 3 and q.shape[-1] in HEAD_DIMS
            and not (torch.is_grad_enabled() and q.requires_grad) and _ops() is not None)


def causal_attention_(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
                      scale: float) -> bool:
    """out [Lq, H, D] = causal attention of q [Lq, H, D] (positions offset..offset+Lq-1) over
    k, v [Lk, KVH, D] (Lk = offset + Lq), all fp32 or all bf16 (computed in fp32); False (nothing
    written) where the kernel does not apply and the caller runs SDPA. Tokens may lie at any
    stride; each token's heads must be contiguous."""
    if not kernel_takes((out, q, k, v), DTYPES, HEAD_DIMS):
        return False
    ops = _ops()
    if ops is None:
        return False
    if q.dtype == torch.float32:
        ops.causal_attention(out, q, k, v, int(offset), float(scale))
    else:
        o32 = torch.empty(out.shape, dtype=torch.float32)
        ops.causal_attention(o32, q.float(), k.float(), v.float(), int(offset), float(scale))
        out.copy_(o32)
    return True


if __name__ == "__main__":  # `python -m kvmesh.model.cpu_attention`: build (or find) the kernel now
    logging.basicConfig(level=logging.INFO)
    print(f"AVX-512 attention: {'ready' if _ops() is not None else 'unavailable: SDPA runs where the AMX attention does not'}")
