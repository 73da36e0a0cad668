"""Row-wise ops of a decoder layer fused into one pass each, for fp32 and bf16 on CPU: RMSNorm,
RoPE over the q and k heads (in place), and SiLU(gate) * up.

NOTE (why). A prefill chunk's matmuls and attention are a few large calls, but between them torch
runs each row-wise op as several passes over memory: bf16 RMSNorm is six (to fp32, square, mean,
rsqrt, scale, back to bf16 and times the weight), RoPE five (two products, a negation, a
concatenation, a sum), SwiGLU two. At 2,048 tokens on the bundled model these were ~200 ms of a
~680 ms bf16 forward and ~300 ms of the fp32 one (torch profiler). Here each op is one pass,
split over the rows by the OpenMP team torch already runs.

NOTE (numerics). Each kernel rounds where the unfused torch ops round, in the same order:
- RMSNorm: ``r = 1 / sqrt(sum(x^2) / D + eps)`` in fp32, then ``w * round(x * r)`` (HF's
  LlamaRMSNorm: fp32 statistics, the normalised row cast to the activation dtype, times the
  weight). The sum is a 16-lane vector sum, so r may differ from torch's in its last bit.
- RoPE: ``round(round(a cos) - round(b sin))`` and ``round(round(b cos) + round(a sin))`` for each
  pair (a, b) = (x[i], x[i + hd/2]): the unfused path's products, negation and sum, bit for bit.
- SwiGLU: ``round(round(g / (1 + e^-g)) * u)`` with e^x within 2 ulp (torch's within 1).
"round" is to the activation dtype (bf16: to nearest even, as torch), nothing for fp32; the
source is built with -ffp-contract=off, so no product and sum fuse into an FMA that the torch ops
would round twice. The tests hold each kernel to the torch ops: RoPE bit for bit, the others to
one ulp of the activation dtype.

Off CPU, under autograd, for other dtypes, or where the extension cannot be built (see
kvmesh.model.native.build_per_mode: ``KVMESH_NATIVE``), callers get None and run the torch ops.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch

from kvmesh.model.gguf_decode import EXP16_SOURCE
from kvmesh.model.native import NativeModule, load_extension

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ROWS_AVX512 1
#endif

// Scalar conversions, as c10::BFloat16 (round to nearest even, NaN -> 0x7FC0).
static inline float bf2f(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u; std::memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(ROWS_AVX512)
static inline __mmask16 lanes(int64_t i, int64_t n) {
  return n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
}
// Load/store 16 lanes of a row as fp32; round() is a float's value in the storage type.
struct F32 {
  using T = float;
  static __m512 load(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
  static void store(float* p, __mmask16 k, __m512 v) { _mm512_mask_storeu_ps(p, k, v); }
  static __m512 round(__m512 v) { return v; }
};
struct BF16 {
  using T = uint16_t;
  static __m512i bits(__m512 v) {  // the bf16 bits in each lane's low half, as f2bf
    const __m512i u = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                          _mm512_set1_epi32(0x7FFF));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  }
  static __m512 load(const uint16_t* p, __mmask16 k) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
  }
  static void store(uint16_t* p, __mmask16 k, __m512 v) { _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(bits(v))); }
  static __m512 round(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits(v), 16)); }
};

""" + EXP16_SOURCE + r"""
template <class S>
static void rms_rows(const typename S::T* x, const typename S::T* w, typename S::T* out,
                     int64_t M, int64_t D, int64_t ldx, float eps) {
  #pragma omp parallel for if (M * D >= 32768) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const typename S::T* xm = x + m * ldx;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) { const __m512 v = S::load(xm + i, lanes(i, D)); ss = _mm512_fmadd_ps(v, v, ss); }
    const __m512 r = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / (float)D + eps));
    for (int64_t i = 0; i < D; i += 16) {
      const __mmask16 k = lanes(i, D);
      S::store(out + m * D + i, k, _mm512_mul_ps(S::load(w + i, k), S::round(_mm512_mul_ps(S::load(xm + i, k), r))));
    }
  }
}

template <class S>
static void rope_rows(typename S::T* x, const typename S::T* cs, const typename S::T* sn,
                      int64_t M, int64_t heads, int64_t hd, int64_t ldx) {
  const int64_t half = hd / 2;
  #pragma omp parallel for if (M * heads * hd >= 32768) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const typename S::T* c = cs + m * hd;
    const typename S::T* s = sn + m * hd;
    for (int64_t h = 0; h < heads; ++h) {
      typename S::T* xh = x + m * ldx + h * hd;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 k = lanes(i, half);
        const __m512 a = S::load(xh + i, k), b = S::load(xh + half + i, k);
        const __m512 lo = _mm512_sub_ps(S::round(_mm512_mul_ps(a, S::load(c + i, k))),
                                        S::round(_mm512_mul_ps(b, S::load(s + i, k))));
        const __m512 hi = _mm512_add_ps(S::round(_mm512_mul_ps(b, S::load(c + half + i, k))),
                                        S::round(_mm512_mul_ps(a, S::load(s + half + i, k))));
        S::store(xh + i, k, lo);
        S::store(xh + half + i, k, hi);
      }
    }
  }
}

template <class S>
static void silu_mul_rows(const typename S::T* gu, typename S::T* out, int64_t M, int64_t I, int64_t ldg) {
  #pragma omp parallel for if (M * I >= 32768) schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 k = lanes(i, I);
      const __m512 g = S::load(gu + m * ldg + i, k), u = S::load(gu + m * ldg + I + i, k);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 silu = S::round(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
      S::store(out + m * I + i, k, _mm512_mul_ps(silu, u));
    }
}
#else
// Without AVX-512BW/VL: the same arithmetic, one element at a time (std::exp for e^x).
struct F32 {
  using T = float;
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
  static float round(float v) { return v; }
};
struct BF16 {
  using T = uint16_t;
  static float load(const uint16_t* p) { return bf2f(*p); }
  static void store(uint16_t* p, float v) { *p = f2bf(v); }
  static float round(float v) { return bf2f(f2bf(v)); }
};

template <class S>
static void rms_rows(const typename S::T* x, const typename S::T* w, typename S::T* out,
                     int64_t M, int64_t D, int64_t ldx, float eps) {
  #pragma omp parallel for if (M * D >= 32768) schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const typename S::T* xm = x + m * ldx;
    float ss = 0.f;
    for (int64_t i = 0; i < D; ++i) { const float v = S::load(xm + i); ss += v * v; }
    const float r = 1.f / std::sqrt(ss / (float)D + eps);
    for (int64_t i = 0; i < D; ++i) S::store(out + m * D + i, S::load(w + i) * S::round(S::load(xm + i) * r));
  }
}

template <class S>
static void rope_rows(typename S::T* x, const typename S::T* cs, const typename S::T* sn,
                      int64_t M, int64_t heads, int64_t hd, int64_t ldx) {
  const int64_t half = hd / 2;
  #pragma omp parallel for if (M * heads * hd >= 32768) schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t h = 0; h < heads; ++h) {
      typename S::T* xh = x + m * ldx + h * hd;
      for (int64_t i = 0; i < half; ++i) {
        const float a = S::load(xh + i), b = S::load(xh + half + i);
        const float lo = S::round(a * S::load(cs + m * hd + i)) - S::round(b * S::load(sn + m * hd + i));
        const float hi = S::round(b * S::load(cs + m * hd + half + i)) + S::round(a * S::load(sn + m * hd + half + i));
        S::store(xh + i, lo);
        S::store(xh + half + i, hi);
      }
    }
}

template <class S>
static void silu_mul_rows(const typename S::T* gu, typename S::T* out, int64_t M, int64_t I, int64_t ldg) {
  #pragma omp parallel for if (M * I >= 32768) schedule(static)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t i = 0; i < I; ++i) {
      const float g = S::load(gu + m * ldg + i);
      S::store(out + m * I + i, S::round(g / (1.f + std::exp(-g))) * S::load(gu + m * ldg + I + i));
    }
}
#endif

static void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, what, ": a CPU [rows, cols] tensor with unit column stride");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, what, ": fp32 or bf16 only");
}

// x [M, D] (rows may be strided), w [D] of x's dtype -> [M, D] contiguous.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.is_contiguous() && w.numel() == x.size(1), "rms_norm: w must be [D] of x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  if (x.scalar_type() == torch::kFloat32)
    rms_rows<F32>(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), (float)eps);
  else
    rms_rows<BF16>((const uint16_t*)x.data_ptr(), (const uint16_t*)w.data_ptr(), (uint16_t*)out.data_ptr(),
                   x.size(0), x.size(1), x.stride(0), (float)eps);
  return out;
}

// x [M, >= heads * hd] rotated in place over its first `heads` heads; cos, sin [M, hd] of x's dtype.
void rope_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t hd) {
  check_rows(x, "rope_");
  TORCH_CHECK(hd % 2 == 0 && heads * hd <= x.size(1), "rope_: x holds fewer than heads * hd columns");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->is_contiguous() && t->dim() == 2 &&
                t->size(0) == x.size(0) && t->size(1) == hd, "rope_: cos and sin must be [M, hd] of x's dtype");
  if (x.scalar_type() == torch::kFloat32)
    rope_rows<F32>(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), x.size(0), heads, hd, x.stride(0));
  else
    rope_rows<BF16>((uint16_t*)x.data_ptr(), (const uint16_t*)cos.data_ptr(), (const uint16_t*)sin.data_ptr(),
                    x.size(0), heads, hd, x.stride(0));
}

// gu [M, 2I] (gate columns, then up) -> silu(gate) * up [M, I].
torch::Tensor silu_mul(torch::Tensor gu) {
  check_rows(gu, "silu_mul");
  TORCH_CHECK(gu.size(1) % 2 == 0, "silu_mul: gu must have 2I columns");
  const int64_t I = gu.size(1) / 2;
  auto out = torch::empty({gu.size(0), I}, gu.options());
  if (gu.scalar_type() == torch::kFloat32)
    silu_mul_rows<F32>(gu.data_ptr<float>(), out.data_ptr<float>(), gu.size(0), I, gu.stride(0));
  else
    silu_mul_rows<BF16>((const uint16_t*)gu.data_ptr(), (uint16_t*)out.data_ptr(), gu.size(0), I, gu.stride(0));
  return out;
}
"""

def _build():
    return load_extension("kvmesh_rows", _SOURCE, ["rms_norm", "rope_", "silu_mul"], "rows-", ("-ffp-contract=off",))


_kernels = NativeModule(lambda: _build(), "fused row kernels", log)
_ops = _kernels.get


def _applies(*tensors: torch.Tensor) -> bool:
    """CPU, fp32 or bf16 (all alike), and no autograd to record."""
    x = tensors[0]
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """RMSNorm of x [..., D] with weight [D] in one pass, or None where the kernel does not apply."""
    if x.dim() < 2 or x.stride(-1) != 1 or not _applies(x, weight):
        return None
    ops = _ops()
    if ops is None:
        return None
    rows = x.reshape(-1, x.shape[-1])
    return ops.rms_norm(rows, weight.contiguous(), eps).view(x.shape)


def rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int) -> bool:
    """Rotate the first `heads` heads of qkv [..., T, n_heads, hd] in place with cos/sin
    [..., T, hd]; False (nothing done) where the kernel does not apply."""
    hd = qkv.shape[-1]
    if qkv.dim() < 3 or not qkv.is_contiguous() or not _applies(qkv, cos, sin):
        return False
    ops = _ops()
    if ops is None:
        return False
    rows = qkv.view(-1, qkv.shape[-2] * hd)
    cos = cos.expand(*qkv.shape[:-2], hd).reshape(-1, hd)  # a batch's shared table, one row per token
    sin = sin.expand(*qkv.shape[:-2], hd).reshape(-1, hd)
    ops.rope_(rows, cos.contiguous(), sin.contiguous(), heads, hd)
    return True


def silu_mul(gate_up: torch.Tensor) -> Optional[torch.Tensor]:
    """silu(gate) * up of gate_up [..., 2I] (gate columns first) in one pass, or None."""
    if gate_up.dim() < 2 or gate_up.stride(-1) != 1 or not _applies(gate_up):
        return None
    ops = _ops()
    if ops is None:
        return None
    out = ops.silu_mul(gate_up.reshape(-1, gate_up.shape[-1]))
    return out.view(*gate_up.shape[:-1], out.shape[-1])


if __name__ == "__main__":  # `python -m kvmesh.model.fused_rows`: build (or find) the kernels now
    logging.basicConfig(level=logging.INFO)
    print(f"fused row kernels: {'ready' if _ops() is not None else 'unavailable, the torch ops run'}")
