"""Load an HF checkpoint folder: config.json, *.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvmesh.model.config import ModelConfig
from kvmesh.model.bundled import folder_digest, read_eos_ids, sha256_file, weight_files
from kvmesh.model.tokenizer import Tokenizer

__all__ = ["Checkpoint", "folder_digest", "load_hf_folder", "sha256_file", "weight_files"]

# Tensors some checkpoints carry that the model recomputes (RoPE tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Checkpoint:
    """What every loader produces: the model's shape, its canonical (HF-named) weights, its tokenizer."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None  # None for weight-only folders (e.g. test models)
    digest: str  # sha256 hex identifying the source weights


def load_hf_folder(folder: str | Path, *, digest: str | None = None, name: str = "") -> Checkpoint:
    """Read an HF checkpoint folder of a supported family into a Checkpoint.

    ``digest`` overrides the computed weights digest (the GGUF loader passes the GGUF file's
    sha256 for the folder it converted the file into).
    """
    folder = Path(folder)
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} missing: not an HF checkpoint folder")
    hf_cfg = json.loads(cfg_file.read_text())
    eos = read_eos_ids(folder, hf_cfg)
    if eos is not None:
        hf_cfg = {**hf_cfg, "eos_token_id": eos}
    config = ModelConfig.from_hf_config(hf_cfg, name=name or hf_cfg.get("_name_or_path") or folder.name)

    files = weight_files(folder)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}

    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_hf_folder(folder, eos_token_ids=config.eos_token_ids or None)
    return Checkpoint(config, state, tokenizer, digest or folder_digest(files))
