"""`kvmesh bench gpu` off a GPU: it refuses with the reason instead of failing somewhere inside."""
from __future__ import annotations

import pytest
import torch

from kvmesh.loadtest import gpu_bench, registry


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the bench would run")
def test_refuses_without_a_cuda_device():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        gpu_bench.run()


def test_is_registered_and_takes_no_model():
    assert registry.BENCHES["gpu"] == gpu_bench.__name__
    with pytest.raises(SystemExit, match="takes no --model"):
        registry.run_bench("gpu", quick=True, model="some/model.gguf")
