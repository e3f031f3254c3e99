"""Worker half: page gather/scatter against the KV cache, file I/O on a pool.

The forward path pays only the gather of a finished chunk's pages into host
memory (a memcpy; a D2H copy on GPUs); checksums and file writes run on the
I/O threads. Loads run entirely on the I/O threads: a request waits for its
load in WAITING_FOR_REMOTE_KVS, so its destination blocks are ours alone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from offload.config import OffloadConfig
from offload.connector.metadata import FileRef, LoadJob, OffloadMetadata
from offload.copier import GroupPages, LayerPages
from offload.keys import ChunkKey, Fingerprint
from offload.metrics import DROP_REASONS, LOAD_FAILURE_REASONS, Recorder
from offload.planner import HybridOffloadPlanner
from offload.store.base import Placement, TierData
from offload.store.format import ChunkHeader
from offload.store.fs import ChunkMiss

logger = init_logger(__name__)


@dataclass
class WorkerCounters:
    """Totals of this worker, logged at shutdown (Prometheus gets the same
    events through `Recorder`, see offload/metrics.py)."""

    loads_ok: int = 0
    loads_failed: int = 0
    chunk_misses: dict[str, int] = field(default_factory=dict)
    files_written: int = 0
    files_existing: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    stores_dropped: dict[str, int] = field(default_factory=dict)


def _background_priority() -> None:
    """Store threads yield the CPU to the model: on a small CPU machine an
    I/O thread that preempts one of vLLM's OpenMP threads stalls the whole
    step. SCHED_IDLE (Linux) runs them only on otherwise idle cores; they
    still finish between steps, and overflow is dropped by policy."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or not permitted: normal priority
        pass


def failure_label(reason: str) -> str:
    """A bounded metric label for a load failure reason."""
    if reason in LOAD_FAILURE_REASONS:
        return reason
    if reason.startswith("error"):
        return "error"
    if "left the tier" in reason:
        return "missing"
    return "allocation mismatch"


def _describe(name: str, t: torch.Tensor, num_blocks: int) -> str:
    """A tensor's page layout independent of how many blocks it has: dtype,
    the dims before the block dim (segments), and the dims after it with
    their strides (one segment's bytes)."""
    d = list(t.shape).index(num_blocks)
    return f"{name}:{t.dtype}:pre{tuple(t.shape[:d])}:post{tuple(t.shape[d + 1:])}/{tuple(t.stride()[d + 1:])}"


class WorkerSide:
    def __init__(self, cfg: OffloadConfig, planner: HybridOffloadPlanner, fingerprint: Fingerprint,
                 make_data: Callable[[torch.device], TierData], layer_names: list[list[str]],
                 recorder: Recorder | None = None) -> None:
        self.cfg = cfg
        self.recorder = recorder or Recorder(cfg.tier_name)
        self._kinds = [g.kind.value for g in planner.groups]
        for reason in DROP_REASONS:  # series exist at 0 from the start
            self.recorder.declare("kvoffload_stores_dropped", reason=reason)
        for reason in LOAD_FAILURE_REASONS:
            self.recorder.declare("kvoffload_failed_loads", reason=reason)
        for kind in set(self._kinds):
            for name in ("kvoffload_checksum_failures", "kvoffload_restored_bytes", "kvoffload_stored_bytes",
                         "kvoffload_stored_tokens", "kvoffload_stores_deduplicated"):
                self.recorder.declare(name, group_kind=kind)
        self.planner = planner
        self.fingerprint = fingerprint
        self._make_data = make_data
        self.data: TierData | None = None
        self.layer_names = layer_names
        self.pages: list[GroupPages] = []
        # Reads before writes: a load blocks a request, a store blocks nobody.
        # Loads get their own threads, so they never queue behind a burst of
        # stores; stores get half as many, and overflow is dropped by policy
        # (max_pending_store_bytes) rather than queued without bound.
        self.load_pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvoffload-load")
        self.store_pool = ThreadPoolExecutor(max(1, cfg.io_threads // 2), thread_name_prefix="kvoffload-store",
                                             initializer=_background_priority)
        self.counters = WorkerCounters()
        self._lock = threading.Lock()
        self._loads: dict[str, Future[str | None]] = {}
        self._stores: set[Future[None]] = set()
        self._pending_store_bytes = 0
        self._closed = False

    # ---- setup ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                           layout: dict) -> None:
        tensors: dict[str, list[str]] = {}
        for g, names in enumerate(self.layer_names):
            layers: list[LayerPages] = []
            for name in names:
                t = kv_caches[name]
                for part in t if isinstance(t, (list, tuple)) else [t]:
                    layers.append(LayerPages.from_tensor(part, num_blocks))
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
            self.pages.append(pages)
        self.data = self._make_data(device)
        self.data.record_layout({**layout, "tensors": tensors})

    # ---- loads ------------------------------------------------------------------

    def _header(self, ref: FileRef) -> ChunkHeader:
        return ChunkHeader(
            fingerprint=self.fingerprint, key=ChunkKey(ref.key), group=ref.group, kind=ref.kind,
            token_start=ref.token_start, token_end=ref.token_end, num_pages=ref.num_pages,
            page_bytes=self.pages[ref.group].page_bytes, parent=ref.parent,
        )

    def _load(self, job: LoadJob) -> str | None:
        """Restore one request; returns a failure reason or None."""
        if job.fail_reason:
            return job.fail_reason
        assert self.data is not None
        slots = job.slots or (None,) * len(job.files)
        for ref, pairs, slot in zip(job.files, job.pages, slots):
            try:
                moved = self.data.load(self._header(ref), self.pages[ref.group], pairs, Placement(slot))
            except ChunkMiss as e:
                with self._lock:
                    self.counters.chunk_misses[e.reason] = self.counters.chunk_misses.get(e.reason, 0) + 1
                if e.reason == "corrupt":
                    self.recorder.inc("kvoffload_checksum_failures", group_kind=ref.kind.value)
                logger.warning("kvoffload: load of request %s is a miss (%s); it will be recomputed",
                               job.req_id, e)
                return e.reason
            with self._lock:
                self.counters.bytes_read += moved
            self.recorder.inc("kvoffload_restored_bytes", moved, group_kind=ref.kind.value)
        return None

    def start_load_kv(self, meta: OffloadMetadata) -> None:
        for job in meta.loads:
            self._loads[job.req_id] = self.load_pool.submit(self._load_guarded, job)

    def _load_guarded(self, job: LoadJob) -> str | None:
        t0 = time.perf_counter()
        try:
            reason = self._load(job)
        except Exception as e:  # a load must never take the engine down
            logger.exception("kvoffload: load of request %s failed", job.req_id)
            reason = f"error: {type(e).__name__}"
        if reason is None:
            self.recorder.observe("kvoffload_load_seconds", time.perf_counter() - t0)
        else:
            self.recorder.inc("kvoffload_failed_loads", reason=failure_label(reason))
        return reason

    # ---- stores -----------------------------------------------------------------

    def _drop(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.counters.stores_dropped[reason] = self.counters.stores_dropped.get(reason, 0) + n
        self.recorder.inc("kvoffload_stores_dropped", n, reason=reason)

    def _stored(self, header: ChunkHeader, nbytes: int, t0: float) -> None:
        with self._lock:
            self.counters.files_written += 1
            self.counters.bytes_written += nbytes
        kind = header.kind.value
        self.recorder.inc("kvoffload_stored_bytes", nbytes, group_kind=kind)
        self.recorder.inc("kvoffload_stored_tokens", header.token_end - header.token_start, group_kind=kind)
        self.recorder.observe("kvoffload_store_seconds", time.perf_counter() - t0, group_kind=kind)

    def wait_for_save(self, meta: OffloadMetadata) -> None:
        for job in meta.stores:
            if self._closed:
                self._drop("shutdown")
                continue
            pages = self.pages[job.file.group]
            nbytes = len(job.block_ids) * pages.page_bytes if self.data.queues_stores else 0
            with self._lock:
                over = self._pending_store_bytes + nbytes > self.cfg.max_pending_store_bytes
                if not over:
                    self._pending_store_bytes += nbytes
            if over:
                self._drop("backpressure")
                continue
            header = self._header(job.file)
            t0 = time.perf_counter()
            try:  # the only step on the forward path: copy the pages out
                staged = self.data.stage(header, pages, job.block_ids, Placement(job.slot))
            except Exception:
                logger.exception("kvoffload: gather for request %s failed", job.req_id)
                self._release(nbytes)
                self._drop("error")
                continue
            if staged is None:  # a host-memory tier: stored already
                self._stored(header, len(job.block_ids) * pages.page_bytes, t0)
                continue
            fut = self.store_pool.submit(self._write, header, staged, nbytes, t0)
            with self._lock:
                self._stores.add(fut)
            fut.add_done_callback(self._forget)

    def _forget(self, fut: Future[None]) -> None:
        with self._lock:
            self._stores.discard(fut)

    def _release(self, nbytes: int) -> None:
        with self._lock:
            self._pending_store_bytes -= nbytes

    def _write(self, header: ChunkHeader, staged: object, nbytes: int, t0: float) -> None:
        assert self.data is not None
        try:
            if self.data.commit(header, staged):
                self._stored(header, nbytes, t0)
            else:
                with self._lock:
                    self.counters.files_existing += 1
                self.recorder.inc("kvoffload_stores_deduplicated", group_kind=header.kind.value)
        except OSError as e:
            logger.warning("kvoffload: store of %s dropped: %s", header.key.hex()[:16], e)
            self._drop("no_space" if e.errno == 28 else "error")
        except Exception:
            logger.exception("kvoffload: store of %s failed", header.key.hex()[:16])
            self._drop("error")
        finally:
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
            self.counters.loads_ok += len(done) - len(failed)
            self.counters.loads_failed += len(failed)
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def report(self) -> None:
        """Queue gauges into the metrics; called once per step."""
        with self._lock:
            queued = self._pending_store_bytes
        self.recorder.set("kvoffload_store_queue_bytes", queued)
        self.recorder.set("kvoffload_loads_in_flight", len(self._loads))

    def shutdown(self) -> None:
        """Finish the stores in flight (bounded), so a warm-up run that exits
        has really stored its prefixes; log whatever had to be dropped."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = set(self._stores)
        _, not_done = wait(pending, timeout=self.cfg.shutdown_timeout_s)
        if not_done:
            self._drop("shutdown", len(not_done))
            logger.warning("kvoffload: shutdown dropped %d stores still pending after %.0fs",
                           len(not_done), self.cfg.shutdown_timeout_s)
        self.load_pool.shutdown(wait=False, cancel_futures=True)
        self.store_pool.shutdown(wait=False, cancel_futures=True)
        logger.info("kvoffload worker counters [%s]: %s", self.cfg.tier_name, self.counters)
