"""GetModelInfo of an engine serving another family: what the gateway checks its tokenizer against
(the fingerprint of the model's own tokenizer, whichever format the gateway reads) and the source."""
from __future__ import annotations

from engine_utils import make_core
from kvmesh.model.bundled import source_tokenizer
from kvmesh.model.loader import load_model
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.servicer import model_info
from model_families import family_model, write_gguf


def test_model_info_names_the_model_and_its_tokenizer(tmp_path):
    m = family_model(tmp_path / "qwen2", "qwen2")
    loaded = load_model(str(m.folder))
    cfg = EngineConfig(model=str(m.folder), served_model_name="tiny")
    info = model_info(make_core(loaded), cfg)
    assert (info.model, info.model_source) == ("tiny", str(m.folder))
    assert info.tokenizer_fingerprint == source_tokenizer(str(m.folder)).fingerprint()
    assert info.kv_namespace.layout.rope == "pre-rope-hf theta=10000"
    # the same model as a GGUF file: a gateway reading either tokenizes alike
    gguf = write_gguf(tmp_path / "q.gguf", m)
    assert source_tokenizer(str(gguf)).fingerprint() == info.tokenizer_fingerprint
    from_gguf = load_model(str(gguf), cache_dir=tmp_path / "cache", progress=False)
    assert model_info(make_core(from_gguf), cfg).tokenizer_fingerprint == info.tokenizer_fingerprint
