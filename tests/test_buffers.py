"""Host memory for direct I/O: pool buffers sit in huge pages; the host tier's arena is faulted in at start.

A buffer of scattered 4 KiB pages splits each O_DIRECT request (a virtio disk takes at most
`max_segments` segments per request), which halved load throughput whenever memory was
fragmented; in 2 MiB pages a chunk file is one request.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from offload.store.buffers import HUGE_PAGE, BufferPool, host_memory, round_up

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str:
    try:
        text = THP.read_text()
    except OSError:
        return "absent"
    return text.split("[", 1)[1].split("]", 1)[0]


def _smaps(t: torch.Tensor, field: str) -> int:
    """`field` (e.g. AnonHugePages, Rss) summed over the mappings that hold `t`'s bytes (from
    /proc/self/smaps: advising huge pages splits a mapping in two)."""
    lo_t = t.data_ptr()
    hi_t = lo_t + t.numel() * t.element_size()
    total, inside, seen = 0, False, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo < hi_t and lo_t < hi
            seen |= inside
        elif inside and line.startswith(field + ":"):
            total += int(line.split()[1]) << 10
    assert seen, "no mapping holds the tensor"
    return total


def _huge_bytes(t: torch.Tensor) -> int:
    return _smaps(t, "AnonHugePages")


def _resident_bytes(t: torch.Tensor) -> int:
    return _smaps(t, "Rss")


needs_thp = pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                               reason=f"transparent huge pages are {_thp_mode()} on this kernel")


@pytest.mark.parametrize("nbytes", [4096, HUGE_PAGE * 2 + 4096, round_up(4194496), 7 << 20])
def test_host_memory_starts_on_a_huge_page_and_holds_what_is_written(nbytes):
    t = host_memory(nbytes)
    assert (t.numel(), t.dtype, t.data_ptr() % HUGE_PAGE) == (nbytes, torch.uint8, 0)
    t.copy_(torch.arange(nbytes, dtype=torch.int64).to(torch.uint8))
    assert torch.equal(t[:1000], torch.arange(1000, dtype=torch.int64).to(torch.uint8))
    assert not t.is_inference()


@needs_thp
def test_pool_buffers_are_backed_by_huge_pages():
    pool = BufferPool()
    buf = pool.get(4194496)  # a chunk file of 4 MiB of pages and its header
    buf.fill_(1)  # first touch: the kernel backs the advised range
    assert _huge_bytes(buf) >= buf.numel() // HUGE_PAGE * HUGE_PAGE


def test_the_host_tiers_arena_is_faulted_in_at_start_and_stopped_at_close():
    """The arena's pages are made resident on a thread of its own (a load's first touch of them
    cost that load), without writing a byte; `close` stops that thread."""
    from offload.store.cpu import CpuData

    class Layout:  # the two fields CpuData reads at construction
        frames, frame_bytes = 3, 5 << 20

    data = CpuData(Layout(), torch.device("cpu"))
    try:
        assert data.prefault is not None and data.prefault.done.wait(30)
        if _resident_bytes(data.arena) < 3 * (5 << 20):
            pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
        assert data.arena.shape == (3, 5 << 20)
    finally:
        data.close()
    assert not data.prefault._thread.is_alive()


def test_prefault_makes_memory_resident_and_keeps_its_bytes():
    from offload.store.buffers import Prefault

    t = host_memory(40 << 20)
    t[:4096].fill_(7)  # in use already: a prefault must not change it
    before = _resident_bytes(t)
    pf = Prefault(t)
    assert pf.done.wait(30)
    pf.stop()
    if _resident_bytes(t) == before:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert _resident_bytes(t) >= 40 << 20
    assert int(t[:4096].sum()) == 7 * 4096 and int(t[4096:].sum()) == 0


def test_reserve_makes_touched_buffers_that_get_hands_out():
    pool = BufferPool(max_free_bytes=64 << 20)
    assert pool.reserve([4194496, 1000], 3) == 6
    assert pool.allocated == 0  # made by reserve, not by a get
    bufs = [pool.get(4194496) for _ in range(3)]
    assert pool.reused == 3 and pool.allocated == 0
    assert all(_resident_bytes(b) >= b.numel() for b in bufs)
    assert pool.reserve([30 << 20], 5) == 2  # max_free_bytes (64 MiB) bounds what is kept


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_host_copy_copies_every_byte_whatever_the_layout(layout):
    """The tiers' copy between host buffers: the copier's memcpy for contiguous uint8 tensors,
    torch's copy for anything else (a strided view here), the same bytes either way."""
    from offload.store.base import host_copy

    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g)
    dst = torch.zeros(3 << 20, dtype=torch.uint8)
    if layout == "strided":
        src, dst = src.view(1024, -1)[:, ::2], dst.view(1024, -1)[:, ::2]
    host_copy(dst, src)
    assert torch.equal(dst, src)
