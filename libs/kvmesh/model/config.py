"""The shape of a decoder of the Llama family (Llama 2/3/3.1+, Mistral, Qwen2/2.5), independent of
where its weights came from, and the mapping from an HF ``config.json`` to it.

The families differ in a few switches only, all fields of `ModelConfig`: q/k/v (and output)
projection biases (Qwen2), a sliding attention window (Mistral, Qwen2 when configured), RoPE
scaling (`RopeScaling`: Llama 3.1's ``llama3``, ``linear``, ``dynamic``) and tied embeddings.
Anything else a checkpoint asks for is refused at load with a message naming it, never run with
wrong logits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}
"""HF ``architectures`` entries that load, and their family."""
FAMILIES = tuple(dict.fromkeys(ARCHITECTURES.values()))
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
SUPPORTED = ("LlamaForCausalLM (Llama 2, 3, 3.1+ and SmolLM), MistralForCausalLM (Mistral), "
             "Qwen2ForCausalLM (Qwen2, Qwen2.5)")
"""What the refusal of another architecture lists."""
_MODEL_TYPES = {"llama": "llama", "smollm": "llama", "mistral": "mistral", "qwen2": "qwen2"}


class UnsupportedModelError(ValueError):
    """A checkpoint asks for something this model code does not implement; the message says what."""


@dataclass(frozen=True)
class RopeScaling:
    """How RoPE's inverse frequencies are changed from ``1 / theta**(2i/d)`` (HF's ``rope_scaling``).

    ``linear``: every frequency divided by ``factor``. ``dynamic`` (NTK): theta enlarged as for a
    sequence of ``factor`` x the original context, fixed (as vLLM; transformers re-derives it per
    forward call from the call's length, so the two agree at that length). ``llama3``: Llama 3.1's
    wavelength-dependent division, from its parameters or, from a GGUF file, from llama.cpp's
    per-frequency divisors (``freq_factors``).
    """

    rope_type: str
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0
    """llama3: the pre-training context; dynamic: the context the factor scales (0 = the model's)."""
    freq_factors: tuple[float, ...] = ()
    """llama3 from GGUF (``rope_freqs.weight``): inverse frequency i is divided by freq_factors[i]."""

    def __post_init__(self) -> None:
        if self.rope_type not in ROPE_TYPES[1:]:
            raise UnsupportedModelError(f"rope scaling {self.rope_type!r} is not supported; supported: "
                                        f"{', '.join(ROPE_TYPES[1:])} (or none)")
        if not self.freq_factors and not self.factor > 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and not self.freq_factors:
            if self.high_freq_factor <= self.low_freq_factor or self.original_max_position_embeddings <= 0:
                raise ValueError("llama3 rope scaling needs high_freq_factor > low_freq_factor and "
                                 "original_max_position_embeddings > 0")
        object.__setattr__(self, "freq_factors", tuple(float(f) for f in self.freq_factors))

    def describe(self) -> str:
        """Every parameter that changes a rotation, in one stable string (KV namespaces)."""
        if self.freq_factors:
            import hashlib

            digest = hashlib.sha256(",".join(f"{f:.9g}" for f in self.freq_factors).encode()).hexdigest()[:16]
            return f"{self.rope_type} freq_factors={digest}"
        if self.rope_type == "llama3":
            return (f"llama3 factor={self.factor:g} low={self.low_freq_factor:g} high={self.high_freq_factor:g} "
                    f"original={self.original_max_position_embeddings}")
        extra = f" original={self.original_max_position_embeddings}" if self.rope_type == "dynamic" else ""
        return f"{self.rope_type} factor={self.factor:g}{extra}"

    def scaled_theta(self, theta: float, head_dim: int, max_position_embeddings: int) -> float:
        """dynamic: the enlarged base for factor x the original context (others: theta)."""
        if self.rope_type != "dynamic":
            return theta
        original = self.original_max_position_embeddings or max_position_embeddings
        length = original * self.factor
        return theta * ((self.factor * length / original) - (self.factor - 1)) ** (head_dim / (head_dim - 2))

    def to_hf(self) -> dict[str, Any]:
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            d.update(low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor,
                     original_max_position_embeddings=self.original_max_position_embeddings)
        elif self.rope_type == "dynamic" and self.original_max_position_embeddings:
            d["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.freq_factors:
            d["kvmesh_freq_factors"] = list(self.freq_factors)
        return d

    @classmethod
    def from_hf(cls, rope: Mapping[str, Any]) -> RopeScaling | None:
        """``rope_scaling`` / ``rope_parameters`` of a config.json; None for plain RoPE."""
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ROPE_TYPES:
            raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported; supported: "
                                        f"{', '.join(ROPE_TYPES[1:])} (or none)")
        return cls(rope_type, float(rope.get("factor", 1.0)), float(rope.get("low_freq_factor", 1.0)),
                   float(rope.get("high_freq_factor", 4.0)), int(rope.get("original_max_position_embeddings") or 0),
                   tuple(rope.get("kvmesh_freq_factors") or ()))


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
    """The checkpoint's ``max_position_embeddings`` (see `context_length` for the usable context)."""
    tie_word_embeddings: bool
    """True when the output projection shares the input embedding matrix."""
    bos_token_id: int | None
    """Beginning-of-sequence token, or None when the tokenizer has none."""
    eos_token_ids: tuple[int, ...]
    """Tokens that end generation."""
    family: str = "llama"
    """Architecture family: one of FAMILIES (what config.json's ``architectures`` named)."""
    qkv_bias: bool = False
    """q/k/v projections carry a bias (Qwen2; Llama with attention_bias)."""
    o_bias: bool = False
    """The attention output projection carries a bias (Llama with attention_bias)."""
    rope_scaling: RopeScaling | None = None
    """RoPE scaling, None for plain RoPE."""
    sliding_window: int | None = None
    """Keys a query attends to at most (itself included), None = full causal attention."""
    full_attention_layers: tuple[int, ...] = ()
    """Layers exempt from `sliding_window` (Qwen2's first max_window_layers); empty = none."""

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
        if self.family not in FAMILIES:
            raise UnsupportedModelError(f"model family {self.family!r} is not supported; supported: {SUPPORTED}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0 or None, got {self.sliding_window}")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        object.__setattr__(self, "full_attention_layers", tuple(int(i) for i in self.full_attention_layers))

    @property
    def num_kv_groups(self) -> int:
        """Query heads sharing one KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def context_length(self) -> int:
        """Longest prompt + output the model serves: max_position_embeddings, times the factor of
        linear and dynamic RoPE scaling (as vLLM derives it)."""
        s = self.rope_scaling
        if s is not None and s.rope_type in ("linear", "dynamic"):
            return int((s.original_max_position_embeddings or self.max_position_embeddings) * s.factor)
        return self.max_position_embeddings

    def window_of(self, layer: int) -> int | None:
        """The attention window of decoder layer ``layer`` (None = full causal attention)."""
        if self.sliding_window is None or layer in self.full_attention_layers:
            return None
        return self.sliding_window

    def rope_description(self) -> str:
        """Every RoPE parameter that changes a key's rotation, as one stable string."""
        base = f"theta={self.rope_theta:g}"
        return base if self.rope_scaling is None else f"{base} {self.rope_scaling.describe()}"

    def architecture_description(self) -> str:
        """Everything but the name and token ids that changes what the model computes (identity)."""
        return (f"{self.family} v{self.vocab_size} h{self.hidden_size} i{self.intermediate_size} "
                f"L{self.num_layers} H{self.num_heads} K{self.num_kv_heads} D{self.head_dim} "
                f"eps={self.rms_norm_eps:g} {self.rope_description()} tie={self.tie_word_embeddings} "
                f"bias={self.qkv_bias},{self.o_bias} window={self.sliding_window} "
                f"full={','.join(map(str, self.full_attention_layers))}")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["full_attention_layers"] = list(self.full_attention_layers)
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
        """Map an HF ``config.json`` dict of a supported architecture to a ModelConfig.

        Rejects what this model code does not implement (another architecture, MLP biases, another
        activation, partial or YaRN/LongRoPE rotary embeddings), so an unsupported checkpoint
        fails at load time rather than producing wrong logits.
        """
        family = hf_family(hf)
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias checkpoints are not supported (only attention biases)")
        if hf.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {hf['hidden_act']!r} unsupported (only silu)")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor < 1 is not supported")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        heads = int(hf["num_attention_heads"])
        layers = int(hf["num_hidden_layers"])
        eos = hf.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, (list, tuple)) else (eos,))
        window, full = _sliding_window(hf, family, layers)
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            name=name or hf.get("_name_or_path", "") or family,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            family=family,
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family == "llama" and attention_bias,
            rope_scaling=RopeScaling.from_hf(rope),
            sliding_window=window,
            full_attention_layers=full,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The equivalent HF ``config.json`` dict (used to write a converted checkpoint folder)."""
        arch = next(a for a, f in ARCHITECTURES.items() if f == self.family)
        d: dict[str, Any] = {
            "architectures": [arch],
            "model_type": self.family,
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
            "mlp_bias": False,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf()
        if self.family == "llama":
            if self.qkv_bias != self.o_bias:
                raise ValueError("a llama config has either all attention biases or none")
            d["attention_bias"] = self.qkv_bias
        elif self.family == "mistral":
            if self.qkv_bias or self.o_bias or self.full_attention_layers:
                raise ValueError("a mistral config has no biases and one window for every layer")
            d["sliding_window"] = self.sliding_window
        else:
            if not self.qkv_bias or self.o_bias:
                raise ValueError("a qwen2 config has q/k/v biases and no output bias")
            d["use_sliding_window"] = self.sliding_window is not None
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = ["full_attention" if self.window_of(i) is None else "sliding_attention"
                                for i in range(self.num_layers)]
        return d


def hf_family(hf: Mapping[str, Any]) -> str:
    """The family of an HF config.json: from ``architectures`` (else ``model_type``); refuses the
    rest naming what is supported."""
    archs = hf.get("architectures") or []
    if archs:
        unknown = [a for a in archs if a not in ARCHITECTURES]
        if unknown:
            raise UnsupportedModelError(f"architecture {unknown[0]!r} is not supported; supported: {SUPPORTED}")
        return ARCHITECTURES[archs[0]]
    model_type = hf.get("model_type", "llama")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {SUPPORTED}")
    return _MODEL_TYPES[model_type]


def _sliding_window(hf: Mapping[str, Any], family: str, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, layers exempt from it) as transformers applies them per family."""
    window = hf.get("sliding_window")
    if family == "llama" or window is None:
        return None, ()
    if family == "mistral":
        if hf.get("layer_types"):
            raise UnsupportedModelError("Mistral configs with per-layer layer_types (Ministral) are not supported")
        return int(window), ()
    if not hf.get("use_sliding_window", False):  # Qwen2 ignores the window unless this is set
        return None, ()
    types = hf.get("layer_types")
    if types is None:
        first = int(hf.get("max_window_layers", 28))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers or set(types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(f"layer_types {types!r}: need one of sliding_attention/full_attention per layer")
    full = tuple(i for i, t in enumerate(types) if t == "full_attention")
    return (int(window), full) if len(full) < layers else (None, ())
