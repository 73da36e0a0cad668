#!/usr/bin/env bash
# Builds llama.cpp, the peer column of `kvmesh bench engine`, for this CPU:
#   1. llama-cpp-python (the Python API column) into the project's .venv, compiled from the sdist;
#   2. llama.cpp's own HTTP server `llama-server` (continuous batching, the concurrency peer), from
#      the very llama.cpp sources that sdist vendors, into $KVMESH_CACHE_DIR (default ~/.cache/kvmesh)/llamacpp/<version>/bin/.
#
# Both are built natively (-march=native) with AMX off: llama.cpp's AMX path segfaults on these
# machines (llama.cpp issue #20824), and a plain `pip install llama-cpp-python` could enable it.
# Idempotent: each part is skipped when already built (FORCE=1 rebuilds both).
#
#   bash scripts/build-llamacpp.sh            # both parts
#   JOBS=4 bash scripts/build-llamacpp.sh     # more parallel compile jobs (default: 2)
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"   # keep equal to the `bench` extra in pyproject.toml
JOBS="${JOBS:-2}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
CACHE="${KVMESH_CACHE_DIR:-$HOME/.cache/kvmesh}/llamacpp/$VERSION"   # kvmesh's cache, as the bench looks
SDIST="$CACHE/llama_cpp_python-$VERSION.tar.gz"
SRC="$CACHE/llama_cpp_python-$VERSION"
BUILD="$CACHE/build-server"
SERVER="$CACHE/bin/llama-server"

# The same flags for both parts: native ISA, AMX off, no network features, CPU only.
GGML_FLAGS=(-DGGML_NATIVE=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
# GGML_AMX_*=OFF alone does not keep AMX out on a CPU that has it: -march=native defines
# __AMX_INT8__, and ggml's CPU backend compiles its AMX path from that macro (the path that
# segfaults). Explicit -mno-amx-* win over -march=native in GCC and Clang whatever their order, so
# the compilers get them through CFLAGS/CXXFLAGS (CMake's initial C/C++ flags).
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
export CFLAGS="${CFLAGS:-} $NO_AMX" CXXFLAGS="${CXXFLAGS:-} $NO_AMX"

log() { echo "[build-llamacpp] $*" >&2; }

[ -x "$PY" ] || { log "no Python at $PY (create the venv first, or set PYTHON)"; exit 1; }
command -v cmake >/dev/null || { log "cmake not found"; exit 1; }
mkdir -p "$CACHE"

# ---- the sources: llama-cpp-python's sdist (vendor/llama.cpp inside) --------------------------
if [ ! -f "$SDIST" ]; then
    log "downloading the llama-cpp-python $VERSION sdist"
    "$PY" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
fi
if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
    log "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$CACHE"
fi

# ---- 1. llama-cpp-python into the venv ------------------------------------------------------------
installed="$("$PY" -c 'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null || true)"
if [ "$installed" = "$VERSION" ] && [ "${FORCE:-0}" != 1 ]; then
    log "llama-cpp-python $VERSION already installed in $("$PY" -c 'import sys; print(sys.prefix)'), skipping"
else
    log "building llama-cpp-python $VERSION from source (-j$JOBS, native, no AMX)"
    start=$(date +%s)
    CMAKE_ARGS="${GGML_FLAGS[*]} -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF" \
    CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
        "$PY" -m pip install --no-cache-dir --force-reinstall --no-deps --verbose "$SDIST"
    # its Python dependencies (numpy, jinja2, typing-extensions, diskcache), without touching the build
    "$PY" -m pip install "llama-cpp-python==$VERSION" >/dev/null
    log "llama-cpp-python built in $(( $(date +%s) - start )) s"
fi

# ---- 2. llama-server from the same vendored llama.cpp ------------------------------------------
if [ -x "$SERVER" ] && [ "${FORCE:-0}" != 1 ]; then
    log "llama-server already built: $SERVER, skipping"
else
    log "building llama-server from $SRC/vendor/llama.cpp (-j$JOBS, native, no AMX)"
    start=$(date +%s)
    rm -rf "$BUILD"   # a fresh configure, so CMake takes this run's CFLAGS/CXXFLAGS
    cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release "${GGML_FLAGS[@]}" \
        -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF   # no npm, no download: the server's web UI is not needed
    cmake --build "$BUILD" --target llama-server -j "$JOBS"
    mkdir -p "$CACHE/bin"
    cp "$BUILD/bin/llama-server" "$SERVER"
    log "llama-server built in $(( $(date +%s) - start )) s"
fi

"$SERVER" --version 2>&1 | head -n 2 >&2 || true
log "done: llama-cpp-python $VERSION in $PY's environment; llama-server at $SERVER"
log "(the bench finds it there, or wherever KVMESH_LLAMA_SERVER points)"
