"""Model code: the Llama-family forward pass (Llama 2/3/3.1+, Mistral, Qwen2/2.5), loaders (GGUF, Hugging
Face folders), tokenizers (incl. GGUF's), weight quantization.

Public API (what the engine and gateway use):
    load_model, load_tokenizer, LoadedModel                -- kvmesh.model.loader
    bundled_gguf_path                                   -- kvmesh.model.bundled (no torch)
    LlamaForCausalLM                                    -- kvmesh.model.llama
    AttentionMetadata, allocate_kv_cache, kv_bytes_per_block -- kvmesh.model.attention
    ModelConfig, RopeScaling                            -- kvmesh.model.config
    Tokenizer, IncrementalDetokenizer                   -- kvmesh.model.tokenizer
    quantize_model                                      -- kvmesh.model.quant
    perplexity, reference_text                          -- kvmesh.model.perplexity
"""

from __future__ import annotations

import importlib

# Resolved on first use (PEP 562), so importing a torch-free submodule (kvmesh.model.tokenizer,
# kvmesh.model.bundled: what the gateway needs) does not import torch through this package.
_HOME = {
    "AttentionMetadata": "attention", "allocate_kv_cache": "attention", "kv_bytes_per_block": "attention",
    "ModelConfig": "config", "RopeScaling": "config",
    "LlamaForCausalLM": "llama",
    "LoadedModel": "loader", "load_model": "loader", "load_tokenizer": "loader",
    "bundled_gguf_path": "bundled",
    "perplexity": "perplexity", "reference_text": "perplexity",
    "quantize_model": "quant",
    "IncrementalDetokenizer": "tokenizer", "Tokenizer": "tokenizer",
}


def __getattr__(name: str):
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'kvmesh.model' has no attribute {name!r}")
    return getattr(importlib.import_module(f"kvmesh.model.{module}"), name)


__all__ = [
    "AttentionMetadata",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "RopeScaling",
    "Tokenizer",
    "allocate_kv_cache",
    "bundled_gguf_path",
    "kv_bytes_per_block",
    "load_model",
    "load_tokenizer",
    "perplexity",
    "quantize_model",
    "reference_text",
]
