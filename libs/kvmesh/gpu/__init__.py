"""Triton kernels of the GPU path (issue 24), each beside the torch reference it is tested against.

    paged_attention   decode attention over the engine's paged KV, reading the block table in place
    kv_codec          KIVI quantize / dequantize and code packing, bit-exact with kvmesh.kv.kivi
    kv_import         packed KIVI codes of a KV chunk expanded straight into paged blocks

These modules import triton at module level; nothing else in kvmesh imports them, so the rest of
the stack never needs triton. Their only other imports are torch and kvmesh.kv.kivi, so they run
with ``PYTHONPATH=libs`` on a machine that has torch and triton and none of kvmesh's service
dependencies (scripts/gpu_check.sh). On CPU tensors they run under ``TRITON_INTERPRET=1``, which
must be set before triton is first imported (tests/unit/gpu/conftest.py).
"""
