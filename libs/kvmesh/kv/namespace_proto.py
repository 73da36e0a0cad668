"""kvmesh.common.v1.KvNamespace <-> kvmesh.kv.namespace.KvNamespace: the one conversion, used by
every service and tool that puts a namespace on the wire or reads one from it. Torch-free."""
from __future__ import annotations

from kvmesh.common.v1 import common_pb2
from kvmesh.kv.namespace import KvLayout, KvNamespace

DTYPES = {"float32": common_pb2.DTYPE_FLOAT32, "bfloat16": common_pb2.DTYPE_BFLOAT16,
          "float16": common_pb2.DTYPE_FLOAT16}
"""Dtype names (torch's, without the "torch." prefix) and their kvmesh.common.v1.Dtype values."""
_DTYPE_NAMES = {value: name for name, value in DTYPES.items()}


def dtype_to_proto(name: str) -> int:
    """The kvmesh.common.v1.Dtype of a dtype name; ValueError for one the enum lacks."""
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} has no kvmesh.common.v1.Dtype value; use one of {', '.join(DTYPES)}")
    return DTYPES[name]


def namespace_to_proto(ns: KvNamespace) -> common_pb2.KvNamespace:
    """The wire form of `ns`; ValueError when its layout's dtype has no Dtype value."""
    layout = ns.layout
    return common_pb2.KvNamespace(
        model_identity=ns.model_identity, storage=ns.storage, tenant_salt=ns.tenant_salt,
        layout=common_pb2.KvLayout(num_layers=layout.num_layers, num_kv_heads=layout.num_kv_heads,
                                   head_dim=layout.head_dim, dtype=dtype_to_proto(layout.dtype),
                                   rope=layout.rope))


def namespace_from_proto(msg: common_pb2.KvNamespace) -> KvNamespace:
    """The domain namespace; ValueError saying which field to fix when `msg` is incomplete (unset
    message, model identity, layout, dtype, RoPE or storage)."""
    if not msg.model_identity:
        raise ValueError("namespace.model_identity is empty; send the engine's (GetModelInfo.kv_namespace)")
    if not msg.HasField("layout"):
        raise ValueError("namespace.layout is unset; send the engine's (GetModelInfo.kv_namespace)")
    layout = msg.layout
    if layout.dtype not in _DTYPE_NAMES:
        known = ", ".join(common_pb2.Dtype.Name(v) for v in _DTYPE_NAMES)
        raise ValueError(f"namespace.layout.dtype {layout.dtype} is not a KV dtype; use one of {known}")
    if not layout.rope:
        raise ValueError("namespace.layout.rope is empty; send the engine's (GetModelInfo.kv_namespace)")
    if not (layout.num_layers and layout.num_kv_heads and layout.head_dim):
        raise ValueError("namespace.layout needs num_layers, num_kv_heads and head_dim >= 1; send the engine's "
                         "(GetModelInfo.kv_namespace)")
    return KvNamespace(msg.model_identity,
                       KvLayout(layout.num_layers, layout.num_kv_heads, layout.head_dim,
                                _DTYPE_NAMES[layout.dtype], layout.rope),
                       msg.storage, msg.tenant_salt)
