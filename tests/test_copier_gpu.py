"""offload._copier_cuda on a CUDA device: the kernel moves exactly the bytes
the CPU copier (offload._copier, tested in test_copier.py) moves, on the page
layouts vLLM gives hybrid models, and the torch fallback agrees with both.

Each case builds the same views over one byte buffer twice, on the GPU and a
copy on the CPU, runs the same gathers and scatters through each copier, and
compares bytes: the gathered pages, and the whole buffer after a scatter (so
padding and other blocks must stay untouched). Skipped without a GPU: the
build itself is tested everywhere (test_cuda_build.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from offload import copier
from offload.copier import GroupPages, LayerPages

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or copier._copier_cuda is None,
                                reason="needs a CUDA GPU and offload._copier_cuda")

NB = 12


def _attention_hybrid(base: torch.Tensor) -> list[torch.Tensor]:
    """FlashAttention's (2, blocks, block_size, heads, head_size), re-strided
    so one block's K and V share a page (vLLM's layout for hybrid models)."""
    half = 64 * 2 * 128
    t = base.view(torch.bfloat16)
    return [t.as_strided((2, NB, 64, 2, 128), (half, 2 * half, 256, 128, 1))]


def _gdn_padded(base: torch.Tensor) -> list[torch.Tensor]:
    """A GDN layer's conv and recurrent state in one padded page per block."""
    page = base.numel() // NB
    conv = base.view(torch.bfloat16).as_strided((NB, 3, 1024), (page // 2, 1024, 1))
    ssm = base.view(torch.float32).as_strided((NB, 4, 64, 64), (page // 4, 4096, 64, 1), 3 * 1024 * 2 // 4)
    return [conv, ssm]


def _odd(base: torch.Tensor) -> list[torch.Tensor]:
    """Segments of 42 and 10 bytes at odd offsets: the kernel's byte path.
    (Layers of a group never overlap; the kernel copies all of them at once.)"""
    t = base.view(torch.bfloat16)
    return [t.as_strided((NB, 7, 3), (29, 3, 1), 1), t.as_strided((2, NB, 5), (13, 31, 1), 360)]


def _big(base: torch.Tensor) -> list[torch.Tensor]:
    """K/V-first segments of 128 KiB: each one split into 64 KiB pieces."""
    return [base.view(torch.bfloat16).view(2, NB, 64, 4, 256)]


CASES = {"attention_hybrid": (_attention_hybrid, 2 * 64 * 2 * 128 * 2),
         "gdn_padded": (_gdn_padded, 3 * 1024 * 2 + 4 * 64 * 64 * 4 + 512),
         "odd": (_odd, 128),
         "big": (_big, 2 * 64 * 4 * 256 * 2)}


def _pair(case: str) -> tuple[torch.Tensor, GroupPages, torch.Tensor, GroupPages]:
    views, page = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    host = torch.randint(0, 256, (NB * page,), dtype=torch.uint8, generator=gen)
    dev = host.to("cuda")
    gpu = GroupPages([LayerPages.from_tensor(t, NB) for t in views(dev)], NB, torch.device("cuda"))
    cpu = GroupPages([LayerPages.from_tensor(t, NB) for t in views(host)], NB, torch.device("cpu"))
    assert gpu.backend == "cuda" and cpu.backend == "cpu" and gpu.page_bytes == cpu.page_bytes
    return dev, gpu, host, cpu


@pytest.mark.parametrize("case", list(CASES))
def test_gather_matches_the_cpu_copier(case):
    dev, gpu, host, cpu = _pair(case)
    for ids in ([3, 0, 5], list(range(NB)), [2, 2], [NB - 1], []):
        assert torch.equal(gpu.gather(ids), cpu.gather(ids)), ids
    out = torch.empty(4 * gpu.page_bytes, dtype=torch.uint8, pin_memory=True)
    assert gpu.gather([7, 1, 7, 4], out=out) is out
    assert torch.equal(out, cpu.gather([7, 1, 7, 4]))


@pytest.mark.parametrize("source", ["pinned", "pageable", "device"])
@pytest.mark.parametrize("case", list(CASES))
def test_scatter_matches_the_cpu_copier_and_touches_only_destinations(case, source):
    dev, gpu, host, cpu = _pair(case)
    n = 3
    buf = torch.randint(0, 256, (n * gpu.page_bytes,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(7))
    pairs = [(0, 4), (2, 9), (1, 0)]
    cpu.scatter(buf, n, pairs)
    src = {"pinned": buf.pin_memory(), "pageable": buf, "device": buf.to("cuda")}[source]
    gpu.scatter(src, n, pairs)
    assert torch.equal(dev.cpu(), host), "every byte of the buffer, padding and other blocks included"


def test_copies_follow_work_queued_on_the_current_stream():
    """The kernel runs on the caller's current stream: a write queued before
    the gather is in what it gathers, and a scatter lands before later work."""
    dev, gpu, host, cpu = _pair("big")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the stream busy, so an unordered copy would see old bytes
        dev.fill_(0xA5)
        got = gpu.gather([1, 2])
        assert bool((got == 0xA5).all())
        buf = torch.full((gpu.page_bytes,), 0x3C, dtype=torch.uint8, pin_memory=True)
        gpu.scatter(buf, 1, [(0, 5)])
        after = dev.view(2, NB, -1)[:, 5].clone()
    side.synchronize()
    assert bool((after == 0x3C).all())


@pytest.mark.parametrize("case", list(CASES))
def test_torch_fallback_agrees(case, monkeypatch):
    """Without the kernel (a driver older than its runtime), torch's copies on CUDA."""
    dev, gpu, host, cpu = _pair(case)
    monkeypatch.setattr(copier, "_copier_cuda", None)
    views, _ = CASES[case]
    fallback = GroupPages([LayerPages.from_tensor(t, NB) for t in views(dev)], NB, torch.device("cuda"))
    assert fallback.backend == "torch"
    ids = random.Random(3).choices(range(NB), k=6)
    assert torch.equal(fallback.gather(ids), cpu.gather(ids))
    buf = cpu.gather([5, 6])
    fallback.scatter(buf, 2, [(1, 0), (0, 11)])
    cpu.scatter(buf, 2, [(1, 0), (0, 11)])
    assert torch.equal(dev.cpu(), host)
