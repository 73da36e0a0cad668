"""KvNamespace: one identity for every place that keys KV."""
import dataclasses
import sys

import pytest

from kvmesh.kv.namespace import EXACT, NAMESPACE_BYTES, KvLayout, KvNamespace, tenant_salt

LAYOUT = KvLayout(30, 3, 64, "float32")


def test_every_field_changes_the_digest_and_equal_values_share_it():
    base = KvNamespace("weights", LAYOUT, tenant_salt="tenant:a")
    assert len(base.digest()) == NAMESPACE_BYTES and base.is_exact and base.storage == EXACT
    variants = [dataclasses.replace(base, model_identity="other"),
                dataclasses.replace(base, layout=dataclasses.replace(LAYOUT, head_dim=32)),
                base.with_storage("int8"), base.for_tenant("tenant:b")]
    digests = {v.digest() for v in variants} | {base.digest()}
    assert len(digests) == 5
    assert KvNamespace("weights", KvLayout(30, 3, 64, "float32"), EXACT, "tenant:a").digest() == base.digest()
    assert not base.with_storage("int8").is_exact


def test_fields_cannot_run_into_each_other():
    """Length-prefixed fields: moving characters from one field to the next is another namespace."""
    a = KvNamespace("ab", LAYOUT, tenant_salt="c")
    b = KvNamespace("a", LAYOUT, tenant_salt="bc")
    assert a.digest() != b.digest()


def test_empty_identity_or_storage_is_refused():
    with pytest.raises(ValueError, match="model_identity"):
        KvNamespace("", LAYOUT)
    with pytest.raises(ValueError, match="storage"):
        KvNamespace("m", LAYOUT, storage="")


def test_tenant_salt_is_the_shared_namespace_else_the_tenant():
    assert tenant_salt("acme") == "tenant:acme"
    assert tenant_salt("acme", "shared") == "ns:shared"
    assert tenant_salt("other", "shared") == tenant_salt("acme", "shared")


def test_the_module_does_not_import_torch():
    import subprocess
    code = "import sys, kvmesh.kv.namespace; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
