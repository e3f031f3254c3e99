"""The worker's store path: gather, dispatch, write.

Contract: `save(job)` is called on the forward path (`wait_for_save`) once
per finished (chunk, group) entry and pays one gather into host memory (a
memcpy; a D2H copy on GPUs): into a host tier's slot where the stack has one
(that tier's store is then done), else into a pooled buffer. Every other
tier is written from that host copy on the store threads (write-through).
A store that will not land is dropped, counted by reason in the tier's
Recorder and reported to the scheduler's indices (`take_dropped`); nothing
blocks the forward path but the gather itself.

What it keeps so the tiers stay prefix-closed and loads stay right:

- broken chains: a dropped attention store leaves a hole (`_holes`); every
  entry chained behind it is dropped too (`parent_dropped`), checked when
  the store is planned and again before its write;
- backpressure: gathered bytes waiting for the store threads are bounded by
  `max_pending_store_bytes`; past it a store is dropped, never queued;
- the writes in flight: each write is registered, as it is queued, in the
  `WritesInFlight` the worker shares with the load pipeline (in_flight.py),
  and forgotten when it lands; a gather into a host slot awaits a
  write-through still reading it.

A load's promotion (the bytes it read from a slower tier, into the faster
tiers the scheduler reserved) is a store too: the load pipeline hands it
over whole (`promote`), and it is queued to the store threads like any
write, so a request's load does not wait for it.

The store pool is made here, with its threads' priority: store threads run
SCHED_IDLE (Linux) so they yield the CPU to the model, and `drain` lifts
them to normal priority while someone waits on them.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

import torch
from vllm.logger import init_logger

from offload.config import OffloadConfig
from offload.connector.cpus import run_on
from offload.connector.in_flight import WritesInFlight
from offload.connector.metadata import FileRef, StoreJob, TierSlot
from offload.connector.registration import KVCache
from offload.metrics import Recorder
from offload.planner import GroupKind
from offload.store.base import HostChunk, ParentGone, Placement, Signer, host_copy
from offload.store.format import ChunkHeader

logger = init_logger(__name__)

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


def _background_priority(tids: list[int], cpus: frozenset[int] | None) -> None:
    """Store threads yield the CPU to the model: on a small CPU machine an
    I/O thread that preempts one of vLLM's OpenMP threads stalls the whole
    step. SCHED_IDLE (Linux) runs them only on otherwise idle cores; they
    still finish between steps, and overflow is dropped by policy. Each
    thread records its id so a drain can lift it (`StorePath.drain`). `cpus`: where
    they may run (offload/connector/cpus.py)."""
    tids.append(threading.get_native_id())
    run_on(cpus)
    _set_policy(0, _IDLE)


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


class StorePath:
    def __init__(self, cfg: OffloadConfig, kv: KVCache, writes: WritesInFlight, recorders: list[Recorder],
                 cpus: frozenset[int] | None = None) -> None:
        self.cfg = cfg
        self.kv = kv
        self.writes = writes
        self.recorders = recorders
        # Reads before writes: loads have their own pool (loads.py); stores get
        # fewer threads (`store_threads`), at idle priority, and overflow is dropped by
        # policy (max_pending_store_bytes) rather than queued without bound.
        self.store_tids: list[int] = []
        self.pool = ThreadPoolExecutor(cfg.store_threads, thread_name_prefix="kvoffload-store",
                                       initializer=_background_priority, initargs=(self.store_tids, cpus))
        self._lock = threading.Lock()
        self._pending_bytes = 0
        # Chunks whose attention store to a tier was dropped: (tier, key[:8])
        # -> the groups dropped. Every entry chained behind one is dropped
        # too (a Mamba state as well: its chunk is incomplete there), so a
        # tier never holds an entry behind a hole (lookups binary-search the
        # attention prefix).
        self._holes: OrderedDict[tuple[int, bytes], set[int]] = OrderedDict()
        # (tier, group, key) of stores and promotions dropped since the last step's report.
        self._dropped: list[tuple[int, int, bytes]] = []
        self.closed = False
        self.share: SharedGathers | None = None

    @property
    def in_flight(self) -> set[Future[None]]:
        """The writes queued or running."""
        return self.writes.futures

    @property
    def pending_bytes(self) -> int:
        """Gathered bytes waiting for the store threads."""
        with self._lock:
            return self._pending_bytes

    # ---- the forward path -----------------------------------------------------------

    def save(self, job: StoreJob) -> None:
        """Store one entry to its targets; a failure drops it, never raises."""
        if self.closed:
            for t in job.targets:
                self.drop(t.tier, "shutdown")
            return
        try:
            self._save(job)
        except Exception:
            logger.exception("kvoffload: gather for request %s failed", job.req_id)
            for t in job.targets:
                self.drop_store(t.tier, job.file, "error")

    def _save(self, job: StoreJob) -> None:
        """One gather on the forward path; the other targets are written from
        that host copy on the store threads."""
        header = self.kv.header(job.file)
        t0 = time.perf_counter()
        n = len(job.block_ids) * self.kv.pages[job.file.group].page_bytes
        shared = self.share.get(header.group, header.key) if self.share is not None else None
        direct, rest = self._split_targets(header, job.targets)
        for t in [t for t in rest if self._behind_hole(t.tier, header)]:
            rest.remove(t)
            self.drop_store(t.tier, header, "parent_dropped")
        if direct is not None:
            self._gather_direct(job, header, direct, shared, n, t0)
        else:
            # Skip the gather where every other tier holds the entry already (one
            # stat, e.g. an earlier run stored a prefix vLLM's own cache held).
            rest = [t for t in rest if not self.kv.tiers[t.tier].holds(header, Placement(t.slot))]
        if not rest:
            return
        if not self._admit(n):
            for t in rest:
                self.drop_store(t.tier, header, "backpressure")
            return
        if direct is not None:
            self._dispatch_write_through(header, direct, rest, n, t0)
            return
        try:
            chunk = self._gather_pooled(job, header, shared, n, rest)
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
            buffer = self.kv.tiers[t.tier].gather_target(header, Placement(t.slot)) if direct is None else None
            if buffer is not None:
                direct = _Direct(t, buffer)
            else:
                rest.append(t)
        return direct, rest

    def _gather(self, job: StoreJob, out: torch.Tensor, shared: HostChunk | None) -> bool:
        """The entry's bytes into `out` (a host tier's slot): a sibling
        connector's copy of this step where there is one, else one gather from
        the KV cache (a partial tail masked). True where it gathered. No CRC:
        the slot's bytes are framed for a file by the copy that writes them
        through (`_write_through`), which takes it in its own pass."""
        if shared is not None:
            host_copy(out, shared.payload)
            return False
        self.kv.pages[job.file.group].gather(job.block_ids, out=out)
        self.kv.mask_tail(job.file, out)
        return True

    def _gather_direct(self, job: StoreJob, header: ChunkHeader, direct: _Direct, shared: HostChunk | None,
                       n: int, t0: float) -> None:
        """Gather into a host tier's slot: that tier's store is done."""
        self.writes.wait_reading(direct.slot, header.group)
        if self._gather(job, direct.buffer, shared) and self.share is not None:
            # A pooled copy, not the slot: a later store or promotion may reuse the slot.
            copy = HostChunk.pooled(self.kv.buffers, n)
            copy.fill(direct.buffer)
            self.share.offer(header.group, header.key, copy)
            copy.release()
        self.kv.tiers[direct.slot.tier].gathered(header, Placement(direct.slot.slot))
        self.stored(direct.slot.tier, header, n, t0)

    def _gather_pooled(self, job: StoreJob, header: ChunkHeader, shared: HostChunk | None, n: int,
                       targets: list[TierSlot]) -> HostChunk:
        """Gather into a pooled host buffer (no tier offered its memory); where a
        target signs, the gather's pass feeds its MAC too (no store thread reads
        the bytes for it)."""
        chunk = HostChunk.pooled(self.kv.buffers, n)
        try:
            signer = self._signer(targets)
            if shared is not None:
                chunk.fill(shared.payload, signer)
            else:
                chunk.gather(self.kv.pages[job.file.group], job.block_ids, signer)
                if self.kv.mask_tail(job.file, chunk.payload):
                    chunk.crc, chunk.signed = None, None  # masked after the pass: the writer takes both
                if self.share is not None:
                    self.share.offer(header.group, header.key, chunk)
        except BaseException:
            chunk.release()
            raise
        return chunk

    # ---- backpressure and dispatch ------------------------------------------------------

    def _admit(self, nbytes: int) -> bool:
        """Count a store's bytes as pending, unless that passes max_pending_store_bytes."""
        with self._lock:
            if self._pending_bytes + nbytes > self.cfg.max_pending_store_bytes:
                return False
            self._pending_bytes += nbytes
            return True

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._pending_bytes -= nbytes

    def _dispatch_write(self, header: ChunkHeader, chunk: HostChunk, targets: list[TierSlot], n: int,
                        t0: float) -> Future[None]:
        """Write a pooled host copy to `targets` on the store threads; a load
        planned meanwhile reads the queued copy (`WritesInFlight.queued_copy`)."""
        self.writes.copy_queued(header, chunk, targets)
        fut = self.pool.submit(self._write, header, chunk, targets, n, t0)
        self.writes.track(fut, header, targets)
        return fut

    def _dispatch_write_through(self, header: ChunkHeader, direct: _Direct, targets: list[TierSlot], n: int,
                                t0: float) -> None:
        """Write a host tier's slot through to `targets` on the store threads;
        a later gather into the same slot waits for it (`WritesInFlight.wait_reading`)."""
        fut = self.pool.submit(self._write_through, header, direct.buffer, targets, n, t0)
        self.writes.slot_read(direct.slot, header.group, fut)
        self.writes.track(fut, header, targets)

    # ---- a load's promotion -------------------------------------------------------------

    def promote(self, up: TierSlot, header: ChunkHeader, chunk: HostChunk, now: bool = False) -> bool:
        """Put a loaded entry into a faster tier; a failure costs only the promotion, reported like
        a dropped store. Queued to the store threads (the chunk held) where the pending bytes allow
        it, so that the load does not wait for the copy and the copy yields the CPU to the model: a
        load planned meanwhile reads the queued copy, a gather into the slot waits for it. Else, or
        `now` (the caller needs the outcome), on the load thread. True where it was put or queued."""
        n = chunk.payload.numel()
        t0 = time.perf_counter()
        try:
            self.writes.wait_reading(up, header.group)
            if not now and not self.closed and self._admit(n):
                try:
                    fut = self._dispatch_write(header, chunk.hold(), [up], n, t0)
                except BaseException:  # not queued (the pool shut down meanwhile): undo what _write would
                    self.writes.copy_written(header, chunk, [up])
                    chunk.release()
                    self._release(n)
                    raise
                self.writes.slot_read(up, header.group, fut)
                return True
            if self.kv.tiers[up.tier].put(header, chunk, Placement(up.slot)):
                self.stored(up.tier, header, n, t0)
            return True
        except Exception as e:
            logger.warning("kvoffload: promotion of %s dropped: %s", header.key.hex()[:16], e)
            self.drop(up.tier, "error")
            with self._lock:
                self._dropped.append((up.tier, header.group, bytes(header.key)))
            return False

    # ---- the store threads ------------------------------------------------------------

    def _write_through(self, header: ChunkHeader, slot: torch.Tensor, targets: list[TierSlot], nbytes: int,
                       t0: float) -> None:
        """Frame the host tier's copy (a copy off the forward path, which
        CRCs the bytes and feeds a signing target's MAC) and write it to the
        tiers below."""
        chunk = HostChunk.pooled(self.kv.buffers, nbytes)
        chunk.fill(slot, self._signer(targets))
        self._write(header, chunk, targets, nbytes, t0)

    def _signer(self, targets: list[TierSlot]) -> Signer | None:
        """The first target's signer (its deployment key), whose MAC a copy for the targets feeds."""
        return next((s for s in (self.kv.tiers[t.tier].signer() for t in targets) if s is not None), None)

    def _write(self, header: ChunkHeader, chunk: HostChunk, targets: list[TierSlot], nbytes: int,
               t0: float) -> None:
        try:
            for t in targets:
                # Again here: a parent's write planned in the same step may have failed since.
                # (One failing while this write runs still leaves a hole: one failed load later.)
                if self._behind_hole(t.tier, header):
                    self.drop_store(t.tier, header, "parent_dropped")
                    continue
                try:
                    if self.kv.tiers[t.tier].put(header, chunk, Placement(t.slot, t.cold)):
                        self.stored(t.tier, header, nbytes, t0)
                    else:
                        self.recorders[t.tier].inc("kvoffload_stores_deduplicated", group_kind=header.kind.value)
                except ParentGone:  # evicted meanwhile: nothing may chain from it here
                    self.drop_store(t.tier, header, "parent_dropped")
                except OSError as e:
                    logger.warning("kvoffload: store of %s dropped: %s", header.key.hex()[:16], e)
                    self.drop_store(t.tier, header, "no_space" if e.errno == errno.ENOSPC else "error")
                except Exception:
                    logger.exception("kvoffload: store of %s failed", header.key.hex()[:16])
                    self.drop_store(t.tier, header, "error")
        finally:
            self.writes.copy_written(header, chunk, targets)
            chunk.release()
            self._release(nbytes)

    # ---- broken chains and counts -------------------------------------------------------

    def drop_store(self, tier: int, entry: ChunkHeader | FileRef, reason: str) -> None:
        """A store of `entry` to `tier` will not land: count it, and note the
        hole where the entry is a link of the attention chain (a missing
        Mamba state only shortens a hit)."""
        self.drop(tier, reason)
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

    def drop(self, tier: int, reason: str, n: int = 1) -> None:
        self.recorders[tier].inc("kvoffload_stores_dropped", n, reason=reason)

    def stored(self, tier: int, header: ChunkHeader, nbytes: int, t0: float) -> None:
        kind = header.kind.value
        rec = self.recorders[tier]
        rec.inc("kvoffload_stored_bytes", nbytes, group_kind=kind)
        rec.inc("kvoffload_stored_tokens", header.token_end - header.token_start, group_kind=kind)
        rec.observe("kvoffload_store_seconds", time.perf_counter() - t0, group_kind=kind)

    def take_dropped(self) -> tuple[tuple[int, int, bytes], ...]:
        """The stores and promotions dropped since the last call, for the
        scheduler's indices (once per step, with the step's output)."""
        with self._lock:
            dropped, self._dropped = self._dropped, []
        return tuple(dropped)

    # ---- waiting and closing --------------------------------------------------------------

    def drain(self, timeout_s: float) -> int:
        """Wait (at most `timeout_s`) for the stores queued so far; returns how many are still pending."""
        pending = self.writes.pending()
        if not pending:
            return 0
        # Someone now waits on these stores (shutdown, or a caller between passes): idle
        # priority would let a busy host starve them past the timeout, so they run at normal
        # priority until they land, then yield again.
        for tid in list(self.store_tids):
            _set_policy(tid, _NORMAL)
        try:
            _, not_done = wait(pending, timeout=timeout_s)
        finally:
            if not self.closed:
                for tid in list(self.store_tids):
                    _set_policy(tid, _IDLE)
        return len(not_done)

    def shutdown(self) -> None:
        """Cancel the writes not started (call after `drain`)."""
        self.pool.shutdown(wait=False, cancel_futures=True)
