"""Cost at scale: a cache directory of N real chunk files (default 1,000,000).

The directory holds N/16 prompts, each a chain of 8 chunks with two files per
chunk (full attention, which names its parent, and a Mamba state), with small
payloads and real headers: the same bytes `FileStore.write` writes (checked
on a sample), written directly under their final names because that is
faster. Measured per operation, medians of --reps:

- lookup: `FileStore.contains` of stored and of absent chunks, with warm
  and with dropped dentry/inode caches;
- store: `FileStore.write_framed` of a new chunk (temporary file, rename,
  ledger record), with this instance's account loaded, and without any;
- eviction: the budget evicting ~1% of the files, per evicted file, by the
  ledger's incremental queue and by the pre-ledger implementation
  (offload/store/budget.py at `LEGACY_REV`, read from git: it walks and
  rebuilds its heap every round);
- accounting: one pass of the pre-ledger walk (what it ran every
  max(0.1 s, 20 x its duration), and inline in a writer every second), against
  the ledger's pass (tail of every log; idle, and with another instance's new
  records), its start-up (snapshot + logs), its compaction (snapshot) and its
  rare reconcile walk. Memory is the RSS growth of building each index.

`python -m bench.scale [--files N] [--dir D]`; the JSON goes to
bench/results/scale.json. The directory is deleted at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import drop_page_cache, filesystem_of, table, write_results
from offload import copier
from offload.keys import ChunkKey, Fingerprint
from offload.planner import GroupKind
from offload.store.base import HostChunk
from offload.store.buffers import BufferPool
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.paths import chunk_path, chunk_rel
from offload.store.files import FileStore
from offload.store.format import HEADER_LEN, ChunkHeader

FP = Fingerprint(hashlib.sha256(b"kvoffload bench scale").digest())
DEPTH = 8
GDN, ATTN = 0, 1
PAYLOAD = {GDN: 128, ATTN: 256}  # bytes; small, so that the directory is metadata-bound


# offload/store/budget.py before the ledger: every pass walks the whole
# layout directory and every eviction round rebuilds its leaf heap.
LEGACY_REV = "719a14d"
REPO = Path(__file__).resolve().parent.parent


@functools.cache
def legacy_budget_class() -> Any:
    """The pre-ledger `DirBudget` class, loaded from `git show LEGACY_REV:offload/store/budget.py`
    (it imports only offload.store.format and offload.store.hygiene.walk, both unchanged since; hygiene
    is offload.store.cachedir.hygiene now)."""
    try:
        src = subprocess.run(["git", "show", f"{LEGACY_REV}:offload/store/budget.py"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"bench.scale needs the git history (commit {LEGACY_REV}) for its baseline: {e}") from None
    src = src.replace("from offload.store.hygiene import", "from offload.store.cachedir.hygiene import")
    name = "bench_legacy_budget"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / f"{name}.py"
        path.write_text(src)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses resolve annotations through it
        spec.loader.exec_module(mod)
    return mod.DirBudget


def new_index_bytes(b: DirBudget) -> int:
    """Python object sizes (sys.getsizeof) of the ledger index: entries, LRU heap, child counts."""
    size = sys.getsizeof
    ix, q = b.index, b.index.queue
    n = size(ix.entries) + size(q._heap) + size(q._children) + size(q._parked)
    for rel, e in ix.entries.items():
        n += size(rel) + size(e) + size(e.t) + size(e.size) + (size(e.parent) if e.parent is not None else 0)
    n += sum(size(x) for x in q._heap)
    n += sum(size(k) + size(k[1]) for k in q._children)
    return n


def old_index_bytes(old: Any) -> int:
    """The same for the pre-ledger index (path -> entry; its heap is rebuilt per eviction round, not kept)."""
    size = sys.getsizeof
    n = size(old._entries)
    for path, e in old._entries.items():
        n += size(path) + size(e) + size(e.__dict__) + size(e.size) + size(e.mtime) + size(e.parent or b"")
    return n


def key(p: int, c: int) -> ChunkKey:
    return ChunkKey(hashlib.sha256(f"{p}/{c}".encode()).digest())


def header(p: int, c: int, g: int) -> ChunkHeader:
    parent = bytes(key(p, c - 1))[:8] if c and g == ATTN else bytes(8)
    kind = GroupKind.MAMBA if g == GDN else GroupKind.FULL_ATTENTION
    return ChunkHeader(FP, key(p, c), g, kind, c * 256, (c + 1) * 256, 1, PAYLOAD[g], parent=parent)


def payload(p: int, c: int, g: int) -> bytes:
    return (p * 131 + c * 7 + g).to_bytes(8, "little") * (PAYLOAD[g] // 8)


def framed(h: ChunkHeader, data: bytes) -> bytes:
    """What FileStore.write_framed writes: the header with the payload's CRC-32C, then the payload."""
    crc = copier.crc32c(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    return ChunkHeader(**{**h.__dict__, "payload_crc": crc}).pack() + data


def build(base: Path, n_files: int) -> tuple[FileStore, int, float]:
    """N files (a multiple of 16) and a ledger record for each, as the engines that wrote them left it."""
    store = FileStore.open(str(base), FP)
    acct = DirBudget(store.root.parent)  # the writing "engine": records only
    for g in (GDN, ATTN):
        for i in range(256):
            os.makedirs(chunk_path(store.root, g, f"{i:02x}").parent, 0o750, exist_ok=True)
    prompts = n_files // (2 * DEPTH)
    t0 = time.perf_counter()
    for p in range(prompts):
        for c in range(DEPTH):
            for g in (ATTN, GDN):
                h = header(p, c, g)
                raw = framed(h, payload(p, c, g))
                final = store.file_path(g, h.key)
                fd = os.open(final, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
                os.write(fd, raw)
                os.close(fd)
                acct.note_write(store.rel(final), len(raw), None if g == GDN else int.from_bytes(h.parent, "big"))
    acct.ledger.seal()
    return store, prompts, time.perf_counter() - t0


def check_identical(store: FileStore, scratch: Path) -> bool:
    """The fast builder's files are byte for byte what FileStore.write writes."""
    ref = dataclasses.replace(FileStore.open(str(scratch), FP), account=None)
    for p, c, g in ((0, 0, ATTN), (0, 3, ATTN), (1, 5, GDN), (2, 7, ATTN)):
        h = header(p, c, g)
        ref.write(h, torch.frombuffer(bytearray(payload(p, c, g)), dtype=torch.uint8))
        if ref.file_path(g, h.key).read_bytes() != store.file_path(g, h.key).read_bytes():
            return False
    return True


def per_op(fn, items, reps: int) -> float:
    """Median over reps of (seconds for all items / len(items))."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for it in items:
            fn(it)
        out.append((time.perf_counter() - t0) / len(items))
    return statistics.median(out)


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = fn()
    return time.perf_counter() - t0, r


def run(files: int, reps: int, dir: str | None = None, out_dir: Path | None = None, cold: bool = True) -> dict:
    files = max(32, files // (2 * DEPTH) * 2 * DEPTH)
    work = Path(tempfile.mkdtemp(prefix="kvoffload-scale-", dir=dir))
    res: dict[str, dict] = {}
    doc: dict = {"files": files, "filesystem": filesystem_of(work), "reps": reps}
    try:
        base = work / "cache"
        store, prompts, build_s = build(base, files)
        top = store.root.parent
        doc["build_s"] = round(build_s, 1)
        doc["identical_to_filestore_write"] = check_identical(store, work / "scratch")
        print(f"{files} chunk files ({prompts} prompts x {DEPTH} chunks x 2 groups) in {build_s:.0f} s on "
              f"{doc['filesystem']}; identical to FileStore.write: {doc['identical_to_filestore_write']}", flush=True)
        rng = random.Random(5)

        # ---- accounting: the old walk --------------------------------------------------------
        old = legacy_budget_class()(top, max_bytes=1 << 60)
        first_s, _ = timed(old.enforce)  # its first pass also reads every header
        passes = [timed(old.enforce)[0] for _ in range(reps)]
        res["old: walk pass (first, reads every header)"] = {"s": first_s}
        res["old: walk pass (steady)"] = {"s": statistics.median(passes)}
        old_cold = None
        if cold:
            method = drop_page_cache()
            old_cold, _ = timed(old.enforce)
            res["old: walk pass (dentry/inode caches dropped)"] = {"s": old_cold, "method": method}
        doc["old_index_bytes_per_file"] = round(old_index_bytes(old) / files, 1)
        print(f"old walk: first {first_s:.2f} s, steady {statistics.median(passes):.2f} s"
              + (f", cold {old_cold:.2f} s" if old_cold else ""), flush=True)

        # ---- accounting: the ledger --------------------------------------------------------------
        walk_s, b = timed(lambda: _loaded(DirBudget(top)))  # no snapshot yet: the first instance walks
        res["new: first start-up (no snapshot: records + walk + snapshot)"] = {"s": walk_s}
        snap = b.describe()
        doc["snapshot"] = snap
        doc["new_index_bytes_per_file"] = round(new_index_bytes(b) / files, 1)
        del old

        load_s = []
        for _ in range(reps):
            t, d = timed(lambda: _loaded(DirBudget(top)))
            assert d.walks == 0 and d.files == b.files
            load_s.append(t)
            del d
        res["new: start-up from the snapshot"] = {"s": statistics.median(load_s)}
        idle = [timed(b.sync)[0] for _ in range(max(20, reps))]
        res["new: pass (tail of every log), idle"] = {"s": statistics.median(idle)}
        other = DirBudget(top)  # another instance's records
        n_rec = min(10000, files)
        # The same chunks stored again by another engine: records of files that exist, at their sizes.
        gdn_size = HEADER_LEN + PAYLOAD[GDN]
        recs = [(chunk_rel(FP.hex(), GDN, key(p % prompts, 0).hex()), gdn_size, None) for p in range(n_rec)]
        for rel, size, parent in recs:
            other.note_write(rel, size, parent)
        t_rec, _ = timed(b.sync)
        res[f"new: pass reading {n_rec} new records"] = {"s": t_rec, "per_record_us": t_rec / n_rec * 1e6}
        # The accounting's own cost per store, without the file I/O: a record appended and folded into
        # the loaded index (names of files that do not exist, taken out again untimed).
        fake = [chunk_rel(FP.hex(), ATTN, h)
                for h in (hashlib.sha256(f"fake{i}".encode()).hexdigest() for i in range(2000 * reps))]
        out = []
        for r in range(reps):
            part = fake[r * 2000:(r + 1) * 2000]
            out.append(per_op(lambda rel: b.note_write(rel, 384, None), part, 1))
            for rel in part:
                b.note_remove(rel)
        res["new: record of a store (append + index update)"] = {"s": statistics.median(out)}
        appender = DirBudget(top)  # a process with no index loaded (a TP>1 worker): append only
        res["new: record of a store, append only"] = {
            "s": per_op(lambda rel: appender.note_write(rel, 384, None), fake[:2000], reps)}
        for rel in fake[:2000]:
            appender.note_remove(rel)
        recon_s, drift = timed(b.reconcile)
        res["new: reconcile walk (every reconcile_interval_s, one instance)"] = {"s": recon_s}
        doc["reconcile_drift"] = drift
        ck_s, _ = timed(b.checkpoint)
        res["new: checkpoint (snapshot of the index)"] = {"s": ck_s, "bytes": b.tail.snap_bytes}
        print(f"ledger: start-up {statistics.median(load_s):.2f} s, pass {statistics.median(idle) * 1e3:.3f} ms, "
              f"{n_rec} records {t_rec * 1e3:.1f} ms, reconcile {recon_s:.2f} s, snapshot {ck_s:.2f} s", flush=True)

        # ---- lookup --------------------------------------------------------------------------------
        hits = [(g, key(rng.randrange(prompts), rng.randrange(DEPTH))) for g in (ATTN, GDN) for _ in range(5000)]
        misses = [(ATTN, ChunkKey(rng.randbytes(32))) for _ in range(10000)]
        assert all(store.contains(g, k) for g, k in hits[:100])
        assert not any(store.contains(g, k) for g, k in misses[:100])
        res["lookup: contains, stored (warm)"] = {"s": per_op(lambda a: store.contains(*a), hits, reps)}
        res["lookup: contains, absent (warm)"] = {"s": per_op(lambda a: store.contains(*a), misses, reps)}
        if cold:
            out = []
            for _ in range(reps):
                drop_page_cache()
                sample = rng.sample(hits, 500)
                out.append(per_op(lambda a: store.contains(*a), sample, 1))
            res["lookup: contains, stored (caches dropped)"] = {"s": statistics.median(out)}

        # ---- store ------------------------------------------------------------------------------------
        pool = BufferPool()
        chunk = HostChunk.pooled(pool, PAYLOAD[ATTN])
        chunk.payload.copy_(torch.frombuffer(bytearray(payload(0, 0, ATTN)), dtype=torch.uint8))
        with_acct = dataclasses.replace(store, account=b, budget=None)
        bare = dataclasses.replace(store, account=None, budget=None)
        k = max(200, min(2000, files // 100))
        base_p = prompts + 10
        kinds = (("store: write_framed + ledger record (index loaded)", with_acct, 0),
                 ("store: write_framed, no ledger", bare, 1))
        out: dict[str, list[float]] = {name: [] for name, _, _ in kinds}
        for r in range(reps):  # interleaved, so that both see the same machine
            for name, st, off in kinds:
                hs = [header(base_p + (2 * r + off) * k + i, 0, ATTN) for i in range(k)]
                out[name].append(per_op(lambda h, st=st: st.write_framed(h, chunk, direct=False), hs, 1))
                if st is bare:  # never recorded: take them away again, as if they had not been written
                    for h in hs:
                        os.unlink(st.file_path(ATTN, h.key))
        for name, _, _ in kinds:
            res[name] = {"s": statistics.median(out[name])}
        stored_new = reps * k

        # ---- eviction --------------------------------------------------------------------------------
        n_evict = max(50, files // 100)
        avg = b.usage / b.files
        b.sync()
        b.low_water = 1.0
        b.max_bytes = int(b.usage - n_evict * avg)
        t_new, _ = timed(b.enforce)
        res["evict: ledger queue, per evicted file"] = {"s": t_new / max(1, b.evicted_files),
                                                         "files": b.evicted_files, "round_s": t_new}
        # The ledger's figure after stores, another instance's records and evictions, against a walk
        # (before the pre-ledger budget evicts without records).
        b.sync()
        doc["final_usage_accounted"] = b.usage
        doc["final_usage_walked"] = sum(os.lstat(os.path.join(d, n)).st_size for d, ds, ns in os.walk(top)
                                        if "ledger-v1" not in d for n in ns)
        doc["stored_during_bench"] = stored_new
        legacy = legacy_budget_class()(top, max_bytes=1 << 60, low_water=1.0)
        legacy.enforce()  # its index (first pass reads every header), not timed
        legacy.max_bytes = legacy.target = int(legacy.usage - n_evict * avg)
        t_old, _ = timed(legacy.enforce)
        res["evict: pre-ledger walk + heap rebuild, per evicted file"] = {
            "s": t_old / max(1, legacy.evicted_files), "files": legacy.evicted_files, "round_s": t_old,
            "of_which_walk_s": legacy.scan_s}
        del legacy
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc["results"] = res
    doc["loadavg_at_end"] = os.getloadavg()[0]  # the machine is shared: see machine.loadavg_at_start too
    old_pass = res["old: walk pass (steady)"]["s"]
    new_pass = res["new: pass (tail of every log), idle"]["s"]
    doc["accounting_pass_ratio_old_to_new"] = old_pass / new_pass if new_pass else None
    rows = []
    for name, r in res.items():
        s = r["s"]
        rows.append([name, f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s",
                     f"{s / files * 1e9:.0f} ns/file" if s > 0.05 else "-"])
    print(table(["operation", "cost", "per file in the tree"], rows))
    print(f"index memory per file: old {doc['old_index_bytes_per_file']} B, new {doc['new_index_bytes_per_file']} B "
          f"(sys.getsizeof of the index structures); "
          f"snapshot {doc['snapshot']['ledger_bytes']} B of ledger for {files} files; "
          f"accounted {doc['final_usage_accounted']} B, walked {doc['final_usage_walked']} B")
    print(f"wrote {write_results('scale', doc, out_dir)}")
    return doc


def _loaded(d: DirBudget) -> DirBudget:
    d.ensure_loaded()
    return d


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to build the directory (default: the system temp dir)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--no-cold", action="store_true", help="skip the measurements that drop the caches")
    a = ap.parse_args(argv)
    run(a.files, a.reps, a.dir, a.out_dir, cold=not a.no_cold)
    return 0


if __name__ == "__main__":
    sys.exit(main())
