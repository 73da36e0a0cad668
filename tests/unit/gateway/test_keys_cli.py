"""`python -m kvmesh.services.gateway.keys`: add prints a key once, list and revoke by id."""
from __future__ import annotations

import json

from kvmesh.services.gateway.auth import KeyStore, hash_key
from kvmesh.services.gateway.keys import main


def test_add_list_revoke(tmp_path, capsys, monkeypatch):
    path = tmp_path / "sub" / "keys.json"
    assert main(["add", "--keys-file", str(path), "--tenant", "acme",
                 "--max-inflight-requests", "4"]) == 0
    out = capsys.readouterr()
    key = out.out.strip()
    assert key.startswith("sk-kvmesh-") and "shown only this once" in out.err
    data = json.loads(path.read_text())
    tenant = data["tenants"][0]
    assert tenant["name"] == "acme" and tenant["max_inflight_requests"] == 4
    assert tenant["keys"][0]["sha256"] == hash_key(key) and key not in path.read_text()
    assert KeyStore(path).authenticate(key).name == "acme"

    monkeypatch.setenv("KVMESH_GATEWAY_KEYS_FILE", str(path))  # the default file
    assert main(["add", "--tenant", "acme"]) == 0
    capsys.readouterr()
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    key_id = tenant["keys"][0]["id"]
    assert listing.startswith("acme: ") and key_id in listing and key not in listing

    assert main(["revoke", "--key-id", key_id]) == 0
    assert main(["revoke", "--key-id", key_id]) == 1
    assert len(json.loads(path.read_text())["tenants"][0]["keys"]) == 1


def test_bad_tenant_name_is_refused(tmp_path, capsys):
    assert main(["add", "--keys-file", str(tmp_path / "k.json"), "--tenant", "no spaces"]) == 2
    assert "tenant" in capsys.readouterr().err
    assert not (tmp_path / "k.json").exists()
