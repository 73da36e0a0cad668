"""API keys → tenants: the keys file, key hashing, and constant-time lookup.

The keys file (JSON, written by `python -m kvmesh.services.gateway.keys`):

    {"version": 1,
     "tenants": [
       {"name": "acme",                      # [A-Za-z0-9._-], 1..64 characters
        "cache_namespace": null,             # optional: tenants naming the same namespace share KV
        "max_inflight_requests": 32,         # optional: this tenant's in-flight cap (else the default)
        "lossy": {"kv_codec": "int8", "recompute_ratio": 0.15, "max_kl": 0.05, "min_top1": 0.95},
                                             # optional: lossy reuse paths this tenant's requests opt
                                             # into by default, and the quality budget they accept
        "keys": [{"id": "k-3f9a1c0e", "sha256": "<64 hex>", "created": "2025-01-01T00:00:00Z"}]}]}

NOTE (hashing). Only a hash of each key is stored: SHA-256 of the UTF-8 key, unsalted. Keys are
generated, never chosen: `sk-kvmesh-` + 32 random bytes (256 bits), so a slow or salted hash buys
nothing (salts and work factors protect low-entropy secrets such as passwords from guessing; a
256-bit key cannot be guessed) and would cost a slow hash per stored key per request, since a
constant-time lookup compares the presented key with every entry. A leaked file therefore reveals
no usable key. Lookup hashes the presented key once and compares it with *every* stored digest
through `hmac.compare_digest`, never stopping early, so timing does not reveal which entry or
how many bytes matched.

Each tenant's requests carry a cache salt — its name, or the `cache_namespace` the operator
configured, as kvmesh.kv.namespace.tenant_salt writes it (the one format, shared with the CLI) —
that the engines and the KV-cache service fold into every KV namespace, so tenants never share
cached KV unless the operator says so.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.errors import Unauthenticated
from kvmesh.kv.namespace import tenant_salt
from kvmesh.kv.quality import LossyOptIn

log = logging.getLogger(__name__)

KEYS_FILE_VERSION = 1
KEY_PREFIX = "sk-kvmesh-"
DEFAULT_TENANT = "default"
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_RELOAD_CHECK_S = 1.0


class KeysFileError(ValueError):
    """The keys file is unreadable or malformed; the message says where and how to fix it."""


@dataclass(frozen=True)
class Tenant:
    """Who a request belongs to: metrics/trace label, KV isolation salt, in-flight cap."""

    name: str
    cache_salt: str
    max_inflight_requests: int | None = None
    lossy: LossyOptIn | None = None
    """Lossy reuse paths the tenant opted into (kvmesh.kv.quality.LossyOptIn); None = exact only,
    unless a request opts in itself."""


def hash_key(key: str) -> str:
    """Hex SHA-256 of an API key (see the module NOTE on why this suffices)."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def open_tenant() -> Tenant:
    """The single tenant of a gateway without a keys file."""
    return Tenant(DEFAULT_TENANT, tenant_salt(DEFAULT_TENANT))


def check_name(value: str, what: str) -> str:
    """`value` if it is a valid tenant or namespace name, else a KeysFileError."""
    if not isinstance(value, str) or not _NAME.match(value):
        raise KeysFileError(f"{what} {value!r} must be 1..64 characters of A-Z a-z 0-9 . _ -")
    return value


def parse_keys_file(data: Any, where: str) -> list[tuple[str, Tenant]]:
    """(sha256 hex, tenant) for every key in a decoded keys file; KeysFileError when malformed."""
    if not isinstance(data, dict) or data.get("version") != KEYS_FILE_VERSION:
        raise KeysFileError(f"{where}: expected an object with \"version\": {KEYS_FILE_VERSION}; "
                            "recreate it with `python -m kvmesh.services.gateway.keys add`")
    tenants = data.get("tenants")
    if not isinstance(tenants, list):
        raise KeysFileError(f"{where}: \"tenants\" must be a list")
    entries: list[tuple[str, Tenant]] = []
    seen_names: set[str] = set()
    for i, t in enumerate(tenants):
        at = f"{where}: tenants[{i}]"
        if not isinstance(t, dict):
            raise KeysFileError(f"{at} must be an object")
        name = check_name(t.get("name"), f"{at}.name")
        if name in seen_names:
            raise KeysFileError(f"{at}: tenant {name!r} appears twice; merge its keys into one entry")
        seen_names.add(name)
        namespace = t.get("cache_namespace")
        if namespace is not None:
            check_name(namespace, f"{at}.cache_namespace")
        limit = t.get("max_inflight_requests")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise KeysFileError(f"{at}.max_inflight_requests must be a whole number >= 1 or null")
        lossy = None
        if t.get("lossy") is not None:
            try:
                lossy = LossyOptIn.from_json(t["lossy"])
            except ValueError as e:
                raise KeysFileError(f"{at}.lossy: {e}") from None
        tenant = Tenant(name, tenant_salt(name, namespace), limit, lossy)
        for j, k in enumerate(t.get("keys") or []):
            digest = k.get("sha256") if isinstance(k, dict) else None
            if not isinstance(digest, str) or not _HEX64.match(digest):
                raise KeysFileError(f"{at}.keys[{j}].sha256 must be 64 lowercase hex digits")
            entries.append((digest, tenant))
    return entries


def read_keys_file(path: Path) -> dict[str, Any]:
    """The decoded keys file; KeysFileError when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise KeysFileError(f"cannot read keys file {path}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise KeysFileError(f"keys file {path} is not valid JSON ({e})") from e


class KeyStore:
    """Maps presented API keys to tenants.

    Without a keys file every request (key or not) is tenant "default". With one, a request needs
    a listed key. The file is re-read when its modification time changes (checked at most once a
    second), so keys added or revoked with the CLI take effect without a restart; a file that
    became malformed is logged and the previous keys stay in force.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._entries: list[tuple[bytes, Tenant]] = []
        self._mtime_ns: int | None = None
        self._checked = 0.0
        if path is not None:
            self._load()

    @property
    def open(self) -> bool:
        """True when no keys file is configured (every request is tenant "default")."""
        return self.path is None

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        """Every configured tenant, each once."""
        return tuple(dict.fromkeys(t for _, t in self._entries))

    def _load(self) -> None:
        assert self.path is not None  # only called with a file configured
        stat = self.path.stat()
        entries = parse_keys_file(read_keys_file(self.path), str(self.path))
        self._entries = [(bytes.fromhex(d), t) for d, t in entries]
        self._mtime_ns = stat.st_mtime_ns
        log.info("keys file %s: %d keys for %d tenants", self.path, len(self._entries),
                 len(self.tenants))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if now - self._checked >= _RELOAD_CHECK_S:
            self._checked = now
            self.reload_if_changed()

    def reload_if_changed(self) -> None:
        """Re-read the keys file now if its modification time changed (errors are logged)."""
        if self.path is None:
            return
        try:
            if os.stat(self.path).st_mtime_ns != self._mtime_ns:
                self._load()
        except (OSError, KeysFileError) as e:
            log.error("keys file %s not reloaded, keeping the previous keys: %s", self.path, e)

    def authenticate(self, key: str | None) -> Tenant:
        """The tenant owning `key`; raises Unauthenticated when a key is needed and not valid."""
        if self.path is None:
            return open_tenant()
        self._maybe_reload()
        if not key:
            raise Unauthenticated(
                "no API key given; send it as the header `Authorization: Bearer <key>` "
                "(gRPC: `authorization` metadata)")
        presented = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        found: Tenant | None = None
        for digest, tenant in self._entries:  # every entry, no early exit
            if hmac.compare_digest(presented, digest):
                found = tenant
        if found is None:
            raise Unauthenticated("incorrect API key provided; check the key, or ask the operator "
                                  "for one (`python -m kvmesh.services.gateway.keys add`)")
        return found


def bearer_token(header: str | None) -> str | None:
    """The key in an `Authorization: Bearer <key>` header value (None when absent or another scheme)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None
