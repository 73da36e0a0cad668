"""Triton kernels of the GPU path (issue 24), each beside the torch reference it is tested against.

    paged_attention   decode attention over the engine's paged KV, reading the block table in place
    kv_codec          KIVI quantize / dequantize and code packing, bit-exact with kvmesh.kv.kivi
    kv_import         packed KIVI codes of a KV chunk expanded straight into paged blocks
    kv_rerotate       a stored chunk's position-free keys (codes or exact) re-rotated to where it lands
                      (blending), dequantized, rotated and written into paged blocks in one launch
    quantized_attention  an opt-in paged int4/int2 KIVI cache, decode attention over it (codes
                      dequantized in registers) and the quantizer that fills it

These modules import triton at module level; nothing else in kvmesh imports them, so the rest of
the stack never needs triton. Their only other imports are torch and kvmesh.kv.kivi, so they run
with ``PYTHONPATH=libs`` on a machine that has torch and triton and none of kvmesh's service
dependencies (scripts/gpu_check.sh). On CPU tensors they run under ``TRITON_INTERPRET=1``, which
must be set before triton is first imported (tests/unit/gpu/conftest.py).
"""
