"""The KV chunk blob codec: (k, v, metadata) of one chunk <-> one self-describing, checksummed blob.

A chunk is the attention KV of a fixed number of tokens of one sequence, all layers:
``k, v [layers, tokens, kv_heads, head_dim]`` in any float dtype. ``encode`` stores it with one of
``CODECS``, optionally followed by zstd; ``decode`` gives it back (or raises: a damaged blob is a
miss, never garbage KV in an engine).

NOTE (blob format, version 1, little-endian)::

    offset  size   field
    0       4      magic b"KVMB"
    4       1      format version (1)
    5       1      codec id: index into CODECS (0 fp16, 1 bf16, 2 int8, 3 int4, 4 int2)
    6       1      flags: bit 0 = payload is one zstd frame; other bits 0
    7       1      source dtype: 0 float32, 1 bfloat16, 2 float16
    8       16     shape L, T, H, D (4 x u32): layers, tokens, kv heads, head dim
    24      4      group_size u32: tokens per key group / channels per value group (int4, int2);
                   head_dim for int8 (per-token-per-head); 0 for fp16 / bf16
    28      4      residual u32: last tokens of the chunk stored as fp16 (0 for fp16 / bf16)
    32      16     namespace (model identity + KV layout + tenant salt; opaque here)
    48      4*T    token ids, u32 each
    48+4T   4      payload length P, u32
    52+4T   P      payload (zstd-compressed when flag bit 0 is set)
    52+4T+P 16     blake2b (digest_size=16) of every byte before it

Raw payload sections, in order (fp16 arrays byte-shuffled: all low bytes, then all high bytes,
which lets zstd see the slowly varying sign/exponent bytes together):

- fp16 / bf16: k, v as ``[L, T, H, D]``.
- int8 / int4 / int2, with ``Q = T - residual`` quantized tokens and ``C = H * D`` channels, for k
  then v: fp16 scales, fp16 zeros, then the uint8 codes packed ``8 // bits`` per byte (lowest
  bits first). Keys of int4/int2 are quantized per channel: codes ``[L, C, Q]``, scales
  ``[L, C, ceil(Q/group)]``; values of int4/int2 per token: codes ``[L, Q, C]``, scales
  ``[L, Q, ceil(C/group)]``; both of int8 per token and head: codes ``[L, Q, C]``, scales
  ``[L, Q, H]`` (asymmetric: measured 0.0077/0.0057 relative error on k/v, symmetric 0.011/0.0067).
  Then the residual ``k, v [L, residual, H, D]`` fp16.

NOTE (measurements): real KV of the bundled SmolLM2-135M (30 layers, 3 KV heads, head_dim 64,
keys after RoPE), the first 1024 tokens of ``reference_text()`` as four 256-token chunks, defaults
(group_size 64, residual 0, zstd level 3). Ratio = 2 bytes * elements of k and v / blob bytes;
error = ||decoded - x|| / ||x|| per tensor, mean over chunks.

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
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import torch
import zstandard

from kvmesh.kv import kivi

CODECS = ("fp16", "bf16", "int8", "int4", "int2")

_MAGIC = b"KVMB"
_VERSION = 1
_FLAG_ZSTD = 1
_FIXED = struct.Struct("<4sBBBB4III16s")  # magic .. namespace, 48 bytes
_U32 = struct.Struct("<I")
_DIGEST = 16
_BITS = {"int8": 8, "int4": 4, "int2": 2}
_RAW16 = {"fp16": torch.float16, "bf16": torch.bfloat16}
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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
    group_size: int = 64
    """int4/int2: tokens per key group and channels per value group (fp16 scale and zero per
    group, so small groups cost bits: 32 bits / group_size per value). Ignored by fp16/bf16/int8."""
    residual: int = 0
    """int8/int4/int2: the most recent tokens of the chunk kept in fp16 (KIVI's full-precision
    window); capped at the chunk length."""
    zstd_level: int = 3
    """zstd level 1..22; higher is slower to encode for little gain on quantized KV."""

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"CodecSpec.name must be one of {CODECS}, got {self.name!r}")
        if not isinstance(self.zstd, bool):
            raise ValueError(f"CodecSpec.zstd must be True or False, got {self.zstd!r}")
        for field, value, lo, hi in (("group_size", self.group_size, 1, 65535),
                                     ("residual", self.residual, 0, 65535),
                                     ("zstd_level", self.zstd_level, 1, 22)):
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise ValueError(f"CodecSpec.{field} must be an int in {lo}..{hi}, got {value!r}")


@dataclass(frozen=True)
class ChunkMeta:
    """What is stored beside the KV: the reader's namespace and the chunk's tokens (to verify a hit)."""

    namespace: bytes
    """16-byte digest of model identity + KV layout + tenant salt (opaque to the codec)."""
    token_ids: tuple[int, ...]
    """The chunk's tokens, one per KV position (u32)."""

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
    namespace: bytes
    token_ids: tuple[int, ...]
    payload_bytes: int  # as stored (after zstd when zstd is set)


def encode(k: torch.Tensor, v: torch.Tensor, meta: ChunkMeta, spec: CodecSpec) -> bytes:
    """Encode one chunk ``k, v [L, T, H, D]`` (any float dtype, any device) into a blob."""
    if k.dim() != 4 or k.shape != v.shape or min(k.shape) < 1:
        raise ValueError(f"k and v must both be non-empty [L, T, H, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype not in _DTYPES or v.dtype != k.dtype:
        raise ValueError(f"k and v must share a dtype among {_DTYPES}, got {k.dtype} and {v.dtype}")
    L, T, H, D = k.shape
    if len(meta.token_ids) != T:
        raise ValueError(f"meta.token_ids has {len(meta.token_ids)} ids for a chunk of {T} tokens")
    if spec.name in _RAW16:
        group, residual = 0, 0
        parts = [_shuffle16(k.to(_RAW16[spec.name])), _shuffle16(v.to(_RAW16[spec.name]))]
    else:
        bits = _BITS[spec.name]
        group = D if bits == 8 else spec.group_size
        residual = min(spec.residual, T)
        Q = T - residual
        parts = [*_quantize_part(k[:, :Q], bits, group, per_channel=bits < 8),
                 *_quantize_part(v[:, :Q], bits, group, per_channel=False),
                 _shuffle16(k[:, Q:].half()), _shuffle16(v[:, Q:].half())]
    raw = torch.cat(parts).cpu().numpy().tobytes()
    payload = zstandard.ZstdCompressor(level=spec.zstd_level).compress(raw) if spec.zstd else raw
    body = b"".join([
        _FIXED.pack(_MAGIC, _VERSION, CODECS.index(spec.name), _FLAG_ZSTD if spec.zstd else 0,
                    _DTYPES.index(k.dtype), L, T, H, D, group, residual, meta.namespace),
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
    if header.codec in _RAW16:
        k = _unshuffle16(next(sections), _RAW16[header.codec]).view(L, T, H, D)
        v = _unshuffle16(next(sections), _RAW16[header.codec]).view(L, T, H, D)
    else:
        bits = _BITS[header.codec]
        Q = T - header.residual
        kq = _dequantize_part(sections, (L, Q, H, D), bits, header.group_size, per_channel=bits < 8)
        vq = _dequantize_part(sections, (L, Q, H, D), bits, header.group_size, per_channel=False)
        k_res = _unshuffle16(next(sections), torch.float16).view(L, header.residual, H, D)
        v_res = _unshuffle16(next(sections), torch.float16).view(L, header.residual, H, D)
        k, v = torch.cat([kq, k_res.float()], dim=1), torch.cat([vq, v_res.float()], dim=1)
    contiguous = torch.contiguous_format
    return k.to(dtype, memory_format=contiguous), v.to(dtype, memory_format=contiguous), header


def _quantize_part(x: torch.Tensor, bits: int, group: int, per_channel: bool) -> list[torch.Tensor]:
    """Quantize ``x [L, Q, H, D]`` to [scales, zeros, packed codes] as flat uint8 tensors."""
    L, Q, H, D = x.shape
    if per_channel:
        codes, scale, zero = kivi.quantize(x.permute(0, 2, 3, 1).reshape(L, H * D, Q), bits, group)  # [L, C, Q]
    else:
        codes, scale, zero = kivi.quantize(x.reshape(L, Q, H * D), bits, group)  # [L, Q, C]
    return [_shuffle16(scale), _shuffle16(zero), kivi.pack(codes, bits)]


def _dequantize_part(sections, shape: tuple[int, int, int, int], bits: int, group: int,
                     per_channel: bool) -> torch.Tensor:
    """Inverse of ``_quantize_part``: consume three sections, return float32 ``[L, Q, H, D]``."""
    L, Q, H, D = shape
    scale = _unshuffle16(next(sections), torch.float16)
    zero = _unshuffle16(next(sections), torch.float16)
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
    if h.codec in _RAW16:
        return [2 * L * T * H * D] * 2
    bits = _BITS[h.codec]
    Q, C, g = T - h.residual, H * D, h.group_size
    groups_k = L * C * -(-Q // g) if bits < 8 else L * Q * -(-C // g)
    groups_v = L * Q * -(-C // g)
    codes = -(-L * Q * C * bits // 8)
    residual = 2 * L * h.residual * C
    return [2 * groups_k, 2 * groups_k, codes, 2 * groups_v, 2 * groups_v, codes, residual, residual]


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
    if len(mv) < _FIXED.size:
        raise CorruptBlob(f"blob of {len(mv)} bytes is shorter than a header")
    magic, version, codec, flags, dtype, L, T, H, D, group, residual, namespace = _FIXED.unpack_from(mv)
    if magic != _MAGIC:
        raise CorruptBlob(f"bad magic {bytes(magic)!r}: not a kvmesh KV blob")
    if version != _VERSION:
        raise CorruptBlob(f"blob format version {version} is not supported (this reader: {_VERSION})")
    if codec >= len(CODECS) or flags & ~_FLAG_ZSTD or dtype >= len(_DTYPES):
        raise CorruptBlob(f"unknown codec {codec}, flags {flags:#x} or dtype {dtype}")
    name = CODECS[codec]
    if name in _RAW16:
        params_ok = group == 0 and residual == 0
    else:
        params_ok = group >= 1 and residual <= T and (name != "int8" or group == D)
    if min(L, T, H, D) < 1 or not params_ok:
        raise CorruptBlob(f"inconsistent header: codec {name}, shape {(L, T, H, D)}, "
                          f"group {group}, residual {residual}")
    tokens_end = _FIXED.size + 4 * T
    if len(mv) < tokens_end + _U32.size:
        raise CorruptBlob("blob truncated inside its token ids")
    (payload_bytes,) = _U32.unpack_from(mv, tokens_end)
    start = tokens_end + _U32.size
    if len(mv) != start + payload_bytes + _DIGEST:
        raise CorruptBlob(f"blob is {len(mv)} bytes, its header says {start + payload_bytes + _DIGEST}")
    token_ids = struct.unpack_from(f"<{T}I", mv, _FIXED.size)
    header = BlobHeader(version, name, bool(flags & _FLAG_ZSTD), _DTYPES[dtype], (L, T, H, D),
                        group, residual, bytes(namespace), token_ids, payload_bytes)
    return header, start


def _shuffle16(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit tensor as flat bytes, all low bytes first then all high bytes."""
    x = t.reshape(-1).view(torch.int16)  # [N]
    return torch.cat([x.to(torch.uint8), (x >> 8).to(torch.uint8)])  # int -> uint8 keeps the low byte


def _unshuffle16(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of ``_shuffle16``: flat bytes -> flat ``dtype`` tensor (on a little-endian host)."""
    n = b.numel() // 2
    return torch.stack([b[:n], b[n:]], dim=-1).view(dtype).view(-1)
