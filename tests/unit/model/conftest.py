"""Shared fixtures for kvmesh.model tests: a tiny random HF Llama on disk, and the real model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach a hub from tests


@dataclass(frozen=True)
class TinyCheckpoint:
    folder: Path
    hf_model: torch.nn.Module  # transformers LlamaForCausalLM, fp32, eval


def make_tiny_hf(folder: Path, *, tie: bool = False, seed: int = 0, init: float = 0.2,
                 vocab: int = 128) -> TinyCheckpoint:
    """A 2-layer GQA Llama with random weights, saved as safetensors like any HF checkpoint.

    ``init`` 0.2 (default) gives peaky logits, so greedy argmax is never a near-tie; HF's own
    0.02 gives realistic weight scales for quantization error bounds.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2,
        initializer_range=init,
    )
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a norm bug cannot hide behind ones
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    hf.save_pretrained(folder)
    return TinyCheckpoint(folder, hf)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyCheckpoint:
    return make_tiny_hf(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def real_model(request):
    """The bundled model, fp32, from the default conversion cache ($KVMESH_CACHE_DIR or ~/.cache/kvmesh).

    Shares tests/conftest.py's ``bundled_model`` when present, so a full test run loads it once.
    """
    try:
        return request.getfixturevalue("bundled_model")
    except pytest.FixtureLookupError:
        from kvmesh.model.loader import load_model

        return load_model("bundled", dtype="float32", device="cpu", weights="fp32", progress=False)


@pytest.fixture(scope="session")
def hf_gguf_model(request):
    """transformers' own loading of the bundled GGUF (dequantized, fp32, eval).

    Shares tests/conftest.py's ``hf_bundled_model`` when present. ``from_pretrained(gguf_file=)``
    insists on ``accelerate``; without it, call the loader it would call (for llama:
    ``load_gguf_checkpoint``) directly.
    """
    try:
        return request.getfixturevalue("hf_bundled_model")
    except pytest.FixtureLookupError:
        pass
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from kvmesh.model.loader import bundled_gguf_path

    path = bundled_gguf_path()
    try:
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    except ValueError as e:
        if "accelerate" not in str(e):
            raise
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model.eval()


@pytest.fixture(scope="session")
def hf_gguf_tokenizer():
    from transformers import AutoTokenizer

    from kvmesh.model.loader import bundled_gguf_path

    path = bundled_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
