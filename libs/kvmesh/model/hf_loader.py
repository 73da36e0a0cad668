"""Load an HF checkpoint folder: config.json, *.safetensors (single or sharded), tokenizer files."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvmesh.model.config import ModelConfig
from kvmesh.model.bundled import read_eos_ids
from kvmesh.model.tokenizer import Tokenizer

# Tensors some checkpoints carry that the model recomputes (RoPE tables).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass(frozen=True)
class Checkpoint:
    """What every loader produces: the model's shape, its canonical (HF-named) weights, its tokenizer."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None  # None for weight-only folders (e.g. test models)
    digest: str  # sha256 hex identifying the source weights


def sha256_file(path: str | Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files: the index's shards if sharded, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [folder / s for s in shards]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder} (.bin checkpoints are not supported)")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"shard {f} listed in the index is missing")
    return files


def folder_digest(files: list[Path]) -> str:
    """sha256 over (name, sha256) of each weight file: changes whenever any weight byte does."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode() + b"\n")
    return h.hexdigest()


def load_hf_folder(folder: str | Path, *, digest: str | None = None, name: str = "") -> Checkpoint:
    """Read an HF Llama checkpoint folder into a Checkpoint.

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
