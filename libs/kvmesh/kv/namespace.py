"""The one identity of KV: which model computed it, how it is laid out, whether it is exact, and
for which tenant. Torch-free (the gateway and the KV service import it).

Every place that keys KV -- the engine's paged prefix cache, the KV connector's chunk keys, the
document catalog, the KV service, the command-line tools -- builds its 16-byte digest from one
`KvNamespace` value through `KvNamespace.digest`, and nowhere else. Two KV entries can only match
when every field is equal:

* ``model_identity``: a digest of the weights, their format and dtype, and the architecture
  (family, shape, RoPE type and scaling, biases, sliding window; and the layer cut of a truncated
  model): a changed model never reads stale KV (kvmesh.model.loader.LoadedModel.identity);
* ``layout``: layers, KV heads, head dim, KV dtype and the RoPE convention and parameters of
  stored keys, scaling included (kvmesh.kv.rope.stored_keys_rope), so KV of another shape or
  rotation never matches;
* ``storage``: ``"exact"`` for KV bit-identical to what the engine computes, otherwise the name of
  the lossy format that made it (a quantizing codec with its parameters, a blend): exact and lossy
  KV never mix, and two lossy formats never pass for each other;
* ``tenant_salt``: tenants share KV only when configured to (see `tenant_salt`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass

NAMESPACE_BYTES = 16
EXACT = "exact"
"""`KvNamespace.storage` of KV equal to what the engine itself computes."""


def tenant_salt(tenant: str, shared_namespace: str | None = None) -> str:
    """The salt of a tenant's KV: its configured shared namespace (tenants naming the same one
    share KV), else its own name. The gateway stamps it on every request; the CLI takes it."""
    return f"ns:{shared_namespace}" if shared_namespace else f"tenant:{tenant}"


@dataclass(frozen=True)
class KvLayout:
    """What one token's KV looks like for a model."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    """The engine's KV dtype, e.g. "float32", "bfloat16"."""
    rope: str = "pre-rope-hf"
    """How stored keys relate to RoPE, with the rotation's parameters (kvmesh.kv.rope)."""

    def describe(self) -> str:
        return f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-{self.dtype}-{self.rope}"


@dataclass(frozen=True)
class KvNamespace:
    """Model identity + KV layout + storage format + tenant salt (see the module docstring).
    Built once per engine (`for_tenant` and `with_storage` derive the per-request ones)."""

    model_identity: str
    layout: KvLayout
    storage: str = EXACT
    tenant_salt: str = ""

    def __post_init__(self) -> None:
        if not self.model_identity:
            raise ValueError("KvNamespace.model_identity is empty; use the engine's weights identity")
        if not self.storage:
            raise ValueError(f"KvNamespace.storage is empty; use {EXACT!r} or a lossy format's name")

    @property
    def is_exact(self) -> bool:
        return self.storage == EXACT

    def for_tenant(self, salt: str) -> KvNamespace:
        return dataclasses.replace(self, tenant_salt=salt)

    def with_storage(self, storage: str) -> KvNamespace:
        return dataclasses.replace(self, storage=storage)

    def digest(self) -> bytes:
        """16 bytes: blake2b over the length-prefixed fields (no ambiguity between fields); the
        same on every process and machine."""
        return _digest(self.model_identity, self.layout.describe(), self.storage, self.tenant_salt)


@functools.lru_cache(maxsize=4096)
def _digest(*parts: str) -> bytes:
    h = hashlib.blake2b(digest_size=NAMESPACE_BYTES, person=b"kvmesh-ns2")
    for part in parts:
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.digest()
