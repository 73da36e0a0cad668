"""Draft service configuration: flags and KVMESH_DRAFT_* environment variables, frozen after start."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from kvmesh.config import ConfigError, setting
from kvmesh.limits import MAX_DRAFT_TOKENS
from kvmesh.model.bundled import BUNDLED_NAME
from kvmesh.rpc.server import ServerSettings

MiB = 1 << 20


@dataclass(frozen=True)
class DraftConfig:
    """The draft service: proposes draft tokens for the engines' speculative decoding, from
    n-gram lookup in each sequence's history and from a draft model with its own KV."""

    server: ServerSettings = ServerSettings(port=50091, grace_s=5.0)
    draft_model: Optional[str] = setting(
        "bundled", "Model of the model drafter: 'bundled' (SmolLM2-135M-Instruct), a .gguf path or "
                   "an HF folder sharing the served model's tokenizer; 'none' = no model drafter (n-gram "
                   "and adaptive over n-gram only; what `kvmesh up --model` uses without --draft-model).")
    draft_weights: str = setting(
        "int4", "Weight format of the draft model (int4: ~1.7x the fp32 decode speed on CPU).",
        choices=("fp32", "bf16", "int8", "int4"))
    draft_num_layers: int = setting(
        0, "Draft with only the first N decoder layers (early exit); 0 = all. Small models lose "
           "their output quality fast (SmolLM2-135M: garbage at 20 of 30 layers).", min=0)
    device: str = setting("cpu", "Torch device of the draft model: cpu, cuda, cuda:N.")
    threads: int = setting(1, "Torch intra-op threads of the draft model; 0 = the cores this process may use (CPU set and cgroup quota).", min=0)
    target_model: str = setting(
        "", "Weights digest of the model the drafts are for (the engines' GetModelInfo "
            "weights_digest); requests naming another get FAILED_PRECONDITION. Empty = the draft "
            "model's digest, or the bundled model's when there is no draft model.")
    served_model_name: str = setting(
        "", "Name of the model the drafts are for, as the engines serve it (their --served-model-name): "
            "the model_name label of this service's metrics. Empty = derived as the engine derives it: "
            "smollm2-135m-instruct for the bundled model, else --draft-model as given when it drafts "
            "for itself, else the --target-model digest. `kvmesh up` passes the engines' name.")
    default_drafter: str = setting("adaptive", "Drafter for requests that leave it unspecified.",
                                   choices=("ngram", "model", "adaptive"))
    max_draft_tokens: int = setting(MAX_DRAFT_TOKENS, "Largest max_draft_tokens a request may ask "
                                    "for; the default is the most an engine can ask for.",
                                    min=1, max=256)
    max_sequences: int = setting(
        4096, "Sequences the service keeps state for; beyond it the least recently used is "
              "dropped (its engine is asked to resync).", min=1)
    state_ttl_s: float = setting(60.0, "Seconds a sequence's state lives after its last call.",
                                 min=0.001)
    sweep_interval_s: float = setting(
        5.0, "Seconds between sweeps that free expired states (expired ones already count as "
             "gone); 0 disables.", min=0.0)
    ngram_max: int = setting(4, "Longest suffix n-gram the n-gram drafter matches.", min=1, max=32)
    ngram_min: int = setting(
        2, "Shortest suffix n-gram the n-gram drafter matches (1 matches after any repeated token: "
           "more drafts, fewer accepted).", min=1, max=32)
    block_size: int = setting(16, "Tokens per block of the draft model's paged KV.", min=1, max=1024)
    kv_cache_bytes: int = setting(
        512 * MiB, "Byte budget of the draft model's KV pool (SmolLM2-135M fp32: 45 KiB per "
                   "token); when full, the least recently drafted sequences lose their KV.",
        min=1)
    catch_up_tokens: int = setting(
        32, "Most committed tokens the draft model computes per Propose (all its sequences, "
            "shortest first; >= max_draft_tokens + 1 keeps steady-state drafting unthrottled). A "
            "sequence further behind (a new prompt, a resync) drafts nothing until caught up, so "
            "no call waits seconds for a long prompt (CPU, 1 thread: ~6 ms per token).", min=1)
    model_cost: float = setting(
        0.6, "Adaptive: cost of one model-drafted token, in target decode steps (draft per-token "
             "time / target per-token time; int4 draft for an fp32 target on CPU ~0.6).", min=0.0)
    verify_cost: float = setting(
        0.1, "Adaptive: extra cost of verifying one more draft token, in target decode steps.",
        min=0.0)
    acceptance_decay: float = setting(
        0.8, "Adaptive: weight of the past in the per-sequence acceptance estimate, per step "
             "(0.8 ~ the last 5 steps).", min=0.01, max=1.0)
    min_gain: float = setting(
        0.05, "Adaptive: draft only when the expected tokens per step-equivalent beat plain "
              "decoding by this fraction.", min=0.0)
    probe_every: int = setting(
        16, "Adaptive: a drafter unused for this many steps of a sequence is tried again.", min=1)

    def validate(self) -> None:
        if self.ngram_min > self.ngram_max:
            raise ConfigError(f"--ngram-min {self.ngram_min} exceeds --ngram-max {self.ngram_max}; "
                              "use ngram_min <= ngram_max (e.g. 2 and 4)")
        if self.default_drafter == "model" and self.draft_model is None:
            raise ConfigError("--default-drafter model needs a draft model; set --draft-model "
                              "bundled (KVMESH_DRAFT_DRAFT_MODEL) or pick ngram/adaptive")
        if self.catch_up_tokens <= self.max_draft_tokens:
            raise ConfigError(f"--catch-up-tokens {self.catch_up_tokens} must exceed --max-draft-tokens "
                              f"{self.max_draft_tokens}: a sequence brings up to that many accepted drafts "
                              f"plus one token per step; use at least {self.max_draft_tokens + 1}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"--device {self.device!r} is not supported; use cpu, cuda or cuda:N "
                              "(KVMESH_DRAFT_DEVICE)")

    @property
    def metrics_model_name(self) -> str:
        """Every draft metric's `model_name` label (see `served_model_name`)."""
        if self.served_model_name:
            return self.served_model_name
        if self.target_model:
            return self.target_model
        return BUNDLED_NAME if self.draft_model in (None, "bundled") else self.draft_model

    @property
    def draft_dtype(self) -> str:
        """Compute dtype of the draft model: bfloat16 for bf16 weights, else float32."""
        return "bfloat16" if self.draft_weights == "bf16" else "float32"
