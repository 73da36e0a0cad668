"""GGUF 4-bit rows rewritten at load into the layout kvmesh.model.gguf_native's kernels read
fastest (C++ source composed into that extension after its kernels, whose ``check_part``,
``q4k_scale_min`` and ``q4x_code_bytes`` it uses; the layout itself is described at
``q4x_code_bytes``, and ``decode_row`` reads it). kvmesh.model.quant.GGUFLinear calls
``gguf_repack`` on each Q4_0, Q4_1 or Q4_K part unless ``KVMESH_GGUF_REPACK=0``.

NOTE. At load, Q4_0, Q4_1 and Q4_K rows are rewritten (``gguf_repack``,
type ``REPACKED_Q4``) into a layout that holds the same codes and, per 32 weights, an fp32 scale
and offset whose fma(code, scale, offset) is the dequantized weight, bit for bit (for Q4_0 the
offset is -8 d; for Q4_K d * sc and -(dmin * m), all exact in fp32). Four blocks' codes share one
64-byte load arranged so that block b's indices come out of it by a byte shift within 128-bit
lanes (port 5) and its high nibbles by one dword shift (port 0); the table per block comes from
two broadcast loads and one FMA. The old per-block path -- fp16 scale conversion, broadcasts and a
byte-to-dword widening, all on port 5 of an Intel core -- ran ~7 cycles a block; this one ~4.5
(one core, L2: 1.9 -> 1.4 ns a block). Same products, same summation slots: the same bits as
the file's own blocks (tested), at 20% more bytes (24 per 32 weights instead of 20).
"""
from __future__ import annotations

REPACKED_Q4 = 1000
"""The kernels' own type id (not ggml's) of 4-bit rows repacked by ``gguf_repack`` (Q4_0, Q4_1 and
Q4_K: the same codes, and per 32 weights an fp32 scale and offset; the same weights bit for bit)."""

REPACK_SOURCE = r"""
// One row of Q4_0, Q4_1 or Q4_K blocks -> its T_Q4X row (layout at q4x_code_bytes): the same
// codes, and per sub-block of 32 the scale and offset whose fma(code, scale, offset) is the
// weight dequant_row writes (Q4_0: d, -8 d; Q4_1: d, m; Q4_K: d * sc, -(dmin * m) -- every one
// exact in fp32, so the weights are the same bits).
static void repack_row(const uint8_t* r, int64_t t, int64_t K, uint8_t* out) {
  const int64_t nblk = K / 32, rest = nblk % 4;
  const int64_t full = nblk / 4 * 4;
  float* scl = (float*)(out + q4x_code_bytes(nblk));  // 4-aligned: code bytes are a multiple of 16
  float* off = scl + nblk;
  std::memset(out, 0, q4x_code_bytes(nblk));
  uint8_t codes[32];
  for (int64_t j = 0; j < nblk; ++j) {
    if (t == T_Q4_0 || t == T_Q4_1) {
      const uint8_t* p = r + j * (t == T_Q4_0 ? 18 : 20);
      const uint8_t* qs = p + (t == T_Q4_0 ? 2 : 4);
      for (int i = 0; i < 16; ++i) { codes[i] = qs[i] & 15; codes[i + 16] = qs[i] >> 4; }
      const float d = fp16_at(p);
      scl[j] = d;
      off[j] = t == T_Q4_0 ? -8.f * d : fp16_at(p + 2);
    } else {  // T_Q4_K: sub-block j = 8 b + 2 c + h of super-block b
      const uint8_t* p = r + (j / 8) * 144;
      const int c = (int)(j % 8) / 2, h = (int)(j % 2);
      uint8_t sc, mn;
      q4k_scale_min((int)(j % 8), p + 4, &sc, &mn);
      for (int l = 0; l < 32; ++l) codes[l] = h ? p[16 + 32 * c + l] >> 4 : p[16 + 32 * c + l] & 15;
      scl[j] = fp16_at(p) * (float)sc;
      off[j] = -(fp16_at(p + 2) * (float)mn);
    }
    // weight w of sub-block s of a quad is code 32 s + w of the quad: nibble j2 = 2 s + w / 16 of
    // lane i = w % 16, i.e. byte s of the lane, high nibble for w >= 16
    const int64_t quad = j / 4, s = j % 4;
    const int64_t lane_bytes = j < full ? 4 : (rest == 1 ? 1 : rest == 2 ? 2 : 4);
    uint8_t* q = out + 64 * quad;
    for (int w = 0; w < 32; ++w) q[(w % 16) * lane_bytes + s] |= (uint8_t)(codes[w] << (w < 16 ? 0 : 4));
  }
}

// blocks [N, row bytes] of ggml type t (Q4_0, Q4_1 or Q4_K) -> [N, T_Q4X row bytes], the same
// weights in the layout decode_row reads fastest; an empty tensor where this build has no T_Q4X
// kernel (no AVX-512) or t is another type.
torch::Tensor gguf_repack(torch::Tensor blocks, int64_t t, int64_t K) {
  if (!fast_type(T_Q4X) || (t != T_Q4_0 && t != T_Q4_1 && t != T_Q4_K)) return torch::empty({0}, torch::kUInt8);
  check_part(blocks, t, K);
  const int64_t N = blocks.size(0), rb = blocks.size(1), ob = row_bytes(T_Q4X, K);
  auto out = torch::empty({N, ob}, torch::TensorOptions().dtype(torch::kUInt8));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  uint8_t* op = out.data_ptr<uint8_t>();
  #pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) repack_row(bp + n * rb, t, K, op + n * ob);
  return out;
}
"""
