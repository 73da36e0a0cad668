"""Wiring: config -> (draft model) -> drafters -> DraftService. Used by __main__ and tests."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from kvmesh.config import ConfigError
from kvmesh.services.draft.adaptive import AdaptiveParams
from kvmesh.services.draft.config import DraftConfig
from kvmesh.services.draft.drafters import Drafter, DrafterKind, DrafterRegistry
from kvmesh.services.draft.metrics import DraftMetrics
from kvmesh.services.draft.ngram import NgramDrafter
from kvmesh.services.draft.service import DraftService
from kvmesh.services.draft.state import StateStore
from kvmesh.threads import set_torch_threads

if TYPE_CHECKING:
    from kvmesh.model.loader import LoadedModel

log = logging.getLogger(__name__)


def load_draft_model(cfg: DraftConfig) -> LoadedModel | None:
    """The draft model (cut to cfg.draft_num_layers), or None without one. Sizes torch's thread
    pool first: call it on the thread that will run the drafts (see the engine's threading NOTE)."""
    if cfg.draft_model is None:
        return None
    from kvmesh.model.loader import load_model, truncate_layers

    set_torch_threads(cfg.threads)
    loaded = load_model(cfg.draft_model, dtype=cfg.draft_dtype, device=cfg.device,
                        weights=cfg.draft_weights, progress=False)
    have = loaded.config.num_layers
    if cfg.draft_num_layers > have:
        raise ConfigError(f"--draft-num-layers {cfg.draft_num_layers} exceeds the {have} decoder layers "
                          f"of {cfg.draft_model!r}; use 1..{have}, or 0 for all of them")
    if cfg.draft_num_layers:
        loaded = truncate_layers(loaded, cfg.draft_num_layers)
    return loaded


def bundled_digest() -> str:
    """Weights digest of the bundled model (sha256 of its GGUF file), as its engines report it."""
    from kvmesh.model.hf_loader import sha256_file
    from kvmesh.model.loader import bundled_gguf_path

    return sha256_file(bundled_gguf_path())


def build_service(cfg: DraftConfig, loaded: LoadedModel | None = None, *,
                  metrics: DraftMetrics) -> DraftService:
    """The service for `cfg`, counting into `metrics`; `loaded` is the draft model (None: no
    model drafter)."""
    drafters: list[Drafter] = [NgramDrafter(cfg.ngram_min, cfg.ngram_max)]
    if loaded is not None:
        from kvmesh.model.attention import kv_bytes_per_block
        from kvmesh.services.draft.model_drafter import ModelDrafter

        per_block = kv_bytes_per_block(loaded.config, cfg.block_size, loaded.dtype)
        num_blocks = max(1, cfg.kv_cache_bytes // per_block)
        drafters.append(ModelDrafter(loaded, num_blocks=num_blocks, block_size=cfg.block_size,
                                     catch_up_tokens=cfg.catch_up_tokens))
        log.info("model drafter: %s, KV pool %d blocks x %d tokens", drafters[-1].describe(),
                 num_blocks, cfg.block_size)
    registry = DrafterRegistry(drafters)
    default = DrafterKind(cfg.default_drafter)
    if default not in registry and default is not DrafterKind.ADAPTIVE:
        raise ConfigError(f"--default-drafter {cfg.default_drafter} is not available without a "
                          "draft model; set --draft-model or pick ngram/adaptive")
    target = cfg.target_model or (loaded.weights_digest if loaded is not None else bundled_digest())
    store = StateStore(ttl_s=cfg.state_ttl_s, max_sequences=cfg.max_sequences, on_drop=registry.release)
    params = AdaptiveParams(
        draft_cost={DrafterKind.NGRAM: 0.0, DrafterKind.MODEL: cfg.model_cost},
        verify_cost=cfg.verify_cost, decay=cfg.acceptance_decay, min_gain=cfg.min_gain,
        probe_every=cfg.probe_every)
    return DraftService(registry, store, target_model=target, max_draft_tokens=cfg.max_draft_tokens,
                        default_drafter=default, adaptive=params, metrics=metrics,
                        vocab_size=loaded.config.vocab_size if loaded is not None else None)
