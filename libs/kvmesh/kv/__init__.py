"""KV chunks: their keys, the self-describing chunk blob codec and its KIVI quantizers.

Public API (what the KV service and the engine use):
    CODECS, CodecSpec, ChunkMeta, BlobHeader, encode, decode, read_header,
    CorruptBlob, NamespaceMismatch                      -- kvmesh.kv.codec
    chunk keys and namespaces                           -- kvmesh.kv.keys
    quantize, dequantize, pack, unpack, channel_order   -- kvmesh.kv.kivi (tensor ops only)
"""
