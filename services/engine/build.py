"""Wiring: config → loaded model → runner → core → async engine. Used by __main__, tests, benches."""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from kvmesh.config import ConfigError
from kvmesh.threads import set_torch_threads
from kvmesh.kv.codec import CodecSpec, exact_codec
from kvmesh.kv.namespace import KvLayout, KvNamespace
from kvmesh.kv.quality import QualityBudget
from kvmesh.kv.rope import stored_keys_rope
from kvmesh.model.loader import LoadedModel, load_model, truncate_layers
from kvmesh.model import amx_attention, cpu_attention
from kvmesh.model.native import paged_decode_kernel
from kvmesh.services.engine.async_engine import AsyncEngine
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.blending import BlendConfig
from kvmesh.services.engine.core import EngineCore
from kvmesh.services.engine.draft_client import DraftClient, DraftClientConfig
from kvmesh.services.engine.guardrail import GuardConfig, Guardrail
from kvmesh.services.engine.kv_connector import KvConnector, KvConnectorConfig
from kvmesh.services.engine.runner import ModelRunner, blocks_for_budget
from kvmesh.services.engine.scheduler import SchedulerConfig
from kvmesh.services.engine.speculation import SpecMode
from kvmesh.services.engine.speculator import SpecConfig

log = logging.getLogger(__name__)


def build_core(cfg: EngineConfig, loaded: LoadedModel | None = None, *,
               clock: Callable[[], float] = time.monotonic) -> EngineCore:
    """Loads the model (unless given), cuts it to `cfg.num_layers` and builds a ready EngineCore
    sized by `cfg`. `clock` times the draft client's back-off (tests pass a fake one)."""
    if loaded is None:
        loaded = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, weights=cfg.weight_format)
    loaded = serve_layers(loaded, cfg)
    if loaded.device.type == "cpu" and loaded.model_dtype == torch.float32:
        paged_decode_kernel()  # built (or loaded from the cache) now, not on the first decode step
    if loaded.device.type == "cpu" and loaded.model_dtype in amx_attention.DTYPES:
        if not amx_attention.prepare():  # likewise for prefill attention, not on the first prompt
            cpu_attention.prepare()  # (AVX-512 without AMX)
    num_blocks = cfg.num_blocks or blocks_for_budget(loaded, cfg.block_size, cfg.kv_cache_bytes)
    max_len = cfg.max_model_len or loaded.config.context_length
    runner = ModelRunner(loaded, num_blocks=num_blocks, block_size=cfg.block_size,
                         graph_batch_sizes=cuda_graph_sizes(cfg, loaded), max_model_len=max_len)
    sched = SchedulerConfig(
        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
        solo_prefill_tokens=cfg.solo_prefill_tokens, max_model_len=max_len, block_size=cfg.block_size,
        max_waiting=cfg.max_waiting)
    log.info("KV pool: %d blocks x %d tokens = %.1f MiB", num_blocks, cfg.block_size,
             runner.kv_cache_bytes / 2**20)
    return EngineCore(loaded, runner, sched, namespace=engine_namespace(loaded),
                      enable_prefix_caching=cfg.enable_prefix_caching, kv=build_kv_connector(cfg, loaded),
                      drafts=build_draft_client(cfg, loaded, clock),
                      spec=SpecConfig(SpecMode(cfg.speculation), cfg.spec_max_draft_tokens,
                                      cfg.spec_batch_draft_tokens, cfg.spec_step_rows, cfg.spec_local_ngram,
                                      cfg.spec_ngram_min, cfg.spec_ngram_max),
                      blend=BlendConfig(cfg.blend_recompute_ratio, cfg.blend_select_layers,
                                        cfg.blend_selection).for_model(loaded.config.num_layers),
                      quality_budget=QualityBudget(cfg.quality_max_kl, cfg.quality_min_top1),
                      guardrail=build_guardrail(cfg))


def cuda_graph_sizes(cfg: EngineConfig, loaded: LoadedModel) -> tuple[int, ...]:
    """Decode batch sizes the runner captures as CUDA graphs: none off CUDA, with --cuda-graphs false,
    or for a model the graphs do not support (logged)."""
    if loaded.device.type != "cuda" or not cfg.cuda_graphs:
        return ()
    from kvmesh.gpu.decode_graphs import graph_batch_sizes, supports

    why = supports(loaded.model)
    if why is not None:
        log.info("decode steps run eagerly, not as CUDA graphs: %s", why)
        return ()
    return graph_batch_sizes(cfg.max_num_seqs)


def build_guardrail(cfg: EngineConfig) -> Guardrail:
    """The online guardrail of lossy reuse paths (services/engine/guardrail.py), from the guard_* flags."""
    return Guardrail(GuardConfig(
        shadow_share=cfg.guard_shadow_share, replay_share=cfg.guard_replay_share, min_checks=cfg.guard_min_checks,
        window=cfg.guard_window, fast_factor=cfg.guard_fast_factor, reenable_checks=cfg.guard_reenable_checks,
        queue=cfg.guard_queue, max_tokens=cfg.guard_max_tokens))


def build_draft_client(cfg: EngineConfig, loaded: LoadedModel,
                       clock: Callable[[], float] = time.monotonic) -> DraftClient | None:
    """The draft service link when `cfg.draft_address` is set."""
    if not cfg.draft_address:
        return None
    client = DraftClient(DraftClientConfig(cfg.draft_address, cfg.draft_timeout_s, cfg.draft_retry_s),
                         target_model=loaded.weights_digest, vocab_size=loaded.config.vocab_size, clock=clock)
    log.info("draft service %s: speculation %s by default, up to %d drafts per step, %.0f ms deadline "
             "(engine instance %s)", cfg.draft_address, cfg.speculation, cfg.spec_max_draft_tokens,
             cfg.draft_timeout_s * 1000, client.instance_id)
    return client


def serve_layers(loaded: LoadedModel, cfg: EngineConfig) -> LoadedModel:
    """The model cut after `cfg.num_layers` decoder layers (0: all of them); ConfigError when the
    model has fewer."""
    if cfg.num_layers == 0:
        return loaded
    have = loaded.config.num_layers
    if cfg.num_layers > have:
        raise ConfigError(f"--num-layers {cfg.num_layers} exceeds the {have} decoder layers of model "
                          f"{loaded.source!r}; use 1..{have}, or 0 for all of them (KVMESH_ENGINE_NUM_LAYERS)")
    log.info("serving the first %d of %d decoder layers (early exit)", cfg.num_layers,
             loaded.source_num_layers or have)
    return truncate_layers(loaded, cfg.num_layers)


def kv_layout(loaded: LoadedModel) -> KvLayout:
    """What one token's KV looks like for this model, stored keys' RoPE convention, base and
    scaling included (a key un-rotated with another rotation is another key)."""
    c = loaded.config
    return KvLayout(c.num_layers, c.num_kv_heads, c.head_dim, str(loaded.dtype).removeprefix("torch."),
                    rope=stored_keys_rope(c))


def engine_namespace(loaded: LoadedModel) -> KvNamespace:
    """The engine's KV identity: built once, here; requests derive theirs (tenant, storage) from it."""
    return KvNamespace(loaded.identity, kv_layout(loaded))


def build_kv_connector(cfg: EngineConfig, loaded: LoadedModel) -> KvConnector | None:
    """The KV-cache service link when `cfg.kvcache_address` is set."""
    if not cfg.kvcache_address:
        return None
    layout = kv_layout(loaded)
    name = exact_codec(loaded.dtype) if cfg.kv_codec == "auto" else cfg.kv_codec
    spec = CodecSpec(name=name, zstd=cfg.kv_zstd, group_size=cfg.kv_group_size, residual=cfg.kv_residual,
                     head=cfg.kv_head_tokens, key_outliers=cfg.kv_key_outliers)
    conn = KvConnector(KvConnectorConfig(cfg.kvcache_address, cfg.kv_chunk_tokens, spec, cfg.kv_timeout_s,
                                         cfg.kv_retry_s, hot_bytes=cfg.kv_hot_bytes,
                                         max_export_bytes=cfg.kv_export_max_bytes,
                                         export_priority=cfg.kv_export_priority),
                       layout=layout, dtype=loaded.dtype, block_size=cfg.block_size, rotary=loaded.model.rotary)
    log.info("KV-cache service %s: chunks of %d tokens, codec %s%s, background exports at %s priority",
             cfg.kvcache_address, cfg.kv_chunk_tokens, spec.name, "+zstd" if cfg.kv_zstd else "",
             conn.export_priority)
    return conn


def build_async_engine(cfg: EngineConfig) -> AsyncEngine:
    """Everything but the gRPC server. The model is loaded on the engine's step-loop thread, which
    sizes its own torch thread pool (see the threading NOTE in async_engine)."""
    def build() -> EngineCore:
        threads = set_torch_threads(cfg.threads)
        log.info("torch threads: %d", threads)
        return build_core(cfg)

    return AsyncEngine(build)
