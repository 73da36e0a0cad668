"""Shared fixtures: the real bundled model (loaded once per session) and engine builders."""
from __future__ import annotations

import os

import pytest

from redis_server import redis_server  # noqa: F401 - a fixture for every test directory

# Before anything imports triton (llguidance's torch helpers do, through torch._dynamo): triton
# builds its own library functions (tl.cdiv, ...) for the interpreter or the GPU once, at its
# import, and kvmesh.gpu's kernels run on CPU tensors only under the interpreter (tests/unit/gpu).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def bundled_model():
    """SmolLM2-135M-Instruct from the bundled GGUF, float32 (converted weights cached on disk)."""
    from kvmesh.model.loader import load_model

    return load_model("bundled", dtype="float32", device="cpu", weights="fp32")


@pytest.fixture(scope="session")
def hf_bundled_model():
    """The same GGUF loaded by Hugging Face transformers (its own dequantizer): the reference."""
    import torch
    from transformers import AutoModelForCausalLM

    from kvmesh.model.loader import bundled_gguf_path

    path = bundled_gguf_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
