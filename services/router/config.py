"""Router configuration: flags and KVMESH_ROUTER_* environment variables, frozen after start."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvmesh.config import ConfigError, setting
from kvmesh.metrics import ALL_MODELS
from kvmesh.rpc.server import ServerSettings
from kvmesh.services.router.topology import CASCADES_HELP, TIERS_HELP, Topology, parse_topology

Policy = Literal["kv_aware", "round_robin", "least_loaded"]
Signal = Literal["mean_logprob", "min_logprob", "neg_entropy"]


@dataclass(frozen=True)
class RouterConfig:
    """The router service: places each request on a tier (cascade, difficulty, or the one the
    client names) and on a replica of it (KV-cache-aware, round-robin or least-loaded)."""

    server: ServerSettings = ServerSettings(port=50081)
    tiers: str = setting("default=127.0.0.1:50061", TIERS_HELP)
    cascades: str = setting("", CASCADES_HELP)
    default_model: str = setting(
        "", "Tier or cascade for requests that name no model; empty = the first cascade, else "
            "the first tier.")
    policy: Policy = setting(
        "kv_aware", "Replica placement: kv_aware (probe every replica, least estimated work "
                    "before the first token), round_robin, or least_loaded (fewest requests in "
                    "flight from this router).")
    probe_timeout_s: float = setting(
        0.2, "kv_aware: deadline of each replica probe. A late answer leaves the replica "
             "unprobed (ranked after the probed ones); an UNAVAILABLE one marks it down.",
        min=0.001)
    load_weight: float = setting(
        64.0, "kv_aware: prompt tokens of prefill one running or waiting request on a replica "
              "is worth (score = uncached prompt tokens + pending prefill tokens + "
              "load_weight x (running + waiting)).", min=0.0)
    cascade_signal: Signal = setting(
        "mean_logprob", "Cascade confidence: mean_logprob or min_logprob of the generated "
                        "tokens, or neg_entropy (minus the mean entropy of the top-5 "
                        "alternatives, renormalized).")
    cascade_threshold: float = setting(
        -0.5, "Cascade: keep a tier's answer when its confidence >= this (logprobs are <= 0: "
              "-0.5 = mean token probability about 0.6), else escalate to the next tier.")
    difficulty_prompt_tokens: int = setting(
        0, "Prompts of at least this many tokens skip a cascade's cheaper tiers and go straight "
           "to its last tier; 0 = off.", min=0)
    down_backoff_s: float = setting(
        5.0, "Seconds a replica that failed (probe or connection) is skipped before it is "
             "tried again.", min=0.0)
    generate_timeout_s: float = setting(
        600.0, "Deadline of one engine Generate call when the caller set none (a caller's "
               "deadline always caps it).", min=0.1)
    stall_timeout_s: float = setting(
        30.0, "Longest wait for an engine stream's next message once it has started; a stream "
              "silent this long is treated as a failed replica (migrated, see "
              "--migration-limit). 0 = no limit.", min=0.0)
    migration_limit: int = setting(
        3, "Times one request may move to another replica when its replica fails mid-stream "
           "(killed, unreachable, hung past --keepalive-s + --keepalive-timeout-s or "
           "--stall-timeout-s): the new replica continues after the tokens already streamed. "
           "0 = a mid-stream failure ends the request with an error.", min=0)
    keepalive_s: float = setting(
        2.0, "Seconds between HTTP/2 pings on a busy engine connection: a replica that stops "
             "answering (a hung or stopped process) is detected within keepalive_s + "
             "keepalive_timeout_s and its requests move on.", min=0.1)
    keepalive_timeout_s: float = setting(
        3.0, "Seconds an engine has to answer a ping before its connection is dropped.",
        min=0.1)
    info_timeout_s: float = setting(
        2.0, "Deadline of the model-info calls ListModels makes (answers are cached).", min=0.01)
    pd_min_prompt_tokens: int = setting(
        256, "P/D tiers (replicas marked /prefill and /decode in --tiers): prompts of at least "
             "this many tokens are prefilled on a prefill replica and decoded on a decode "
             "replica; shorter ones run whole on a decode replica. 256 (one KV chunk): from "
             "there on, kvmesh bench pd measured P/D saving a decode beside the prompt more "
             "than it costs the prompt.", min=1)
    openai_api_key: str = setting(
        "", "Bearer key sent to OpenAI-compatible replicas; empty sends none.", secret=True)

    def validate(self) -> None:
        self.topology  # parses both specs; raises ConfigError with the fix
        if self.cascade_threshold > 0:
            raise ConfigError(f"--cascade-threshold {self.cascade_threshold} can never be met: "
                              f"{self.cascade_signal} is always <= 0; use a negative value such "
                              "as -0.5")

    @property
    def topology(self) -> Topology:
        """The tiers, cascades and default model parsed from the specs."""
        return parse_topology(self.tiers, self.cascades, self.default_model)

    @property
    def metrics_model_name(self) -> str:
        """The one model this router serves (a single tier and no cascade: the tier's name, as
        /v1/models lists it), else ALL_MODELS: the label of its series that belong to no tier."""
        names = self.topology.model_names
        return names[0] if len(names) == 1 else ALL_MODELS
