"""The tier stack's one gather per entry, against two independent connectors
(an `OffloadMultiConnector` with a CPU child and a file child, each child
gathering every entry itself), and the stack's store/load GB/s
against each tier alone, in the same run.

Drives the real worker half (`offload.connector.worker.WorkerSide`) and the
real tier indices on a synthetic hybrid KV cache (bench/kvsynth.py): the
forward path is `wait_for_save` (the gathers); a store is complete when its
last tier has it; loads read every entry back into other blocks.

Configurations, alternating within each repetition:
- cpu: the host-memory tier alone;
- fs: the file tier alone;
- stack: host memory, then files (write-through from the host copy);
- two-connectors: the cpu and fs tiers as two workers, each gathering (our
  MultiConnector with two of our children and no shared gather);
- two-connectors-shared: the same with the MultiConnector's `GatherShare`
  (the first child gathers, the second copies its host bytes).
Loads: stack from host memory (after a reset), stack after a restart (host
memory empty: from files, with promotion into host memory), each tier alone.

Write-through vs write-behind (files written only when host memory evicts an
entry) is reported from the same store stream: bytes written to files and
what a restart could restore.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import GB, drop_page_cache, median, table, write_results
from bench.kvsynth import CHUNK, TINY, HybridKV, Shape
from offload.config import parse_config
from offload.connector.metadata import FileRef, LoadEntry, LoadJob, OffloadMetadata, StoreJob, TierSlot
from offload.connector.worker import WorkerSide
from offload.keys import Fingerprint
from offload.metrics import Recorder
from offload.multi_connector.share import GatherShare
from offload.planner import GroupSpec, HybridOffloadPlanner
from offload.store.base import TierContext, TierIndex
from offload.store.cachedir.owners import CacheDirs
from offload.store.cachedir.paths import CHUNK_SUFFIX
from offload.store.stack import build_stack

FP = Fingerprint(b"\x07" * 32)


def planner_for(kv: HybridKV) -> HybridOffloadPlanner:
    s = kv.shape
    specs = [GroupSpec(g.kind, CHUNK if g.index == 0 else s.block, g.pages.page_bytes, 1) for g in kv.groups]
    return HybridOffloadPlanner(specs, CHUNK)


class Counting:
    """Counts the bytes and seconds of every gather out of the KV cache."""

    def __init__(self, kv: HybridKV) -> None:
        self.bytes = 0
        self.seconds = 0.0
        for g in kv.groups:  # both ways out of the KV cache: `gather`, and `gather_crc` (the CRC in its pass)
            for name in ("gather", "gather_crc"):
                setattr(g.pages, name, self._counted(getattr(g.pages, name), g.pages.page_bytes))

    def _counted(self, fn, page_bytes: int):
        def counted(ids, *args, **kwargs):
            t0 = time.perf_counter()
            r = fn(ids, *args, **kwargs)
            self.seconds += time.perf_counter() - t0
            self.bytes += len(ids) * page_bytes
            return r
        return counted


def build(kv: HybridKV, tiers: list[dict], cache: Path) -> tuple[WorkerSide, list[TierIndex]]:
    """One connector's worker half and its tiers' indices (bottom-up, as the connector builds them)."""
    for t in tiers:
        if t["store"] == "fs":
            t["path"] = str(cache / t.get("name", "fs"))
    cfg = parse_config({"tiers": tiers, "io_threads": 4, "max_pending_store_bytes": 1 << 40})
    planner = planner_for(kv)
    stack = build_stack([(t.store, t.options()) for t in cfg.tiers], TierContext(planner, FP, FP, dirs=CacheDirs()))
    stack.check()
    indices = stack.indices()
    worker = WorkerSide(cfg, planner, FP, stack.data, [[], []], [Recorder(t.tier_name) for t in cfg.tiers])
    worker.pages = [g.pages for g in kv.groups]
    worker.tiers = stack.data(torch.device("cpu"))
    return worker, indices


def kv_files(cache: Path) -> list[str]:
    return [str(p) for p in cache.rglob(f"*{CHUNK_SUFFIX}")]


def ref(kv: HybridKV, c: int, g) -> FileRef:
    return FileRef(g.index, g.kind, kv.keys[c], c * CHUNK, (c + 1) * CHUNK, len(g.ids[c]),
                   kv.keys[c - 1][:8] if c else bytes(8))


def store_all(kv: HybridKV, workers: list[tuple[WorkerSide, list[TierIndex]]],
              share: GatherShare | None = None) -> tuple[float, float]:
    """(forward-path seconds, seconds until every tier has every entry)."""
    t0 = time.perf_counter()
    forward = 0.0
    for c in range(kv.chunks):
        if share is not None:
            share.clear()  # what the MultiConnector does after each step
        for w, indices in workers:
            meta = OffloadMetadata()
            for g in kv.groups:
                parent = kv.keys[c - 1] if c else None
                targets = []
                for t, ix in enumerate(indices):
                    p = ix.reserve(g.index, kv.keys[c], parent)
                    if p is not None:
                        targets.append(TierSlot(t, p.slot))
                if targets:
                    meta.stores.append(StoreJob("r", ref(kv, c, g), tuple(g.ids[c]), tuple(targets)))
            f0 = time.perf_counter()
            w.wait_for_save(meta)
            forward += time.perf_counter() - f0
    if share is not None:
        share.clear()
    for w, _ in workers:
        while w.stores.in_flight:
            time.sleep(0.001)
    return forward, time.perf_counter() - t0


def load_all(kv: HybridKV, worker: WorkerSide, indices: list[TierIndex]) -> tuple[float, dict[int, int]]:
    """Load every entry into its blocks (zeroed first) and check the bytes; (seconds, entries per tier)."""
    def snapshot() -> list[torch.Tensor]:  # what a restore must bring back (Mamba padding is not part of a page)
        return [g.pages.gather([b for ids in g.ids for b in ids]) for g in kv.groups]
    expect = snapshot()
    kv.zero()
    jobs, per_tier = [], {}
    for c in range(kv.chunks):
        entries = []
        for g in kv.groups:
            src = None
            for t, ix in enumerate(indices):
                p = ix.pin(g.index, kv.keys[c])
                if p is not None:
                    src = TierSlot(t, p.slot)
                    break
            assert src is not None, "an entry missing from every tier"
            per_tier[src.tier] = per_tier.get(src.tier, 0) + 1
            ups = []
            for t in range(src.tier):
                p = indices[t].reserve(g.index, kv.keys[c], kv.keys[c - 1] if c else None)
                if p is not None:
                    ups.append(TierSlot(t, p.slot))
            entries.append(LoadEntry(ref(kv, c, g), tuple(enumerate(g.ids[c])), src, tuple(ups)))
        jobs.append(LoadJob(f"r{c}", tuple(entries)))
    t0 = time.perf_counter()
    worker.start_load_kv(OffloadMetadata(loads=jobs))
    done: set[str] = set()
    while len(done) < len(jobs):
        r = worker.get_transfer_results()
        assert not r.failed_recving, r.failed_recving
        done |= r.finished_recving
    seconds = time.perf_counter() - t0
    for c in range(kv.chunks):
        for t in range(len(indices)):
            for g in kv.groups:
                indices[t].unpin(g.index, kv.keys[c])
    assert all(torch.equal(a, b) for a, b in zip(snapshot(), expect)), "restored bytes differ"
    return seconds, per_tier


def write_behind_bytes(kv: HybridKV, cpu_bytes: int) -> tuple[int, int]:
    """Replay the store stream on a host index alone: entries it evicts are
    what write-behind would write; what it holds at the end is lost on a
    restart. Returns (entries evicted, entries held)."""
    w, (ix,) = build(kv, [{"store": "cpu", "cpu_bytes": cpu_bytes}], Path("/nonexistent"))
    for c in range(kv.chunks):
        for g in kv.groups:
            ix.reserve(g.index, kv.keys[c], kv.keys[c - 1] if c else None)
    u = ix.usage()
    w.shutdown()
    return sum(u.evictions), sum(u.entries)


def run(gib: float, reps: int, tiny: bool, work: Path) -> dict:
    kv = HybridKV(int(gib * 2**30), TINY if tiny else Shape(), seed=3)
    counting = Counting(kv)
    total = kv.total_bytes
    cpu_bytes = max(1 << 20, total * 5 // 4)  # room for every entry
    configs = {
        "cpu": [[{"store": "cpu", "cpu_bytes": cpu_bytes}]],
        "fs": [[{"store": "fs"}]],
        "stack": [[{"store": "cpu", "cpu_bytes": cpu_bytes}, {"store": "fs"}]],
        "two-connectors": [[{"store": "cpu", "cpu_bytes": cpu_bytes}], [{"store": "fs"}]],
        "two-connectors-shared": [[{"store": "cpu", "cpu_bytes": cpu_bytes}], [{"store": "fs"}]],
    }
    rows: dict[str, dict[str, list[float]]] = {}
    for rep in range(reps):
        for name, connectors in configs.items():
            cache = work / f"{name}{rep}"
            workers = [build(kv, [dict(t) for t in tiers], cache) for tiers in connectors]
            share = None
            if name == "two-connectors-shared":
                share = GatherShare()
                for w, _ in workers:
                    w.share_gathers(share)
            counting.bytes, counting.seconds = 0, 0.0
            forward, complete = store_all(kv, workers, share)
            r = rows.setdefault(name, {})
            r.setdefault("gather_bytes_per_chunk", []).append(counting.bytes / kv.chunks)
            r.setdefault("gather_ms_per_chunk", []).append(counting.seconds / kv.chunks * 1e3)
            r.setdefault("forward_ms_per_chunk", []).append(forward / kv.chunks * 1e3)
            r.setdefault("store_GBps", []).append(total / complete / GB)
            # Loads: from the fastest tier that holds each entry (the first connector's).
            w, ix = workers[0]
            drop_page_cache(kv_files(cache))
            secs, _ = load_all(kv, w, ix)
            r.setdefault("load_GBps", []).append(total / secs / GB)
            if name == "stack":  # a restart: host memory empty, files serve, host memory is refilled
                for w2, _ in workers:
                    w2.shutdown()
                w, ix = build(kv, [{"store": "cpu", "cpu_bytes": cpu_bytes}, {"store": "fs"}], cache)
                drop_page_cache(kv_files(cache))
                secs, per_tier = load_all(kv, w, ix)
                assert per_tier == {1: kv.chunks * len(kv.groups)}, per_tier
                r.setdefault("restart_load_GBps", []).append(total / secs / GB)
                secs, per_tier = load_all(kv, w, ix)  # promoted: now from host memory
                assert per_tier == {0: kv.chunks * len(kv.groups)}, per_tier
                r.setdefault("promoted_load_GBps", []).append(total / secs / GB)
                workers = [(w, ix)]
            for w2, _ in workers:
                w2.shutdown()
            shutil.rmtree(cache, ignore_errors=True)
    evicted, held = write_behind_bytes(kv, total // 2)
    entries = kv.chunks * len(kv.groups)
    summary = {name: {k: median(v) for k, v in r.items()} for name, r in rows.items()}
    return {
        "bytes": total, "chunks": kv.chunks, "reps": reps, "runs": rows, "median": summary,
        "write_policy_half_host": {
            "entries": entries,
            "write_through_entries_written": entries, "write_through_restorable_after_restart": entries,
            "write_behind_entries_written": evicted, "write_behind_restorable_after_restart": evicted,
            "write_behind_lost_on_restart": held,
        },
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=0.5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tiny", action="store_true", help="small shapes (tests)")
    ap.add_argument("--dir", default=None, help="directory for the file tier (default: a temporary one)")
    ap.add_argument("--out", default=None, help="results directory (default bench/results)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tier-stack-", dir=args.dir)).resolve()
    try:
        res = run(args.gib, args.reps, args.tiny, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    cols = ["gather_bytes_per_chunk", "gather_ms_per_chunk", "forward_ms_per_chunk", "store_GBps", "load_GBps",
            "restart_load_GBps", "promoted_load_GBps"]
    print(table(["config", *cols], [[n, *(f"{m.get(c, float('nan')):.3g}" for c in cols)]
                                    for n, m in res["median"].items()]))
    print("write policy, host memory = half the working set:", res["write_policy_half_host"])
    write_results("tier_stack", res, Path(args.out) if args.out else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
