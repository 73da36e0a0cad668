"""kvmesh.common.v1.KvNamespace <-> KvNamespace: a lossless round trip (same digest), and a
refusal that names the field to fix for every incomplete message."""
from __future__ import annotations

import pytest

from kvmesh.common.v1 import common_pb2
from kvmesh.kv.namespace import KvLayout, KvNamespace
from kvmesh.kv.namespace_proto import namespace_from_proto, namespace_to_proto

NAMESPACE = KvNamespace("weights-sha", KvLayout(30, 3, 64, "bfloat16", rope="pre-rope-hf theta=10000"),
                        storage="int4-g64-r0-h0-o0", tenant_salt="tenant:acme")


def test_round_trip_keeps_every_field_and_the_digest():
    msg = namespace_to_proto(NAMESPACE)
    assert msg.layout.dtype == common_pb2.DTYPE_BFLOAT16
    back = namespace_from_proto(common_pb2.KvNamespace.FromString(msg.SerializeToString()))
    assert back == NAMESPACE and back.digest() == NAMESPACE.digest()


def _without(field: str) -> common_pb2.KvNamespace:
    msg = namespace_to_proto(NAMESPACE)
    owner, _, name = field.rpartition(".")
    (getattr(msg, owner) if owner else msg).ClearField(name)
    return msg


@pytest.mark.parametrize("field, fix", [
    ("model_identity", "model_identity is empty"),
    ("layout", "layout is unset"),
    ("layout.dtype", "layout.dtype 0 is not a KV dtype"),
    ("layout.rope", "layout.rope is empty"),
    ("layout.head_dim", "head_dim >= 1"),
    ("storage", "storage is empty"),
])
def test_an_incomplete_message_says_what_to_fix(field, fix):
    with pytest.raises(ValueError, match=fix):
        namespace_from_proto(_without(field))


def test_an_empty_tenant_salt_is_the_models_namespace():
    model_only = namespace_from_proto(_without("tenant_salt"))
    assert model_only.tenant_salt == "" and model_only.for_tenant("tenant:acme") == NAMESPACE


def test_a_dtype_without_an_enum_value_is_refused():
    with pytest.raises(ValueError, match="float64"):
        namespace_to_proto(KvNamespace("m", KvLayout(1, 1, 8, "float64")))
