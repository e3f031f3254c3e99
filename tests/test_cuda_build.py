"""offload._copier_cuda as `make setup` builds it (scripts/cuda_build.sh): with
nvcc from the package index, for sm_80 and sm_90, on machines with or without
a GPU. Without one the module imports, refuses a device with NoCudaDevice, and
offload/copier.py copies with the CPU copier (or torch on CUDA) instead."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import sysconfig
from pathlib import Path

import pybind11
import pytest
import torch

import offload
from offload import copier

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "csrc" / "copier_cuda.cu", ROOT / "csrc" / "page_layout.h"]
TOOLCHAIN = Path(sys.prefix) / "cuda-toolchain" / "nvidia" / "cu13"
FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


def _elf_sections(data: bytes) -> dict[str, bytes]:
    """Section name -> bytes of a little-endian ELF64 file."""
    assert data[:4] == b"\x7fELF" and data[4] == 2, "not an ELF64 file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = hdrs[shstrndx][4]
    out = {}
    for name_off, _, _, _, off, size, *_ in hdrs:
        start = names + name_off
        out[data[start:data.index(b"\0", start)].decode()] = data[off:off + size]
    return out


def fatbin_targets(path: Path) -> set[tuple[str, int]]:
    """("sass" | "ptx", sm) of every entry in the file's embedded fat binaries
    (the .nv_fatbin section; layout as cuobjdump lists it)."""
    blob = _elf_sections(path.read_bytes()).get(".nv_fatbin", b"")
    out, pos = set(), 0
    while pos + 16 <= len(blob):
        magic, _, header, size = struct.unpack_from("<IHHQ", blob, pos)
        if magic != FATBIN_MAGIC:
            break
        p, end = pos + header, pos + header + size
        while p < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", blob, p)
            sm, = struct.unpack_from("<I", blob, p + 28)
            out.add(({KIND_ELF: "sass", KIND_PTX: "ptx"}.get(kind, f"kind{kind}"), sm))
            p += entry_header + payload
        pos = end
    return out


def _built() -> Path:
    found = sorted(Path(offload.__file__).parent.glob("_copier_cuda*.so"))
    assert found, "offload._copier_cuda is not built: run `make cuda-build` (make setup runs it)"
    return found[0]


def _specs(n_blocks: int = 4, block_bytes: int = 64) -> list:
    return [(0x1000, block_bytes, [0], block_bytes)]


def test_built_for_sm80_and_sm90_and_current():
    so = _built()
    targets = fatbin_targets(so)
    assert {("sass", 80), ("sass", 90)} <= targets, targets
    assert ("ptx", 90) in targets, targets  # newer GPUs JIT it
    stale = [s.name for s in SOURCES if s.stat().st_mtime > so.stat().st_mtime]
    assert not stale, f"{so.name} is older than {stale}: run `make cuda-build`"


def test_imports_and_refuses_a_missing_device():
    from offload import _copier_cuda as m

    assert copier._copier_cuda is m
    assert m.runtime_version() >= 12000
    n = m.device_count()
    assert n >= 0
    if n == 0:
        # No GPU here: every device is missing, and the runtime's reason is named.
        with pytest.raises(m.NoCudaDevice, match=r"no CUDA device \(.+\)"):
            m.PageTable(_specs(), 0)
    else:
        with pytest.raises(m.NoCudaDevice, match=f"no CUDA device {n} "):
            m.PageTable(_specs(), n)  # one past the last device
    assert issubclass(m.NoCudaDevice, RuntimeError)


def test_falls_back_without_a_device():
    from offload import _copier_cuda as m

    if m.device_count() > 0:
        pytest.skip("this machine has a CUDA device: the kernel path is taken (tests/test_e2e_gpu.py)")
    table, why = copier.cuda_page_table(_specs(), 0)
    assert table is None and "no CUDA device" in why

    # A CUDA device asked for: no kernel, torch's copies instead (they need the tensors) ...
    kv = torch.arange(2 * 6 * 32, dtype=torch.int32).reshape(2, 6, 32)
    layers = [copier.LayerPages.from_tensor(kv, 6)]
    assert copier.GroupPages(layers, 6, torch.device("cuda:0")).backend == "torch"
    bare = [copier.LayerPages(lp.base_ptr, lp.block_stride, lp.seg_offsets, lp.seg_bytes) for lp in layers]
    with pytest.raises(ValueError, match="no CUDA device"):
        copier.GroupPages(bare, 6, torch.device("cuda:0"))

    # ... and on CPU the CPU copier moves the bytes, the CUDA module loaded or not.
    pages = copier.GroupPages(layers, 6, torch.device("cpu"))
    assert pages.backend == "cpu"
    buf = pages.gather([4, 1])
    # Layer-major; within the layer block by block, each block's segments (K, V) in order.
    want = torch.cat([kv[k, b] for b in (4, 1) for k in range(2)]).view(torch.uint8)
    assert torch.equal(buf, want)
    kv2 = torch.zeros_like(kv)
    copier.GroupPages([copier.LayerPages.from_tensor(kv2, 6)], 6, torch.device("cpu")).scatter(buf, 2, [(0, 3), (1, 5)])
    assert torch.equal(kv2[:, 3], kv[:, 4]) and torch.equal(kv2[:, 5], kv[:, 1])
    assert int(kv2[:, [0, 1, 2, 4]].abs().sum()) == 0


@pytest.mark.long  # `make setup` compiles it on every run (a failure fails setup); 18 s of nvcc
def test_source_compiles_with_the_venv_nvcc(tmp_path):
    """Compiles csrc/copier_cuda.cu afresh (sm_80 only, to keep it short) with
    the toolchain `make setup` installed: fails as soon as the source stops compiling."""
    nvcc = TOOLCHAIN / "bin" / "nvcc"
    assert nvcc.exists(), f"{nvcc} missing: run `make cuda-build` (make setup runs it)"
    obj = tmp_path / "copier_cuda.o"
    cmd = [str(nvcc), "-c", str(SOURCES[0]), "-o", str(obj), "-std=c++17", "-Xcompiler", "-fPIC",
           f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
           "-gencode", "arch=compute_80,code=sm_80"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_HOME": str(TOOLCHAIN)})
    assert r.returncode == 0, f"nvcc failed:\n{r.stderr[-4000:]}"
    assert ("sass", 80) in fatbin_targets(obj)
