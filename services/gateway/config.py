"""Gateway configuration: flags and KVMESH_GATEWAY_* environment variables, frozen after start."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvmesh.config import ConfigError, setting
from kvmesh.metrics import ALL_MODELS
from kvmesh.rpc.server import ServerSettings

_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class GatewayConfig:
    """Everything the gateway needs to start; see `python -m kvmesh.services.gateway --help`."""

    router_address: str = setting("127.0.0.1:50081", "host:port of the router service (the upstream of every generation).")
    kvcache_address: Optional[str] = setting(None, "host:port of the KV-cache service whose sentence-embedding model (all-MiniLM-L6-v2, loaded once there) serves POST /v1/embeddings and is listed in /v1/models; unset = no embeddings endpoint. `kvmesh up` sets it.")
    model: str = setting("bundled", "Tokenizer source: 'bundled' (SmolLM2 GGUF), a .gguf path or a Hugging Face folder; only the tokenizer and chat template are read, never the weights. Must tokenize like the engines' --model: checked at start (--model-check-timeout-s).")
    chat_template: Optional[str] = setting(None, "Chat template overriding the model's own: a path to a Jinja file, or the template itself (as vLLM's --chat-template). Unset = the model's (tokenizer_config.json, chat_template.jinja or GGUF metadata).")
    model_check_timeout_s: float = setting(10.0, "At start, wait this long for the router's model list and refuse to start when an engine tier's tokenizer differs from the gateway's; a router that does not answer in time is logged and the gateway starts unchecked. 0 = no check.", min=0.0)
    http_host: str = setting("127.0.0.1", "Address the OpenAI-compatible HTTP server binds (loopback by default).")
    http_port: int = setting(8000, "HTTP port; 0 picks a free one (printed at start).", min=0, max=65535)
    server: ServerSettings = ServerSettings(port=50051)
    metrics: bool = setting(True, "Serve Prometheus text at GET /metrics on the HTTP port.")
    keys_file: Optional[Path] = setting(None, "JSON file of tenants and API-key hashes (see `python -m kvmesh.services.gateway.keys`); unset = no keys, every request is tenant 'default'.")
    max_inflight_requests: int = setting(256, "Upstream requests (prompts x n) in flight at once; more get 503 with Retry-After.", min=1)
    max_inflight_prompt_tokens: int = setting(262144, "Prompt tokens in flight at once over all requests; more get 503 with Retry-After.", min=1)
    tenant_max_inflight_requests: int = setting(0, "Default per-tenant cap on upstream requests in flight (a tenant's own `max_inflight_requests` in the keys file wins); over it: 429. 0 = no cap.", min=0)
    retry_after_s: int = setting(1, "Seconds sent in Retry-After when a request is refused for load.", min=1)
    slo_ttft_s: float = setting(0.0, "SLO-aware admission: refuse a request with 503 + Retry-After when its predicted time to first token (the prompt tokens queued ahead of it over the measured prefill rate) exceeds this many seconds, instead of admitting work that will miss it. 0 = off.", min=0.0)
    max_n: int = setting(16, "Largest `n` (choices per prompt) a request may ask for.", min=1, max=128)
    max_batch_prompts: int = setting(32, "Most prompts one /v1/completions request may batch.", min=1)
    default_temperature: float = setting(1.0, "Temperature of a request that names none (OpenAI's default is 1.0; 0 = greedy).", min=0.0, max=2.0)
    request_timeout_s: float = setting(600.0, "Deadline of each upstream generation (the whole stream).", min=0.1)
    models_refresh_s: float = setting(5.0, "Seconds the router's model list is cached before it is asked again.", min=0.0)
    trace_content: bool = setting(False, "Record prompts and completions in trace spans (gen_ai.input.messages, gen_ai.output.messages). Off by default: traces then carry token counts, never text.")

    def validate(self) -> None:
        if self.chat_template is not None and not self.chat_template.strip():
            raise ConfigError("--chat-template is empty; give a Jinja file or the template text, or unset it "
                              "(KVMESH_GATEWAY_CHAT_TEMPLATE)")
        if ":" not in self.router_address:
            raise ConfigError(f"--router-address {self.router_address!r} needs a port, e.g. 127.0.0.1:50081 "
                              "(KVMESH_GATEWAY_ROUTER_ADDRESS)")
        if self.keys_file is not None and not self.keys_file.is_file():
            raise ConfigError(f"--keys-file {self.keys_file} does not exist; create it with "
                              f"`python -m kvmesh.services.gateway.keys add --keys-file {self.keys_file} "
                              "--tenant NAME`, or unset it to run without keys")
        if self.kvcache_address is not None and ":" not in self.kvcache_address:
            raise ConfigError(f"--kvcache-address {self.kvcache_address!r} needs a port, e.g. 127.0.0.1:50071 "
                              "(KVMESH_GATEWAY_KVCACHE_ADDRESS), or unset it to serve no embeddings")
        rpc = self.server
        if self.http_host == rpc.host and self.http_port == rpc.port and rpc.port != 0:
            raise ConfigError(f"--http-port and --port are both {rpc.port}; give the HTTP and gRPC "
                              "servers different ports")

    @property
    def metrics_model_name(self) -> str:
        """ALL_MODELS on the process-wide series (in-flight gauges, RPC metrics): the gateway
        serves whatever the router lists. Per-request series carry the request's model."""
        return ALL_MODELS

    @property
    def open_to_network_without_keys(self) -> bool:
        """True when a server binds beyond loopback while no keys file is configured."""
        return self.keys_file is None and not (self.http_host in _LOOPBACK
                                               and self.server.host in _LOOPBACK)
