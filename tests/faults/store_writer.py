"""A store-writing process on the worker's real store path, to be killed with SIGKILL.

`python tests/faults/store_writer.py DIR FIRST` writes (chunk, group) files
for chunks FIRST, FIRST+1, ... forever, exactly as the connector's worker does:
`GroupPages.gather` (the C++ copier) out of KV-cache-shaped tensors shaped
like the tiny Qwen3-Next's (a GDN group whose pages sit inside padded
131,072-byte blocks, and a full-attention group of bf16 [blocks, 4, 128, 128]
layers), staged and committed by `FsData` on a 4-thread I/O pool, at most 16
stores pending. It prints READY after its first file is on disk.

The bytes of every chunk are a pure function of its index (`expected_payload`),
so a verifier can check a surviving file byte for byte.
"""

from __future__ import annotations

import hashlib
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from offload.copier import GroupPages, LayerPages
from offload.keys import ChunkKey, Fingerprint
from offload.planner import GroupKind
from offload.store.base import HostChunk, Placement
from offload.store.buffers import BufferPool
from offload.store.files import FileStore
from offload.store.format import ChunkHeader
from offload.store.fs import FsData

FP = Fingerprint(hashlib.sha256(b"kvoffload reliability store writer").digest())
NUM_BLOCKS = 16
ATTN_PAGES = 4  # blocks per attention file: 4 x 2 layers x 131,072 = 1 MiB payload
GDN, ATTN = 0, 1


def key_of(i: int) -> ChunkKey:
    return ChunkKey(hashlib.sha256(f"chunk {i}".encode()).digest())


def parent_of(i: int) -> bytes:
    return key_of(i - 1)[:8] if i else bytes(8)


class KvCache:
    """KV-cache-shaped tensors and their page tables, as the worker registers them."""

    def __init__(self) -> None:
        self.gdn_base = [torch.zeros(NUM_BLOCKS, 131072, dtype=torch.int8) for _ in range(2)]
        gdn_views = [torch.as_strided(b, (NUM_BLOCKS, 1, 1, 17536), (131072, 17536, 17536, 1)) for b in self.gdn_base]
        self.attn = [torch.zeros(NUM_BLOCKS, 4, 128, 128, dtype=torch.bfloat16) for _ in range(2)]
        self.pages = [
            GroupPages([LayerPages.from_tensor(v, NUM_BLOCKS) for v in gdn_views], NUM_BLOCKS, torch.device("cpu")),
            GroupPages([LayerPages.from_tensor(t, NUM_BLOCKS) for t in self.attn], NUM_BLOCKS, torch.device("cpu")),
        ]
        # numpy copies: single-threaded memcpy (torch's parallel copy crawls on busy cores)
        self._noise = np.random.default_rng(7).integers(0, 256, 1 << 21, dtype=np.uint8)

    def _slice(self, seed: int) -> torch.Tensor:
        off = (seed * 4099) % (self._noise.size - 131072)
        return self._noise[off:off + 131072]

    def fill(self, i: int, group: int) -> list[int]:
        """Write chunk i's pages into some blocks; return their ids."""
        if group == GDN:
            b = i % NUM_BLOCKS
            for layer, base in enumerate(self.gdn_base):
                base[b].view(torch.uint8).numpy()[:] = self._slice(i * 7 + layer)
            return [b]
        ids = [(i * ATTN_PAGES + k) % NUM_BLOCKS for k in range(ATTN_PAGES)]
        for layer, t in enumerate(self.attn):
            for k, b in enumerate(ids):
                t[b].view(-1).view(torch.uint8).numpy()[:] = self._slice(i * 13 + layer * 5 + k)
        return ids

    def header(self, i: int, group: int) -> ChunkHeader:
        return ChunkHeader(FP, key_of(i), group, GroupKind.MAMBA if group == GDN else GroupKind.FULL_ATTENTION,
                           i * 256, (i + 1) * 256, 1 if group == GDN else ATTN_PAGES,
                           self.pages[group].page_bytes, parent=parent_of(i))


def expected_payload(kv: KvCache, i: int, group: int) -> np.ndarray:
    return kv.pages[group].gather(kv.fill(i, group)).numpy().copy()


def main(path: str, first: int) -> None:
    store = FileStore.open(path, FP)
    data = FsData(store)
    kv = KvCache()
    pool = ThreadPoolExecutor(4, thread_name_prefix="kvoffload-io")
    slots = threading.Semaphore(16)  # the worker's pending-store bound, in stores
    ready = threading.Event()

    buffers = BufferPool()

    def commit(header: ChunkHeader, staged: HostChunk) -> None:
        try:
            data.put(header, staged, Placement())
            staged.release()
            if not ready.is_set():
                ready.set()
                print("READY", flush=True)
        finally:
            slots.release()

    i = first
    while True:
        for group in (GDN, ATTN):
            header = kv.header(i, group)
            ids = kv.fill(i, group)
            slots.acquire()
            staged = HostChunk.pooled(buffers, header.payload_len)
            kv.pages[group].gather(ids, out=staged.payload)
            pool.submit(commit, header, staged)
        i += 1


def zygote() -> None:
    """Import once, fork a writer per `run PATH FIRST` line on stdin (a fresh
    process each time, as fast as fork), print `PID n`, reap it, print
    `EXIT status`. Run with OMP_NUM_THREADS=1: fork-safe torch."""
    import os

    KvCache()  # warm the imports and the allocator once
    for line in sys.stdin:
        cmd, path, first = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                main(path, int(first))
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                os._exit(1)
        print(f"PID {pid}", flush=True)
        _, status = os.waitpid(pid, 0)
        print(f"EXIT {status}", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--zygote":
        zygote()
    else:
        main(sys.argv[1], int(sys.argv[2]))
