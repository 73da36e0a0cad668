"""`python -m kvmesh.services.gateway.keys`: manage the gateway's API keys file.

    ... keys add --keys-file keys.json --tenant acme [--cache-namespace shared] [--max-inflight-requests 32]
             [--lossy '{"kv_codec": "int8", "max_kl": 0.05}']
    ... keys list --keys-file keys.json
    ... keys revoke --keys-file keys.json --key-id k-3f9a1c0e

`add` creates a random key, prints it once on stdout and stores only its SHA-256 (see
`kvmesh.services.gateway.auth` for the format and why that hash). The file is rewritten
atomically (temporary file in the same directory, fsync, rename) under an exclusive lock, with
mode 0600; a running gateway picks the change up within a second. `--keys-file` defaults to
$KVMESH_GATEWAY_KEYS_FILE.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import secrets
import sys
import tempfile
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kvmesh.kv.quality import LossyOptIn
from kvmesh.services.gateway.auth import (
    KEY_PREFIX,
    KEYS_FILE_VERSION,
    KeysFileError,
    check_name,
    hash_key,
    parse_keys_file,
    read_keys_file,
)


def new_key() -> str:
    """A fresh API key: the prefix plus 32 random bytes, URL-safe base64."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `<path>.lock`, so two CLI runs never lose each other's edits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {"version": KEYS_FILE_VERSION, "tenants": []}
    data = read_keys_file(path)
    parse_keys_file(data, str(path))  # refuse to extend a malformed file
    return data


def write_atomic(path: Path, data: dict[str, Any]) -> None:
    """Replace `path` with `data` as JSON in one rename (readers see the old or the new file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def add_key(path: Path, tenant: str, *, cache_namespace: str | None = None,
            max_inflight_requests: int | None = None, lossy: LossyOptIn | None = None) -> tuple[str, str]:
    """Create a key for `tenant` (creating the tenant and the file as needed); returns (id, key).

    `cache_namespace` / `max_inflight_requests` / `lossy` (its opt-in to lossy reuse paths), when
    given, are set on the tenant.
    """
    check_name(tenant, "tenant")
    if cache_namespace is not None:
        check_name(cache_namespace, "cache namespace")
    if max_inflight_requests is not None and max_inflight_requests < 1:
        raise KeysFileError("--max-inflight-requests must be >= 1")
    key = new_key()
    key_id = "k-" + secrets.token_hex(4)
    with _locked(path):
        data = _load(path)
        entry = next((t for t in data["tenants"] if t["name"] == tenant), None)
        if entry is None:
            entry = {"name": tenant, "cache_namespace": None, "max_inflight_requests": None,
                     "keys": []}
            data["tenants"].append(entry)
        if cache_namespace is not None:
            entry["cache_namespace"] = cache_namespace
        if max_inflight_requests is not None:
            entry["max_inflight_requests"] = max_inflight_requests
        if lossy is not None:
            entry["lossy"] = lossy.to_json()
        created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        entry.setdefault("keys", []).append({"id": key_id, "sha256": hash_key(key), "created": created})
        write_atomic(path, data)
    return key_id, key


def revoke_key(path: Path, key_id: str) -> bool:
    """Remove the key with id `key_id`; False when no key has that id."""
    with _locked(path):
        data = _load(path)
        found = False
        for tenant in data["tenants"]:
            kept = [k for k in tenant.get("keys") or [] if k.get("id") != key_id]
            found |= len(kept) != len(tenant.get("keys") or [])
            tenant["keys"] = kept
        if found:
            write_atomic(path, data)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmesh.services.gateway.keys",
                                     description="Manage the gateway's API keys file.")
    sub = parser.add_subparsers(dest="command", required=True)
    default_file = os.environ.get("KVMESH_GATEWAY_KEYS_FILE")
    for name, text in (("add", "create a key for a tenant and print it once"),
                       ("list", "list tenants and key ids (never keys)"),
                       ("revoke", "delete a key by id")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--keys-file", type=Path, default=default_file, required=default_file is None,
                       help="the keys file [env KVMESH_GATEWAY_KEYS_FILE]")
        if name == "add":
            p.add_argument("--tenant", required=True, help="tenant name (A-Z a-z 0-9 . _ -)")
            p.add_argument("--cache-namespace", help="share cached KV with tenants naming the same namespace")
            p.add_argument("--max-inflight-requests", type=int, help="this tenant's in-flight request cap")
            p.add_argument("--lossy", help="JSON opt-in of the tenant's requests to lossy reuse paths, with the "
                                           "quality budget accepted: any of kv_codec (fp16, bf16, int8, int4, int2), "
                                           "recompute_ratio (blending, [0, 1)), max_kl, min_top1")
        if name == "revoke":
            p.add_argument("--key-id", required=True, help="id shown by `add` and `list`")
    args = parser.parse_args(argv)
    path = Path(args.keys_file)
    try:
        if args.command == "add":
            lossy = None
            if args.lossy is not None:
                try:
                    lossy = LossyOptIn.from_json(json.loads(args.lossy))
                except (ValueError, json.JSONDecodeError) as e:
                    raise KeysFileError(f"--lossy: {e}") from None
            key_id, key = add_key(path, args.tenant, cache_namespace=args.cache_namespace,
                                  max_inflight_requests=args.max_inflight_requests, lossy=lossy)
            print(key)
            print(f"added key {key_id} for tenant {args.tenant} to {path}; the key is shown only "
                  "this once", file=sys.stderr)
        elif args.command == "list":
            for tenant in _load(path)["tenants"]:
                ids = ", ".join(k["id"] for k in tenant.get("keys") or []) or "no keys"
                print(f"{tenant['name']}: {ids}")
        elif not revoke_key(path, args.key_id):
            print(f"no key {args.key_id} in {path}", file=sys.stderr)
            return 1
    except KeysFileError as e:
        print(f"keys: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
