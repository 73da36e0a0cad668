"""The shape of a Llama-architecture model, independent of where its weights came from."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a Llama-family decoder.

    Built by the loaders from GGUF metadata or an HF ``config.json``; read by the model, the KV-cache
    allocator and the engine. Frozen: a loaded model's shape never changes.
    """

    name: str
    """Human-readable model name (from the checkpoint metadata)."""
    vocab_size: int
    """Rows of the embedding / columns of the logits."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_layers: int
    """Number of decoder blocks."""
    num_heads: int
    """Query heads per layer."""
    num_kv_heads: int
    """Key/value heads per layer (GQA: divides ``num_heads``)."""
    head_dim: int
    """Width of one attention head."""
    rope_theta: float
    """RoPE base frequency."""
    rms_norm_eps: float
    """Epsilon inside every RMSNorm."""
    max_position_embeddings: int
    """Longest context the model was trained for."""
    tie_word_embeddings: bool
    """True when the output projection shares the input embedding matrix."""
    bos_token_id: int | None
    """Beginning-of-sequence token, or None when the tokenizer has none."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end generation."""

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                    "num_kv_heads", "head_dim", "max_position_embeddings")
        for field in positive:
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig.{field} must be > 0, got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("rope_theta and rms_norm_eps must be > 0")
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"unknown ModelConfig fields: {sorted(unknown)}")
        return cls(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ()))})

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], name: str = "") -> ModelConfig:
        """Map an HF ``LlamaConfig`` dict (``config.json``) to a ModelConfig.

        Rejects what this model code does not implement (rope scaling, biases), so an unsupported
        checkpoint fails at load time rather than producing wrong logits.
        """
        arch = hf.get("model_type", "llama")
        if arch not in ("llama", "mistral", "smollm"):
            raise ValueError(f"unsupported model_type {arch!r}: only Llama-architecture checkpoints load")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias checkpoints are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} unsupported (only silu)")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope scaling {rope_type!r} is not supported")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        return cls(
            name=name or hf.get("_name_or_path", "") or arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent HF ``LlamaConfig`` dict (used to write a converted checkpoint folder)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "_name_or_path": self.name,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
        }
