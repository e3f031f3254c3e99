"""Worker half of the tier stack: page gather/scatter against the KV cache,
tier I/O on thread pools.

The forward path pays only one gather per finished (chunk, group) entry into
host memory (a memcpy; a D2H copy on GPUs): into the host tier's slot when the
stack has one, else into a pooled buffer. Every other tier is written from that
host copy on the I/O threads (write-through). Loads run entirely on the I/O
threads, one task per file, so a request's files are read at once: a request
waits for its load in WAITING_FOR_REMOTE_KVS, so its destination blocks are
ours alone; the bytes read from a slower tier are put into the faster tiers
the scheduler reserved (promotion), from the same read. A request is a hit only
if every file was restored; all its files are read regardless, so every bad
one is found (and quarantined) in the same pass.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from offload.config import OffloadConfig
from offload.connector.kv_gate import GatedPages, KVGate
from offload.connector.metadata import DroppedStores, FileRef, LoadJob, OffloadMetadata, StoreJob, TierSlot
from offload.copier import GroupPages, LayerPages
from offload.keys import ChunkKey, Fingerprint
from offload.metrics import DROP_REASONS, Recorder
from offload.planner import GroupKind, HybridOffloadPlanner
from offload.store.base import ChunkMiss, HostChunk, MissReason, ParentGone, Placement, TierData
from offload.store.buffers import BufferPool
from offload.store.format import ChunkHeader
from offload.tailmask import TokenMap

logger = init_logger(__name__)


@dataclass
class WorkerCounters:
    """Totals of one tier in this worker, logged at shutdown (Prometheus gets
    the same events through `Recorder`, see offload/metrics.py)."""

    loads_ok: int = 0
    loads_failed: int = 0
    chunk_misses: dict[str, int] = field(default_factory=dict)
    files_written: int = 0
    files_existing: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    read_s: float = 0.0  # loads: reading entries from the tier (verify included)
    scatter_s: float = 0.0  # loads: copying them into the KV cache
    stores_dropped: dict[str, int] = field(default_factory=dict)


# Linux scheduling policies (os has them only on Linux; _set_policy ignores them elsewhere).
_IDLE, _NORMAL = getattr(os, "SCHED_IDLE", 5), getattr(os, "SCHED_OTHER", 0)
# Dropped stores remembered for their children: far more than a step stores. One forgotten
# can leave a hole again, which costs one failed load (the recompute stores the chain again).
_MAX_HOLES = 1 << 16


def _set_policy(tid: int, policy: int) -> None:
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not permitted: the policy stays as it is
        pass


def _background_priority(tids: list[int]) -> None:
    """Store threads yield the CPU to the model: on a small CPU machine an
    I/O thread that preempts one of vLLM's OpenMP threads stalls the whole
    step. SCHED_IDLE (Linux) runs them only on otherwise idle cores; they
    still finish between steps, and overflow is dropped by policy. Each
    thread records its id so a drain can lift it (`WorkerSide.drain`)."""
    tids.append(threading.get_native_id())
    _set_policy(0, _IDLE)


def _describe(name: str, t: torch.Tensor, num_blocks: int) -> str:
    """A tensor's page layout independent of how many blocks it has: dtype,
    the dims before the block dim (segments), and the dims after it with
    their strides (one segment's bytes)."""
    d = list(t.shape).index(num_blocks)
    return f"{name}:{t.dtype}:pre{tuple(t.shape[:d])}:post{tuple(t.shape[d + 1:])}/{tuple(t.stride()[d + 1:])}"


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


class SharedGathers(ABC):
    """Host copies of entries gathered in the current step, shared by sibling
    WorkerSides in one worker (a MultiConnector's OffloadConnector children):
    the first to store an entry gathers it from the KV cache and offers its
    host copy; the next ones copy those bytes (a memcpy, never a second
    device transfer). Its owner clears it after each step's `wait_for_save`
    of every sibling."""

    @abstractmethod
    def get(self, group: int, key: bytes) -> HostChunk | None:
        """The entry's host copy offered this step, or None; valid until the owner clears it."""

    @abstractmethod
    def offer(self, group: int, key: bytes, chunk: HostChunk) -> None:
        """Keep a copy of `chunk` (a held reference of its own) unless the entry has one;
        the caller keeps and releases its own reference."""


class _Direct(NamedTuple):
    """A store's gather target in a tier's host memory (its slot)."""

    slot: TierSlot
    buffer: torch.Tensor


class WorkerSide:
    def __init__(self, cfg: OffloadConfig, planner: HybridOffloadPlanner, fingerprint: Fingerprint,
                 make_data: Callable[[torch.device], list[TierData]], layer_names: list[list[str]],
                 recorders: list[Recorder],
                 token_map: Callable[[int, torch.Tensor, int], TokenMap] | None = None) -> None:
        self.cfg = cfg
        self.recorders = recorders
        self._kinds = [g.kind.value for g in planner.groups]
        for rec in recorders:
            for reason in DROP_REASONS:  # series exist at 0 from the start
                rec.declare("kvoffload_stores_dropped", reason=reason)
            for reason in MissReason:
                rec.declare("kvoffload_failed_loads", reason=reason.value)
            for kind in set(self._kinds):
                for name in ("kvoffload_checksum_failures", "kvoffload_restored_bytes", "kvoffload_stored_bytes",
                             "kvoffload_stored_tokens", "kvoffload_stores_deduplicated",
                             "kvoffload_load_read_seconds", "kvoffload_load_scatter_seconds"):
                    rec.declare(name, group_kind=kind)
        self.planner = planner
        self.fingerprint = fingerprint
        self._make_data = make_data
        self.tiers: list[TierData] = []
        self.layer_names = layer_names
        self.pages: list[GatedPages] = []  # per group, behind the sleep-mode gate
        self._gate = KVGate()
        self.buffers = BufferPool()
        # Reads before writes: a load blocks a request, a store blocks nobody.
        # Loads get their own threads, so they never queue behind a burst of
        # stores; stores get half as many, and overflow is dropped by policy
        # (max_pending_store_bytes) rather than queued without bound.
        self._store_tids: list[int] = []
        self.load_pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvoffload-load")
        self.store_pool = ThreadPoolExecutor(max(1, cfg.io_threads // 2), thread_name_prefix="kvoffload-store",
                                             initializer=_background_priority, initargs=(self._store_tids,))
        self.counters = [WorkerCounters() for _ in recorders]
        self._lock = threading.Lock()
        self._loads: dict[str, Future[MissReason | None]] = {}
        self._stores: set[Future[None]] = set()
        # Host slots a write-through is still copying out of: a later gather
        # into the same slot (after the scheduler evicted and reused it) waits.
        self._reading: dict[tuple[int, int, int], Future[None]] = {}
        # Entries queued for the lower tiers, by (tier, group, key): a load the
        # scheduler planned from its reservation (a ledger tier records a store
        # when it plans it) reads these bytes instead of racing the write.
        self._writing: dict[tuple[int, int, bytes], HostChunk] = {}
        # Every entry on its way to a lower tier, either path, by (tier, group,
        # key) -> the write: a child's write finds its parent here (not yet a
        # file) or in the tier, and is dropped where it finds neither.
        self._queued_keys: dict[tuple[int, int, bytes], Future[None]] = {}
        self._pending_store_bytes = 0
        # Chunks whose attention store to a tier was dropped: (tier, key[:8])
        # -> the groups dropped. Every entry chained behind one is dropped
        # too (a Mamba state as well: its chunk is incomplete there), so a
        # tier never holds an entry behind a hole (lookups binary-search the
        # attention prefix).
        self._holes: OrderedDict[tuple[int, bytes], set[int]] = OrderedDict()
        # (tier, group, key) of stores and promotions dropped since the last step's report.
        self._dropped: list[tuple[int, int, bytes]] = []
        self._closed = False
        self._share: SharedGathers | None = None
        # Partial tails: per attention group, which token owns each byte of a
        # page (built at registration; None where it cannot be known).
        self._token_map = token_map
        self._token_maps: dict[int, list[TokenMap] | None] = {}
        self._tensors: dict[int, list[torch.Tensor]] = {}
        self._num_blocks = 0  # the KV cache's, set at registration

    # ---- setup ------------------------------------------------------------------

    def share_gathers(self, share: SharedGathers) -> None:
        """Take from `share` what a sibling gathered this step, and offer it
        what this worker gathers (see SharedGathers). Call before the first
        `wait_for_save`; once set, for the worker's life."""
        self._share = share

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                           layout: dict) -> None:
        self._num_blocks = num_blocks
        tensors: dict[str, list[str]] = {}
        for g, names in enumerate(self.layer_names):
            layers: list[LayerPages] = []
            for name in names:
                t = kv_caches[name]
                for part in t if isinstance(t, (list, tuple)) else [t]:
                    layers.append(LayerPages.from_tensor(part, num_blocks))
                    self._tensors.setdefault(g, []).append(part)
                    tensors.setdefault(f"g{g}", []).append(_describe(name, part, num_blocks))
            device = (kv_caches[names[0]][0] if isinstance(kv_caches[names[0]], (list, tuple))
                      else kv_caches[names[0]]).device
            pages = GroupPages(layers, num_blocks, device)
            expected = self.planner.groups[g].page_bytes
            if pages.page_bytes != expected:
                raise RuntimeError(
                    f"KV cache group {g}: registered tensors hold {pages.page_bytes} bytes per block, "
                    f"the KV cache spec says {expected}; this backend's layout is not supported"
                )
            self.pages.append(GatedPages(pages, self._gate))
        # Pinned where the copy kernel reads or writes host memory from CUDA.
        self.buffers = BufferPool(pinned=device.type == "cuda")
        self.tiers = self._make_data(device)
        for i, tier in enumerate(self.tiers):
            tier.record_layout({**layout, "tensors": tensors})
            tier.queued = partial(self._queued_write, i)
        # Map partial tails' attention pages now, at start-up: the first tail store would
        # otherwise probe them inside the step that returns its prompt's first token (tens of
        # ms on 1152-token blocks, paid by the first request after every restart).
        unit = self.planner.tail_unit
        for g, spec in enumerate(self.planner.groups):
            if unit and spec.kind is GroupKind.FULL_ATTENTION and spec.block_size % unit == 0 \
                    and unit < spec.block_size:
                self._maps(g)

    @property
    def token_mapped_groups(self) -> list[int]:
        """Attention groups whose partial-tail token maps are built."""
        return sorted(g for g, m in self._token_maps.items() if m is not None)

    def release_kv_caches(self) -> bool:
        """vLLM is about to release the KV cache (sleep mode): wait for the
        copies in progress, refuse later ones (KVCacheReleased: a load becomes
        a miss, a store is dropped) and drop the page tables with their raw
        addresses. False where it is released already."""
        if not self._gate.open:
            return False
        self._gate.close()
        for p in self.pages:
            p.drop()
        return True

    def retake_kv_caches(self) -> bool:
        """vLLM mapped the KV cache again: page tables from the same tensors'
        current addresses, then copies are allowed. False where it was not released."""
        if self._gate.open:
            return False
        for p in self.pages:
            p.retake()
        self._gate.reopen()
        return True

    # ---- loads ------------------------------------------------------------------

    def _header(self, ref: FileRef) -> ChunkHeader:
        return ChunkHeader(
            fingerprint=self.fingerprint, key=ChunkKey(ref.key), group=ref.group, kind=ref.kind,
            token_start=ref.token_start, token_end=ref.token_end, num_pages=ref.num_pages,
            page_bytes=self.pages[ref.group].page_bytes, parent=ref.parent, parent_key=ref.parent_key,
        )

    def _count(self, tier: int, field_name: str, n: int = 1, key: str | None = None) -> None:
        with self._lock:
            c = self.counters[tier]
            if key is None:
                setattr(c, field_name, getattr(c, field_name) + n)
            else:
                d = getattr(c, field_name)
                d[key] = d.get(key, 0) + n

    def start_load_kv(self, meta: OffloadMetadata) -> None:
        for job in meta.loads:
            run = _LoadRun(job)
            self._loads[job.req_id] = run.result
            if job.fail_reason is not None or not job.entries:
                self._finish(run)
                continue
            # One task per file, all on the load pool: a request's files are
            # read at once (up to io_threads), and no task ever waits for
            # another, so the pool cannot deadlock. Files of earlier requests
            # are queued first.
            for i in range(len(job.entries)):
                self.load_pool.submit(self._load_file, run, i)

    def _load_file(self, run: _LoadRun, i: int) -> None:
        """Read, verify and scatter file `i` of a load; the last file of the
        request to finish decides the request's result."""
        with run.lock:
            if run.t0 is None:
                run.t0 = time.perf_counter()
        try:
            failed = self._read_and_scatter(run, i)
        except Exception as e:  # a load must never take the engine down
            logger.exception("kvoffload: load of request %s failed (%s)", run.job.req_id, type(e).__name__)
            failed = (run.job.entries[i].source.tier, MissReason.ERROR)
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
        header = self._header(ref)
        kind = ref.kind.value
        t0 = time.perf_counter()
        try:
            chunk = self._queued(src.tier, header) or self.tiers[src.tier].get(header, Placement(src.slot),
                                                                               self.buffers)
        except ChunkMiss as e:
            self._count(src.tier, "chunk_misses", key=e.reason.value)
            self.recorders[src.tier].inc("kvoffload_chunk_misses", reason=e.reason.value)
            if e.reason is MissReason.CORRUPT:
                self.recorders[src.tier].inc("kvoffload_checksum_failures", group_kind=ref.kind.value)
            logger.warning("kvoffload: load of request %s is a miss (%s); it will be recomputed", job.req_id, e)
            return src.tier, e.reason
        try:
            # Once another file of the request failed, the request is
            # recomputed: its pages are not worth a copy. The verified bytes
            # still fill the slots reserved for them in faster tiers.
            if not run.failures:
                t1 = time.perf_counter()
                self.pages[ref.group].scatter(chunk.payload, ref.num_pages, pairs)
                t2 = time.perf_counter()
                # Where a restore's time goes, per group kind (read vs scatter; promotion is neither).
                self._count(src.tier, "read_s", t1 - t0)
                self._count(src.tier, "scatter_s", t2 - t1)
                self.recorders[src.tier].inc("kvoffload_load_read_seconds", t1 - t0, group_kind=kind)
                self.recorders[src.tier].inc("kvoffload_load_scatter_seconds", t2 - t1, group_kind=kind)
                with run.lock:
                    run.moved.append((src.tier, ref.kind.value, len(pairs) * self.pages[ref.group].page_bytes))
            for up in entry.promote:
                self._promote(up, header, chunk)
        finally:
            chunk.release()
        return None

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
                self._count(tier, "bytes_read", moved)
                self.recorders[tier].inc("kvoffload_restored_bytes", moved, group_kind=kind)
            elapsed = time.perf_counter() - (run.t0 if run.t0 is not None else time.perf_counter())
            for t in {e.source.tier for e in job.entries} or {0}:
                self.recorders[t].observe("kvoffload_load_seconds", elapsed)
        if failed is not None:
            tier, reason = failed
            self.recorders[tier].inc("kvoffload_failed_loads", reason=reason.value)
        run.result.set_result(failed[1] if failed is not None else None)

    def _queued(self, tier: int, header: ChunkHeader) -> HostChunk | None:
        """The entry's bytes while its write to `tier` is still queued (held), else None."""
        with self._lock:
            chunk = self._writing.get((tier, header.group, bytes(header.key)))
            return chunk.hold() if chunk is not None else None

    def _promote(self, up: TierSlot, header: ChunkHeader, chunk: HostChunk) -> None:
        """Put a loaded entry into a faster tier; a failure costs only the promotion."""
        t0 = time.perf_counter()
        try:
            self._wait_reading(up, header.group)
            if self.tiers[up.tier].put(header, chunk, Placement(up.slot)):
                self._stored(up.tier, header, chunk.payload.numel(), t0)
        except Exception as e:
            logger.warning("kvoffload: promotion of %s dropped: %s", header.key.hex()[:16], e)
            self._drop(up.tier, "error")
            with self._lock:
                self._dropped.append((up.tier, header.group, bytes(header.key)))

    # ---- stores -----------------------------------------------------------------

    def _drop_store(self, tier: int, entry: ChunkHeader | FileRef, reason: str) -> None:
        """A store of `entry` to `tier` will not land: count it, and note the
        hole where the entry is a link of the attention chain (a missing
        Mamba state only shortens a hit)."""
        self._drop(tier, reason)
        with self._lock:
            self._dropped.append((tier, entry.group, bytes(entry.key)))
            if entry.kind is not GroupKind.MAMBA:
                self._holes.setdefault((tier, bytes(entry.key[:8])), set()).add(entry.group)
                while len(self._holes) > _MAX_HOLES:
                    self._holes.popitem(last=False)

    def _behind_hole(self, tier: int, header: ChunkHeader) -> bool:
        """Is the chunk this entry chains from incomplete on `tier` by a
        dropped store? (Otherwise the entry is about to be written: the hole
        it fills, if any, is gone.)"""
        with self._lock:
            if header.parent != bytes(8) and self._holes.get((tier, bytes(header.parent))):
                return True
            if header.kind is not GroupKind.MAMBA:
                k = (tier, bytes(header.key[:8]))
                dropped = self._holes.get(k)
                if dropped is not None:
                    dropped.discard(header.group)
                    if not dropped:
                        del self._holes[k]
            return False

    def _drop(self, tier: int, reason: str, n: int = 1) -> None:
        self._count(tier, "stores_dropped", n, key=reason)
        self.recorders[tier].inc("kvoffload_stores_dropped", n, reason=reason)

    def _stored(self, tier: int, header: ChunkHeader, nbytes: int, t0: float) -> None:
        with self._lock:
            self.counters[tier].files_written += 1
            self.counters[tier].bytes_written += nbytes
        kind = header.kind.value
        rec = self.recorders[tier]
        rec.inc("kvoffload_stored_bytes", nbytes, group_kind=kind)
        rec.inc("kvoffload_stored_tokens", header.token_end - header.token_start, group_kind=kind)
        rec.observe("kvoffload_store_seconds", time.perf_counter() - t0, group_kind=kind)

    def wait_for_save(self, meta: OffloadMetadata) -> None:
        for job in meta.stores:
            if self._closed:
                for t in job.targets:
                    self._drop(t.tier, "shutdown")
                continue
            try:
                self._save(job)
            except Exception:
                logger.exception("kvoffload: gather for request %s failed", job.req_id)
                for t in job.targets:
                    self._drop_store(t.tier, job.file, "error")

    def _save(self, job: StoreJob) -> None:
        """One gather on the forward path; the other targets are written from
        that host copy on the store threads."""
        header = self._header(job.file)
        t0 = time.perf_counter()
        n = len(job.block_ids) * self.pages[job.file.group].page_bytes
        shared = self._share.get(header.group, header.key) if self._share is not None else None
        direct, rest = self._split_targets(header, job.targets)
        for t in [t for t in rest if self._behind_hole(t.tier, header)]:
            rest.remove(t)
            self._drop_store(t.tier, header, "parent_dropped")
        if direct is not None:
            self._gather_direct(job, header, direct, shared, n, t0)
        else:
            # Skip the gather where every other tier holds the entry already (one
            # stat, e.g. an earlier run stored a prefix vLLM's own cache held).
            rest = [t for t in rest if not self.tiers[t.tier].holds(header, Placement(t.slot))]
        if not rest:
            return
        if not self._admit(n):
            for t in rest:
                self._drop_store(t.tier, header, "backpressure")
            return
        if direct is not None:
            self._dispatch_write_through(header, direct, rest, n, t0)
            return
        try:
            chunk = self._gather_pooled(job, header, shared, n)
        except BaseException:
            self._release(n)
            raise
        self._dispatch_write(header, chunk, rest, n, t0)

    def _split_targets(self, header: ChunkHeader,
                       targets: tuple[TierSlot, ...]) -> tuple[_Direct | None, list[TierSlot]]:
        """The first target that offers its host memory to gather into, and the others."""
        direct: _Direct | None = None
        rest: list[TierSlot] = []
        for t in targets:
            buffer = self.tiers[t.tier].gather_target(header, Placement(t.slot)) if direct is None else None
            if buffer is not None:
                direct = _Direct(t, buffer)
            else:
                rest.append(t)
        return direct, rest

    def _gather(self, job: StoreJob, out: torch.Tensor, shared: HostChunk | None) -> bool:
        """The entry's bytes into `out`: a sibling connector's copy of this
        step where there is one, else one gather from the KV cache (a partial
        tail masked). True where it gathered."""
        if shared is not None:
            out.copy_(shared.payload)
            return False
        self.pages[job.file.group].gather(job.block_ids, out=out)
        self._mask_tail(job.file, out)
        return True

    def _gather_direct(self, job: StoreJob, header: ChunkHeader, direct: _Direct, shared: HostChunk | None,
                       n: int, t0: float) -> None:
        """Gather into a host tier's slot: that tier's store is done."""
        self._wait_reading(direct.slot, header.group)
        if self._gather(job, direct.buffer, shared) and self._share is not None:
            # A pooled copy, not the slot: a later store or promotion may reuse the slot.
            copy = HostChunk.pooled(self.buffers, n)
            copy.payload.copy_(direct.buffer)
            self._share.offer(header.group, header.key, copy)
            copy.release()
        self.tiers[direct.slot.tier].gathered(header, Placement(direct.slot.slot))
        self._stored(direct.slot.tier, header, n, t0)

    def _gather_pooled(self, job: StoreJob, header: ChunkHeader, shared: HostChunk | None, n: int) -> HostChunk:
        """Gather into a pooled host buffer (no tier offered its memory)."""
        chunk = HostChunk.pooled(self.buffers, n)
        try:
            if self._gather(job, chunk.payload, shared) and self._share is not None:
                self._share.offer(header.group, header.key, chunk)
        except BaseException:
            chunk.release()
            raise
        return chunk

    def _admit(self, nbytes: int) -> bool:
        """Count a store's bytes as pending, unless that passes max_pending_store_bytes."""
        with self._lock:
            if self._pending_store_bytes + nbytes > self.cfg.max_pending_store_bytes:
                return False
            self._pending_store_bytes += nbytes
            return True

    def _dispatch_write(self, header: ChunkHeader, chunk: HostChunk, targets: list[TierSlot], n: int,
                        t0: float) -> None:
        """Write a pooled host copy to `targets` on the store threads; a load
        planned meanwhile reads the queued copy (`_queued`)."""
        with self._lock:
            for t in targets:
                self._writing[(t.tier, header.group, bytes(header.key))] = chunk
        self._track(self.store_pool.submit(self._write, header, chunk, targets, n, t0), header, targets)

    def _dispatch_write_through(self, header: ChunkHeader, direct: _Direct, targets: list[TierSlot], n: int,
                                t0: float) -> None:
        """Write a host tier's slot through to `targets` on the store threads;
        a later gather into the same slot waits for it (`_wait_reading`)."""
        fut = self.store_pool.submit(self._write_through, header, direct.buffer, targets, n, t0)
        with self._lock:
            self._reading[(direct.slot.tier, header.group, direct.slot.slot)] = fut
        self._track(fut, header, targets)

    def _queued_write(self, tier: int, group: int, key: bytes) -> Future[None] | None:
        """The write still taking an entry to `tier`, if one is queued or running."""
        with self._lock:
            fut = self._queued_keys.get((tier, group, key))
        return fut if fut is not None and not fut.done() else None

    def _track(self, fut: Future[None], header: ChunkHeader, targets: list[TierSlot]) -> None:
        keys = [(t.tier, header.group, bytes(header.key)) for t in targets]
        with self._lock:
            self._stores.add(fut)
            # Registered before any later store is submitted: a child finds its parent's write.
            for k in keys:
                self._queued_keys[k] = fut
        fut.add_done_callback(partial(self._forget, keys=keys))

    def _maps(self, group: int) -> list[TokenMap] | None:
        """Token maps of a group's layers (one per registered tensor), or None."""
        if group not in self._token_maps:
            maps: list[TokenMap] | None = None
            if self._token_map is not None:
                try:
                    by_shape: dict[tuple, TokenMap] = {}
                    maps = []
                    for t in self._tensors[group]:
                        shape = (tuple(t.shape), t.dtype)
                        if shape not in by_shape:
                            by_shape[shape] = self._token_map(group, t, list(t.shape).index(self._num_blocks))
                        maps.append(by_shape[shape])
                except Exception as e:
                    logger.warning("kvoffload: partial tails of KV cache group %d cannot be stored: %s", group, e)
                    maps = None
            self._token_maps[group] = maps
        return self._token_maps[group]

    def _mask_tail(self, ref: FileRef, payload: torch.Tensor) -> None:
        """A partial tail's attention entry: zero the last block's slots from
        its boundary on (stale or later KV), so the entry is a function of
        its prefix alone. Raises where that cannot be done (the store is dropped)."""
        spec = self.planner.groups[ref.group]
        valid = ref.token_end % spec.block_size
        if spec.kind is not GroupKind.FULL_ATTENTION or valid == 0:
            return
        maps = self._maps(ref.group)
        if maps is None:
            raise RuntimeError(f"no token map for KV cache group {ref.group}: partial tail not stored")
        offset = 0
        for lp, tm in zip(self.pages[ref.group].layers, maps):
            last = offset + (ref.num_pages - 1) * lp.page_bytes
            tm.zero_from(payload[last:last + lp.page_bytes], valid)
            offset += ref.num_pages * lp.page_bytes

    def _wait_reading(self, t: TierSlot, group: int) -> None:
        with self._lock:
            fut = self._reading.pop((t.tier, group, t.slot), None)
        if fut is not None:
            fut.result()  # rare: the slot was evicted and reused while its write-through ran

    def _forget(self, fut: Future[None], keys: list[tuple[int, int, bytes]]) -> None:
        with self._lock:
            self._stores.discard(fut)
            for k in keys:
                if self._queued_keys.get(k) is fut:
                    del self._queued_keys[k]

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._pending_store_bytes -= nbytes

    def _write_through(self, header: ChunkHeader, slot: torch.Tensor, targets: list[TierSlot], nbytes: int,
                       t0: float) -> None:
        """Frame the host tier's copy (a memcpy off the forward path) and
        write it to the tiers below."""
        chunk = HostChunk.pooled(self.buffers, nbytes)
        chunk.payload.copy_(slot)
        self._write(header, chunk, targets, nbytes, t0)

    def _write(self, header: ChunkHeader, chunk: HostChunk, targets: list[TierSlot], nbytes: int,
               t0: float) -> None:
        try:
            for t in targets:
                # Again here: a parent's write planned in the same step may have failed since.
                # (One failing while this write runs still leaves a hole: one failed load later.)
                if self._behind_hole(t.tier, header):
                    self._drop_store(t.tier, header, "parent_dropped")
                    continue
                try:
                    if self.tiers[t.tier].put(header, chunk, Placement(t.slot, t.cold)):
                        self._stored(t.tier, header, nbytes, t0)
                    else:
                        self._count(t.tier, "files_existing")
                        self.recorders[t.tier].inc("kvoffload_stores_deduplicated", group_kind=header.kind.value)
                except ParentGone:  # evicted meanwhile: nothing may chain from it here
                    self._drop_store(t.tier, header, "parent_dropped")
                except OSError as e:
                    logger.warning("kvoffload: store of %s dropped: %s", header.key.hex()[:16], e)
                    self._drop_store(t.tier, header, "no_space" if e.errno == errno.ENOSPC else "error")
                except Exception:
                    logger.exception("kvoffload: store of %s failed", header.key.hex()[:16])
                    self._drop_store(t.tier, header, "error")
        finally:
            with self._lock:
                for t in targets:
                    k = (t.tier, header.group, bytes(header.key))
                    if self._writing.get(k) is chunk:
                        del self._writing[k]
            chunk.release()
            self._release(nbytes)

    # ---- completion ---------------------------------------------------------------

    def get_transfer_results(self) -> KVConnectorTransferResults:
        done: set[str] = set()
        failed: set[str] = set()
        for req_id, fut in list(self._loads.items()):
            if fut.done():
                del self._loads[req_id]
                done.add(req_id)
                if fut.result() is not None:
                    failed.add(req_id)
        with self._lock:
            self.counters[0].loads_ok += len(done) - len(failed)
            self.counters[0].loads_failed += len(failed)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def take_dropped(self) -> DroppedStores | None:
        """The stores and promotions dropped since the last call, for the
        scheduler's indices (once per step, with the step's output)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return DroppedStores(tuple(dropped)) if dropped else None

    def report(self) -> None:
        """Queue gauges into the metrics; called once per step."""
        with self._lock:
            queued = self._pending_store_bytes
        # The queue holds writes to the tiers below the top; loads belong to
        # the stack. Each figure once (on the bottom / top tier), 0 elsewhere,
        # so a sum over tiers stays right.
        last = len(self.recorders) - 1
        for t, rec in enumerate(self.recorders):
            rec.set("kvoffload_store_queue_bytes", queued if t == last else 0)
            rec.set("kvoffload_store_queue_limit_bytes", self.cfg.max_pending_store_bytes if t == last else 0)
            rec.set("kvoffload_loads_in_flight", len(self._loads) if t == 0 else 0)

    def drain(self, timeout_s: float) -> int:
        """Wait (at most `timeout_s`) for the stores queued so far; returns how many are still pending."""
        with self._lock:
            pending = set(self._stores)
        if not pending:
            return 0
        # Someone now waits on these stores (shutdown, or a caller between passes): idle
        # priority would let a busy host starve them past the timeout, so they run at normal
        # priority until they land, then yield again.
        for tid in list(self._store_tids):
            _set_policy(tid, _NORMAL)
        try:
            _, not_done = wait(pending, timeout=timeout_s)
        finally:
            if not self._closed:
                for tid in list(self._store_tids):
                    _set_policy(tid, _IDLE)
        return len(not_done)

    def shutdown(self) -> None:
        """Finish the stores in flight (bounded), so a warm-up run that exits
        has really stored its prefixes; log whatever had to be dropped."""
        if self._closed:
            return
        self._closed = True
        not_done = self.drain(self.cfg.shutdown_timeout_s)
        if not_done:
            self._drop(len(self.tiers) - 1 if self.tiers else 0, "shutdown", not_done)
            logger.warning("kvoffload: shutdown dropped %d stores still pending after %.0fs",
                           not_done, self.cfg.shutdown_timeout_s)
        self.load_pool.shutdown(wait=False, cancel_futures=True)
        self.store_pool.shutdown(wait=False, cancel_futures=True)
        for tier in self.tiers:
            tier.close()
        for rec, c in zip(self.recorders, self.counters):
            logger.info("kvoffload worker counters [%s]: %s", rec.tier, c)
