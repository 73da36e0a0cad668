"""Model code: Llama-architecture forward pass, loaders (GGUF, Hugging Face), tokenizer, weight quantization.

Public API (what the engine and gateway use):
    load_model, load_tokenizer, LoadedModel, bundled_gguf_path -- kvmesh.model.loader
    LlamaForCausalLM                                    -- kvmesh.model.llama
    AttentionMetadata, allocate_kv_cache, kv_bytes_per_block -- kvmesh.model.attention
    ModelConfig                                         -- kvmesh.model.config
    Tokenizer, IncrementalDetokenizer                   -- kvmesh.model.tokenizer
    quantize_model                                      -- kvmesh.model.quant
    perplexity, reference_text                          -- kvmesh.model.perplexity
"""

from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache, kv_bytes_per_block
from kvmesh.model.config import ModelConfig
from kvmesh.model.llama import LlamaForCausalLM
from kvmesh.model.loader import LoadedModel, bundled_gguf_path, load_model, load_tokenizer
from kvmesh.model.perplexity import perplexity, reference_text
from kvmesh.model.quant import quantize_model
from kvmesh.model.tokenizer import IncrementalDetokenizer, Tokenizer

__all__ = [
    "AttentionMetadata",
    "IncrementalDetokenizer",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
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
