"""Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) with a paged-KV entry point for the engine
and a dense, cache-free entry point for perplexity and tests.

One module serves Llama 2/3/3.1+, Mistral and Qwen2/2.5: their differences are switches of
ModelConfig (q/k/v and output biases, a per-layer sliding window, RoPE scaling, tied embeddings).

Checkpoints arrive with HF's parameter names (``model.layers.{i}.self_attn.q_proj.weight`` ...);
``load_weights`` fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (rows
concatenated). A decode step is ~500 small ops, so op count is what costs beyond reading the
weights: fusing turns 7 matmuls per layer into 4 and lets RoPE run once over q and k together.
Each output element is still one dot product over the same inputs, and the fused matmuls were
checked bit-identical to the separate ones (fp32 and bf16, 1 to 512 rows). Numerics otherwise
follow HF's LlamaForCausalLM op for op (fp32 RMSNorm statistics, fp32 RoPE tables cast to the
activation dtype, SDPA with scale head_dim**-0.5), which is what the parity tests check.
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.model.attention import AttentionMetadata, KVCache, paged_attention, write_kv
from kvmesh.model import fused_rows
from kvmesh.model.config import ModelConfig, RopeScaling
from kvmesh.model.native import LINEAR_ROWS, linear_rows_kernel
from kvmesh.model.quant import GGUF_ROWS, GGUFDecode


class Linear(nn.Linear):
    """nn.Linear whose fp32 CPU calls of at most ``LINEAR_ROWS`` rows (decode steps, a decode
    with its drafts) run kvmesh.model.native's skinny kernel: it streams the weights once for all
    rows, so verifying 7 drafts costs ~1.5x a plain decode's matmuls instead of MKL's ~2.3x, and a
    row's result does not depend on the other rows (the same bits alone or beside its drafts).
    Anything else -- more rows, other dtypes or devices, autograd, no kernel -- is F.linear. A bias
    (Qwen2's q/k/v) is added after the kernel, so rows stay independent of each other."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x.dim() == 2 and x.shape[0] <= LINEAR_ROWS and x.dtype == torch.float32
                and x.device.type == "cpu" and self.weight.dtype == torch.float32 and self.weight.is_contiguous()
                and not (torch.is_grad_enabled() and self.weight.requires_grad)):
            kernel = linear_rows_kernel()
            if kernel is not None:
                out = kernel(x.contiguous(), self.weight)
                return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """Root-mean-square norm; statistics in fp32 whatever the activation dtype (as HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_rows.rms_norm(x, self.weight, self.eps)  # the lines below in one pass
        if fused is not None:
            return fused
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One fused op, bit-identical to the lines below for fp32 (checked at 1-512 rows);
            # a decode step runs 61 norms, and each op costs dispatch time at one row.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE, computed from positions exactly like HF's rope of the same type
    (default, linear, dynamic, llama3; see kvmesh.model.config.RopeScaling).

    inv_freq is not a registered buffer: ``model.to(torch.bfloat16)`` would round it, and HF
    computes the angles in fp32 regardless of the model dtype. It is cached per device instead.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                 max_position_embeddings: int = 0) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.scaling = scaling
        self.theta = theta if scaling is None else scaling.scaled_theta(theta, head_dim, max_position_embeddings)
        self._inv_freq: dict[torch.device, torch.Tensor] = {}

    @classmethod
    def of(cls, config: ModelConfig) -> RotaryEmbedding:
        """The rotary embedding of a model config (its head, base and scaling)."""
        return cls(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)

    def inv_freq(self) -> torch.Tensor:
        """[head_dim/2] fp32 inverse frequencies on the CPU (HF's op order, then the scaling)."""
        exps = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float) / self.head_dim
        inv = 1.0 / (self.theta ** exps)
        s = self.scaling
        if s is None or s.rope_type == "dynamic":
            return inv
        if s.freq_factors:
            if len(s.freq_factors) != inv.numel():
                raise ValueError(f"rope freq_factors has {len(s.freq_factors)} entries; a head of {self.head_dim} "
                                 f"needs {inv.numel()}")
            return inv / torch.tensor(s.freq_factors, dtype=torch.float32)
        if s.rope_type == "linear":
            return inv / s.factor
        # llama3: keep high frequencies, divide low ones by factor, interpolate in between
        old = s.original_max_position_embeddings
        low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)

    def _inv(self, device: torch.device) -> torch.Tensor:
        inv = self._inv_freq.get(device)
        if inv is None:
            inv = self._inv_freq[device] = self.inv_freq().to(device)  # [head_dim/2] fp32
        return inv

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [..., T] long -> cos, sin: [..., T, head_dim] in `dtype`
        freqs = positions.to(torch.float32)[..., None] * self._inv(positions.device)  # [..., T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, hd]; cos/sin: [..., T, hd] (broadcast over heads)."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


class LlamaAttention(nn.Module):
    """GQA self-attention's projections and dense causal attention; the paged attention over the
    engine's cache is LlamaDecoderLayer.forward's. ``window``: this layer's sliding window (keys
    a query sees, itself included), None = full causal attention."""

    def __init__(self, cfg: ModelConfig, window: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.window = window
        # rows: q heads, then k heads, then v heads (each head_dim rows)
        self.qkv_proj = Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim,
                               bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        # x: [..., T, hidden] -> q [..., T, heads, hd], k/v [..., T, kv_heads, hd] (q, k rotated)
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(*x.shape[:-1], h + 2 * kvh, self.head_dim)
        if fused_rows.rope_(qkv, cos, sin, h + kvh):  # apply_rope's arithmetic, in place
            return qkv[..., :h, :], qkv[..., h:h + kvh, :], qkv[..., h + kvh:, :]
        qk = apply_rope(qkv[..., : h + kvh, :], cos, sin)  # one rotation for q and k heads
        return qk[..., :h, :], qk[..., h:, :], qkv[..., h + kvh:, :]

    def attend_dense(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q [B, T, heads, hd], k/v [B, T, kvh, hd] -> causal attention output [B, T, heads * hd]
        b, t = q.shape[:2]
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))  # [B, heads|kvh, T, hd]
        g = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # HF repeat_kv order
        if self.window is not None and t > self.window:
            pos = torch.arange(t, device=q.device)
            rel = pos[:, None] - pos[None, :]  # query - key
            mask = (rel >= 0) & (rel < self.window)  # [T, T]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return o.transpose(1, 2).reshape(b, t, -1)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), gate and up as one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)  # gate rows, then up
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        act = fused_rows.silu_mul(gate_up)  # the line below in one pass
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, cfg.window_of(layer))
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # The layer in two halves around its attention, so that code attending differently (the
    # paged cache below, kvmesh.kv.blend's selective recompute) runs this layer's exact ops.
    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [..., T, hidden] -> (q [..., T, heads, hd], k, v [..., T, kv_heads, hd]), q and k rotated."""
        return self.self_attn.qkv(self.input_layernorm(x), cos, sin)

    def attention_outputs(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """x: the layer's input [..., T, hidden], o: its attention output [..., T, heads * hd]
        -> the layer's output [..., T, hidden]."""
        x = x + self.self_attn.o_proj(o)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, kv_cache, attn) -> torch.Tensor:
        # x: [T, hidden] (flattened batch) -> [T, hidden]
        q, k, v = self.attention_inputs(x, cos, sin)
        o = paged_attention(q, k, v, kv_cache[0], kv_cache[1], attn, self.self_attn.scale,
                            window=self.self_attn.window)  # [T, heads, hd]
        return self.attention_outputs(x, o.reshape(x.shape[0], -1))

    def forward_rows(self, x, cos, sin, kv_cache, attn: AttentionMetadata, keep: list[int]) -> torch.Tensor:
        """``forward`` for a layer of which only the rows ``keep`` (sorted flat indices) are read
        afterwards: every row's keys and values go into the cache, but the attention, o, the
        norm and the MLP run for the kept rows alone, each attended as a decode row
        (AttentionMetadata.rows_as_decodes). x: [T, hidden] -> [len(keep), hidden]."""
        q, k, v = self.attention_inputs(x, cos, sin)
        write_kv(k, v, kv_cache[0], kv_cache[1], attn.slot_mapping)
        if not keep:
            return x[:0]
        rows = torch.tensor(keep, dtype=torch.long, device=x.device)
        o = paged_attention(q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows),
                            kv_cache[0], kv_cache[1], attn.rows_as_decodes(keep), self.self_attn.scale,
                            window=self.self_attn.window)  # [len(keep), heads, hd]
        return self.attention_outputs(x.index_select(0, rows), o.reshape(len(keep), -1))

    def forward_dense(self, x, cos, sin) -> torch.Tensor:
        # x: [B, T, hidden] -> [B, T, hidden]
        return self.attention_outputs(x, self.self_attn.attend_dense(*self.attention_inputs(x, cos, sin)))


class LlamaModel(nn.Module):
    """Embedding, decoder stack and final norm (HF's ``model.`` prefix)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fuse_projections(state_dict: dict[str, torch.Tensor], num_layers: int) -> dict[str, torch.Tensor]:
    """HF names -> this model's: per layer, q/k/v rows (weights, and biases where present)
    concatenated into qkv_proj and gate/up into gate_up_proj. Missing parts are left unfused, so
    ``load_weights`` reports them by HF name."""
    out = dict(state_dict)
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        for fused, parts in _FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{prefix}{p}.{kind}" for p in parts]
                if all(n in out for n in names):
                    out[f"{prefix}{fused}.{kind}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


class LlamaForCausalLM(nn.Module):
    """The model the engine runs. Build with a config, then ``load_weights`` a canonical state dict."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding.of(config)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy a canonical (HF-named) state dict in, casting to this model's dtype/device.

        Strict: every parameter must be present (``lm_head.weight`` may be absent when tied) and
        no unknown name may appear, so a wrong checkpoint fails here, not as garbage logits.
        """
        state_dict = fuse_projections(state_dict, self.config.num_layers)
        if self.config.tie_word_embeddings:  # re-tie: to_empty()/to() may have split the shared tensor
            self.lm_head.weight = self.model.embed_tokens.weight
        expected = dict(self.named_parameters(remove_duplicate=False))
        if self.config.tie_word_embeddings:
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
            expected.pop("lm_head.weight")
        missing, unknown = expected.keys() - state_dict.keys(), state_dict.keys() - expected.keys()
        if missing or unknown:
            raise ValueError(f"state dict mismatch: missing {sorted(missing)[:5]}, unknown {sorted(unknown)[:5]}")
        with torch.no_grad():
            for name, param in expected.items():
                src = state_dict[name]
                if src.shape != param.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model {tuple(param.shape)}")
                param.copy_(src)

    def first_layers(self, num_layers: int) -> LlamaForCausalLM:
        """This model cut after its first `num_layers` decoder layers (early exit: their output
        goes through the final norm and lm_head). Every kept module is shared, not copied: the
        result costs no weight memory next to this model, and this model stays usable."""
        if not 1 <= num_layers <= self.config.num_layers:
            raise ValueError(f"num_layers must be in 1..{self.config.num_layers}, got {num_layers}")
        config = dataclasses.replace(self.config, num_layers=num_layers)
        with torch.device("meta"):  # a shell: every module with weights is replaced below
            cut = LlamaForCausalLM(config)
        cut.model.embed_tokens = self.model.embed_tokens
        cut.model.layers = nn.ModuleList(list(self.model.layers)[:num_layers])  # windows per layer kept
        cut.model.norm = self.model.norm
        cut.lm_head = self.lm_head  # tied or not, as in this model
        cut.rotary = self.rotary
        return cut.train(self.training)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache,
                attn: AttentionMetadata, keep: list[int] | None = None) -> torch.Tensor:
        """Paged forward over a flattened batch. input_ids, positions: [T] -> final hidden [T, hidden].

        Writes each layer's new keys/values into ``kv_caches`` at ``attn.slot_mapping``.
        ``keep`` (sorted flat indices): only these rows' hidden states are wanted ([len(keep),
        hidden] is returned, in keep's order). The last layer then computes every row's keys
        and values but the rest of its work (attention, o, MLP) for the kept rows alone: a
        prefill chunk's other rows feed the cache, not the logits (at 2,048 prompt tokens of
        SmolLM2-135M, 1/30 of the work skipped). Nothing upstream of that layer changes.
        """
        if len(kv_caches) != self.config.num_layers:
            raise ValueError(f"need {self.config.num_layers} KV caches, got {len(kv_caches)}")
        attn.prepare(kv_caches[0][0].shape[1])  # derive gather indices once per step
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, h.dtype)  # [T, hd]
        if attn.all_decode and input_ids.shape[0] <= GGUF_ROWS and kv_caches[0][0].dtype == torch.float32 \
                and h.dtype == torch.float32 and h.device.type == "cpu":
            fused = self.gguf_decode()
            if fused is not None:  # the whole stack in one native call (GGUF weights)
                h = fused(h, cos, sin, kv_caches, attn)
                return h if keep is None else h.index_select(0, torch.tensor(keep, dtype=torch.long))
        layers = list(self.model.layers)
        last = len(layers) if keep is None else len(layers) - 1
        for layer, cache in zip(layers[:last], kv_caches[:last]):
            h = layer(h, cos, sin, cache, attn)
        if keep is not None:
            h = layers[-1].forward_rows(h, cos, sin, kv_caches[-1], attn, keep)
        return self.model.norm(h)

    def gguf_decode(self):
        """kvmesh.model.quant.GGUFDecode of this model (decode steps in one native call), or None
        where it does not apply; decided once, on first use (weights are replaced before serving)."""
        if "_gguf_decode" not in self.__dict__:
            self.__dict__["_gguf_decode"] = GGUFDecode.of(self) if os.environ.get("KVMESH_GGUF_FUSED", "1") != "0" else None
        return self.__dict__["_gguf_decode"]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal forward. input_ids: [B, T] -> float32 logits [B, T, vocab]."""
        h = self.model.embed_tokens(input_ids)  # [B, T, hidden]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self.rotary(positions, h.dtype)  # [T, hd], broadcast over batch
        for layer in self.model.layers:
            h = layer.forward_dense(h, cos, sin)
        return self.compute_logits(self.model.norm(h))
