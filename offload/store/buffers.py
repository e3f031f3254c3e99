"""Reusable host buffers for the filesystem tier, and the O_DIRECT probe.

Gathering into fresh memory costs more than the copy itself: every new page
faults on first touch (measured on this machine's copier: 7.6 GB/s into a
reused buffer, ~1.9 GB/s into a fresh one). So staged stores and loads take
their buffers from a pool and give them back. Every buffer starts on a
`DIRECT_ALIGN` boundary and its length is a multiple of it, so a store can be
written with O_DIRECT straight from it. On CUDA the buffers are pinned, which
the copy kernel needs to address host memory directly.

Host memory (`host_memory`) is asked for in transparent huge pages. A direct
read or write is one device request only if its buffer is made of few
physically contiguous runs: the block layer merges adjacent pages into one
segment, and a virtio disk takes at most `max_segments` (254 here) per
request. Memory taken from a fragmented free list is 4 KiB pages scattered
over the host, which splits a 4 MiB read into several requests, as slow as
memory was fragmented when the buffer was made; in 2 MiB pages it is one
request, every time.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import uuid

import torch

from offload.copier import DIRECT_ALIGN

DEFAULT_MAX_FREE_BYTES = 256 << 20
HUGE_PAGE = 2 << 20


def host_memory(nbytes: int, pinned: bool = False) -> torch.Tensor:
    """`nbytes` of uint8 host memory starting on a `HUGE_PAGE` boundary, its
    whole huge pages advised as transparent huge pages (the kernel falls back
    to small pages where THP is off or none is free; nothing else changes).

    Pinned memory (CUDA) comes from the CUDA allocator instead, aligned to
    `DIRECT_ALIGN` only.
    """
    # Not an inference tensor, although stores are staged under vLLM's
    # inference_mode: the I/O threads write the header into it outside it.
    with torch.inference_mode(False):
        if pinned:
            raw = torch.empty(nbytes + DIRECT_ALIGN, dtype=torch.uint8, pin_memory=True)
            off = (-raw.data_ptr()) % DIRECT_ALIGN
            return raw[off:off + nbytes]  # the view keeps `raw` alive
        # Private: a shared anonymous mapping is shmem, which THP's madvise mode does not cover.
        area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        whole = torch.frombuffer(area, dtype=torch.uint8)  # holds `area` until freed
        off = (-whole.data_ptr()) % HUGE_PAGE
        huge = nbytes // HUGE_PAGE * HUGE_PAGE
        if huge and hasattr(mmap, "MADV_HUGEPAGE"):
            area.madvise(mmap.MADV_HUGEPAGE, off, huge)
        return whole[off:off + nbytes]


MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without changing their bytes
_PREFAULT_STEP = 64 << 20


class Prefault:
    """Faults a tensor's pages in on a thread of its own, in steps, leaving its bytes as they are
    (`MADV_POPULATE_WRITE`; nothing happens on kernels without it), while it is in use. Memory
    first touched by a load costs that load (most on a VM that reports free pages to its host,
    for direct reads and copies alike). `stop()` ends it early (the owner's close)."""

    def __init__(self, t: torch.Tensor) -> None:
        self._addr, self._len = t.data_ptr(), t.numel() * t.element_size()
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvoffload-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            page = mmap.PAGESIZE
            start = self._addr // page * page
            end = self._addr + self._len
            while start < end and not self._stop.is_set():
                n = min(_PREFAULT_STEP, end - start)
                # ctypes drops the GIL for the call: the engine runs on while pages fault in.
                if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(n), MADV_POPULATE_WRITE) != 0:
                    return  # an older kernel (EINVAL) or no memory to spare: pages fault in on use
                start += n
        finally:
            self.done.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def round_up(n: int, align: int = DIRECT_ALIGN) -> int:
    return -(-n // align) * align


class BufferPool:
    """Free lists of aligned uint8 host buffers, by size.

    `get(n)` returns a buffer of `round_up(n)` bytes (a fresh one when none of
    that size is free); `put` returns it. At most `max_free_bytes` are kept
    idle; beyond that a returned buffer is freed. What is in use is bounded by
    the caller (the worker's `max_pending_store_bytes` and its I/O threads).
    Thread-safe: stores are staged on the forward thread and committed on the
    I/O threads.
    """

    def __init__(self, pinned: bool = False, max_free_bytes: int = DEFAULT_MAX_FREE_BYTES) -> None:
        self.pinned = pinned
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()
        self.allocated = 0  # buffers created (a metric for tests and benchmarks)
        self.reused = 0

    def get(self, nbytes: int) -> torch.Tensor:
        cap = round_up(max(nbytes, 1))
        with self._lock:
            free = self._free.get(cap)
            if free:
                self._free_bytes -= cap
                self.reused += 1
                return free.pop()
            self.allocated += 1
        return host_memory(cap, self.pinned)

    def reserve(self, sizes: list[int], count: int) -> int:
        """Make `count` touched buffers of each of `sizes` bytes now and keep them free (as far as
        `max_free_bytes` allows): the first loads after a start then read into memory already
        faulted in (see `Prefault`). Returns how many were made."""
        made = 0
        for n in dict.fromkeys(round_up(max(s, 1)) for s in sizes):
            for _ in range(count):
                with self._lock:
                    if self._free_bytes + n > self.max_free_bytes:
                        return made
                buf = host_memory(n, self.pinned)
                buf.fill_(0)
                self.put(buf)
                made += 1
        return made

    def put(self, buf: torch.Tensor) -> None:
        cap = buf.numel()
        with self._lock:
            if self._free_bytes + cap <= self.max_free_bytes:
                self._free.setdefault(cap, []).append(buf)
                self._free_bytes += cap


def probe_o_direct(directory: str | os.PathLike) -> bool:
    """Whether an aligned O_DIRECT write works in `directory` (tmpfs, some
    overlay and NFS mounts refuse it with EINVAL). Creates `directory`."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".o_direct_probe.{os.getpid()}.{uuid.uuid4().hex[:8]}")
    page = mmap.mmap(-1, DIRECT_ALIGN)  # page-aligned
    try:
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL | flag, 0o600)
        try:
            return os.write(fd, page) == DIRECT_ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        page.close()
        try:
            os.remove(path)
        except OSError:
            pass
