"""The KV chunk blob codec: exact round trips, quantization error bounds, corruption and namespace
checks on small random chunks; compression ratio and error on real KV of the bundled model (slow)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from kvmesh.kv import kivi
from kvmesh.kv.codec import (
    CODECS,
    ChunkMeta,
    CodecSpec,
    CorruptBlob,
    NamespaceMismatch,
    decode,
    encode,
    exact_codec,
    read_header,
)
from kvmesh.kv.namespace import EXACT

NS = bytes(range(16))
BITS = {"int8": 8, "int4": 4, "int2": 2}


def make_kv(L=2, T=40, H=2, D=8, dtype=torch.float32, seed=0):
    """Random ``k, v [L, T, H, D]``; key channels differ in scale by 1000x (KIVI's outlier
    channels), so quantizing keys along the wrong axis breaks the per-group error bound."""
    g = torch.Generator().manual_seed(seed)
    channel_scale = torch.logspace(-2, 1, H * D)[torch.randperm(H * D, generator=g)].view(1, 1, H, D)
    k = torch.randn(L, T, H, D, generator=g) * channel_scale + torch.randn(1, 1, H, D, generator=g)
    v = torch.randn(L, T, H, D, generator=g) * torch.logspace(-1, 1, T).view(1, T, 1, 1)
    return k.to(dtype), v.to(dtype)


def meta(T, ns=NS):
    return ChunkMeta(namespace=ns, token_ids=tuple(range(1000, 1000 + T)))


def roundtrip(k, v, spec, **kw):
    k2, v2, header = decode(encode(k, v, meta(k.shape[1]), spec), namespace=NS, **kw)
    return k2, v2, header


def group_bound(x, group, bits):
    """Largest error ``quantize`` may make on each element of ``x [..., n]`` grouped along the last
    dim: half a step of the group's (fp16, rounded up) scale plus fp16 rounding of its minimum."""
    bound = torch.empty_like(x)
    for s in range(0, x.shape[-1], group):
        g = x[..., s:s + group]
        mn, mx = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        bound[..., s:s + group] = (mx - mn) / ((1 << bits) - 1) * 0.5 * (1 + 2**-9) + mn.abs() * 2**-11 \
            + 1e-6 * (mn.abs() + mx.abs() + 1)
    return bound


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16), ("fp32", torch.float32)])
@pytest.mark.parametrize("zstd", [False, True])
def test_raw_codecs_round_trip_to_their_precision(name, dtype, zstd):
    k, v = make_kv()
    k2, v2, header = roundtrip(k, v, CodecSpec(name, zstd=zstd))
    assert torch.equal(k2, k.to(dtype).float()) and torch.equal(v2, v.to(dtype).float())
    assert (header.codec, header.zstd, header.group_size, header.residual) == (name, zstd, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_exact_codec_of_a_dtype_gives_back_every_bit(dtype):
    """The deployment default: KV of the engine's dtype, bit for bit (NaN payloads, signed zeros
    and subnormals included), through the byte-plane shuffle and zstd."""
    k, v = make_kv(dtype=dtype)
    k.view(-1)[:4] = torch.tensor([float("nan"), -0.0, 1e-40, float("inf")], dtype=dtype)
    spec = CodecSpec(exact_codec(dtype), zstd=True)
    assert spec.storage(dtype) == EXACT
    k2, v2, _ = decode(encode(k, v, meta(k.shape[1]), spec), namespace=NS, dtype=dtype)
    assert torch.equal(k2.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       k.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert torch.equal(v2, v)


def test_storage_names_exact_formats_and_every_lossy_parameter():
    assert CodecSpec("fp32").storage(torch.float32) == EXACT
    assert CodecSpec("bf16").storage(torch.bfloat16) == EXACT
    assert CodecSpec("fp16").storage(torch.float32) == "fp16"  # a downcast is lossy
    assert CodecSpec("int4", zstd=True).storage(torch.float32) == CodecSpec("int4", zstd=False).storage(torch.float32)
    names = {CodecSpec("int4").storage(torch.float32), CodecSpec("int4", group_size=32).storage(torch.float32),
             CodecSpec("int4", residual=8).storage(torch.float32), CodecSpec("int2").storage(torch.float32),
             CodecSpec("int4", key_outliers=4).storage(torch.float32), CodecSpec("int8").storage(torch.float32)}
    assert len(names) == 6 and EXACT not in names
    with pytest.raises(ValueError, match="no exact KV codec"):
        exact_codec(torch.int8)


def test_positioned_keys_are_flagged_in_the_header():
    k, v = make_kv()
    blob = encode(k, v, ChunkMeta(NS, tuple(range(k.shape[1])), positioned=True), CodecSpec("fp32"))
    assert read_header(blob).positioned
    assert not read_header(encode(k, v, meta(k.shape[1]), CodecSpec("fp32"))).positioned


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("group", [16, 7])
def test_quantized_error_within_half_a_step_of_each_group(name, group):
    k, v = make_kv()
    L, T, H, D = k.shape
    k2, v2, header = roundtrip(k, v, CodecSpec(name, group_size=group, head=0, key_outliers=0))
    bits = BITS[name]
    assert header.group_size == group
    perm = (0, 2, 3, 1)  # keys per channel: groups of tokens of one channel
    assert ((k2 - k).permute(perm).abs() <= group_bound(k.permute(perm), group, bits)).all()
    flat = (L, T, H * D)  # values per token: groups of channels of one token
    assert ((v2 - v).reshape(flat).abs() <= group_bound(v.reshape(flat), group, bits)).all()


def test_more_bits_less_error():
    k, v = make_kv()
    errs = [(roundtrip(k, v, CodecSpec(n, group_size=8, key_outliers=0))[0] - k).norm() / k.norm()
            for n in ("int2", "int4", "int8")]
    assert errs[0] > 3 * errs[1] > 9 * errs[2] and errs[2] < 0.01


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("residual", [1, 9, 40, 500])
def test_residual_tokens_are_exact_fp16(name, residual):
    k, v = make_kv()
    T = k.shape[1]
    k2, v2, header = roundtrip(k, v, CodecSpec(name, residual=residual, group_size=16, head=0))
    r = min(residual, T)
    assert header.residual == r
    assert torch.equal(k2[:, T - r:], k[:, T - r:].half().float())
    assert torch.equal(v2[:, T - r:], v[:, T - r:].half().float())
    if r < T:
        assert not torch.equal(k2[:, :T - r], k[:, :T - r].half().float())


@pytest.mark.parametrize("name", CODECS)
def test_zstd_on_and_off_decode_to_the_same_kv(name):
    k, v = make_kv()
    plain = roundtrip(k, v, CodecSpec(name, zstd=False, residual=3))
    packed = roundtrip(k, v, CodecSpec(name, zstd=True, residual=3))
    assert torch.equal(plain[0], packed[0]) and torch.equal(plain[1], packed[1])
    assert not plain[2].zstd and packed[2].zstd


@pytest.mark.parametrize("name", CODECS)
def test_bf16_input_and_output_dtypes(name):
    k, v = make_kv(dtype=torch.bfloat16)
    k2, v2, header = roundtrip(k, v, CodecSpec(name), dtype=torch.bfloat16)
    assert header.src_dtype == torch.bfloat16 and k2.dtype == v2.dtype == torch.bfloat16
    assert k2.shape == k.shape
    k32, _, header32 = roundtrip(k.float(), v.float(), CodecSpec(name))
    assert header32.src_dtype == torch.float32 and k32.dtype == torch.float32
    assert torch.equal(k32.bfloat16(), k2)


@pytest.mark.parametrize("name", ["int8", "int4", "int2"])
@pytest.mark.parametrize("head,residual", [(1, 0), (3, 2), (40, 0), (30, 30)])
def test_head_tokens_are_exact_fp16(name, head, residual):
    k, v = make_kv()
    T = k.shape[1]
    k2, v2, header = roundtrip(k, v, CodecSpec(name, head=head, residual=residual, group_size=16))
    h = min(head, T - min(residual, T))
    assert (header.head, header.residual) == (h, min(residual, T))
    assert torch.equal(k2[:, :h], k[:, :h].half().float()) and torch.equal(v2[:, :h], v[:, :h].half().float())
    if h + header.residual < T:
        assert not torch.equal(v2[:, h:T - header.residual], v[:, h:T - header.residual].half().float())
    later = decode(encode(k, v, meta(T), CodecSpec(name, head=head, residual=residual, group_size=16),
                          sequence_start=False), namespace=NS)[2]
    assert later.head == 0  # only a sequence's first chunk holds its attention sink


def test_key_outlier_channels_get_twice_the_bits():
    """int2 with m outlier channels: in every (layer, head) the m widest key channels are quantized
    at 4 bits (half-step bound of 15 levels), the rest at 2; values are unaffected."""
    k, v = make_kv(L=2, T=40, H=2, D=16)
    L, T, H, D = k.shape
    m, group = 5, 8
    plain = roundtrip(k, v, CodecSpec("int2", group_size=group, head=0, key_outliers=0))
    k2, v2, header = roundtrip(k, v, CodecSpec("int2", group_size=group, head=0, key_outliers=m))
    assert header.key_outliers == m
    assert torch.equal(v2, plain[1])
    kc, kc2 = k.permute(0, 2, 3, 1), k2.permute(0, 2, 3, 1)  # [L, H, D, T]
    wide = (kc.amax(-1) - kc.amin(-1)).topk(m, dim=-1).indices
    is_wide = torch.zeros(L, H, D, dtype=torch.bool).scatter_(-1, wide, True)[..., None].expand_as(kc)
    err = (kc2 - kc).abs()
    assert (err[is_wide] <= group_bound(kc, group, 4)[is_wide]).all()
    assert (err[~is_wide] <= group_bound(kc, group, 2)[~is_wide]).all()
    assert not (err[is_wide] <= group_bound(kc, group, 4)[is_wide] / 4).all()  # really 4 bits, not more
    assert (k2 - k).norm() < 0.5 * (plain[0] - k).norm()  # the wide channels held most of the error
    # the mask costs ceil(L*H*D/8) bytes; outlier codes twice the bits of the rest
    small = len(encode(k, v, meta(T), CodecSpec("int2", zstd=False, group_size=group, head=0, key_outliers=0)))
    big = len(encode(k, v, meta(T), CodecSpec("int2", zstd=False, group_size=group, head=0, key_outliers=m)))
    assert big - small == -(-L * H * D // 8) + L * H * m * T * (4 - 2) // 8


def test_codec_defaults_fill_in_per_codec():
    assert (CodecSpec("int2").head_tokens(), CodecSpec("int2").outlier_channels()) == (1, 16)
    assert (CodecSpec("int4").head_tokens(), CodecSpec("int4").outlier_channels()) == (0, 0)
    assert CodecSpec("int8", key_outliers=4).outlier_channels() == 0  # 8 bits: nothing wider to give
    assert (CodecSpec("int8").head_tokens(), CodecSpec("int8").group_tokens()) == (1, 16)
    assert (CodecSpec("int4").group_tokens(), CodecSpec("int2").group_tokens(), CodecSpec("fp16").group_tokens()) == (64, 64, 0)
    assert CodecSpec("int8", group_size=32).group_tokens() == 32
    assert (CodecSpec("int2", head=0, key_outliers=3).head_tokens(), CodecSpec("int2", key_outliers=3).outlier_channels()) == (0, 3)


def as_version_1(blob: bytes) -> bytes:
    """A version-2 blob without head tokens or outlier channels rewritten in format version 1
    (48-byte fixed header, same payload), as a store written before version 2 holds it."""
    body = bytearray(blob[:-16])
    assert body[48:52] == b"\0\0\0\0", "only blobs without head tokens and outliers have a v1 form"
    body[4] = 1
    del body[48:52]
    return bytes(body) + hashlib.blake2b(bytes(body), digest_size=16).digest()


def as_version_2(blob: bytes) -> bytes:
    """A version-3 int4/int2 blob with the version byte of 2 (the same layout for those codecs)."""
    body = bytearray(blob[:-16])
    body[4] = 2
    return bytes(body) + hashlib.blake2b(bytes(body), digest_size=16).digest()


@pytest.mark.parametrize("name", ["int4", "int2"])
def test_version_1_and_2_blobs_still_decode(name):
    k, v = make_kv()
    blob = encode(k, v, meta(k.shape[1]), CodecSpec(name, group_size=8, residual=3, head=0, key_outliers=0))
    k2, v2, new = decode(blob, namespace=NS)
    assert new.version == 3
    for version, old in ((1, as_version_1(blob)), (2, as_version_2(blob))):
        k1, v1, header = decode(old, namespace=NS)
        assert header.version == version and (header.head, header.key_outliers, header.residual) == (0, 0, 3)
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


OLD_INT8 = Path(__file__).parent / "data" / "int8_v2_head1_residual3.kvmb"
"""make_kv()'s chunk as the format-2 writer stored it with int8 (head 1, residual 3): keys and
values quantized per token and head (written by the codec before version 3)."""


def test_int8_blobs_of_version_2_decode_per_token_and_head():
    k, v = make_kv()
    L, T, H, D = k.shape
    k2, v2, header = decode(OLD_INT8.read_bytes(), namespace=NS)
    assert (header.version, header.codec, header.group_size, header.head, header.residual) == (2, "int8", D, 1, 3)
    for x, x2 in ((k, k2), (v, v2)):
        assert torch.equal(x2[:, :1], x[:, :1].half().float()) and torch.equal(x2[:, -3:], x[:, -3:].half().float())
        mid, mid2 = x[:, 1:-3].reshape(L, T - 4, H * D), x2[:, 1:-3].reshape(L, T - 4, H * D)
        assert ((mid2 - mid).abs() <= group_bound(mid, D, 8)).all()
    # the same chunk written now: keys per channel (make_kv's channels differ 1000x in scale)
    k3, _, new = roundtrip(k, v, CodecSpec("int8", head=1, residual=3))
    assert new.version == 3 and new.group_size == 16
    perm, mid = (0, 2, 3, 1), slice(1, T - 3)
    bound = group_bound(k[:, mid].permute(perm), 16, 8)
    assert ((k3 - k)[:, mid].permute(perm).abs() <= bound).all()
    assert not ((k2 - k)[:, mid].permute(perm).abs() <= bound).all()


def test_outlier_mask_that_does_not_match_the_header_is_corrupt():
    k, v = make_kv(L=1, T=6, H=1, D=8)
    blob = encode(k, v, meta(6), CodecSpec("int2", zstd=False, group_size=4, head=0, key_outliers=2))
    start = 52 + 4 * 6 + 4  # payload: the mask byte comes first
    body = bytearray(blob[:-16])
    body[start] ^= 0xFF  # 6 channels marked instead of 2
    bad = bytes(body) + hashlib.blake2b(bytes(body), digest_size=16).digest()
    with pytest.raises(CorruptBlob, match="outlier mask"):
        decode(bad, namespace=NS)


def test_header_round_trips_token_ids_and_fields():
    k, v = make_kv(L=3, T=5, H=2, D=4)
    ids = (0, 1, 2**32 - 1, 7, 123456789)
    blob = encode(k, v, ChunkMeta(NS, ids), CodecSpec("int2", group_size=4, residual=2, zstd_level=5,
                                                       head=1, key_outliers=3))
    header = read_header(blob)
    assert header == decode(blob, namespace=NS)[2]
    assert (header.version, header.codec, header.zstd, header.src_dtype, header.shape) == (
        3, "int2", True, torch.float32, (3, 5, 2, 4))
    assert (header.group_size, header.residual, header.head, header.key_outliers) == (4, 2, 1, 3)
    assert (header.namespace, header.token_ids) == (NS, ids)
    assert header.payload_bytes == len(blob) - 52 - 4 * 5 - 4 - 16


@pytest.mark.parametrize("name", CODECS)
def test_every_single_byte_flip_is_caught(name):
    k, v = make_kv(L=1, T=6, H=1, D=4)
    blob = encode(k, v, meta(6), CodecSpec(name, group_size=4, residual=1))
    for i in range(len(blob)):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(blob)
            bad[i] ^= mask
            with pytest.raises(CorruptBlob):
                decode(bytes(bad), namespace=NS)


def test_truncation_and_trailing_bytes_are_caught():
    k, v = make_kv(L=1, T=6, H=1, D=4)
    blob = encode(k, v, meta(6), CodecSpec("int4", group_size=4))
    for n in range(len(blob)):
        with pytest.raises(CorruptBlob):
            decode(blob[:n], namespace=NS)
    for junk in (b"\0", b"x" * 17):
        with pytest.raises(CorruptBlob):
            decode(blob + junk, namespace=NS)
        with pytest.raises(CorruptBlob):
            read_header(blob + junk)
    with pytest.raises(CorruptBlob):
        read_header(blob[:-1])


def reseal(blob: bytes, offset: int, value: int) -> bytes:
    """The blob with one header byte changed and a valid checksum again (a forged/future blob)."""
    body = bytearray(blob[:-16])
    body[offset] = value
    return bytes(body) + hashlib.blake2b(bytes(body), digest_size=16).digest()


@pytest.mark.parametrize("offset,value,what", [
    (0, ord("X"), "magic"), (4, 4, "version"), (4, 1, "version"), (5, 9, "codec"), (6, 2, "flags"), (7, 5, "dtype"),
    (24, 0, "group"),  # int4 with group 0
    (28, 200, "residual"),  # residual past the chunk
    (48, 7, "head"),  # head tokens past the chunk
    (50, 5, "outliers"),  # more outlier channels than a head has
    (6, 0, "payload"),  # zstd flag cleared: payload size no longer matches
])
def test_forged_headers_with_valid_checksum_are_corrupt(offset, value, what):
    k, v = make_kv(L=1, T=6, H=1, D=4)
    blob = reseal(encode(k, v, meta(6), CodecSpec("int4", group_size=4)), offset, value)
    with pytest.raises(CorruptBlob):
        decode(blob, namespace=NS)


def test_namespace_and_shape_mismatch():
    k, v = make_kv()
    blob = encode(k, v, meta(k.shape[1]), CodecSpec("int4"))
    with pytest.raises(NamespaceMismatch, match="namespace"):
        decode(blob, namespace=b"\0" * 16)
    with pytest.raises(NamespaceMismatch, match="shape"):
        decode(blob, namespace=NS, expect_shape=(2, 40, 2, 16))
    assert decode(blob, namespace=NS, expect_shape=tuple(k.shape))[0].shape == k.shape


@pytest.mark.parametrize("kwargs,match", [
    ({"name": "int3"}, "name"), ({"zstd": 1}, "zstd"), ({"group_size": 0}, "group_size"),
    ({"group_size": 2.0}, "group_size"), ({"residual": -1}, "residual"), ({"zstd_level": 0}, "zstd_level"),
    ({"zstd_level": 23}, "zstd_level"),
])
def test_bad_spec_values_say_what_to_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CodecSpec(**kwargs)


def test_bad_inputs_raise_value_error():
    k, v = make_kv(T=4)
    with pytest.raises(ValueError, match="16 bytes"):
        ChunkMeta(b"short", (1, 2))
    with pytest.raises(ValueError, match="token_ids"):
        ChunkMeta(NS, (-1,))
    with pytest.raises(ValueError, match="ids for a chunk"):
        encode(k, v, meta(3), CodecSpec())
    with pytest.raises(ValueError, match="L, T, H, D"):
        encode(k, v[:, :2], meta(4), CodecSpec())
    with pytest.raises(ValueError, match="dtype"):
        encode(k.half(), v, meta(4), CodecSpec())


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_kivi_pack_is_lossless(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 7), dtype=torch.uint8)
    packed = kivi.pack(codes, bits)
    assert packed.numel() == -(-codes.numel() * bits // 8)
    assert torch.equal(kivi.unpack(packed, bits, codes.numel()).view(3, 5, 7), codes)


@pytest.mark.slow
def test_real_kv_compression_and_error(bundled_model):
    """int2 + zstd is >= 7x smaller than fp16 on real 256-token chunks, errors stay bounded."""
    from kvmesh.model.attention import AttentionMetadata, allocate_kv_cache
    from kvmesh.kv.rope import unrotate_keys
    from kvmesh.model.perplexity import reference_text

    lm, cfg = bundled_model, bundled_model.config
    ids = lm.tokenizer.encode(reference_text())[:512]
    T, bs = len(ids), 16
    kv = allocate_kv_cache(cfg, -(-T // bs), bs, torch.float32, "cpu")
    md = AttentionMetadata(slot_mapping=torch.arange(T), query_lens=[T], context_lens=[T],
                           block_tables=torch.arange(-(-T // bs))[None])
    with torch.inference_mode():
        lm.model.forward(torch.tensor(ids), torch.arange(T), kv, md)
    k = torch.stack([kc.view(-1, cfg.num_kv_heads, cfg.head_dim)[:T] for kc, _ in kv])  # [L, T, kvh, hd]
    v = torch.stack([vc.view(-1, cfg.num_kv_heads, cfg.head_dim)[:T] for _, vc in kv])
    k = torch.cat([unrotate_keys(k[:, s:s + 256], s, lm.model.rotary) for s in range(0, T, 256)], dim=1)  # as stored

    def run(spec):
        blob_bytes, errs = 0, []
        for s in range(0, T, 256):
            kc, vc = k[:, s:s + 256], v[:, s:s + 256]
            blob = encode(kc, vc, ChunkMeta(NS, tuple(ids[s:s + 256])), spec, sequence_start=s == 0)
            k2, v2, _ = decode(blob, namespace=NS, expect_shape=tuple(kc.shape))
            blob_bytes += len(blob)
            errs += [float((k2 - kc).norm() / kc.norm()), float((v2 - vc).norm() / vc.norm())]
        return 2 * 2 * k.numel() / blob_bytes, errs

    # measured worst k/v chunk: 0.0002, 0.0017, 0.008, 0.097, 0.48
    max_rel_err = {"fp32": 1e-12, "fp16": 1e-3, "bf16": 5e-3, "int8": 0.015, "int4": 0.15, "int2": 0.6}
    for name in CODECS:
        ratio, errs = run(CodecSpec(name))
        assert max(errs) < max_rel_err[name], (name, errs)
        if name == "int2":
            assert ratio >= 7.0
            plain_ratio, plain_errs = run(CodecSpec(name, head=0, key_outliers=0))
            # the 16 widest key channels at 4 bits: key error well down, for about 15% more bytes
            assert max(errs[0::2]) < 0.8 * min(plain_errs[0::2]) and plain_ratio > ratio
