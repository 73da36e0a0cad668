#!/usr/bin/env bash
# Build a Python base image from Debian packages, for machines that cannot pull from a public
# container registry but can reach a Debian archive (see README "The compose stack"):
#
#   sudo bash scripts/build-base-image.sh [TAG]      # default tag: kvmesh-base:bookworm
#   bash scripts/build-image.sh --base kvmesh-base:bookworm
#
# It runs `debootstrap --variant=minbase bookworm` into a temporary folder, adds Python 3.11
# (Debian's python3, python3-venv) and CA certificates, and `docker import`s the tree. The result
# plays the role of python:3.11-slim for compose/Dockerfile: `python3` on PATH, apt working.
# Needs root (debootstrap) and a running Docker engine. DEBIAN_MIRROR picks the archive (the
# default is debootstrap's own); the machine's proxy settings apply as usual.
set -euo pipefail

tag=${1:-kvmesh-base:bookworm}
suite=bookworm
packages=python3,python3-venv,ca-certificates,tzdata

if [ "$(id -u)" != 0 ]; then
  echo "build-base-image: debootstrap needs root; run it with sudo" >&2
  exit 1
fi
if ! command -v debootstrap >/dev/null 2>&1; then
  echo "build-base-image: debootstrap is missing: apt-get install -y debootstrap" >&2
  exit 1
fi
if ! docker info >/dev/null 2>&1; then
  echo "build-base-image: no Docker engine answers (start dockerd first)" >&2
  exit 1
fi

root=$(mktemp -d /var/tmp/kvmesh-base.XXXXXX)
chmod 755 "$root"  # it becomes the image's /: mktemp made it private (0700)
trap 'rm -rf --one-file-system "$root"' EXIT

echo "[base] debootstrap $suite (minbase + $packages) into $root" >&2
debootstrap --variant=minbase --include="$packages" "$suite" "$root" ${DEBIAN_MIRROR:+"$DEBIAN_MIRROR"} >&2

# What an image should not carry: the package cache and lists (apt-get update refreshes them),
# machine identity, logs of the bootstrap.
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/log/* "$root"/var/cache/debconf/*-old \
       "$root"/etc/machine-id "$root"/debootstrap
: > "$root/etc/machine-id"

echo "[base] docker import -> $tag" >&2
tar -C "$root" --numeric-owner -c . | docker import \
  -c 'ENV LANG=C.UTF-8 PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  -c 'CMD ["bash"]' \
  -m "debootstrap --variant=minbase $suite + $packages" - "$tag" >/dev/null
docker run --rm "$tag" python3 -c 'import sys, venv, ssl; print("[base] ok: python", sys.version.split()[0])' >&2
echo "$tag"
