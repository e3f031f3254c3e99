"""The worker's load pipeline.

Contract: `start(job)` reads a request's files entirely on the load threads,
one task per file, so a request's files are read at once; it never blocks
the forward path. A request waits for its load in WAITING_FOR_REMOTE_KVS, so
its destination blocks are ours alone. Each file is read (from the pooled
copy of a write still queued to its tier, which `WritesInFlight` holds,
else from the tier), verified by the tier, and scattered into the KV cache;
the bytes read from a slower tier are handed to the store path, which puts
them into the faster tiers the scheduler reserved (promotion), from the
same read, on its store threads: the request's load does not wait for it.
A request is a hit only if every file was restored; all its files are read
regardless, so every bad one is found (and quarantined) in the same
pass, and a failed request is reported with the gravest of its reasons. A
file tier's payload CRC (O_DIRECT reads, no key) is checked in the scatter's
own pass over the bytes (`TierData.get_to_scatter`), and so is a MAC's hash where the copier hashes.
`results()` hands back the requests finished since the last call.

Loads get their own pool (`io_threads` threads, made here): a load blocks a
request, a store blocks nobody, so loads never queue behind stores; at the
device the stores' writes have the idle I/O class (the store threads run at
SCHED_IDLE). bench.fs_tier measures a load during stores. Every
event is counted in the tier's Recorder (offload/metrics.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from vllm.logger import init_logger

from offload.config import OffloadConfig
from offload.connector.cpus import run_on
from offload.connector.in_flight import WritesInFlight
from offload.connector.metadata import LoadJob, TierSlot
from offload.connector.registration import KVCache
from offload.connector.warm import WarmReader
from offload.metrics import Recorder
from offload.store.base import ChunkMiss, HostChunk, MissReason, Placement
from offload.store.format import ChunkHeader

logger = init_logger(__name__)

# A failed request's reason when several of its files failed: the gravest
# first (a bug, then a file that is bad for good, then one that may be fine).
_GRAVITY = (MissReason.ERROR, MissReason.UNSAFE, MissReason.UNAUTHENTICATED, MissReason.CORRUPT,
            MissReason.IO_ERROR, MissReason.MISSING, MissReason.ALLOCATION_MISMATCH)


@dataclass
class _LoadRun:
    """One request's load in flight: its files are read in parallel, and the
    last one to finish resolves `result` (None, or the request's MissReason)."""

    job: LoadJob
    result: Future[MissReason | None] = field(default_factory=Future)
    lock: threading.Lock = field(default_factory=threading.Lock)
    left: int = 0
    t0: float | None = None
    failures: dict[int, tuple[int, MissReason]] = field(default_factory=dict)  # file index -> (tier, reason)
    moved: list[tuple[int, str, int]] = field(default_factory=list)  # (tier, group kind, bytes) scattered

    def __post_init__(self) -> None:
        self.left = len(self.job.entries)


class LoadPipeline:
    def __init__(self, cfg: OffloadConfig, kv: KVCache, writes: WritesInFlight,
                 promote: Callable[[TierSlot, ChunkHeader, HostChunk, bool], bool], recorders: list[Recorder],
                 cpus: frozenset[int] | None = None) -> None:
        self.kv = kv
        self.writes = writes  # a write still queued: its copy is read instead
        # A promotion is a store: handed to the store path (`StorePath.promote`), True where it was put
        # or queued; `now`: put before it returns (warm start's slot, whose outcome it reports).
        self._promote = promote
        self.recorders = recorders
        # `cpus`: where the load threads run (offload/connector/cpus.py; None: where they are started).
        self.pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvoffload-load", initializer=run_on,
                                       initargs=(cpus,))
        # Requests whose load is in flight or finished and not yet reported, by id.
        self.in_flight: dict[str, Future[MissReason | None]] = {}
        self.busy = 0  # files being read now (warm start waits while any is)
        self._busy_lock = threading.Lock()  # the load threads of every request change it
        self.warm: WarmReader | None = None  # set by the worker: entries warm start holds or will hold

    def start(self, job: LoadJob) -> None:
        run = _LoadRun(job)
        self.in_flight[job.req_id] = run.result
        if job.fail_reason is not None or not job.entries:
            self._finish(run)
            return
        # One task per file, all on the load pool: a request's files are
        # read at once (up to io_threads), and no task ever waits for
        # another, so the pool cannot deadlock. Files of earlier requests
        # are queued first.
        for i in range(len(job.entries)):
            self.pool.submit(self._load_file, run, i)

    def results(self) -> tuple[set[str], set[str]]:
        """(finished, failed among them): the requests whose load ended since the last call."""
        done: set[str] = set()
        failed: set[str] = set()
        for req_id, fut in list(self.in_flight.items()):
            if fut.done():
                del self.in_flight[req_id]
                done.add(req_id)
                if fut.result() is not None:
                    failed.add(req_id)
        return done, failed

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _load_file(self, run: _LoadRun, i: int) -> None:
        """Read, verify and scatter file `i` of a load; the last file of the
        request to finish decides the request's result."""
        with run.lock:
            if run.t0 is None:
                run.t0 = time.perf_counter()
        with self._busy_lock:
            self.busy += 1
        try:
            failed = self._read_and_scatter(run, i)
        except Exception as e:  # a load must never take the engine down
            logger.exception("kvoffload: load of request %s failed (%s)", run.job.req_id, type(e).__name__)
            failed = (run.job.entries[i].source.tier, MissReason.ERROR)
        with self._busy_lock:
            self.busy -= 1
        with run.lock:
            if failed is not None:
                run.failures[i] = failed
            run.left -= 1
            last = run.left == 0
        if last:
            self._finish(run)

    def _read_and_scatter(self, run: _LoadRun, i: int) -> tuple[int, MissReason] | None:
        job = run.job
        entry = job.entries[i]
        ref, pairs, src = entry.file, entry.pages, entry.source
        header = self.kv.header(ref)
        kind = ref.kind.value
        t0 = time.perf_counter()
        # Warm start may hold these bytes in host memory already, or be about to read them: then the
        # load uses its copy, or takes the read over and fills warm start's slot from it (`fill`).
        warmed, fill, tier = self.warm.serve(src.tier, header) if self.warm is not None else (None, None, src.tier)
        try:
            chunk = warmed or self.writes.queued_copy(tier, header) or self.kv.tiers[tier].get_to_scatter(
                header, Placement(src.slot if tier == src.tier else None), self.kv.buffers)
        except ChunkMiss as e:
            if fill is not None and self.warm is not None:
                self.warm.filled(header, e.reason.value)
                fill = None
            return self._missed(job.req_id, tier, ref.kind.value, e)
        try:
            # Once another file of the request failed, the request is
            # recomputed: its pages are not worth a copy, but every file is
            # still verified (each bad one is found in this pass), and the
            # verified bytes still fill the slots reserved for them in faster tiers.
            # A CRC or a MAC's hash the tier left to us (`crc_due`, `mac_due`) is
            # taken in the scatter's own pass over the bytes: a mismatch fails the
            # request, whose blocks vLLM then frees uncached and recomputes.
            if not run.failures:
                t1 = time.perf_counter()
                ghash = chunk.mac_due.ghash if chunk.mac_due is not None else None
                crc = self.kv.pages[ref.group].scatter(chunk.payload, ref.num_pages, pairs,
                                                       crc=chunk.crc_due is not None, ghash=ghash)
                chunk.check(crc, mac_fed=ghash is not None)
                t2 = time.perf_counter()
                # Where a restore's time goes, per group kind (read vs scatter; promotion is neither).
                self.recorders[src.tier].inc("kvoffload_load_read_seconds", t1 - t0, group_kind=kind)
                self.recorders[src.tier].inc("kvoffload_load_scatter_seconds", t2 - t1, group_kind=kind)
                with run.lock:
                    run.moved.append((src.tier, ref.kind.value, len(pairs) * self.kv.pages[ref.group].page_bytes))
            else:
                chunk.check()
            for up in entry.promote:
                self._promote(up, header, chunk, False)
            if fill is not None and self.warm is not None:
                self.warm.filled(header, None if self._promote(fill, header, chunk, True) else "no_room")
                fill = None
        except ChunkMiss as e:
            if fill is not None and self.warm is not None:
                self.warm.filled(header, e.reason.value)
                fill = None
            return self._missed(job.req_id, src.tier, ref.kind.value, e)
        finally:
            if fill is not None and self.warm is not None:
                self.warm.filled(header, MissReason.ERROR.value)
            if warmed is not None and self.warm is not None:
                self.warm.unserve(header)
            chunk.release()
        return None

    def _missed(self, req_id: str, tier: int, kind: str, e: ChunkMiss) -> tuple[int, MissReason]:
        """Count and log one file's miss; the request fails with its reason."""
        self.recorders[tier].inc("kvoffload_chunk_misses", reason=e.reason.value)
        if e.reason is MissReason.CORRUPT:
            self.recorders[tier].inc("kvoffload_checksum_failures", group_kind=kind)
        logger.warning("kvoffload: load of request %s is a miss (%s); it will be recomputed", req_id, e)
        return tier, e.reason

    def _finish(self, run: _LoadRun) -> None:
        """A request's load is done: a hit only if every file was restored."""
        job = run.job
        if job.fail_reason is not None:
            logger.info("kvoffload: load of request %s is a miss (%s: %s); it will be recomputed",
                        job.req_id, job.fail_reason.value, job.fail_detail)
            failed: tuple[int, MissReason] | None = (job.entries[-1].source.tier if job.entries else 0,
                                                     job.fail_reason)
        elif run.failures:
            # Every file was read, so every bad one was found (and counted,
            # and quarantined) in this pass; the request's reason is the
            # gravest of them, whatever the order the files finished in.
            failed = min(run.failures.values(), key=lambda f: _GRAVITY.index(f[1]))
        else:
            failed = None
            for tier, kind, moved in run.moved:
                self.recorders[tier].inc("kvoffload_restored_bytes", moved, group_kind=kind)
            elapsed = time.perf_counter() - (run.t0 if run.t0 is not None else time.perf_counter())
            for t in {e.source.tier for e in job.entries} or {0}:
                self.recorders[t].observe("kvoffload_load_seconds", elapsed)
        if failed is not None:
            tier, reason = failed
            self.recorders[tier].inc("kvoffload_failed_loads", reason=reason.value)
        run.result.set_result(failed[1] if failed is not None else None)
