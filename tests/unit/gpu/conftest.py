"""The Triton kernels of kvmesh.gpu run here on CPU tensors under triton's interpreter, and natively
on a CUDA device when there is one.

triton decides per kernel, when ``@triton.jit`` runs (at the import of kvmesh.gpu.*), whether it
is interpreted: so TRITON_INTERPRET is set here, before any test module imports those kernels,
unless the environment already says (scripts/gpu_check.sh runs with TRITON_INTERPRET=0 for native
CUDA). The `device` fixture then checks which way the kernels really went: if something in this
process imported them earlier with another setting, the tests of the mode that cannot run skip
with the reason instead of failing obscurely.
"""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def kernels_interpreted() -> bool:
    """Whether kvmesh.gpu's kernels were built for triton's interpreter (vs compiled for a GPU)."""
    from kvmesh.gpu import kv_codec

    # by name: importing triton.runtime.interpreter needs numpy, which a GPU box may lack
    return type(kv_codec._dequantize_kernel).__name__ == "InterpretedFunction"


@pytest.fixture(params=["cpu", "cuda"])
def device(request) -> str:
    """Where the kernels run: 'cpu' (interpreter) and 'cuda' (native), each skipped when impossible."""
    import torch

    interpreted = kernels_interpreted()
    if request.param == "cpu" and not interpreted:
        pytest.skip("kvmesh.gpu's kernels were compiled for the GPU (TRITON_INTERPRET was off when they "
                    "were first imported in this process); CPU tensors need the interpreter")
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        if interpreted:
            pytest.skip("kvmesh.gpu's kernels run in the interpreter; run with TRITON_INTERPRET=0 for native CUDA")
    return request.param


def _tiny_config():
    from kvmesh.model.config import ModelConfig

    return ModelConfig(name="tiny", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5,
                       max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,))


TINY = _tiny_config()
"""A 2-layer GQA Llama config for the tests' random checkpoints (loadtest.gpu_engine_bench.random_checkpoint)."""
