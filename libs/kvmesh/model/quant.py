"""Weight-only int8 / int4 quantization of the decoder's Linear layers (not embeddings, norms, lm_head).

NOTE (kernels). torch 2.13 on CPU has ``aten._weight_int8pack_mm`` (int8 [N, K] weight, one scale
per output channel) and ``aten._weight_int4pack_mm_for_cpu`` (weight packed by
``_convert_weight_to_int4pack_for_cpu`` from int32 nibbles, per-group ``(scale, zero)`` with
w = (q - 8) * scale + zero). Both accept fp32/fp16/bf16 activations, but measured on this
machine's AVX-512/AMX CPU only bf16 has a fast kernel (fp32/fp16 are ~10-30x slower than a dense
fp32 matmul), and even in bf16 their cost grows linearly with the rows. So each QuantLinear:
  * rows <= ``SMALL_BATCH[mode]`` (decode batches): the packed kernel, activations cast to bf16;
  * more rows (prefill, perplexity) or no usable kernel (other devices): dequantize the weight to
    the activation dtype and run a dense matmul -- compute-bound there, so dequantizing is cheap.
The kernel is probed once per layer at quantization time on the weight's device; a missing or
mismatching op silently leaves the plain-torch path, so every device works.

NOTE (Q4_1). The GGUF weights are Q4_1: groups of 32 along the input dim, w = d*q + m with q in
0..15 and the group's minimum at q=0, maximum at q=15. Asymmetric int4 with group size 32 and
scale = (max - min) / 15, zero = min therefore recovers q exactly and the weights to float32
rounding: int4 of the bundled model is (almost) the file's own precision, not a further loss.
The packed kernel holds scale/zero in bf16, which costs a little of that exactness on decode.

NOTE (int4-w8a8). Weight-only kernels win where a matmul is bound by reading weights (one or two
rows), but from a few rows on a step is compute-bound and the CPU's int8 dot products (AVX-512
VNNI, through ``torch._int_mm``) are what is fast: for all 120 decoder matmuls of SmolLM2-135M on
this 2-core machine, 32 rows take 14 ms as int8 x int8 against ~50 ms in fp32, 256 rows 52 ms
against ~190 ms, and one row 5.8 ms against 15.6 ms (one-off measurements). The ``int4-w8a8``
format therefore keeps the int4 packed kernel for matmuls of at most ``SMALL_BATCH['int4-w8a8']``
rows (single-sequence decode) and sends larger ones (batched decode, draft verification of
several rows, prefill) through ``W8A8Linear``: int8 weights per output channel times int8
activations quantized per token at run time, with SmoothQuant's per-channel smoothing (Xiao et
al. 2023: x/s times W*s, s = max|x|^a / max|W|^(1-a) from a calibration pass, a = 0.65) so that
activation outliers do not eat the int8 range. The output projection (``lm_head``, 49152 rows,
the largest single matmul of a decode step) is W8A8 for every row count. Measured on the first
8,192 tokens of pydoc_data.topics (one-off): per-token W8A8 without smoothing +3.5% perplexity,
per-tensor activation scales (torch's dynamic quantized Linear) +50%, smoothed +0.99%
(+0.60% with lm_head left in fp32). Calibration text is the standard library's own docstrings,
not the evaluation text.

NOTE (gguf). ``GGUFLinear`` holds a GGUF file's weight exactly as the file does (rows of Q4_0 /
Q4_1 / Q8_0 / Q4_K / Q6_K blocks, never re-quantized) and multiplies fp32 activations with it
in kvmesh.model.gguf_native: the dequantized file's matmul up to summation order (each block is
dequantized in registers to exactly gguf-py's fp32 values). Up to ``GGUF_ROWS`` rows (decode
steps, drafts being verified, small batches) the kernel streams the blocks; larger matmuls
(prefill) are compute-bound, and dequantize a cache-sized tile of weight rows at a time, each
tile one dense fp32 matmul. Where the kernels are not built, on other devices, or for a block
type they lack, the layer holds the exactly dequantized fp32 weight instead: the same model
everywhere, only slower or larger.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kvmesh.model.gguf_native import KERNEL_TYPES, gguf_ops
from kvmesh.model.gguf_repack import REPACKED_Q4
from kvmesh.model.native import w8a8_ops

# Rows at or below which the packed kernel beats dequantize + dense matmul, measured over all 210
# decoder Linears of SmolLM2-135M on 2 AVX-512/AMX cores (int8 crosses over near 64 rows, int4
# near 100): decode batches use the kernel, prefill chunks dequantize.
SMALL_BATCH = {"int8": 64, "int4": 96, "int4-w8a8": 2}
INT4_GROUP = 32
_SKIP = ("lm_head",)  # tied to the embedding here; quantizing it would quantize the embedding too


MODES = ("int8", "int4", "int4-w8a8")
SMOOTH_ALPHA = 0.65


class W8A8Linear(nn.Module):
    """Bias-free Linear as int8 weights (symmetric, per output channel) times int8 activations
    (symmetric, per token, quantized at run time), with SmoothQuant smoothing (see the NOTE).

    weight: [N, K] float; smooth: [K] positive per-input-channel factors (None = no smoothing).
    Output = (x / smooth) quantized per row, times (weight * smooth) quantized per row, rescaled,
    in the input's dtype. Where ``torch._int_mm`` is unavailable for the device the same integer
    products are computed in float64 (exact, slow): the result never depends on the kernel."""

    def __init__(self, weight: torch.Tensor, smooth: torch.Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float()
        n, k = w.shape
        if smooth is None:
            smooth = torch.ones(k, device=w.device)
        if smooth.shape != (k,) or not bool((smooth > 0).all()):
            raise ValueError(f"smooth must be {k} positive factors, one per input channel")
        w = w * smooth.float()[None, :]
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [N]
        self.in_features, self.out_features = k, n
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("wscale", scale)
        self.register_buffer("inv_smooth", 1.0 / smooth.float())
        self._int_mm = _int_mm_works(self.qweight.device, k, n)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, w8a8, {'int_mm' if self._int_mm else 'float64'}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        native = w8a8_ops() if self._int_mm and x.device.type == "cpu" else None
        if native is not None:  # the same arithmetic, one pass each (kvmesh.model.native)
            quantize_rows, rescale_rows = native
            xq, step = quantize_rows(x.reshape(-1, self.in_features).float().contiguous(), self.inv_smooth)
            y = rescale_rows(torch._int_mm(xq, self.qweight.t()), step, self.wscale)
            return y.to(x.dtype).view(*lead, self.out_features)
        x2 = x.reshape(-1, self.in_features).float() * self.inv_smooth  # [M, K]
        step = x2.abs().amax(dim=1, keepdim=True).clamp_min_(1e-12).div_(127.0)  # [M, 1] per-token step
        xq = x2.div_(step).round_().to(torch.int8)
        if self._int_mm:
            acc = torch._int_mm(xq, self.qweight.t()).float()  # [M, N] exact int32 sums
        else:
            acc = (xq.double() @ self.qweight.double().t()).float()
        y = acc.mul_(step).mul_(self.wscale)
        return y.to(x.dtype).view(*lead, self.out_features)


def _int_mm_works(device: torch.device, k: int, n: int) -> bool:
    """Whether ``torch._int_mm`` runs int8 x int8 -> int32 for these shapes on `device` (probed
    with the row counts this layer will see; CUDA's kernel has shape limits, CPU's has none)."""
    try:
        for m in (1, 3, 32):
            a = torch.ones(m, k, dtype=torch.int8, device=device)
            b = torch.ones(n, k, dtype=torch.int8, device=device).t()
            if int(torch._int_mm(a, b)[0, 0]) != k:
                return False
        return True
    except (RuntimeError, NotImplementedError, AttributeError):
        return False


class QuantLinear(nn.Module):
    """Linear with int8 (per-channel, symmetric) or int4 (group-wise, asymmetric) weights;
    mode ``int4-w8a8`` adds a W8A8Linear of the same weight for matmuls of more than
    SMALL_BATCH rows (see the NOTE). A bias (Qwen2's q/k/v) stays unquantized, added after."""

    def __init__(self, in_features: int, out_features: int, mode: str, group_size: int = INT4_GROUP) -> None:
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if mode != "int8" and in_features % group_size:
            raise ValueError(f"int4 needs in_features ({in_features}) divisible by group_size ({group_size})")
        self.in_features, self.out_features, self.mode, self.group_size = in_features, out_features, mode, group_size
        self._kernel: tuple[torch.Tensor, torch.Tensor] | None = None  # (packed weight, bf16 scales)
        self._kernel_device: torch.device | None = None
        self.large: W8A8Linear | None = None
        self.register_buffer("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, mode: str, group_size: int = INT4_GROUP,
                    smooth: torch.Tensor | None = None) -> QuantLinear:
        q = cls(linear.in_features, linear.out_features, mode, group_size)
        if linear.bias is not None:
            q.bias = linear.bias.detach().clone()
        w = linear.weight.detach().float()  # [N, K]
        if mode == "int8":
            scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0  # [N]
            q.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))
            q.register_buffer("scales", scale)
            q.register_buffer("zeros", None)
        else:
            n, k = w.shape
            g = w.view(n, k // group_size, group_size)  # [N, K/gs, gs]
            lo, hi = g.amin(-1), g.amax(-1)  # [N, K/gs]
            scale = (hi - lo) / 15.0
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: q = 0
            nib = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
            q.register_buffer("qweight", nib[:, 0::2] | (nib[:, 1::2] << 4))  # [N, K/2], low nibble = even k
            q.register_buffer("scales", scale)
            q.register_buffer("zeros", lo)
        if mode == "int4-w8a8":
            q.large = W8A8Linear(q.dequantize(torch.float32), smooth)
        q._try_kernel()
        return q

    def extra_repr(self) -> str:
        kernel = "packed kernel" if self._kernel is not None else "dequantize"
        return f"in={self.in_features}, out={self.out_features}, {self.mode}, {kernel}"

    def nibbles(self) -> torch.Tensor:
        """int4 only: the unpacked q values, [N, K] uint8 in 0..15."""
        lo, hi = self.qweight & 15, self.qweight >> 4
        return torch.stack((lo, hi), dim=-1).view(self.out_features, self.in_features)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this layer represents, [N, K] in ``dtype``.

        Written for speed (this runs on every prefill matmul): int8 lets ``mul`` promote in one
        pass; int4 unpacks nibbles straight into the float buffer and scales in place. The int4
        formula is q*scale + zero in fp32 with two roundings, the same as GGUF's own dequantizer.
        """
        if self.mode == "int8":
            return torch.mul(self.qweight, self.scales.to(dtype)[:, None])
        n, k, gs = self.out_features, self.in_features, self.group_size
        w = torch.empty(n, k // 2, 2, dtype=torch.float32, device=self.qweight.device)
        w[..., 0] = self.qweight & 15
        w[..., 1] = self.qweight >> 4
        w = w.view(n, k // gs, gs).mul_(self.scales.float()[..., None]).add_(self.zeros.float()[..., None])
        return w.view(n, k).to(dtype)

    def _try_kernel(self) -> None:
        """Pack for the device's kernel and keep it only if it agrees with the dequantized weight."""
        dev = self.qweight.device
        try:
            if self.mode == "int8":
                kernel = (self.qweight, self.scales.to(torch.bfloat16))
            elif dev.type == "cpu":
                packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.nibbles().to(torch.int32), 1)
                sz = torch.stack((self.scales, self.zeros + 8 * self.scales), dim=-1)  # [N, K/gs, 2]
                kernel = (packed, sz.transpose(0, 1).contiguous().to(torch.bfloat16))  # [K/gs, N, 2]
            else:
                return  # the CUDA int4 kernel wants another packing; dequantize path instead
            self._kernel, self._kernel_device = kernel, dev
            probe_rng = torch.Generator().manual_seed(0)  # leaves the global RNG untouched
            x = torch.randn(2, self.in_features, generator=probe_rng).to(dev, torch.bfloat16)
            got = self._kernel_mm(x).float()
            want = F.linear(x.float(), self.dequantize(torch.float32))
            if not torch.allclose(got, want, rtol=5e-2, atol=5e-2 * want.abs().max().item()):
                raise RuntimeError("kernel disagrees with reference")
        except (RuntimeError, NotImplementedError, AttributeError):
            self._kernel, self._kernel_device = None, None

    def _kernel_mm(self, x: torch.Tensor) -> torch.Tensor:
        w, s = self._kernel  # type: ignore[misc]
        if self.mode == "int8":
            return torch.ops.aten._weight_int8pack_mm(x, w, s)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, self.group_size, s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        small = x2.shape[0] <= SMALL_BATCH[self.mode]
        if self._kernel is not None and small and x.device == self._kernel_device:
            y = self._kernel_mm(x2.to(torch.bfloat16)).to(x.dtype)
        elif self.large is not None and not small:
            y = self.large(x2)
        else:
            y = F.linear(x2, self.dequantize(x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)


def quantize_model(model: nn.Module, mode: str, group_size: int = INT4_GROUP,
                   smooth: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """Replace every decoder nn.Linear with a QuantLinear, in place; returns ``model``.

    Call after the model is on its final device and dtype (the packed kernel is chosen for that
    device). The output projection stays unquantized (see ``_SKIP``), except in ``int4-w8a8``,
    where it becomes a W8A8Linear (a separate int8 copy: a tied embedding stays as it is).
    smooth: per Linear name, SmoothQuant factors for the W8A8 matmuls (``smooth_factors``).
    """
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {MODES}, got {mode!r}")
    smooth = smooth or {}
    targets = [
        (name, mod) for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and not name.endswith(_SKIP)
    ]
    for name, linear in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear.from_linear(linear, mode, group_size, smooth.get(name)))
    head = getattr(model, "lm_head", None)
    if mode == "int4-w8a8" and isinstance(head, nn.Linear):
        model.lm_head = W8A8Linear(head.weight, smooth.get("lm_head"))
    return model


@torch.inference_mode()
def smooth_factors(model: nn.Module, token_ids: list[int], alpha: float = SMOOTH_ALPHA,
                   window: int = 512) -> dict[str, torch.Tensor]:
    """SmoothQuant factors for every nn.Linear of a (not yet quantized) causal LM: for input
    channel j, max|x_j|^alpha / max|W_j|^(1-alpha), the activation maximum taken over a dense
    forward of `token_ids` in windows of `window` tokens (``model.forward_dense``)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if not token_ids:
        raise ValueError("smooth_factors needs calibration tokens")
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            def record(mod, inputs, output, name=name):
                a = inputs[0].detach().abs().reshape(-1, inputs[0].shape[-1]).amax(dim=0).float()
                seen[name] = a if name not in seen else torch.maximum(seen[name], a)
            hooks.append(mod.register_forward_hook(record))
    try:
        device = next(model.parameters()).device
        for i in range(0, len(token_ids), window):
            model.forward_dense(torch.tensor([token_ids[i:i + window]], device=device))
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for name, amax in seen.items():
        w = model.get_submodule(name).weight.detach().float().abs().amax(dim=0)
        out[name] = amax.clamp_min(1e-5).pow(alpha) / w.clamp_min(1e-5).pow(1.0 - alpha)
    return out


def calibration_text() -> str:
    """Text for ``smooth_factors``: docstrings of a fixed set of standard-library modules
    (real English and code, shipped with Python, distinct from the perplexity text)."""
    import argparse
    import collections
    import functools
    import inspect
    import itertools
    import json
    import logging
    import pathlib
    import re
    import statistics
    import string
    import textwrap

    docs = []
    for mod in (collections, json, re, textwrap, string, statistics, itertools, functools, pathlib,
                argparse, logging):
        for name in sorted(vars(mod)):
            obj = getattr(mod, name)
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc and len(doc) > 200:
                docs.append(doc)
    return "\n\n".join(docs)


GGUF_ROWS = 64
"""Rows at or below which GGUFLinear runs the block kernels rather than the tiled dequantize +
dense matmul (and a decode step runs fused, kvmesh.model.llama). All 120 decoder matmuls of
SmolLM2-135M on this 2-core machine (one-off, 2 threads, ms): block kernels 16 / 27 / 48 / 87 at
8 / 16 / 32 / 64 rows, tiled 36 / 35 / 55 / 93 (fp32 weights: 41 / 58 / 84 / 127); at 128 and
512 rows the tiled path wins (169 / 664 against 185 / 746; fp32 weights 168 / 579)."""
GGUF_TILE_FLOATS = 1 << 21
"""fp32 weights the tiled path dequantizes at a time (8 MiB: a decoder matmul of SmolLM2-135M in
one tile, the output projection in 14). MKL packs its operands into cache-sized panels itself; a
tile of weight rows in L2 (640 KiB, 96-284 rows) left it narrow products that ran slower: SmolLM2's
four decoder matmuls of a layer took 95 -> 77 ms at 2,048 rows and 7.7 -> 6.8 at 128 (paired on a
2-core Ice Lake, 2 threads; 2.5 and 4 MiB tiles fell between)."""


class GGUFLinear(nn.Module):
    """Bias-optional Linear over a GGUF file's own quantized blocks (see the NOTE). ``parts``:
    (ggml type id, [rows, bytes per row] uint8) stacked along the output dim, e.g. q, k and v of
    a fused projection, each part in its own block type."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None = None, device: torch.device | str = "cpu", act8: bool = False) -> None:
        super().__init__()
        device = torch.device(device)
        self.in_features = in_features
        self.out_features = sum(int(rows.shape[0]) for _, rows in parts)
        self.types = tuple(int(t) for t, _ in parts)
        self.register_buffer("bias", None if bias is None else bias.detach().float().to(device))
        self._bias = self.bias
        self._a8 = None  # gguf-a8: (op, qs, d, m, types, rows per part), kvmesh.model.gguf_a8
        if act8:
            self._init_a8(parts, device)
            return
        ops = gguf_ops() if device.type == "cpu" else None
        self._ops = ops if ops is not None and all(t in KERNEL_TYPES for t in self.types) else None
        self._type_list = list(self.types)
        self._mm = None if self._ops is None else self._ops.gguf_mm
        if self._ops is not None:
            self._blocks = [rows.contiguous() for _, rows in parts]
            if os.environ.get("KVMESH_GGUF_REPACK", "1") != "0":  # 4-bit rows in the kernels' own layout
                for i, (t, rows) in enumerate(zip(self.types, self._blocks)):
                    packed = self._ops.gguf_repack(rows, t, in_features)
                    if packed.numel():
                        self._blocks[i], self._type_list[i] = packed, REPACKED_Q4
            for i, rows in enumerate(self._blocks):
                self.register_buffer(f"blocks{i}", rows)
            self.register_buffer("weight", None)
        else:
            self._blocks = []
            self.register_buffer("weight", torch.cat([_dequantize_py(t, rows, in_features) for t, rows in parts]).to(device))

    def _init_a8(self, parts: list[tuple[int, torch.Tensor]], device: torch.device) -> None:
        """gguf-a8: the parts repacked for the 8-bit activation kernel (see kvmesh.model.gguf_a8)."""
        from kvmesh.model import gguf_a8

        if device.type != "cpu":
            raise ValueError("weights='gguf-a8' runs on the CPU (AVX-512 VNNI); on a GPU use 'gguf'")
        op = gguf_a8.ops()
        if op is None:
            raise ValueError("weights='gguf-a8' needs the native kernels on a CPU with AVX-512 VNNI, "
                             "which this machine or build does not have; use 'gguf' (exact)")
        packed = [gguf_a8.pack(t, rows, self.in_features) for t, rows in parts]
        for i, (qs, d, m) in enumerate(packed):
            for kind, tensor in (("qs", qs), ("d", d), ("m", m)):
                self.register_buffer(f"a8_{kind}{i}", tensor)
        self._a8 = (op.a8_mm, [p[0] for p in packed], [p[1] for p in packed], [p[2] for p in packed],
                    list(self.types), [int(rows.shape[0]) for _, rows in parts])
        self._ops, self._mm, self._blocks, self._type_list = None, None, [], list(self.types)
        self.register_buffer("weight", None)

    def extra_repr(self) -> str:
        from gguf import GGMLQuantizationType

        kinds = "+".join(GGMLQuantizationType(t).name for t in self.types)
        how = "8-bit activations (gguf-a8)" if self._a8 is not None else \
            "block kernel" if self._ops is not None else "dequantized"
        return f"in={self.in_features}, out={self.out_features}, gguf {kinds}, {how}"

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight the file stores, [out_features, in_features] (gguf-py's exact bits)."""
        if self._a8 is not None:
            raise ValueError("a gguf-a8 layer keeps only its repacked blocks; load with weights='gguf' to dequantize")
        if self._ops is None:
            return self.weight
        return torch.cat([self._ops.gguf_dequant(b, t, self.in_features) for b, t in zip(self._blocks, self._type_list)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if self._a8 is not None:
            op, qs, d, m, types, ns = self._a8
            y = op(x.reshape(-1, self.in_features).float().contiguous(), qs, d, m, types, ns)
            if self._bias is not None:
                y = y + self._bias
            return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        if (self._mm is not None and x.dim() == 2 and x.shape[0] <= GGUF_ROWS and x.dtype == torch.float32
                and x.device.type == "cpu"):  # a decode step: the fewest Python ops (~120 calls a step)
            y = self._mm(x.contiguous(), self._blocks, self._type_list)
            return y if self._bias is None else y + self._bias
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if self._ops is None:
            y = F.linear(x2, self.weight.to(x.dtype))
        elif x2.shape[0] <= GGUF_ROWS and x.device.type == "cpu":
            y = self._ops.gguf_mm(x2.float().contiguous(), self._blocks, self._type_list).to(x.dtype)
        elif x.device.type == "cpu":  # tiles of the weight dequantized in cache, one dense matmul each
            y = self._ops.gguf_mm_tiled(x2.float().contiguous(), self._blocks, self._type_list,
                                           GGUF_TILE_FLOATS).to(x.dtype)
        else:
            y = F.linear(x2, self.dequantize().to(x.device, x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*lead, self.out_features)


def _dequantize_py(qtype: int, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """gguf-py's dequantizer (any type it knows): [N, bytes per row] uint8 -> [N, K] fp32."""
    import numpy as np
    from gguf.quants import dequantize

    if qtype == 0:  # F32: the bytes are the floats
        return rows.contiguous().view(torch.float32).reshape(-1, in_features).clone()
    w = np.asarray(dequantize(rows.numpy(), qtype), dtype=np.float32)
    return torch.from_numpy(w.reshape(-1, in_features).copy())


def use_gguf_blocks(model: nn.Module, tensors: dict, fused: dict[str, tuple[str, ...]],
                    act8: bool = False) -> nn.Module:
    """Replace every decoder Linear and the output projection of ``model`` (already loaded with
    the same file's dequantized weights) by a GGUFLinear over the file's blocks, in place.

    tensors: HF weight name -> kvmesh.model.gguf_loader.QuantizedTensor; the output projection
    of a tied model is the embedding's tensor. fused: this model's fused Linear suffix -> the HF
    parts it stacks (kvmesh.model.llama's q/k/v and gate/up). A bias stays as loaded. act8: the
    lossy gguf-a8 arithmetic (kvmesh.model.gguf_a8); ValueError naming a tensor whose block type
    it does not take."""
    device = next(model.parameters()).device
    targets = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, linear in targets:
        prefix, _, child = name.rpartition(".")
        parent = model.get_submodule(prefix) if prefix else model
        owner, _, block = prefix.rpartition(".")
        kind = f"{block}.{child}"  # e.g. self_attn.qkv_proj
        hf = [f"{owner}.{p}.weight" for p in fused[kind]] if kind in fused else [f"{name}.weight"]
        if name == "lm_head" and "lm_head.weight" not in tensors:
            hf = ["model.embed_tokens.weight"]  # tied: the output projection is the embedding
        missing = [h for h in hf if h not in tensors]
        if missing:
            raise ValueError(f"GGUF file has no tensor for {missing[0]} ({name})")
        parts = [(tensors[h].qtype, tensors[h].rows) for h in hf]
        if any(tensors[h].in_features != linear.in_features for h in hf) or \
                sum(int(r.shape[0]) for _, r in parts) != linear.out_features:
            raise ValueError(f"GGUF tensors {hf} do not match {name} ({linear.out_features}x{linear.in_features})")
        if act8:
            from kvmesh.model.gguf_a8 import TYPES

            odd = [h for h in hf if tensors[h].qtype not in TYPES]
            if odd:
                from gguf import GGMLQuantizationType

                raise ValueError(f"weights='gguf-a8' takes {', '.join(TYPES.values())} blocks; this file's {odd[0]} "
                                 f"is {GGMLQuantizationType(tensors[odd[0]].qtype).name}: use weights='gguf'")
        setattr(parent, child, GGUFLinear(parts, linear.in_features, linear.bias, device, act8=act8))
    return model


FAST_BLOCK_TYPES = frozenset({2, 3, 8, 12, 14})
"""ggml types the block kernels run in registers (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)."""


class GGUFDecode:
    """A decode step of a GGUF model's whole decoder stack in one native call (gguf_native's
    ``gguf_decode``): per layer norm, qkv, RoPE, the new keys/values into the paged cache,
    attention, o + residual, norm, gate/up, SiLU, down + residual, then the final norm, in one
    OpenMP region. It replaces ~25 torch ops per layer whose dispatch cost as much as the
    matmuls themselves at one row (measured before it: 10.8 ms a token, 6.4 of them matmuls).

    The same arithmetic as the layer-by-layer path up to float rounding: the matmuls are the
    same kernel; the norm's sum of squares, SiLU's exp (a polynomial, within 2 ulp) and the
    softmax are summed in another order. Every row is computed alone, so a draft being verified
    gets the bits a plain decode of the same token gets. ``of(model)`` returns None where the
    model does not fit it (another weight format, a sliding window, head shapes the kernel lacks,
    no kernel); the engine then runs the layer-by-layer path."""

    def __init__(self, model: nn.Module, op) -> None:
        cfg = model.config
        self._op = op
        self.heads, self.kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.scale = cfg.head_dim ** -0.5
        self.eps = float(cfg.rms_norm_eps)
        self.blocks, self.types, self.nparts, self.biases, self.norms = [], [], [], [], []
        empty = torch.empty(0)
        for layer in model.model.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
                self.blocks += lin._blocks
                self.types += lin._type_list  # the kernels' types (4-bit parts repacked)
                self.nparts.append(len(lin._blocks))
                self.biases.append(empty if lin._bias is None else lin._bias.contiguous())
            self.norms += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
        self.norms.append(model.model.norm.weight.detach())

    @classmethod
    def of(cls, model: nn.Module) -> GGUFDecode | None:
        cfg = model.config
        layers = list(model.model.layers)
        if not layers or cfg.head_dim % 16 or cfg.head_dim > 256:
            return None
        for layer in layers:
            lins = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if layer.self_attn.window is not None or not all(
                    isinstance(lin, GGUFLinear) and lin._a8 is None and lin._ops is not None
                    and set(lin.types) <= FAST_BLOCK_TYPES
                    for lin in lins):
                return None
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if any(w.dtype != torch.float32 or w.device.type != "cpu" for w in norms):
                return None
        op = getattr(gguf_ops(), "gguf_decode", None)
        return None if op is None else cls(model, op)

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches, attn) -> torch.Tensor:
        """h [T, hidden] (overwritten), cos/sin [T, head_dim] of an all-decode step -> the final-normed hidden."""
        return self._op(h, cos.contiguous(), sin.contiguous(), self.blocks, self.types, self.nparts, self.biases,
                        self.norms, [k for k, _ in kv_caches], [v for _, v in kv_caches], attn.slot_mapping,
                        attn.decode_blocks, attn.decode_ctx, self.heads, self.kv_heads, self.scale, self.eps)
