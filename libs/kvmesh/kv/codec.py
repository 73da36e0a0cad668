"""The KV chunk blob codec: (k, v, metadata) of one chunk <-> one self-describing, checksummed blob.

A chunk is the attention KV of a fixed number of tokens of one sequence, all layers:
``k, v [layers, tokens, kv_heads, head_dim]`` in any float dtype. ``encode`` stores it with one of
``CODECS``, optionally followed by zstd; ``decode`` gives it back (or raises: a damaged blob is a
miss, never garbage KV in an engine).

NOTE (blob format, version 3, little-endian; versions 1 and 2 are read too)::

    offset  size   field
    0       4      magic b"KVMB"
    4       1      format version (3; 2 = the same, int8 keys per token; 1 = as 2 without the
                   two u16 fields at 48)
    5       1      codec id: index into CODECS (0 fp16, 1 bf16, 2 int8, 3 int4, 4 int2, 5 fp32)
    6       1      flags: bit 0 = payload is one zstd frame; bit 1 = keys are at their sequence
                   positions (RoPE applied, as the engine holds them) instead of position-free;
                   other bits 0
    7       1      source dtype: 0 float32, 1 bfloat16, 2 float16
    8       16     shape L, T, H, D (4 x u32): layers, tokens, kv heads, head dim
    24      4      group_size u32: tokens per key group / channels per value group (int8, int4,
                   int2; int8 of versions 1-2: head_dim, per token and head); 0 for raw floats
    28      4      residual u32: last tokens of the chunk stored as fp16 (0 for fp16 / bf16)
    32      16     namespace (model identity + KV layout + tenant salt; opaque here)
    48      2      head u16: first tokens of the chunk stored as fp16 (0 for fp16 / bf16)
    50      2      key outliers u16: m, key channels per (layer, head) at twice the bits (int4, int2)
    52      4*T    token ids, u32 each
    52+4T   4      payload length P, u32
    56+4T   P      payload (zstd-compressed when flag bit 0 is set)
    56+4T+P 16     blake2b (digest_size=16) of every byte before it

Raw payload sections, in order (float arrays byte-shuffled into byte planes: every value's byte
0, then every byte 1, ..., which lets zstd see the slowly varying sign/exponent bytes together):

- fp16 / bf16 / fp32: k, v as ``[L, T, H, D]``. The codec of the engine's own dtype stores it
  exactly (``CodecSpec.storage`` is then kvmesh.kv.namespace.EXACT): the deployment default.
- int8 / int4 / int2, with ``Q = T - head - residual`` quantized tokens (those between the head
  and the residual) and ``C = H * D`` channels:
  keys: the outlier mask (``L*H*D`` bits, one per channel, packed; empty when m is 0), fp16
  scales, fp16 zeros and codes of the other ``D - m`` channels of each head, then fp16 scales,
  zeros and codes of the m marked channels at twice the bits (empty when m is 0); values: fp16
  scales, zeros, codes. Codes are uint8 packed ``8 // bits`` per byte (lowest bits first). Keys
  are quantized per channel: codes ``[L, H, D - m, Q]`` and ``[L, H, m, Q]`` (channels in
  ascending order within each set; m is 0 for int8), scales per ``group`` tokens; values per
  token: codes ``[L, Q, C]``, scales ``[L, Q, ceil(C/group)]``. (int8 blobs of versions 1 and 2
  hold keys as values, per token and head: codes ``[L, Q, C]``, scales ``[L, Q, H]``.) Then
  ``k, v [L, head, H, D]`` and ``k, v [L, residual, H, D]`` fp16.

NOTE (measurements): real KV of the bundled SmolLM2-135M (30 layers, 3 KV heads, head_dim 64,
keys after RoPE), the first 1024 tokens of ``reference_text()`` as four 256-token chunks, defaults
of version 1 (group_size 64, residual 0, zstd level 3, no head, no outliers). Ratio = 2 bytes *
elements of k and v / blob bytes; error = ||decoded - x|| / ||x|| per tensor, mean over chunks.

    codec  zstd off  zstd on   rel err k / v     encode / decode ms (1 CPU thread, zstd on)
    fp16   1.00x     1.18x     0.0002 / 0.0002   20 / 15
    bf16   1.00x     1.41x     0.0016 / 0.0017   36 / 15
    int8   1.88x     1.99x     0.0077 / 0.0057   20 / 13
    int4   3.55x     3.90x     0.045  / 0.097    17 / 15
    int2   6.39x     8.22x     0.227  / 0.485    16 / 12

group_size trades ratio for error (int2 + zstd: 32 -> 6.52x, 0.19 / 0.41; 64 -> 8.22x; 128 ->
9.49x, 0.26 / 0.54; int4 + zstd: 32 -> 3.49x, 128 -> 4.19x). 64 is the smallest group that keeps
int2 + zstd above 7x, and makes a value group exactly one head. Every fp16 residual token costs
16 bits per value of its own, so the default window is 0. zstd gets its gain from the skewed code
distribution of min/max groups (about 1.45 of 2 bits); coding differences of neighbouring tokens'
codes (CacheGen) was measured to make the int2/int4 streams 5-10% larger, so it is not used.
fp16/bf16 time is mostly blake2b over 5.9 MB (7 ms each way) and zstd.

NOTE (int8's defaults, format version 3: keys per channel, groups of 16, head 1). The table's int8
(per token and head, version 1-2) changed a 64-token greedy answer in 22% of kvmesh bench
quality's test prompts though its teacher-forced top-1 was 99.6%: near-ties flip. Tuned on that
benchmark's dev split (78 prompts; exact-match / top-1 / KL per token):
    per token and head, group 64              0.846  0.9971  6e-5
      + the first token in fp16               0.923  0.9986  4e-5
    keys per channel, 64-token groups, + head 0.936  0.9988  2e-5
    ... 32-token / 32-channel groups          0.897  0.9984  2e-5
    ... 16-token / 16-channel groups          0.962  0.9994  1e-5   (the default)
(exact-match moves by a few prompts between neighbours; KL and top-1 order them). On the table's
1,024 tokens (position-free keys): 1.60x without zstd, 1.76x with (version 2: 1.88x / 1.99x),
relative error 0.0016 / 0.0040 on k / v, encode / decode 43 / 18 ms per chunk.

NOTE (int2's defaults: head 1, key outliers 16). Plain min/max int2 cost +17.8% perplexity on
the benchmark's continuation (``kvmesh bench kvcache``; keys alone +9.9%, values alone +5.7%).
Two cheap exceptions take most of it away, measured on three 2,048-token windows of the text:
the sequence's first token in fp16 (its value vector is the attention sink; values alone fall to
+1.8%), and in every (layer, head) the 16 key channels of widest range in the chunk at 4 bits
(keys alone: +0.8%; 8 channels: +4.7%). Together: +2.1..2.5% against +17.8..28% for plain int2,
at 7.1x instead of 8.1x with zstd. Tried and worse: MSE-optimal clipping of the range (keys
+47%: the extremes matter), sparse per-group outlier values, a rank-1..4 fp16 approximation of
each head's keys or values with the residual quantized (values +24%: the sink token's residual
is large), 32-token key groups.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch
import zstandard

from kvmesh.kv import kivi
from kvmesh.kv.namespace import EXACT

CODECS = ("fp16", "bf16", "int8", "int4", "int2", "fp32")

_MAGIC = b"KVMB"
_VERSION = 3  # written; versions 1 and 2 are still read (see the format NOTE)
_FLAG_ZSTD = 1
_FLAG_POSITIONED = 2
_FIXED = {1: struct.Struct("<4sBBBB4III16s"),  # magic .. namespace, 48 bytes
          2: struct.Struct("<4sBBBB4III16sHH"),  # + head tokens, key outlier channels: 52 bytes
          3: struct.Struct("<4sBBBB4III16sHH")}  # as 2; int8 keys per channel (see the format NOTE)
_HEADER_PREFIX = struct.Struct("<4sB")
_U32 = struct.Struct("<I")
_DIGEST = 16
_BITS = {"int8": 8, "int4": 4, "int2": 2}
_RAW = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
"""Codecs that store every value as is in a float type (lossless when it is the source dtype)."""
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEFAULT_HEAD = {"int2": 1, "int8": 1}
_DEFAULT_GROUP = {"int8": 16, "int4": 64, "int2": 64}
_DEFAULT_KEY_OUTLIERS = {"int4": 0, "int2": 16}
_EMPTY = torch.empty(0, dtype=torch.uint8)


class CorruptBlob(ValueError):
    """The blob is damaged or not ours: bad magic, version, codec, length, checksum or truncation."""


class NamespaceMismatch(ValueError):
    """The blob is intact but was written for another namespace (model, layout, tenant) or shape."""


@dataclass(frozen=True)
class CodecSpec:
    """How a chunk is stored: codec name, zstd on/off, quantization group and residual sizes."""

    name: str = "int4"
    """One of CODECS."""
    zstd: bool = True
    """Compress the payload with zstd (lossless)."""
    group_size: int | None = None
    """int8/int4/int2: tokens per key group and channels per value group (fp16 scale and zero per
    group, so small groups cost bits: 32 bits / group_size per value); None = the codec's default
    (int8: 16, int4/int2: 64). Ignored by fp16/bf16/fp32."""
    residual: int = 0
    """int8/int4/int2: the most recent tokens of the chunk kept in fp16 (KIVI's full-precision
    window); capped at the chunk length."""
    zstd_level: int = 3
    """zstd level 1..22; higher is slower to encode for little gain on quantized KV."""
    head: int | None = None
    """int8/int4/int2: the first tokens of a sequence's first chunk kept in fp16 (``encode``'s
    ``sequence_start``); None = the codec's default (int8, int2: 1; int4: 0). A sequence's first token
    is its attention sink: a value vector of small norm that draws much of every later query's
    attention, so its quantization error reaches every output."""
    key_outliers: int | None = None
    """int4/int2: key channels per layer and KV head -- the chunk's widest -- quantized with twice
    the bits (int2: 4, int4: 8); None = the codec's default (int2: 16, int4: 0). Ignored by int8."""

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"CodecSpec.name must be one of {CODECS}, got {self.name!r}")
        if not isinstance(self.zstd, bool):
            raise ValueError(f"CodecSpec.zstd must be True or False, got {self.zstd!r}")
        for field, value, lo, hi in (("group_size", self.group_size, 1, 65535),
                                     ("residual", self.residual, 0, 65535),
                                     ("zstd_level", self.zstd_level, 1, 22),
                                     ("head", self.head, 0, 65535),
                                     ("key_outliers", self.key_outliers, 0, 65535)):
            if value is None and field in ("group_size", "head", "key_outliers"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"CodecSpec.{field} must be an int in {lo}..{hi}, got {value!r}")

    def group_tokens(self) -> int:
        """`group_size` with the codec's default filled in (0 for the raw float codecs)."""
        if self.name in _RAW:
            return 0
        return _DEFAULT_GROUP[self.name] if self.group_size is None else self.group_size

    def head_tokens(self) -> int:
        """`head` with the codec's default filled in."""
        return _DEFAULT_HEAD.get(self.name, 0) if self.head is None else self.head

    def storage(self, dtype: torch.dtype) -> str:
        """The KvNamespace storage name of KV stored this way from an engine of `dtype`:
        kvmesh.kv.namespace.EXACT when decoding gives back exactly what was encoded, else a name
        that fixes every parameter changing the decoded values (zstd never does)."""
        if self.name in _RAW:
            return EXACT if _RAW[self.name] == dtype else self.name
        # int8's keys were quantized per token before format version 3 ("int8-g..."); per channel
        # since, which decodes to other values, hence another name.
        name = "int8c" if self.name == "int8" else self.name
        return (f"{name}-g{self.group_tokens()}-r{self.residual}-h{self.head_tokens()}"
                f"-o{self.outlier_channels()}")

    def outlier_channels(self) -> int:
        """`key_outliers` with the codec's default filled in (0 for codecs that do not use it)."""
        if self.name not in ("int4", "int2"):
            return 0
        return _DEFAULT_KEY_OUTLIERS[self.name] if self.key_outliers is None else self.key_outliers


def exact_codec(dtype: torch.dtype) -> str:
    """The codec that stores KV of `dtype` exactly."""
    for name, raw in _RAW.items():
        if raw == dtype:
            return name
    raise ValueError(f"no exact KV codec for {dtype}; use one of {', '.join(map(str, _RAW.values()))}")


@dataclass(frozen=True)
class ChunkMeta:
    """What is stored beside the KV: the reader's namespace and the chunk's tokens (to verify a hit)."""

    namespace: bytes
    """16-byte digest of model identity + KV layout + tenant salt (opaque to the codec)."""
    token_ids: tuple[int, ...]
    """The chunk's tokens, one per KV position (u32)."""
    positioned: bool = False
    """The keys are at their sequence positions (RoPE applied, as the engine's cache holds them),
    not position-free (kvmesh.kv.rope): what an exact prefix chunk stores, since un-rotating and
    rotating again is not exact in floating point, and a prefix chunk never moves."""

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, bytes) or len(self.namespace) != 16:
            raise ValueError(f"ChunkMeta.namespace must be 16 bytes, got {self.namespace!r}")
        object.__setattr__(self, "token_ids", tuple(int(t) for t in self.token_ids))
        if any(not 0 <= t < 2**32 for t in self.token_ids):
            raise ValueError("ChunkMeta.token_ids must be in 0..2**32-1")


@dataclass(frozen=True)
class BlobHeader:
    """Everything in a blob but its payload (see the format NOTE in the module docstring)."""

    version: int
    codec: str
    zstd: bool
    src_dtype: torch.dtype
    shape: tuple[int, int, int, int]  # L, T, H, D
    group_size: int
    residual: int
    head: int  # 0 in version 1 blobs
    key_outliers: int  # 0 in version 1 blobs
    namespace: bytes
    token_ids: tuple[int, ...]
    payload_bytes: int  # as stored (after zstd when zstd is set)
    positioned: bool = False  # ChunkMeta.positioned


def encode(k: torch.Tensor, v: torch.Tensor, meta: ChunkMeta, spec: CodecSpec, *,
           sequence_start: bool = True) -> bytes:
    """Encode one chunk ``k, v [L, T, H, D]`` (any float dtype, any device) into a blob.

    ``sequence_start``: the chunk's first token is its sequence's first (position 0). Only such a
    chunk keeps ``spec.head`` tokens in fp16: the attention sink is the sequence's first token."""
    if k.dim() != 4 or k.shape != v.shape or min(k.shape) < 1:
        raise ValueError(f"k and v must both be non-empty [L, T, H, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype not in _DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k and v must share a dtype among {_DTYPES}, got {k.dtype} and {v.dtype}")
    L, T, H, D = k.shape
    if len(meta.token_ids) != T:
        raise ValueError(f"meta.token_ids has {len(meta.token_ids)} ids for a chunk of {T} tokens")
    if spec.name in _RAW:
        group, residual, head, outliers = 0, 0, 0, 0
        parts = [_shuffle(k.to(_RAW[spec.name])), _shuffle(v.to(_RAW[spec.name]))]
    else:
        bits = _BITS[spec.name]
        group = spec.group_tokens()
        residual = min(spec.residual, T)
        head = min(spec.head_tokens(), T - residual) if sequence_start else 0
        end = T - residual
        outliers = min(spec.outlier_channels(), D) if end > head else 0
        kq, vq = k[:, head:end], v[:, head:end]
        parts = [*_quantize_keys(kq, bits, group, outliers), *_quantize_part(vq, bits, group, per_channel=False),
                 _shuffle(k[:, :head].half()), _shuffle(v[:, :head].half()),
                 _shuffle(k[:, end:].half()), _shuffle(v[:, end:].half())]
    raw = torch.cat([p.cpu() for p in parts]).numpy().tobytes()
    payload = zstandard.ZstdCompressor(level=spec.zstd_level).compress(raw) if spec.zstd else raw
    body = b"".join([
        _FIXED[_VERSION].pack(_MAGIC, _VERSION, CODECS.index(spec.name),
                              (_FLAG_ZSTD if spec.zstd else 0) | (_FLAG_POSITIONED if meta.positioned else 0),
                              _DTYPES.index(k.dtype), L, T, H, D, group, residual, meta.namespace,
                              head, outliers),
        struct.pack(f"<{T}I", *meta.token_ids),
        _U32.pack(len(payload)),
        payload,
    ])
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def read_header(blob: bytes) -> BlobHeader:
    """Parse a blob's header without touching its payload or checksum (cheap).

    Raises CorruptBlob on a bad magic, version, codec, flags, dtype or field, or a total length
    that does not match the header. ``decode`` additionally verifies the checksum.
    """
    return _parse(memoryview(blob))[0]


def verify(blob: bytes) -> BlobHeader:
    """Checksum and header of a blob, without decoding its payload (what a store checks on write
    and on read). Raises CorruptBlob."""
    mv = memoryview(blob)
    if len(mv) < _DIGEST or hashlib.blake2b(mv[:-_DIGEST], digest_size=_DIGEST).digest() != mv[-_DIGEST:]:
        raise CorruptBlob("blob checksum mismatch (damaged or truncated)")
    return _parse(mv)[0]


def decode(blob: bytes, *, namespace: bytes, dtype: torch.dtype = torch.float32, device="cpu",
           expect_shape: tuple[int, int, int, int] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, BlobHeader]:
    """Decode a blob into ``k, v [L, T, H, D]`` of ``dtype`` on ``device``, plus its header.

    Raises CorruptBlob when the checksum, header or payload is bad (checked first, before any
    field is trusted), and NamespaceMismatch when the blob is intact but its namespace differs
    from ``namespace`` or its shape from ``expect_shape``.
    """
    mv = memoryview(blob)
    if len(mv) < _DIGEST or hashlib.blake2b(mv[:-_DIGEST], digest_size=_DIGEST).digest() != mv[-_DIGEST:]:
        raise CorruptBlob("blob checksum mismatch (damaged or truncated); treat it as a miss")
    header, start = _parse(mv)
    if header.namespace != namespace:
        raise NamespaceMismatch(f"blob namespace {header.namespace.hex()} != reader's {bytes(namespace).hex()}: "
                                "written by another model, KV layout or tenant")
    if expect_shape is not None and tuple(expect_shape) != header.shape:
        raise NamespaceMismatch(f"blob shape {header.shape} != expected {tuple(expect_shape)}")
    raw = _inflate(mv[start:start + header.payload_bytes], header)
    buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
    sections = iter(torch.split(buf, _section_sizes(header)))
    L, T, H, D = header.shape
    if header.codec in _RAW:
        k = _unshuffle(next(sections), _RAW[header.codec]).view(L, T, H, D)
        v = _unshuffle(next(sections), _RAW[header.codec]).view(L, T, H, D)
    else:
        bits = _BITS[header.codec]
        head, residual = header.head, header.residual
        Q = T - head - residual
        if bits < 8 or header.version >= 3:
            kq = _dequantize_keys(sections, (L, Q, H, D), bits, header.group_size, header.key_outliers)
        else:  # int8 before version 3: keys per token and head, as values
            next(sections)  # the (empty) outlier mask
            kq = _dequantize_part(sections, (L, Q, H, D), bits, header.group_size, per_channel=False)
            for _ in range(3):  # the (empty) outlier channels
                next(sections)
        vq = _dequantize_part(sections, (L, Q, H, D), bits, header.group_size, per_channel=False)
        fp16 = [_unshuffle(next(sections), torch.float16).view(L, n, H, D).float()
                for n in (head, head, residual, residual)]
        if head or residual:
            k, v = torch.cat([fp16[0], kq, fp16[2]], dim=1), torch.cat([fp16[1], vq, fp16[3]], dim=1)
        else:  # no copy: the cast below makes them contiguous
            k, v = kq, vq
    contiguous = torch.contiguous_format
    return k.to(dtype, memory_format=contiguous), v.to(dtype, memory_format=contiguous), header


def _quantize_part(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> list[torch.Tensor]:
    """Quantize ``x [L, Q, H, D]`` to [scales, zeros, packed codes] as flat uint8 tensors."""
    L, Q, H, D = x.shape
    if per_channel:
        codes, scale, zero = kivi.quantize(x.permute(0, 2, 3, 1).reshape(L, H * D, Q), bits, group)  # [L, C, Q]
    else:
        codes, scale, zero = kivi.quantize(x.reshape(L, Q, H * D), bits, group)  # [L, Q, C]
    return [_shuffle(scale), _shuffle(zero), kivi.pack(codes, bits)]


def _quantize_keys(x: torch.Tensor, bits: int, group: int, outliers: int) -> list[torch.Tensor]:
    """Keys ``x [L, Q, H, D]`` per channel: [outlier mask, scales, zeros, codes of the other channels,
    then scales, zeros, codes of the ``outliers`` widest channels of each (layer, head) at twice the
    bits], as flat uint8 tensors (mask and outlier sections empty when ``outliers`` is 0)."""
    L, Q, H, D = x.shape
    xc = x.permute(0, 2, 3, 1).float()  # [L, H, D, Q]
    if not outliers:
        return [_EMPTY, *_quantize_part(x, bits, group, per_channel=True), _EMPTY, _EMPTY, _EMPTY]
    width = xc.amax(-1) - xc.amin(-1)  # [L, H, D]
    mask = torch.zeros(L, H, D, dtype=torch.uint8, device=x.device)
    mask.scatter_(-1, width.topk(outliers, dim=-1).indices, 1)
    order = kivi.channel_order(mask)  # [L, H, D]: plain channels, then outliers (each ascending)
    xs = xc.gather(2, order[..., None].expand(L, H, D, Q))
    parts = [kivi.pack(mask, 1)]
    for lo, hi, b in ((0, D - outliers, bits), (D - outliers, D, min(8, 2 * bits))):
        codes, scale, zero = kivi.quantize(xs[:, :, lo:hi].reshape(L, H * (hi - lo), Q), b, group)
        parts += [_shuffle(scale), _shuffle(zero), kivi.pack(codes, b)]
    return parts


def _dequantize_keys(sections, shape: tuple[int, int, int, int], bits: int, group: int,
                     outliers: int) -> torch.Tensor:
    """Inverse of ``_quantize_keys``: consume seven sections, return float32 ``[L, Q, H, D]``."""
    L, Q, H, D = shape
    mask_bytes = next(sections)
    if not outliers:
        x = _dequantize_part(sections, shape, bits, group, per_channel=True)
        for _ in range(3):
            next(sections)
        return x
    mask = kivi.unpack(mask_bytes, 1, L * H * D).view(L, H, D)
    if not bool((mask.sum(-1, dtype=torch.int32) == outliers).all()):
        raise CorruptBlob(f"key outlier mask does not mark {outliers} channels in every head")
    xs = []
    for n, b in ((D - outliers, bits), (outliers, min(8, 2 * bits))):
        scale = _unshuffle(next(sections), torch.float16)
        zero = _unshuffle(next(sections), torch.float16)
        codes = kivi.unpack(next(sections), b, L * H * n * Q)
        gshape = (L, H * n, -(-Q // group))
        xs.append(kivi.dequantize(codes.view(L, H * n, Q), scale.view(gshape), zero.view(gshape), group)
                  .view(L, H, n, Q))
    order = kivi.channel_order(mask)
    x = torch.empty(L, H, D, Q, device=order.device).scatter_(2, order[..., None].expand(L, H, D, Q), torch.cat(xs, dim=2))
    return x.permute(0, 3, 1, 2)


def _dequantize_part(sections, shape: tuple[int, int, int, int], bits: int, group: int,
                     per_channel: bool) -> torch.Tensor:
    """Inverse of ``_quantize_part``: consume three sections, return float32 ``[L, Q, H, D]``."""
    L, Q, H, D = shape
    scale = _unshuffle(next(sections), torch.float16)
    zero = _unshuffle(next(sections), torch.float16)
    codes = kivi.unpack(next(sections), bits, L * Q * H * D)
    if per_channel:
        gshape = (L, H * D, -(-Q // group))
        x = kivi.dequantize(codes.view(L, H * D, Q), scale.view(gshape), zero.view(gshape), group)  # [L, C, Q]
        return x.reshape(L, H, D, Q).permute(0, 3, 1, 2)  # a view: decode makes it contiguous
    gshape = (L, Q, -(-(H * D) // group))
    x = kivi.dequantize(codes.view(L, Q, H * D), scale.view(gshape), zero.view(gshape), group)  # [L, Q, C]
    return x.reshape(L, Q, H, D)


def _section_sizes(h: BlobHeader) -> list[int]:
    """Byte size of each raw payload section, in order (the format NOTE's list)."""
    L, T, H, D = h.shape
    if h.codec in _RAW:
        return [_RAW[h.codec].itemsize * L * T * H * D] * 2
    bits = _BITS[h.codec]
    Q, C, g, m = T - h.head - h.residual, H * D, h.group_size, h.key_outliers
    codes = -(-L * Q * C * bits // 8)
    if bits < 8 or h.version >= 3:  # keys per channel; the m outlier channels of each head separately
        mask = -(-L * C // 8) if m else 0
        plain_groups, out_groups = L * H * (D - m) * -(-Q // g), L * H * m * -(-Q // g)
        keys = [mask, 2 * plain_groups, 2 * plain_groups, -(-L * H * (D - m) * Q * bits // 8),
                2 * out_groups, 2 * out_groups, -(-L * H * m * Q * min(8, 2 * bits) // 8)]
    else:
        groups_k = L * Q * -(-C // g)
        keys = [0, 2 * groups_k, 2 * groups_k, codes, 0, 0, 0]
    groups_v = L * Q * -(-C // g)
    head, residual = 2 * L * h.head * C, 2 * L * h.residual * C
    return [*keys, 2 * groups_v, 2 * groups_v, codes, head, head, residual, residual]


def _inflate(payload: memoryview, h: BlobHeader) -> bytes:
    """The raw payload (zstd undone), checked to be exactly the size the header implies."""
    expected = sum(_section_sizes(h))
    if h.zstd:
        try:
            if zstandard.frame_content_size(payload) != expected:
                raise CorruptBlob("zstd frame size does not match the header")
            raw = zstandard.ZstdDecompressor().decompress(payload)
        except zstandard.ZstdError as e:
            raise CorruptBlob(f"bad zstd payload: {e}") from e
    else:
        raw = payload
    if len(raw) != expected:
        raise CorruptBlob(f"payload is {len(raw)} bytes, the header implies {expected}")
    return raw


def _parse(mv: memoryview) -> tuple[BlobHeader, int]:
    """Header fields and the payload's offset; CorruptBlob unless the whole blob is consistent."""
    if len(mv) < _HEADER_PREFIX.size:
        raise CorruptBlob(f"blob of {len(mv)} bytes is shorter than a header")
    magic, version = _HEADER_PREFIX.unpack_from(mv)
    if magic != _MAGIC:
        raise CorruptBlob(f"bad magic {bytes(magic)!r}: not a kvmesh KV blob")
    if version not in _FIXED:
        raise CorruptBlob(f"blob format version {version} is not supported (this reader: {sorted(_FIXED)})")
    fixed = _FIXED[version]
    if len(mv) < fixed.size:
        raise CorruptBlob(f"blob of {len(mv)} bytes is shorter than a header")
    magic, version, codec, flags, dtype, L, T, H, D, group, residual, namespace, *extra = fixed.unpack_from(mv)
    head, outliers = extra if extra else (0, 0)
    if codec >= len(CODECS) or flags & ~(_FLAG_ZSTD | _FLAG_POSITIONED) or dtype >= len(_DTYPES):
        raise CorruptBlob(f"unknown codec {codec}, flags {flags:#x} or dtype {dtype}")
    name = CODECS[codec]
    if name in _RAW:
        params_ok = group == 0 and residual == 0 and head == 0 and outliers == 0
    else:
        params_ok = (group >= 1 and head + residual <= T
                     and (name != "int8" or outliers == 0) and (name != "int8" or version >= 3 or group == D)
                     and outliers <= D and (outliers == 0 or head + residual < T))
    if min(L, T, H, D) < 1 or not params_ok:
        raise CorruptBlob(f"inconsistent header: codec {name}, shape {(L, T, H, D)}, group {group}, "
                          f"residual {residual}, head {head}, key outliers {outliers}")
    tokens_end = fixed.size + 4 * T
    if len(mv) < tokens_end + _U32.size:
        raise CorruptBlob("blob truncated inside its token ids")
    (payload_bytes,) = _U32.unpack_from(mv, tokens_end)
    start = tokens_end + _U32.size
    if len(mv) != start + payload_bytes + _DIGEST:
        raise CorruptBlob(f"blob is {len(mv)} bytes, its header says {start + payload_bytes + _DIGEST}")
    token_ids = struct.unpack_from(f"<{T}I", mv, fixed.size)
    header = BlobHeader(version, name, bool(flags & _FLAG_ZSTD), _DTYPES[dtype], (L, T, H, D),
                        group, residual, head, outliers, bytes(namespace), token_ids, payload_bytes,
                        bool(flags & _FLAG_POSITIONED))
    return header, start


def _shuffle(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as flat bytes in byte planes: every value's byte 0, then every byte 1 ...
    (sign and exponent bytes, which repeat, end up together for zstd). Exactly invertible."""
    n = t.element_size()
    return t.reshape(-1).view(torch.uint8).view(-1, n).t().reshape(-1)  # [n * N]


def _unshuffle(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``_shuffle``: flat bytes -> flat ``dtype`` tensor (on a little-endian host)."""
    n = dtype.itemsize
    out = torch.empty((b.numel() // n, n), dtype=torch.uint8, device=b.device)  # fresh: aligned for the view
    return out.copy_(b.view(n, -1).t()).view(dtype).view(-1)
