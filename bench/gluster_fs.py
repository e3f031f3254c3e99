"""The file tier through a GlusterFS FUSE mount against the same on a local directory, and against the
mount's own raw throughput (dd).

A replica-2 volume (tests/gluster.py: two bricks in directories on the local disk, so every byte
written through the mount is written twice on this host, and one FUSE mount) is started, measured and
torn down; `make setup` installs GlusterFS. On each of the two directories, per repetition, interleaved:

- dd: `dd bs=4M oflag=direct conv=fdatasync` of the run's byte count into one file, then
  `dd bs=4M iflag=direct` of it back (after dropping the page cache): what the filesystem moves with no
  checksum, no file per chunk and no rename;
- ours, stores: `FsData.put` of one file per (chunk, group) (CRC-32C, O_DIRECT where the filesystem
  takes it, rename into place) on the connector's default store threads, at most twice as many queued, as
  the worker runs them; then a sync;
- ours, loads: the same files cold (page cache dropped), `FsData.get` (read with the tier's defaults,
  verify) on the connector's default load threads (`io_threads`);
- vLLM x16: `vllm.v1.kv_offload.tiering.fs.io.batch_store_block` / `batch_load_block` of the same
  file count and size from / into one host buffer, 16 threads (its default), O_DIRECT where its own
  probe allows: its file tier's I/O with nothing else.

CPU per GB counts this process and, on the mount, the GlusterFS processes (the FUSE client and both
brick servers, from /proc/<pid>/stat): the work a FUSE filesystem does in its own daemons is part of
what a store or a load costs. Local CPU counts this process only (the kernel's work on its behalf is
in its system time).

    python -m bench.gluster_fs [--mib 256] [--file-mib 4] [--reps 3] [--dir DIR]

`--dir`: where the local directory and the bricks go (default .cache/ in the repository).
Writes bench/results/gluster_fs.json.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import GB, REPO, cpu_seconds, drop_page_cache, filesystem_of, median, table, write_results
from offload import copier
from offload.config import parse_config
from offload.keys import ChunkKey, Fingerprint
from offload.planner import GroupKind
from offload.store.base import HostChunk, Placement
from offload.store.buffers import BufferPool
from offload.store.files import FileStore
from offload.store.format import HEADER_LEN, ChunkHeader
from offload.store.fs import FsData

sys.path.insert(0, str(REPO / "tests"))
import gluster  # tests/gluster.py: the volume

FP = Fingerprint(bytes(range(32)))
_DEFAULTS = parse_config({"store": "fs", "path": "/unused"})
LOAD_THREADS, STORE_THREADS = _DEFAULTS.io_threads, _DEFAULTS.store_threads  # the connector's defaults
VLLM_THREADS = 16
CLK = os.sysconf("SC_CLK_TCK")


def daemon_cpu(pids: list[int]) -> float:
    """User + system CPU seconds of processes `pids` (the GlusterFS client and bricks)."""
    total = 0.0
    for pid in pids:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(f[11]) + int(f[12])) / CLK
        except (OSError, IndexError, ValueError):
            pass
    return total


def gluster_pids(volume: gluster.Volume) -> list[int]:
    pids = list(volume.brick_pids().values())
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"glusterfs") and f"--volfile-id=/{volume.name}".encode() in cmd:
                pids.append(int(d.name))
    return pids


def headers(n: int, payload: int) -> list[ChunkHeader]:
    return [ChunkHeader(FP, ChunkKey(i.to_bytes(4, "big") * 8), 1, GroupKind.FULL_ATTENTION, i * 256, (i + 1) * 256,
                        1, payload, parent=bytes(8)) for i in range(n)]


@functools.cache
def _noise(n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8)


def store_all(data: FsData, hs: list[ChunkHeader], pool: BufferPool) -> None:
    slots = threading.BoundedSemaphore(2 * STORE_THREADS)

    def commit(h: ChunkHeader, staged: HostChunk) -> bool:
        try:
            return data.put(h, staged, Placement())
        finally:
            staged.release()
            slots.release()

    with ThreadPoolExecutor(STORE_THREADS) as ex:
        futs = []
        for h in hs:
            slots.acquire()
            staged = HostChunk.pooled(pool, h.payload_len)
            # Bytes like KV's (no run of one value the disk could treat specially), distinct per file.
            # (our copier, as the worker's gather: torch's copy would count its OpenMP threads' spinning here)
            copier.memcpy(staged.payload, _noise(h.payload_len))
            staged.payload.numpy()[:8] = list(h.key[:8])
            futs.append(ex.submit(commit, h, staged))
        for f in futs:
            assert f.result() is True
    os.sync()


def load_all(data: FsData, hs: list[ChunkHeader], pool: BufferPool) -> None:
    def one(h: ChunkHeader) -> None:
        data.get(h, Placement(), pool).release()

    with ThreadPoolExecutor(LOAD_THREADS) as ex:
        list(ex.map(one, hs))


def vllm_io(where: Path, n: int, file_bytes: int, buf: mmap.mmap, store: bool) -> None:
    """vLLM's file tier I/O: one file per entry, from / into `buf` (its CPU tier's layout)."""
    from vllm.v1.kv_offload.tiering.fs import io as vio

    where.mkdir(parents=True, exist_ok=True)  # its probe writes a file there
    direct = vio.probe_o_direct(str(where))
    view = memoryview(buf)
    op = vio.batch_store_block if store else vio.batch_load_block

    def one(i: int) -> None:
        op([str(where / f"{i % 256:02x}" / f"{i}.bin")], view, [i * file_bytes], file_bytes, direct)
    with ThreadPoolExecutor(VLLM_THREADS) as ex:
        list(ex.map(one, range(n)))
    if store:
        os.sync()


def dd(args: list[str]) -> float:
    """Seconds dd reports for its copy."""
    p = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"copied, ([0-9.]+) s", p.stderr)
    assert m, p.stderr
    return float(m.group(1))


def measure(where: Path, nbytes: int, file_bytes: int, pids: list[int],
            vllm_buf: mmap.mmap | None) -> dict[str, tuple[float, float, float]]:
    """{op: (wall s, CPU s in all, CPU s of the GlusterFS processes)} for dd write/read and our stores/loads in
    `where`."""
    out = {}
    big = where / "dd.bin"
    count = max(1, nbytes // (4 << 20))
    d0 = daemon_cpu(pids)
    s = dd(["if=/dev/zero", f"of={big}", "bs=4M", f"count={count}", "oflag=direct", "conv=fdatasync"])
    d = daemon_cpu(pids) - d0
    out["dd write"] = (s, d, d)  # dd's own CPU is a child's: only the daemons' is counted
    drop_page_cache([big])
    d0 = daemon_cpu(pids)
    s = dd([f"if={big}", "of=/dev/null", "bs=4M", "iflag=direct"])
    d = daemon_cpu(pids) - d0
    out["dd read"] = (s, d, d)
    big.unlink()
    cache = where / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    hs = headers(nbytes // file_bytes, file_bytes)
    pool = BufferPool(max_free_bytes=1 << 30)
    # Faulted in once, as a running worker's pool is: fresh pages would put page faults into the figures.
    warm = [pool.get(HEADER_LEN + file_bytes) for _ in range(LOAD_THREADS + 2 * STORE_THREADS)]
    for b in warm:
        b.fill_(0)
    for b in warm:
        pool.put(b)
    store = FileStore.open(str(cache), FP)
    data = FsData(store)
    # As the connector's registration does: the layout recorded and the directories made, before any store.
    data.record_layout({"bench": "gluster_fs", "groups": [{}, {}], "tensors": {}})
    c0, d0, t0 = cpu_seconds(), daemon_cpu(pids), time.perf_counter()
    store_all(data, hs, pool)
    d = daemon_cpu(pids) - d0
    out["ours store"] = (time.perf_counter() - t0, cpu_seconds() - c0 + d, d)
    files = [str(store.file_path(h.group, h.key)) for h in hs]
    drop_page_cache(files)
    reader = FsData(store)
    c0, d0, t0 = cpu_seconds(), daemon_cpu(pids), time.perf_counter()
    load_all(reader, hs, pool)
    d = daemon_cpu(pids) - d0
    out["ours load"] = (time.perf_counter() - t0, cpu_seconds() - c0 + d, d)
    out["_direct"] = (float(bool(data.direct)), 0.0, 0.0)
    out["_direct_reads"] = (float(reader.direct_read_count == len(hs)), 0.0, 0.0)
    store.close()
    shutil.rmtree(cache, ignore_errors=True)
    if vllm_buf is not None:
        vdir = where / "vllm"
        c0, d0, t0 = cpu_seconds(), daemon_cpu(pids), time.perf_counter()
        vllm_io(vdir, len(hs), file_bytes, vllm_buf, store=True)
        d = daemon_cpu(pids) - d0
        out["vLLM x16 store"] = (time.perf_counter() - t0, cpu_seconds() - c0 + d, d)
        drop_page_cache([str(p) for p in vdir.rglob("*.bin")])
        c0, d0, t0 = cpu_seconds(), daemon_cpu(pids), time.perf_counter()
        vllm_io(vdir, len(hs), file_bytes, vllm_buf, store=False)
        d = daemon_cpu(pids) - d0
        out["vLLM x16 load"] = (time.perf_counter() - t0, cpu_seconds() - c0 + d, d)
        shutil.rmtree(vdir, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="bytes per operation (MiB)")
    ap.add_argument("--file-mib", type=float, default=4, help="bytes per chunk file (MiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=REPO / ".cache")
    ap.add_argument("--out-dir", type=Path, default=None)
    a = ap.parse_args(argv)
    why = gluster.unavailable()
    if why:
        print(f"gluster_fs: {why}", file=sys.stderr)
        return 2
    a.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="gluster-bench.", dir=a.dir))
    nbytes, file_bytes = a.mib << 20, int(a.file_mib * (1 << 20))
    volume = gluster.Volume(base / "volume").start()
    try:
        local = base / "local"
        local.mkdir()
        mount = volume.mounts[0] / "bench"
        mount.mkdir()
        pids = gluster_pids(volume)
        try:
            import vllm.v1.kv_offload.tiering.fs.io  # noqa: F401

            vllm_buf: mmap.mmap | None = mmap.mmap(-1, (nbytes // file_bytes) * file_bytes)  # page aligned
            vllm_buf.write(os.urandom(1 << 20) * (len(vllm_buf) >> 20))  # faulted in, as a running tier's
        except ImportError:
            vllm_buf = None
        runs: dict[str, dict[str, list[tuple[float, float, float]]]] = {"local": {}, "gluster": {}}
        for _ in range(a.reps):
            for name, where, watch in (("local", local, []), ("gluster", mount, pids)):
                for op, v in measure(where, nbytes, file_bytes, watch, vllm_buf).items():
                    runs[name].setdefault(op, []).append(v)
        rows, doc_rows = [], []
        for name, ops in runs.items():
            for op in ("dd write", "dd read", "ours store", "ours load", "vLLM x16 store", "vLLM x16 load"):
                if op not in ops:
                    continue
                walls = [w for w, _, _ in ops[op]]
                cpus = [c for _, c, _ in ops[op]]
                daemons = [d for _, _, d in ops[op]]
                gbs = nbytes / GB / median(walls)
                cpu_gb = median(cpus) / (nbytes / GB)
                daemon_gb = median(daemons) / (nbytes / GB)
                rows.append([name, op, round(gbs, 3), f"{min(nbytes / GB / w for w in walls):.3f}-"
                             f"{max(nbytes / GB / w for w in walls):.3f}", round(cpu_gb, 2), round(daemon_gb, 2)])
                doc_rows.append({"fs": name, "op": op, "gb_s": gbs, "gb_s_all": [nbytes / GB / w for w in walls],
                                 "cpu_s_per_gb": cpu_gb, "gluster_cpu_s_per_gb": daemon_gb, "cpu_s_all": cpus})
        print(table(["where", "op", "GB/s (median)", "range", "CPU s/GB", "of it GlusterFS"], rows))
        path = write_results("gluster_fs", {
            "bytes_per_op": nbytes, "file_bytes": file_bytes, "reps": a.reps, "io_threads": LOAD_THREADS,
            "store_threads": STORE_THREADS, "vllm_threads": VLLM_THREADS,
            "local_fs": filesystem_of(local), "mount_fs": filesystem_of(mount),
            "volume": "GlusterFS replica 2, both bricks in directories on the local filesystem, one FUSE mount",
            "gluster_version": subprocess.run(["glusterfs", "--version"], capture_output=True,
                                              text=True).stdout.splitlines()[0],
            "o_direct_stores": {k: bool(v["_direct"][0][0]) for k, v in runs.items()},
            "o_direct_loads": {k: all(r[0] for r in v["_direct_reads"]) for k, v in runs.items()},
            "cpu_counts": "this process (stores, loads); on the mount also the GlusterFS client and brick "
                          "processes (gluster_cpu_s_per_gb: theirs alone); dd rows: the GlusterFS processes only "
                          "(0 locally)", "loadavg_at_end": os.getloadavg()[0],
            "rows": doc_rows}, a.out_dir)
        print(f"wrote {path}")
    finally:
        volume.close()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
