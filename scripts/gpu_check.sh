#!/usr/bin/env bash
# The GPU checks of issue 24 on a machine with a CUDA device, torch, triton and pytest, and none of
# kvmesh's service dependencies (no pip install: the repository is put on PYTHONPATH as setup.py
# maps it: kvmesh -> libs/kvmesh, kvmesh.services -> services/, kvmesh.loadtest -> loadtest/;
# the engine rows import the engine's runner, which needs gguf and llguidance: carry them as wheels):
#   1. nvidia-smi and the versions;
#   2. kvmesh bench gpu (loadtest/gpu_bench.py), which checks every kernel against torch first;
#   3. tests/unit/gpu natively on CUDA (TRITON_INTERPRET=0; the CPU-interpreter cases skip).
# Everything goes to files directly under $OUT (default: bench-results/gpu-check): nvidia-smi.txt,
# pytest.txt, gpu_bench.txt (all tables), gpu_bench.json, summary.txt. Printed, last: a short summary
# (test result line, failures, the bench's summary against the issue's targets). Each step has a
# time cap (bench 330 s, pytest 140 s; about 3 + 1.5 minutes expected on an H100, kernels compiled
# from scratch). Exits nonzero when a test, a correctness check or a CUDA-graph timing fails.
#
#   OUT=/some/dir bash scripts/gpu_check.sh        (PYTHON=python3 by default)
set -uo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
py=${PYTHON:-python3}
out=${OUT:-$root/bench-results/gpu-check}
mkdir -p "$out"

# kvmesh as an import root without installing it: links, in a temporary folder, shaped as setup.py maps it
pkgroot=$(mktemp -d)
trap 'rm -rf "$pkgroot"' EXIT
mkdir "$pkgroot/kvmesh"
for entry in "$root"/libs/kvmesh/*; do
  ln -s "$entry" "$pkgroot/kvmesh/$(basename "$entry")"
done
ln -s "$root/loadtest" "$pkgroot/kvmesh/loadtest"
ln -s "$root/services" "$pkgroot/kvmesh/services"
export PYTHONPATH="$pkgroot${PYTHONPATH:+:$PYTHONPATH}"
export TRITON_INTERPRET=0

status=0
{ nvidia-smi 2>&1 || echo "(nvidia-smi failed)"; } >"$out/nvidia-smi.txt"
# without a CUDA device every test below would skip and pass: that is a failed check, not a pass
versions=$("$py" -c "import sys, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else ''); sys.exit(0 if torch.cuda.is_available() else 1)" 2>&1) || status=1
echo "$versions" >>"$out/nvidia-smi.txt"

# the bench first: it checks every kernel it times against torch, and its numbers are what this
# run is for; then the tests, whose ~70 kernel compilations take most of their time
t0=$SECONDS
timeout 330 "$py" -u -m kvmesh.loadtest.gpu_bench --json "$out/gpu_bench.json" >"$out/gpu_bench.txt" 2>&1 || { rc=$?; status=1; echo "(bench exit $rc; 124 = over its 330 s cap)" >>"$out/gpu_bench.txt"; }
t_bench=$((SECONDS - t0))

t0=$SECONDS
timeout 140 "$py" -m pytest tests/unit/gpu -q -p no:cacheprovider >"$out/pytest.txt" 2>&1 || { rc=$?; status=1; echo "(pytest exit $rc; 124 = over its 140 s cap)" >>"$out/pytest.txt"; }
t_test=$((SECONDS - t0))

{
  echo "== gpu_check: $versions"
  echo "== pytest tests/unit/gpu (native CUDA, ${t_test} s): $(grep -E '(passed|failed|error)' "$out/pytest.txt" | tail -1)"
  grep -E '^(FAILED|ERROR)|^\(pytest exit' "$out/pytest.txt" | head -20
  echo "== kvmesh bench gpu (${t_bench} s; every table in gpu_bench.txt)"
  if grep -q '^== summary' "$out/gpu_bench.txt"; then
    sed -n '/^== summary/,$p' "$out/gpu_bench.txt"
  else
    tail -30 "$out/gpu_bench.txt"
  fi
  if [ "$status" != 0 ]; then echo "gpu_check: FAILED (files in $out)"; else echo "gpu_check: all passed (files in $out)"; fi
} >"$out/summary.txt"
cat "$out/summary.txt"
exit "$status"
