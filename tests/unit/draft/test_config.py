"""Draft service config: defaults, env/flags, and fix-it messages."""
from __future__ import annotations

import pytest

from kvmesh.config import ConfigError, load_config
from kvmesh.services.draft.config import DraftConfig


def load(argv=(), env=None) -> DraftConfig:
    return load_config(DraftConfig, "draft", list(argv), env or {})


def test_defaults():
    cfg = load()
    assert (cfg.server.port, cfg.draft_model, cfg.draft_weights, cfg.draft_num_layers, cfg.threads) == \
        (50091, "bundled", "int4", 0, 1)
    assert (cfg.state_ttl_s, cfg.default_drafter, cfg.ngram_min, cfg.ngram_max) == (60.0, "adaptive", 2, 4)
    assert cfg.draft_dtype == "float32" and cfg.target_model == ""


def test_env_and_flags():
    cfg = load(["--ngram-min", "1", "--draft-model", "none"],
               {"KVMESH_DRAFT_DRAFT_WEIGHTS": "bf16", "KVMESH_DRAFT_STATE_TTL_S": "5"})
    assert (cfg.ngram_min, cfg.draft_model, cfg.draft_dtype, cfg.state_ttl_s) == (1, None, "bfloat16", 5.0)


@pytest.mark.parametrize("argv, message", [
    (["--ngram-min", "5"], "--ngram-min 5 exceeds --ngram-max 4"),
    (["--default-drafter", "model", "--draft-model", "none"], "needs a draft model"),
    (["--device", "tpu"], "use cpu, cuda or cuda:N"),
    (["--max-draft-tokens", "0"], "below the minimum"),
    (["--catch-up-tokens", "16"], "--catch-up-tokens 16 must exceed --max-draft-tokens 16"),
])
def test_fix_it_messages(argv, message):
    with pytest.raises(ConfigError, match=message):
        load(argv)
