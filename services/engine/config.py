"""Engine configuration: flags and KVMESH_ENGINE_* environment variables, frozen after start."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from kvmesh.config import ConfigError, setting
from kvmesh.model.bundled import BUNDLED_NAME, names_gguf
from kvmesh.limits import MAX_DRAFT_TOKENS
from kvmesh.rpc.server import ServerSettings
from kvmesh.threads import parse_cpu_list

MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine service needs to start; see `python -m kvmesh.services.engine --help`."""

    server: ServerSettings = ServerSettings(port=50061)
    model: str = setting("bundled", "Model source: 'bundled' (SmolLM2-135M-Instruct GGUF), a .gguf path, or a Hugging Face checkpoint folder, of a Llama (2, 3, 3.1+), Mistral or Qwen2 (2.5) model; other architectures are refused naming these.")
    served_model_name: str = setting("", "Model name reported to clients (vLLM's flag); empty = derived from --model: smollm2-135m-instruct for the bundled model, else --model as given (as vLLM). `kvmesh up` passes its own --served-model-name, else derives it the same way.", aliases=("served_name",))
    dtype: str = setting("float32", "Compute dtype.", choices=("float32", "bfloat16"))
    weights: str = setting("auto", "Weight format: auto (a GGUF model on CPU in float32: gguf, the file's own blocks; otherwise the compute dtype), fp32, bf16, weight-only int8/int4, or int4-w8a8 (int4 for one- and two-row matmuls, int8 weights x int8 activations for larger ones and the output projection: faster batches and prefill, +1% perplexity), or gguf (GGUF models only: the file's own quantized blocks run as they are, exact with respect to the file up to float rounding), or gguf-a8 (GGUF models with Q4_0/Q4_1/Q8_0 blocks, CPUs with AVX-512 VNNI: the same blocks times activations rounded to 8 bits per block of 32, llama.cpp's arithmetic; lossy, faster prefill and batches).", choices=("auto", "fp32", "bf16", "int8", "int4", "int4-w8a8", "gguf", "gguf-a8"))
    num_layers: int = setting(0, "Serve only the first N decoder layers (early exit: then the final norm and lm_head), e.g. a cheap cascade tier of the same weights; 0 = all. Its KV namespace differs from the full model's.", min=0)
    device: str = setting("cpu", "Torch device: cpu, cuda, cuda:N.")
    cuda_graphs: bool = setting(True, "On a CUDA device, replay plain decode steps as CUDA graphs captured at start for batch sizes 1, 2, 4, ... up to --max-num-seqs (one launch per step instead of hundreds); other steps (prefill chunks, drafts, imports) run eagerly. Ignored on CPU.")
    cpus: str = setting("", "Pin the engine process to these CPUs (a list as taskset takes it: 0, 0-3,8) before its threads start; --threads 0 then counts them. Empty = not pinned. `kvmesh up --pin-engines` gives each engine its own.")
    threads: int = setting(0, "Torch intra-op threads; 0 = the cores this process may use (its CPU set, capped by its cgroup CPU quota). In a multi-process stack give the busy engine the cores.", min=0)
    block_size: int = setting(16, "Tokens per paged-KV block.", min=1, max=1024)
    kv_cache_bytes: int = setting(1024 * MiB, "Byte budget of the paged KV pool (never exceeded). Ignored when num_blocks > 0.", min=1)
    num_blocks: int = setting(0, "Paged KV pool size in blocks; 0 derives it from kv_cache_bytes.", min=0)
    max_model_len: int = setting(0, "Max prompt + generated tokens per request; 0 = the model's context length.", min=0)
    max_num_seqs: int = setting(64, "Max sequences in one batch.", min=1)
    max_num_batched_tokens: int = setting(512, "Per-step token budget (decodes + prefill chunks).", min=16)
    solo_prefill_tokens: int = setting(2048, "Per-step token budget while no sequence is decoding: a prompt prefilled alone delays nobody's next token, so it runs in bigger chunks (fewer passes over its growing KV, bigger matmuls; the same answer). Values up to --max-num-batched-tokens turn it off.", min=0)
    max_waiting: int = setting(1024, "Queue cap; requests beyond it get RESOURCE_EXHAUSTED.", min=1)
    enable_prefix_caching: bool = setting(True, "Reuse full KV blocks of identical prompt prefixes inside the engine.")
    kvcache_address: Optional[str] = setting(None, "host:port of the KV-cache service; unset = in-engine prefix cache only.")
    role: str = setting("both", "Prefill/decode disaggregation: the part of a request this engine is for, reported in GetModelInfo. prefill: P/D prefill hops (GenerateRequest.kv_handoff: the prompt's KV is stored in the KV-cache service, so it needs --kvcache-address); decode: their decode hops, which import that KV; both (the default): whole requests. The router's tier spec marks replicas the same way (HOST:PORT/prefill, HOST:PORT/decode); any engine still serves whole requests when the router falls back to colocated serving.", choices=("both", "prefill", "decode"))
    kv_chunk_tokens: int = setting(256, "Tokens per KV chunk stored in the KV-cache service (a multiple of block_size).", min=16)
    kv_codec: str = setting("auto", "Codec of exported chunks: auto (the default) stores the engine's KV dtype as is, so a cache hit gives the same tokens as no cache; fp16, bf16 (lossy from float32), int8, int4 and int2 are lossy and opt-in: their KV is kept in a namespace of its own and never serves a request that did not ask for it.", choices=("auto", "fp32", "fp16", "bf16", "int8", "int4", "int2"))
    kv_zstd: bool = setting(True, "zstd-compress exported chunks.")
    kv_group_size: Optional[int] = setting(None, "int8/int4/int2: tokens per key group, channels per value group; unset = the codec's default (int8: 16, int4/int2: 64).", min=1, max=65535)
    kv_residual: int = setting(0, "int8/int4/int2: last tokens of each chunk kept in fp16.", min=0)
    kv_head_tokens: Optional[int] = setting(None, "int8/int4/int2: first tokens of a sequence's first chunk kept in fp16 (the attention sink); unset = the codec's default (int8, int2: 1; int4: 0).", min=0, max=65535)
    kv_key_outliers: Optional[int] = setting(None, "int4/int2: widest key channels per layer and KV head in each chunk, stored with twice the bits; unset = the codec's default (int2: 16, int4: 0).", min=0, max=65535)
    kv_timeout_s: float = setting(5.0, "Deadline of each KV-cache call; a late answer means recompute.", min=0.01)
    kv_retry_s: float = setting(2.0, "After a KV-cache call went unanswered (service down, hung or late), requests skip the service and compute their prompt for this long before it is called again.", min=0.0)
    kv_export_priority: str = setting("idle", "CPU priority of exports nobody waits for (new prompt chunks stored for later hits): idle (the default) runs them only on CPU the engine leaves idle, so they take no cores from requests, and under sustained load they wait, then are dropped (counted in kvmesh_engine_kv_export_dropped_total); normal lets them compete with the step loop. P/D handoffs and ingested documents always run at normal priority.", choices=("idle", "normal"))
    kv_export_max_bytes: int = setting(1024 * MiB, "Most KV bytes the queued background exports may hold in memory; an export past it is dropped (counted).", min=0)
    kv_hot_bytes: int = setting(512 * MiB, "Byte budget of the engine's LRU of decoded document chunks fetched from the KV-cache service (reused by later prompts that cite the same documents without a fetch); 0 = off.", min=0)
    draft_address: Optional[str] = setting(None, "host:port of the draft service (kvmesh.draft.v1) for speculative decoding; unset = no speculation, whatever a request asks.")
    speculation: str = setting("adaptive", "Speculative decoding for requests that leave GenerateRequest.speculation unspecified: off, ngram (prompt lookup), model (the service's draft model) or adaptive (the service picks drafter and length, and the engine lets it draft only while drafting steps are measured faster). Takes effect only with --draft-address; outputs are the same as without (greedy and seeded: identical tokens; unseeded sampling: the same distribution).", choices=("off", "ngram", "model", "adaptive"))
    spec_max_draft_tokens: int = setting(7, "Most draft tokens verified per sequence and step (k), given while the step's decode rows (a token plus its drafts per speculating sequence) stay within --spec-step-rows; each costs one extra token of the step's budget and KV slot while it is verified.", min=1, max=MAX_DRAFT_TOKENS)
    spec_batch_draft_tokens: int = setting(0, "Draft tokens per sequence at least, even past --spec-step-rows (0: steps whose speculating sequences cannot each get a draft within --spec-step-rows verify none; raise it where batched verification is cheap, e.g. on a GPU).", min=0, max=MAX_DRAFT_TOKENS)
    spec_step_rows: int = setting(8, "Decode rows a step may fill with full-length drafts: up to 8, fp32 CPU steps stream the weights once for all rows (kvmesh.model.native); beyond, every extra row costs more.", min=1, max=256)
    spec_local_ngram: bool = setting(True, "Adaptive requests' n-gram drafts are looked up in the engine (microseconds) instead of through a Propose call to the draft service (~1 ms, about a tenth of a gguf decode step); requests that name a drafter, and the adaptive model/service choice, still use the draft service.")
    spec_ngram_min: int = setting(2, "Shortest suffix n-gram the engine's in-process n-gram lookup (--spec-local-ngram) matches; the draft service's --ngram-min is its own.", min=1, max=32)
    spec_ngram_max: int = setting(4, "Longest suffix n-gram the engine's in-process n-gram lookup matches; the draft service's --ngram-max is its own.", min=1, max=32)
    draft_timeout_s: float = setting(0.1, "Deadline of one Propose call (all speculating sequences of a step); a late or failed call means plain decoding for that step.", min=0.001)
    draft_retry_s: float = setting(2.0, "After a failed Propose call, decode without drafts for this long before calling the draft service again.", min=0.0)
    blend_recompute_ratio: float = setting(1.0, "Prompts with documents: share of the reused document tokens whose KV is recomputed with the new context. 1 (the default) is exact: documents are computed in place and reused only as exact prefixes. Below 1 opts every such prompt of the deployment into blending, which is lossy (0 = pure reuse); a request opts in alone with blend.recompute_ratio.", min=0.0, max=1.0)
    quality_max_kl: float = setting(0.05, "Quality budget of lossy reuse paths (lossy KV codecs, blending) for requests and tenants that declare none: most mean KL(exact || lossy) per answer token, in nats, as the guardrail's shadow checks estimate it.", min=1e-6)
    quality_min_top1: float = setting(0.95, "Quality budget of lossy reuse paths for requests and tenants that declare none: least teacher-forced top-1 agreement with exact computation.", min=1e-6, max=1.0)
    blend_select_layers: int = setting(2, "Leading layers run over every prompt token to choose the tokens to recompute (1..layers-1; capped at layers-1 for shallower models).", min=1)
    blend_selection: str = setting("deviation+deep-attention", "How blending picks the tokens to recompute: by KV deviation plus the attention the prompt's last tokens pay them through the layers past the probe (deviation+deep-attention, the default), by KV deviation alone (CacheBlend), by deviation plus that attention at the probe layer only (deviation+attention), or that with every document's first tokens taken first (sinks+deviation+attention).", choices=("deviation+deep-attention", "deviation", "deviation+attention", "sinks+deviation+attention"))
    guard_shadow_share: float = setting(0.02, "Guardrail: share of requests served over lossy KV (lossy codec, blending) that are shadow-checked: recomputed exactly when the engine is idle and compared along the served answer (KL, top-1). Deterministic: the first and then every ceil(1/share)-th of each path; 0 = no checks (nothing is ever disabled).", min=0.0, max=1.0)
    guard_replay_share: float = setting(0.1, "Guardrail: while a lossy path is disabled, share of the requests asking for it (served exactly) whose check replays the lossy path offline; passing replays enable it again.", min=0.0, max=1.0)
    guard_min_checks: int = setting(8, "Guardrail: checks of a path before its running estimate can disable it or refuse a request's tighter budget (fewer can disable it only when two in a row are far over budget, see --guard-fast-factor).", min=1)
    guard_window: int = setting(32, "Guardrail: most recent checks of a path pooled into its running estimate (KL per answer position, top-1 agreement).", min=1)
    guard_fast_factor: float = setting(4.0, "Guardrail: two checks in a row this many times over the budget (KL, or top-1 shortfall) disable a path before --guard-min-checks.", min=1.0)
    guard_reenable_checks: int = setting(8, "Guardrail: replays in a row whose pooled estimate is within budget that enable a disabled path again.", min=1)
    guard_queue: int = setting(8, "Guardrail: checks waiting for an idle engine; when it is full the oldest is dropped (counted in kvmesh_engine_guard_dropped_checks_total). Each holds its answer's logits rows (up to --guard-max-tokens x vocabulary x 4 bytes).", min=1)
    guard_max_tokens: int = setting(64, "Guardrail: answer positions a check compares (the logits rows a checked request keeps while it is served).", min=1)

    def validate(self) -> None:
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(
                f"--device {self.device!r} is not supported; use cpu, cuda or cuda:N "
                "(KVMESH_ENGINE_DEVICE)")
        if self.weights == "bf16" and self.dtype != "bfloat16":
            raise ConfigError("--weights bf16 needs --dtype bfloat16 (KVMESH_ENGINE_DTYPE=bfloat16)")
        if self.kv_chunk_tokens % self.block_size:
            raise ConfigError(f"--kv-chunk-tokens ({self.kv_chunk_tokens}) must be a multiple of --block-size "
                              f"({self.block_size}), e.g. {self.block_size * max(1, self.kv_chunk_tokens // self.block_size)}")
        if self.cpus:
            try:
                cpus = parse_cpu_list(self.cpus)
            except ValueError as err:
                raise ConfigError(f"--cpus: {err}") from None
            missing = cpus - os.sched_getaffinity(0)
            if missing:
                raise ConfigError(f"--cpus {self.cpus}: CPU(s) {sorted(missing)} are not available to this process "
                                  f"(it may use {sorted(os.sched_getaffinity(0))})")
        if self.role == "prefill" and not self.kvcache_address:
            raise ConfigError("--role prefill hands its prompts' KV to decode engines through the KV-cache "
                              "service: set --kvcache-address (KVMESH_ENGINE_KVCACHE_ADDRESS)")
        if self.spec_ngram_min > self.spec_ngram_max:
            raise ConfigError(f"--spec-ngram-min {self.spec_ngram_min} exceeds --spec-ngram-max "
                              f"{self.spec_ngram_max}; use min <= max (e.g. 2 and 4)")
        if self.weights == "fp32" and self.dtype != "float32":
            raise ConfigError("--weights fp32 needs --dtype float32; use --weights auto to follow the dtype")

    @property
    def model_name(self) -> str:
        """The served name: `served_model_name`, else derived from `model` as `kvmesh up` derives it."""
        if self.served_model_name:
            return self.served_model_name
        return BUNDLED_NAME if self.model == "bundled" else self.model

    @property
    def metrics_model_name(self) -> str:
        """Every engine metric's `model_name` label: the served name (one engine, one model)."""
        return self.model_name

    @property
    def weight_format(self) -> str:
        """The resolved weight format. 'auto': a GGUF model (the bundled one, a .gguf file) served
        on CPU in float32 runs its own quantized blocks ('gguf': exact with respect to the file,
        a quarter of fp32's bytes per decoded token); anything else follows the compute dtype."""
        if self.weights != "auto":
            return self.weights
        if self.dtype == "float32" and self.device == "cpu" and names_gguf(self.model):
            return "gguf"
        return "bf16" if self.dtype == "bfloat16" else "fp32"
