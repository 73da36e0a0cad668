"""API keys: hashing, constant-time lookup over every entry, tenants and salts, reloads."""
from __future__ import annotations

import hashlib
import hmac
import json
import os

import pytest

from kvmesh.errors import Unauthenticated
from kvmesh.kv.namespace import tenant_salt
from kvmesh.services.gateway import auth
from kvmesh.services.gateway.auth import (
    KeysFileError,
    KeyStore,
    bearer_token,
    hash_key,
    parse_keys_file,
)
from kvmesh.services.gateway.keys import add_key


def test_hash_is_sha256_hex():
    assert hash_key("sk-kvmesh-abc") == hashlib.sha256(b"sk-kvmesh-abc").hexdigest()


def test_open_store_is_tenant_default():
    store = KeyStore(None)
    assert store.open
    for key in (None, "", "anything"):
        tenant = store.authenticate(key)
        assert (tenant.name, tenant.cache_salt) == ("default", "tenant:default")


@pytest.fixture
def keyfile(tmp_path):
    path = tmp_path / "keys.json"
    keys = {name: add_key(path, name, **opts)[1] for name, opts in
            [("acme", {}), ("beta", {"max_inflight_requests": 3}),
             ("c1", {"cache_namespace": "shared"}), ("c2", {"cache_namespace": "shared"})]}
    return path, keys


def test_keys_map_to_tenants_with_salts_and_limits(keyfile):
    path, keys = keyfile
    store = KeyStore(path)
    acme, beta = store.authenticate(keys["acme"]), store.authenticate(keys["beta"])
    assert (acme.name, acme.cache_salt, acme.max_inflight_requests) == ("acme", "tenant:acme", None)
    assert (beta.name, beta.max_inflight_requests) == ("beta", 3)
    assert store.authenticate(keys["c1"]).cache_salt == store.authenticate(keys["c2"]).cache_salt \
        == tenant_salt("c1", "shared") == "ns:shared"
    assert len(store.tenants) == 4


@pytest.mark.parametrize("key", [None, "", "sk-kvmesh-guess"])
def test_missing_or_unknown_key_is_unauthenticated(keyfile, key):
    with pytest.raises(Unauthenticated):
        KeyStore(keyfile[0]).authenticate(key)


def test_lookup_compares_every_entry_in_constant_time(keyfile, monkeypatch):
    path, keys = keyfile
    store = KeyStore(path)
    calls = []
    real = hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    store.authenticate(keys["acme"])  # the first entry: no early exit
    assert len(calls) == 4 and all(c == (32, 32) for c in calls)
    calls.clear()
    with pytest.raises(Unauthenticated):
        store.authenticate("x")
    assert len(calls) == 4


def test_file_holds_only_hashes_and_is_private(keyfile):
    path, keys = keyfile
    text = path.read_text()
    assert all(k not in text for k in keys.values())
    assert all(hash_key(k) in text for k in keys.values())
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert all(k.startswith("sk-kvmesh-") and len(k) > 40 for k in keys.values())


def test_reload_picks_up_new_keys_and_survives_a_broken_file(keyfile):
    path, keys = keyfile
    store = KeyStore(path)
    _, new = add_key(path, "late")
    store.reload_if_changed()
    assert store.authenticate(new).name == "late"
    path.write_text("{not json")
    store.reload_if_changed()  # logged, previous keys kept
    assert store.authenticate(keys["acme"]).name == "acme"


@pytest.mark.parametrize("data, fragment", [
    ({"version": 2, "tenants": []}, "version"),
    ({"version": 1, "tenants": {}}, "list"),
    ({"version": 1, "tenants": [{"name": "bad name", "keys": []}]}, "name"),
    ({"version": 1, "tenants": [{"name": "a"}, {"name": "a"}]}, "twice"),
    ({"version": 1, "tenants": [{"name": "a", "keys": [{"sha256": "xyz"}]}]}, "sha256"),
    ({"version": 1, "tenants": [{"name": "a", "max_inflight_requests": 0}]}, "max_inflight"),
])
def test_malformed_files_say_what_is_wrong(data, fragment):
    with pytest.raises(KeysFileError, match=fragment):
        parse_keys_file(data, "keys.json")


def test_unreadable_file_fails_at_start(tmp_path):
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"version": 1, "tenants": "no"}))
    with pytest.raises(KeysFileError):
        KeyStore(path)


@pytest.mark.parametrize("header, key", [
    ("Bearer sk-1", "sk-1"), ("bearer   sk-1 ", "sk-1"), ("Basic abc", None), ("Bearer", None),
    (None, None), ("", None),
])
def test_bearer_token(header, key):
    assert bearer_token(header) == key
