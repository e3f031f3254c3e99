#!/usr/bin/env bash
# Builds offload._copier_cuda (the CUDA copy kernel) on any machine, GPU or not:
# nvcc, its front end, the CUDA headers and the static runtime come from the
# package index (NVIDIA's CUDA 13 wheels), installed apart from the venv's
# site-packages into $VENV/cuda-toolchain, so they never touch the versions
# torch or vLLM depend on. A CUDA_HOME the user set, or the nvcc on PATH of a
# machine with a GPU, is used instead (its toolkit matches its driver; the
# wheels' CUDA 13 runtime needs a driver of the 580 series or later). Safe to re-run.
#   KVOFFLOAD_CUDA_ARCHS  default "80;90": SASS for sm_80 (A100; sm_86/89 run it) and
#                         sm_90 (H100), plus compute_90 PTX that newer GPUs JIT.
# Disk: about 125 MB of wheels, 320 MB unpacked (docs/operations.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
CUDA_WHEELS=13.5.37   # nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-runtime, nvidia-cuda-crt
TC="$VENV/cuda-toolchain"

if [ "$(cat "$TC/VERSION" 2>/dev/null)" != "$CUDA_WHEELS" ]; then
  echo "cuda-build: installing the CUDA $CUDA_WHEELS compiler wheels into $TC"
  rm -rf "$TC"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --target "$TC" \
    "nvidia-cuda-nvcc==$CUDA_WHEELS" "nvidia-nvvm==$CUDA_WHEELS" \
    "nvidia-cuda-runtime==$CUDA_WHEELS" "nvidia-cuda-crt==$CUDA_WHEELS"
  # Wheels do not promise the executable bit.
  find "$TC/nvidia/cu13/bin" "$TC/nvidia/cu13/nvvm/bin" -maxdepth 1 -type f -exec chmod +x {} +
  echo "$CUDA_WHEELS" > "$TC/VERSION"
fi

# The pinned wheels everywhere (so CI builds with what it installed), except
# where the user set CUDA_HOME, or on a GPU machine with its own nvcc.
if [ -z "${CUDA_HOME:-}" ]; then
  if ! { command -v nvcc >/dev/null 2>&1 && command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }; then
    export CUDA_HOME="$PWD/$TC/nvidia/cu13"
  fi
fi
echo "cuda-build: nvcc $( "${CUDA_HOME:+$CUDA_HOME/bin/}nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p' )" \
     "(${CUDA_HOME:-$(command -v nvcc)}), archs ${KVOFFLOAD_CUDA_ARCHS:-80;90}"
start=$(date +%s)
KVOFFLOAD_CUDA=1 "$PY" setup.py -q build_ext --inplace
"$PY" -c "import offload._copier_cuda as m; print('cuda-build: offload._copier_cuda built (CUDA runtime', m.runtime_version(), \
'; devices here:', m.device_count(), ')')"
echo "cuda-build: $(( $(date +%s) - start )) s"
