"""Builds a Router from a RouterConfig: one backend per replica, one pool per tier."""
from __future__ import annotations

import httpx

from kvmesh.rpc.client import make_channel
from kvmesh.services.router.backends import Backend, EngineBackend
from kvmesh.services.router.config import RouterConfig
from kvmesh.services.router.metrics import RouterMetrics
from kvmesh.services.router.openai_backend import OpenAIBackend
from kvmesh.services.router.placement import TierState
from kvmesh.services.router.pool import PlacementKnobs, TierPool
from kvmesh.services.router.router import CascadeKnobs, Router
from kvmesh.services.router.topology import Replica


def build_backend(replica: Replica, cfg: RouterConfig) -> Backend:
    """A gRPC backend for an engine, an httpx one for an OpenAI-compatible endpoint."""
    if replica.kind == "engine":
        # A replica that went away is retried after the router's own back-off, so grpc's
        # reconnect back-off (up to 2 minutes by default) must not keep it out longer.
        backoff_ms = max(int(cfg.down_backoff_s * 1000), 100)
        # Pings while a call is open (and unlimited ones while the engine only sends: a long
        # prefill sends nothing) detect a replica that hangs -- the connection stays up, nothing
        # answers -- within keepalive + timeout; the engine's server accepts them (rpc.server).
        channel = make_channel(replica.address, options=[
            ("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 1000)),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
            ("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
            # grpc 1.85 waits for a ping's answer this long, whatever keepalive_timeout says
            # (its default is 60 s): measured, a SIGSTOPped server is dropped after 60 s without it
            ("grpc.http2.ping_timeout_ms", int(cfg.keepalive_timeout_s * 1000)),
            ("grpc.http2.max_pings_without_data", 0)])
        return EngineBackend(replica, channel)
    return OpenAIBackend(replica, httpx.AsyncClient(), cfg.openai_api_key)


def build_router(cfg: RouterConfig, metrics: RouterMetrics) -> Router:
    """Everything the servicer needs, counting into `metrics`; channels connect lazily, on the
    first call."""
    topology = cfg.topology
    knobs = PlacementKnobs(cfg.policy, cfg.probe_timeout_s, cfg.load_weight,
                           cfg.generate_timeout_s, cfg.stall_timeout_s, cfg.migration_limit,
                           cfg.pd_min_prompt_tokens)
    pools = {
        tier.name: TierPool(tier, [build_backend(r, cfg) for r in tier.replicas], knobs,
                            TierState([r.label for r in tier.replicas], cfg.down_backoff_s), metrics)
        for tier in topology.tiers}
    return Router(topology, pools, metrics,
                  CascadeKnobs(cfg.cascade_signal, cfg.cascade_threshold,
                               cfg.difficulty_prompt_tokens),
                  info_timeout_s=cfg.info_timeout_s)
