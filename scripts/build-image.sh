#!/usr/bin/env bash
# Build the images of the compose stack (README "The compose stack"):
#
#   bash scripts/build-image.sh [--base IMAGE] [--ca-bundle FILE|none] [--gpu] [--tag TAG]
#
#   kvmesh image      compose/Dockerfile             tag $KVMESH_IMAGE (default kvmesh:local)
#   prometheus image  compose/prometheus.Dockerfile  tag $KVMESH_PROMETHEUS_IMAGE (default
#                                                    kvmesh-prometheus:local)
#
# --base      the base image (python:3.11-slim or the same shape). Default: python:3.11-slim when
#             it is present or can be pulled, else kvmesh-base:bookworm, built from Debian
#             packages by scripts/build-base-image.sh when missing (that needs root).
# --ca-bundle extra CA certificates for the build's downloads (build stage only). Default: the
#             `cert` of this machine's pip configuration, if any; `none` for no extra bundle.
# --gpu       torch's CUDA build (the package index's default) instead of the CPU wheel.
#
# The machine's pip settings travel in as build arguments, never written into a file: its
# index-url and extra-index-url (http(s) ones; local file:// indexes cannot be seen from the
# build), and for the CPU build the torch wheel, fetched here with this machine's pip (so its
# find-links and local indexes count) unless TORCH_INDEX_URL names a CPU wheel index.
# The build context is what git tracks or would track (git ls-files), plus those inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

base=${KVMESH_BASE_IMAGE:-}
ca_bundle=default
variant=cpu
tag=${KVMESH_IMAGE:-kvmesh:local}
prom_tag=${KVMESH_PROMETHEUS_IMAGE:-kvmesh-prometheus:local}
while [ $# -gt 0 ]; do
  case "$1" in
    --base) base=$2; shift 2;;
    --ca-bundle) ca_bundle=$2; shift 2;;
    --gpu) variant=cuda; shift;;
    --tag) tag=$2; shift 2;;
    -h|--help) sed -n '2,22p' "$0"; exit 0;;
    *) echo "build-image: unknown argument $1 (see --help)" >&2; exit 2;;
  esac
done

say() { echo "[build-image] $*" >&2; }
die() { echo "build-image: $*" >&2; exit 1; }

docker info >/dev/null 2>&1 || die "no Docker engine answers (start dockerd, or set DOCKER_HOST)"
# Without the buildx plugin the docker CLI cannot use BuildKit: take the classic builder, which
# this Dockerfile is written for (no BuildKit-only syntax).
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0

if [ -z "$base" ]; then
  if docker image inspect python:3.11-slim >/dev/null 2>&1 \
     || timeout 60 docker pull -q python:3.11-slim >/dev/null 2>&1; then
    base=python:3.11-slim
  else
    base=kvmesh-base:bookworm
    say "python:3.11-slim cannot be pulled; using $base (Debian packages)"
  fi
fi
if ! docker image inspect "$base" >/dev/null 2>&1; then
  [ "$base" = kvmesh-base:bookworm ] || die "base image $base is neither present nor pullable"
  say "building $base from Debian packages (scripts/build-base-image.sh)"
  bash scripts/build-base-image.sh "$base" >/dev/null
fi

pip_get() { python3 -m pip config get "$1" 2>/dev/null || true; }
http_only() { tr ' ' '\n' | grep -E '^https?://' | paste -sd' ' - || true; }

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
inputs=compose/build-inputs
mkdir -p "$stage/$inputs/wheels"

if [ "$ca_bundle" = default ]; then
  ca_bundle=${PIP_CERT:-$(pip_get global.cert)}
  ca_bundle=${ca_bundle:-none}
fi
if [ "$ca_bundle" != none ]; then
  [ -r "$ca_bundle" ] || die "--ca-bundle $ca_bundle: not a readable file"
  cp "$ca_bundle" "$stage/$inputs/extra-ca.pem"
  say "extra CA bundle for the build stage: $ca_bundle"
fi

torch_version=$(sed -n 's/^torch==//p' compose/requirements.lock)
[ -n "$torch_version" ] || die "compose/requirements.lock pins no torch (run scripts/lock-image-deps.py)"
if [ "$variant" = cpu ] && [ -z "${TORCH_INDEX_URL:-}" ]; then
  cache=${XDG_CACHE_HOME:-$HOME/.cache}/kvmesh/image-wheels
  mkdir -p "$cache"
  say "fetching torch==$torch_version+cpu with this machine's pip configuration"
  python3 -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
      --python-version 3.11 --implementation cp -d "$cache" "torch==$torch_version+cpu" >&2 \
    || die "no CPU torch wheel $torch_version+cpu reachable with this machine's pip configuration;" \
           "set TORCH_INDEX_URL to a CPU wheel index, or build with --gpu"
  ln "$cache"/torch-"$torch_version"+cpu-*.whl "$stage/$inputs/wheels/" 2>/dev/null \
    || cp "$cache"/torch-"$torch_version"+cpu-*.whl "$stage/$inputs/wheels/"
fi

index_url=${PIP_INDEX_URL:-$(pip_get global.index-url | http_only)}
extra_index_url=${PIP_EXTRA_INDEX_URL:-$(pip_get global.extra-index-url | http_only)}

build_args=(--build-arg "BASE_IMAGE=$base" --build-arg "TORCH_VARIANT=$variant"
            --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-}"
            --build-arg "PIP_INDEX_URL=$index_url" --build-arg "PIP_EXTRA_INDEX_URL=$extra_index_url")

say "building $tag (base $base, torch $variant)"
previous=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
start=$(date +%s)
{ git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
    [ -e "$f" ] && printf '%s\0' "$f"; done; } > "$stage/files"
tar -c -f - --null -T "$stage/files" -C "$stage" "$inputs" \
  | nice -n "${KVMESH_BUILD_NICE:-10}" docker build -q -f compose/Dockerfile -t "$tag" "${build_args[@]}" - >&2
say "built $tag in $(( $(date +%s) - start )) s"
# Keep the build stage of this build (the cache of the next one) under a tag, and drop the build
# stages of earlier builds: each is gigabytes, and every change of the sources leaves one behind.
cache_tag="kvmesh-build-cache:${tag//[:\/]/-}"
tar -c -f - --null -T "$stage/files" -C "$stage" "$inputs" \
  | docker build -q --target build -f compose/Dockerfile -t "$cache_tag" "${build_args[@]}" - >/dev/null
docker image prune -f --filter label=org.kvmesh.stage=build >/dev/null
# and the image this build replaced under $tag (unless a container still uses it)
if [ -n "$previous" ] && [ "$previous" != "$(docker image inspect -f '{{.Id}}' "$tag")" ]; then
  docker rmi "$previous" >/dev/null 2>&1 || true
fi

# The build inputs must not reach the runtime image: no build-stage file (extra CA bundle,
# wheels, sources), and no certificate of the extra bundle that Debian's own bundle lacks.
docker run --rm --entrypoint sh "$tag" -c '
  for f in /tmp/build-inputs /tmp/ca-bundle.crt /src; do [ -e "$f" ] && echo "LEAKED $f"; done
  echo "=== debian bundle"; cat /etc/ssl/certs/ca-certificates.crt
  echo "=== other certificate files"
  find / -xdev -type f \( -name "*.pem" -o -name "*.crt" \) -not -path "/etc/ssl/certs/*" -exec cat {} + 2>/dev/null
  true' > "$stage/image-certs"
python3 - "$stage/image-certs" "$stage/$inputs/extra-ca.pem" <<'PY' || die "$tag carries build inputs (see above)"
import os, re, sys
text = open(sys.argv[1]).read()
leaked = re.findall(r"^LEAKED (.+)$", text, re.M)
debian = text.partition("=== other certificate files")[0]
pem = re.compile(r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.S)
extra = set(pem.findall(open(sys.argv[2]).read())) if os.path.exists(sys.argv[2]) else set()
foreign = extra - set(pem.findall(debian))
trusted = foreign & set(pem.findall(text))
print(f"[build-image] runtime image: build-stage files {leaked or 'none'}; extra CA bundle: "
      f"{len(foreign)} certificate(s) beyond Debian's, {len(trusted)} of them in the image", file=sys.stderr)
sys.exit(1 if leaked or trusted else 0)
PY

say "building $prom_tag (Debian's prometheus on $base)"
nice -n "${KVMESH_BUILD_NICE:-10}" docker build -q -f compose/prometheus.Dockerfile -t "$prom_tag" \
  --build-arg "BASE_IMAGE=$base" compose >&2
echo "$tag"
