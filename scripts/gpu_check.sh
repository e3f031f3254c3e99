#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (a lent GPU machine has no vLLM:
# the copier, its fallback and the tail masks are what can run there).
# Builds both copiers in place with the machine's own nvcc and python3, runs
# the copier tests (the GPU ones skip elsewhere), compute-sanitizer's memcheck
# over the kernel tests where it is installed, and bench/copier_gpu.py.
#   OUT  where the log and the bench's JSON go (default: bench/results)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-bench/results}
mkdir -p "$OUT"
nvidia-smi -L; nvcc --version | tail -2; "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
start=$(date +%s)
KVOFFLOAD_CUDA=1 "$PY" setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "gpu-check: built in $(( $(date +%s) - start )) s"
"$PY" -m pytest -q -p no:cacheprovider -rs tests/test_copier_gpu.py tests/test_tailmask.py tests/test_copier.py tests/test_cuda_build.py
rc=$?
if command -v compute-sanitizer >/dev/null; then
  timeout 180 compute-sanitizer --tool memcheck --error-exitcode 3 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_copier_gpu.py -k "not torch_fallback" 2>&1 | tail -5
  rc=$(( rc | ${PIPESTATUS[0]} ))
fi
"$PY" -m bench.copier_gpu --gib "${GIB:-2}" --reps "${REPS:-5}" --out-dir "$OUT" || rc=1
exit $rc
