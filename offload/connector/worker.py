"""The worker half of the tier stack: the facade vLLM's worker-role calls reach.

Contract: `WorkerSide` answers the connector's worker calls and owns the
rooms that do the work, each in its own module:

- `registration.py` (`KVCache`): the registered KV cache as page tables per
  group, the tiers' worker data, host buffers, entry headers, sleep mode and
  partial-tail masks;
- `loads.py` (`LoadPipeline`): `start_load_kv`'s loads on the load threads,
  reported by `get_transfer_results`;
- `stores.py` (`StorePath`): `wait_for_save`'s gathers and the writes on the
  store threads, broken chains, backpressure, the store threads' priority,
  and the loads' promotions (`promote`); `take_dropped` reports its drops;
- `in_flight.py` (`WritesInFlight`): the writes on their way to the tiers
  below, which the store path registers and the loads and the tiers ask
  about; made here and handed to both, so neither reaches into the other;
- `warm.py` (`WarmReader`): warm start's copies into host memory.

Every event is counted once, in the tier's `Recorder` (offload/metrics.py):
Prometheus gets it with the step's stats, and `shutdown` logs each tier's
totals from the same Recorder (`worker_figures`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.logger import init_logger

from offload.config import OffloadConfig
from offload.connector import heap
from offload.connector.cpus import io_cpus, threads_started_on
from offload.connector.in_flight import WritesInFlight
from offload.connector.kv_gate import GatedPages
from offload.connector.loads import LoadPipeline
from offload.connector.metadata import OffloadMetadata, WorkerReport
from offload.connector.registration import KVCache, TokenMapper
from offload.connector.stores import SharedGathers, StorePath
from offload.connector.warm import WarmReader
from offload.keys import Fingerprint
from offload.metrics import DROP_REASONS, Recorder
from offload.planner import HybridOffloadPlanner
from offload.store.base import MissReason, TierData
from offload.store.buffers import BufferPool

__all__ = ["WorkerSide", "worker_figures"]

logger = init_logger(__name__)

# The start of the shutdown line of each tier's totals; JSON (`worker_figures`) follows ": ".
SHUTDOWN_LINE = "kvoffload worker counters"


def worker_figures(rec: Recorder) -> dict[str, object]:
    """A tier's totals in this worker so far, from its Recorder (what its Prometheus series add up to)."""
    return {
        "stored_entries": rec.count("kvoffload_store_seconds"),
        "stored_bytes": int(rec.total("kvoffload_stored_bytes")),
        "stores_deduplicated": int(rec.total("kvoffload_stores_deduplicated")),
        "stores_dropped": {k: int(v) for k, v in rec.by("kvoffload_stores_dropped", "reason").items()},
        "loads_restored": rec.count("kvoffload_load_seconds"),
        "failed_loads": {k: int(v) for k, v in rec.by("kvoffload_failed_loads", "reason").items()},
        "chunk_misses": {k: int(v) for k, v in rec.by("kvoffload_chunk_misses", "reason").items()},
        "restored_bytes": int(rec.total("kvoffload_restored_bytes")),
        "load_read_seconds": round(rec.total("kvoffload_load_read_seconds"), 3),
        "load_scatter_seconds": round(rec.total("kvoffload_load_scatter_seconds"), 3),
    }


class WorkerSide:
    def __init__(self, cfg: OffloadConfig, planner: HybridOffloadPlanner, fingerprint: Fingerprint,
                 make_data: Callable[[torch.device], list[TierData]], layer_names: list[list[str]],
                 recorders: list[Recorder], token_map: TokenMapper | None = None) -> None:
        self.cfg = cfg
        self.planner = planner
        self.fingerprint = fingerprint
        self.recorders = recorders
        for rec in recorders:
            for reason in DROP_REASONS:  # series exist at 0 from the start
                rec.declare("kvoffload_stores_dropped", reason=reason)
            for miss in MissReason:
                rec.declare("kvoffload_failed_loads", reason=miss.value)
            for kind in {g.kind.value for g in planner.groups}:
                for name in ("kvoffload_checksum_failures", "kvoffload_restored_bytes", "kvoffload_stored_bytes",
                             "kvoffload_stored_tokens", "kvoffload_stores_deduplicated",
                             "kvoffload_load_read_seconds", "kvoffload_load_scatter_seconds"):
                    rec.declare(name, group_kind=kind)
        self.kv = KVCache(planner, fingerprint, make_data, layer_names, token_map)
        self.writes = WritesInFlight()
        # This is vLLM's thread: its binding says where the I/O threads may run.
        self.cpus = cpus = io_cpus()
        self.stores = StorePath(cfg, self.kv, self.writes, recorders, cpus=cpus)
        self.loads = LoadPipeline(cfg, self.kv, self.writes, self.stores.promote, recorders, cpus=cpus)
        # Warm start's reads, behind every request's load (offload/connector/warm.py).
        self.warm = WarmReader(self.kv, lambda: self.loads.busy > 0, recorders[0], cpus=cpus)
        self.loads.warm = self.warm
        self._closed = False
        self._froze_heap = False  # registration froze the heap (offload/connector/heap.py): shutdown undoes it

    # The registered cache, its tiers and buffers (tests and benches set them on a worker never registered).

    @property
    def pages(self) -> list[GatedPages]:
        return self.kv.pages

    @pages.setter
    def pages(self, pages: list[GatedPages]) -> None:
        self.kv.pages = pages

    @property
    def tiers(self) -> list[TierData]:
        return self.kv.tiers

    @tiers.setter
    def tiers(self, tiers: list[TierData]) -> None:
        self.kv.tiers = tiers

    @property
    def buffers(self) -> BufferPool:
        return self.kv.buffers

    @buffers.setter
    def buffers(self, buffers: BufferPool) -> None:
        self.kv.buffers = buffers

    # ---- setup ------------------------------------------------------------------

    def share_gathers(self, share: SharedGathers) -> None:
        """Take from `share` what a sibling gathered this step, and offer it
        what this worker gathers (see SharedGathers). Call before the first
        `wait_for_save`; once set, for the worker's life."""
        self.stores.share = share

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int,
                           layout: dict) -> None:
        with threads_started_on(self.cpus):  # the tiers' own threads (made here) off the model's cores
            self.kv.register(kv_caches, num_blocks, layout, self.writes.queued_write)
        # One touched load buffer per load thread and group: a restart's first loads would
        # otherwise read into memory faulted in under them (see Prefault).
        self.kv.buffers.reserve(self.kv.file_bytes(), self.cfg.io_threads)
        # The heap built so far (model, torch, vLLM, our tables and buffers) out of the garbage
        # collector's full scans, which hold the GIL while every load waits (offload/connector/heap.py).
        self._froze_heap = heap.freeze()

    @property
    def token_mapped_groups(self) -> list[int]:
        """Attention groups whose partial-tail token maps are built."""
        return self.kv.token_mapped_groups

    def release_kv_caches(self) -> bool:
        """vLLM is about to release the KV cache (sleep mode): wait for the
        copies in progress, refuse later ones (KVCacheReleased: a load becomes
        a miss, a store is dropped) and drop the page tables with their raw
        addresses. False where it is released already."""
        return self.kv.release()

    def retake_kv_caches(self) -> bool:
        """vLLM mapped the KV cache again: page tables from the same tensors'
        current addresses, then copies are allowed. False where it was not released."""
        return self.kv.retake()

    # ---- each step ------------------------------------------------------------------

    def start_load_kv(self, meta: OffloadMetadata) -> None:
        # Warm entries first: a load planned in the same step may read one (it takes it over).
        if meta.warm:
            self.warm.start(meta.warm)
        for job in meta.loads:
            self.loads.start(job)

    def wait_for_save(self, meta: OffloadMetadata) -> None:
        for job in meta.stores:
            self.stores.save(job)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        done, failed = self.loads.results()
        return KVConnectorTransferResults(finished_recving=done, failed_recving=failed)

    def take_report(self) -> WorkerReport | None:
        """The stores and promotions dropped and the warm entries settled since
        the last call, for the scheduler's indices (once per step, with the step's output)."""
        dropped, warmed = self.stores.take_dropped(), self.warm.take_report()
        return WorkerReport(dropped, warmed) if dropped or warmed else None

    def report(self) -> None:
        """Queue gauges into the metrics; called once per step."""
        queued = self.stores.pending_bytes
        # The queue holds writes to the tiers below the top; loads belong to
        # the stack. Each figure once (on the bottom / top tier), 0 elsewhere,
        # so a sum over tiers stays right.
        last = len(self.recorders) - 1
        for t, rec in enumerate(self.recorders):
            rec.set("kvoffload_store_queue_bytes", queued if t == last else 0)
            rec.set("kvoffload_store_queue_limit_bytes", self.cfg.max_pending_store_bytes if t == last else 0)
            rec.set("kvoffload_loads_in_flight", len(self.loads.in_flight) if t == 0 else 0)
        self.warm.report()

    # ---- the end ----------------------------------------------------------------------

    def drain(self, timeout_s: float) -> int:
        """Wait (at most `timeout_s`) for the stores queued so far; returns how many are still pending."""
        return self.stores.drain(timeout_s)

    def shutdown(self) -> None:
        """Finish the stores in flight (bounded), so a warm-up run that exits
        has really stored its prefixes; log whatever had to be dropped."""
        if self._closed:
            return
        self.warm.stop()
        self._closed = self.stores.closed = True
        not_done = self.drain(self.cfg.shutdown_timeout_s)
        if not_done:
            self.stores.drop(len(self.tiers) - 1 if self.tiers else 0, "shutdown", not_done)
            logger.warning("kvoffload: shutdown dropped %d stores still pending after %.0fs",
                           not_done, self.cfg.shutdown_timeout_s)
        self.loads.shutdown()
        self.stores.shutdown()
        for tier in self.tiers:
            tier.close()
        if self._froze_heap:
            heap.unfreeze()
            self._froze_heap = False
        for rec in self.recorders:
            logger.info("%s [%s]: %s", SHUTDOWN_LINE, rec.tier, json.dumps(worker_figures(rec), sort_keys=True))
