"""Build for kvoffload.

The CPU extension ``offload._copier`` is always built (pybind11, no torch
headers, so it compiles in seconds).  The CUDA extension
``offload._copier_cuda`` is built when asked for (``KVOFFLOAD_CUDA=1``, as
scripts/cuda_build.sh does with nvcc from the package index, GPU or not) or
when a CUDA toolkit *and* a CUDA-enabled torch are both present; it is never
required at runtime (offload/copier.py falls back).  ``KVOFFLOAD_CUDA=0``
forces it off.  ``KVOFFLOAD_CUDA_ARCHS`` (default "80;90") picks the SASS
targets; PTX of the last one is embedded too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

import pybind11
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import Extension, find_packages, setup


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def _cuda_home(nvcc: str) -> str:
    # nvcc on PATH may be a wrapper script, so also try the usual install root.
    for home in (
        os.environ.get("CUDA_HOME"),
        os.environ.get("CUDA_PATH"),
        os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
        "/usr/local/cuda",
    ):
        if home and any(
            os.path.exists(os.path.join(home, d, "libcudart_static.a"))
            for d in ("lib64", "targets/x86_64-linux/lib", "lib")
        ):
            return home
    raise RuntimeError("cannot find the CUDA toolkit's libcudart_static.a; set CUDA_HOME")


def _want_cuda() -> bool:
    flag = os.environ.get("KVOFFLOAD_CUDA")
    if flag is not None:
        return flag.strip() not in ("", "0", "false", "no")
    if _nvcc() is None:
        return False
    try:  # only auto-enable when torch itself can use CUDA
        import torch

        return torch.version.cuda is not None and torch.cuda.is_available()
    except Exception:
        return False


class CudaBuildExt(build_ext):
    """Compiles ``.cu`` sources with nvcc, links the objects with the host linker."""

    def build_extension(self, ext: Extension) -> None:
        cu = [s for s in ext.sources if s.endswith(".cu")]
        if not cu:
            return super().build_extension(ext)
        nvcc = _nvcc()
        if nvcc is None:
            raise RuntimeError("KVOFFLOAD_CUDA=1 but nvcc was not found (set CUDA_HOME)")
        cuda_home = _cuda_home(nvcc)
        archs = os.environ.get("KVOFFLOAD_CUDA_ARCHS", "80;90").split(";")
        gencode = []
        for a in archs:
            a = a.strip().replace(".", "")
            if a:
                gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        # PTX for the newest arch so future GPUs can JIT it.
        last = archs[-1].strip().replace(".", "")
        gencode += ["-gencode", f"arch=compute_{last},code=compute_{last}"]
        build_tmp = os.path.join(self.build_temp, "cuda")
        os.makedirs(build_tmp, exist_ok=True)
        objs = []
        for src in cu:
            obj = os.path.join(build_tmp, os.path.basename(src) + ".o")
            cmd = [
                nvcc, "-c", src, "-o", obj, "-O3", "-std=c++17",
                "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
                f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}",
                *gencode,
            ]
            print(" ".join(cmd))
            subprocess.check_call(cmd)
            objs.append(obj)
        ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
        ext.extra_objects = list(ext.extra_objects or []) + objs
        lib_dirs = [os.path.join(cuda_home, d) for d in ("lib64", "targets/x86_64-linux/lib", "lib")]
        ext.library_dirs = list(ext.library_dirs or []) + [d for d in lib_dirs if os.path.isdir(d)]
        # Static cudart: the .so then needs no libcudart on the loader path
        # (torch wheels ship their own, often under a different soname).
        ext.libraries = [*list(ext.libraries or []), "cudart_static", "rt", "dl", "pthread"]
        ext.language = "c++"
        # Always link: the objects were just compiled, perhaps by another nvcc
        # or for other archs, which setuptools' timestamp check cannot see.
        force, self.force = self.force, True
        try:
            super().build_extension(ext)
        finally:
            self.force = force


# Headers shared by both extensions (included relative to csrc/); listing them
# as depends= rebuilds on change and puts them in the sdist.
_headers = ["csrc/page_layout.h"]

ext_modules = [
    Pybind11Extension(
        "offload._copier",
        ["csrc/copier.cpp"],
        depends=[*_headers, "csrc/ghash.h"],
        cxx_std=17,
        extra_compile_args=["-O3"],
    )
]
if _want_cuda():
    ext_modules.append(
        Extension("offload._copier_cuda", ["csrc/copier_cuda.cu"], depends=_headers)
    )

setup(
    packages=find_packages(include=["offload", "offload.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": CudaBuildExt},
)
