"""Usage accounting and byte budget of a filesystem cache directory:
prefix-closed LRU eviction, fed by the directory's ledgers, not by walks.

One `DirBudget` per cache directory and owner (`offload.store.cachedir.owners`)
accounts for everything under the layout directory (every fingerprint,
quarantine and layout files; the ledger directory is reported apart), so
several engines sharing one directory, each with the same `max_bytes`, keep
it within the budget together. Its index (`offload.store.cachedir.usage_index`: one
entry per file: size, recency, parent) is the newest snapshot plus every
instance's log records since (`offload.store.cachedir.ledger`); keeping it current
costs a listing of the ledger directory and a read of the new lines, however
many files the cache holds. A full walk (`offload.store.cachedir.reconcile`) happens
only to build a first snapshot, and every `reconcile_s` by one instance (the
lease holder), spread over housekeeping passes; it corrects drift, and the
other instances adopt its snapshot. Compaction (`offload.store.cachedir.compaction`)
folds the logs into a snapshot now and then.

Eviction keeps presence prefix-closed (`offload.store.evictor`): in an
attention or windowed group a file is evicted only when no file of that
group chains from it (its children name it in the header's `parent` field),
so the oldest *leaf* goes first and its parent becomes a leaf in turn. Mamba
states stand alone and are plain LRU. Recency is the file's mtime: the
write, or the last successful load (`FileStore` touches a file it loaded),
so it is shared between processes. Loads are not recorded; an eviction
candidate's mtime is checked with one stat before it goes, and a file
touched since it was indexed goes back in the queue.

A write holds its bytes in the budget from before it starts
(`offload.store.cachedir.inflight`): eviction makes room for it ahead, and
what another instance cannot see of ours is bounded by `IN_FLIGHT_SHARE`.

This class ties the parts together: it holds the one lock over the index and
decides when each part runs: the tail of the logs (`offload.store.cachedir.tail`),
the walks, eviction (`offload.store.cachedir.eviction`) and compaction.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from offload.store.cachedir import compaction, hygiene
from offload.store.cachedir.compaction import FOLDED_IDLE_S
from offload.store.cachedir.eviction import Eviction
from offload.store.cachedir.inflight import InFlight
from offload.store.cachedir.lease import Lease
from offload.store.cachedir.ledger import (
    LedgerWriter,
    Snapshot,
    read_snapshot,
)
from offload.store.cachedir.paths import (
    LEDGER_DIR,
    ChunkRel,
    parse_chunk_rel,
    rel_of,
    valid_rel,
)
from offload.store.cachedir.reconcile import Reconciler, Walk
from offload.store.cachedir.tail import LogTail
from offload.store.cachedir.usage_index import UsageIndex
from offload.store.options import DEFAULT_RECONCILE_S

logger = logging.getLogger(__name__)

# Bytes one instance may have in flight, as a share of the budget: the most by which another instance's
# view of the directory can fall short (the low-water mark leaves 20% for its own writes to land in).
IN_FLIGHT_SHARE = 0.025
TOMB_S = 600.0  # how long a removal overrides older additions that arrive late (NFS lag, slow tails)


class DirBudget:
    def __init__(self, top: Path, max_bytes: int | None = None, low_water: float = 0.8, rescan_s: float = 1.0,
                 reconcile_s: float = DEFAULT_RECONCILE_S, file_mode: int = 0o640, dir_mode: int = 0o750,
                 read_only: bool = False, folded_idle_s: float = FOLDED_IDLE_S) -> None:
        self.top = Path(top)  # the layout directory (offload/store/cachedir/paths.py)
        self.read_only = read_only  # an inspecting tool: reads the ledger, writes nothing (no log, no snapshot)
        self.folded_idle_s = folded_idle_s
        self.ledger_dir = self.top / LEDGER_DIR
        self.max_bytes = max_bytes
        self.low_water = low_water
        self.rescan_s = rescan_s
        self.reconcile_s = reconcile_s
        self.file_mode = file_mode
        self.network = hygiene.is_network_fs(self.top)
        # Each NFS tail is a round trip per log: poll less often there.
        self.poll_s = 1.0 if self.network else 0.1
        self.ledger = LedgerWriter(self.ledger_dir, file_mode, dir_mode, self.network)
        self.lease = Lease(self.ledger_dir)
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()
        self.loaded = False
        self.index = UsageIndex()
        self.reconciler = Reconciler(self.top, self.index, self._lock, self.lease)
        self.tail = LogTail(self.ledger_dir)
        self.eviction = Eviction(self.top, self.index, self.ledger)
        self._folded_logs_at = float("-inf")  # the last checkpoint made for the number of logs
        self._synced_at = 0.0
        self._other_bytes = 0
        self._walked = 0.0  # start of the walk behind our index (ours, or an adopted snapshot's)
        self._troubles_walked = 0  # `troubles` when our last walk started
        self._adopt: str | None = None
        self._walk: Walk | None = None
        self._tombs_pruned_at = 0.0
        self._real_top = os.path.realpath(self.top)
        self.in_flight = InFlight()
        self.evicted_files = 0
        self.evicted_bytes = 0
        self.scan_s = 0.0  # the last sync (ledger tail)
        self.checkpoints = 0

    # ---- figures -----------------------------------------------------------------------

    @property
    def target(self) -> int:
        return int((self.max_bytes or 0) * self.low_water)

    @property
    def usage(self) -> int:
        """Bytes under the directory as accounted, the ledger directory aside
        (its size is `ledger_bytes`; compaction bounds it, see docs/format.md)."""
        return self.index.bytes + self._other_bytes

    @property
    def ledger_bytes(self) -> int:
        return self.tail.ledger_bytes

    @property
    def bad_lines(self) -> int:
        """Log lines torn or damaged, so far."""
        return self.tail.bad_lines

    @property
    def files(self) -> int:
        return len(self.index)

    @property
    def by_group(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(files, bytes) per (fingerprint directory name, group)."""
        return self.index.by_group()

    def chunk_entries(self, fp_hex: str) -> list[tuple[ChunkRel, int, float, int | None, bool]] | None:
        """(rel decoded, size, recency, parent key prefix, cold) of every chunk file of fingerprint
        `fp_hex` the index holds; None until it is loaded."""
        if not self.loaded:
            return None
        with self._lock:
            out = []
            for rel, e in self.index.entries.items():
                c = parse_chunk_rel(rel)
                if c is not None and c.fingerprint == fp_hex:
                    out.append((c, e.size, e.t, e.parent, e.cold))
            return out

    @property
    def walks(self) -> int:
        return self.reconciler.walks

    @property
    def walk_s(self) -> float:
        return self.reconciler.walk_s

    @property
    def troubles(self) -> int:
        """Failed appends to our log and passes that could not list the ledger directory, so far."""
        return self.ledger.failed + self.tail.unreachable

    @property
    def last_drift(self) -> dict[str, int]:
        return self.reconciler.last_drift

    def describe(self) -> dict:
        """The ledger's state, for tools (`kvoffload stats`, benchmarks)."""
        now = time.time()
        tail, snap = self.tail, self.tail.snap
        logs = [n for n in tail.offsets if n not in tail.ignored]
        return {"bytes": self.usage, "files": self.files, "ledger_bytes": tail.ledger_bytes,
                "logs": len(logs), "sealed_logs": len(tail.sealed & set(logs)),
                "snapshot": snap.name if snap is not None else None,
                "snapshot_age_s": round(now - snap.created, 1) if snap is not None else None,
                "last_walk_age_s": round(now - self._walked, 1) if self._walked else None,
                "bad_lines": self.bad_lines, "walked_to_load": self.walks > 0}

    def interval_s(self) -> float:
        """Pause between housekeeping passes: shorter above 70% of the budget,
        and while a walk is in progress (it advances one slice per pass)."""
        if self._walk is not None:
            return 0.05
        if self.max_bytes and self.usage > 0.7 * self.max_bytes:
            return self.poll_s / 5
        return self.poll_s

    # ---- what the writers call -----------------------------------------------------------

    def rel(self, path: Path | str) -> str | None:
        """`path` relative to the directory, if a record may name it."""
        p = str(path)
        top = str(self.top)
        if not p.startswith(top + "/"):
            p, top = os.path.realpath(p), self._real_top
            if not p.startswith(top + "/"):
                return None
        rel = rel_of(top, p)
        return rel if valid_rel(rel) else None

    def note_write(self, rel: str, size: int, parent: int | None = None, cold: bool = False) -> None:
        """A file appeared under its final name (any thread): record it, and
        in a process whose index is loaded, evict at once if over budget.
        `cold`: it enters the eviction order below every file that is not."""
        t = time.time()
        self.ledger.put(rel, size, t, parent, cold)
        if not self.loaded or not self._lock.acquire(blocking=False):
            return  # the next sync reads the record back
        try:
            self.index.put(rel, t, size, parent, cold)
            self._make_room_locked()
        finally:
            self._lock.release()

    def _make_room_locked(self) -> None:
        """Evict if this process's writes, landed and in flight, take the directory over its budget."""
        if not self.max_bytes:
            return
        # Near the budget, every write first reads the other instances' new records (one listing and a
        # read per log): they may have filled or freed the room since the last pass.
        used = self.usage + self.in_flight.bytes
        if used > 0.9 * self.max_bytes or time.monotonic() - self._synced_at > self.rescan_s:
            self._sync_locked()
        if self.usage + self.in_flight.bytes > self.max_bytes:
            self._evict_locked()

    @contextmanager
    def reserving(self, nbytes: int) -> Iterator[None]:
        """Around one write (any thread): its bytes count as used until the
        block ends (the writer notes the file after it), so a process whose
        index is loaded evicts for them before they land."""
        cap = int(self.max_bytes * IN_FLIGHT_SHARE) if self.max_bytes else None
        with self.in_flight.hold(nbytes, cap):
            if cap and self.loaded:
                with self._lock:  # the write waits for its room (a store thread, never the forward step)
                    self._make_room_locked()
            yield

    def note_remove(self, rel: str) -> None:
        """A file went away other than by eviction (moved to quarantine, deleted by a tool)."""
        t = time.time()
        self.ledger.drop(rel, t)
        if self.loaded:
            with self._lock:
                self.index.drop(rel, t)

    # ---- loading and tailing ---------------------------------------------------------------

    def _install(self, snap: Snapshot) -> None:
        """Replace the index with a snapshot's; the caller syncs from its offsets."""
        self.index.install(snap.entries)
        self.tail.offsets = dict(snap.offsets)
        self._other_bytes = snap.other
        self._walked = snap.walked

    def ensure_loaded(self, stop: threading.Event | None = None) -> bool:
        """Build the index: the newest snapshot and the logs since, or, where
        there is none, a walk (which then becomes the first snapshot)."""
        if self.loaded:
            return True
        with self._load_lock:
            if self.loaded:
                return True
            snap = self.tail.newest_snapshot(full=True)
            if snap is not None:
                with self._lock:
                    self._install(snap)
                    self.tail.snap, self.tail.snap_bytes = snap, self.tail.snap_sizes.get(snap.name, 0)
                    snap.entries = []
                    self._sync_locked()
                self.loaded = True
                return True
            with self._lock:
                self._sync_locked()  # records of writers already running go in first
            walk = self.reconciler.start()
            while not walk.done:
                if stop is not None and stop.is_set():
                    return False
                self.reconciler.step(walk, 1 << 30)
            self._finish_walk(walk, initial=True)
            self.loaded = True
        if not self.read_only and self.lease.acquire():
            try:
                self.checkpoint()
            finally:
                self.lease.release()
        return True

    def sync(self) -> None:
        """Read every log's new lines into the index (the steady-state pass)."""
        with self._lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        t0 = time.perf_counter()
        adopt = self.tail.read(self.index, self._walked if self.loaded else None)
        if not self.tail.reachable:
            return  # a network filesystem without its server: every offset kept, tail later
        if adopt is not None:
            self._adopt = adopt  # another instance walked: take its corrections
        now = time.time()
        if now - self._tombs_pruned_at > 60:
            self.index.prune_tombs(min(now - TOMB_S, self._walk.started if self._walk is not None else now))
            self._tombs_pruned_at = now
        if self.network:
            self.ledger.flush()
        self._synced_at = time.monotonic()
        self.scan_s = time.perf_counter() - t0

    # ---- walks ------------------------------------------------------------------------------

    def _finish_walk(self, walk: Walk, initial: bool = False) -> None:
        self.reconciler.finish(walk, initial)
        with self._lock:
            self._other_bytes = walk.other
            self._walked = walk.started

    def reconcile(self, stop: threading.Event | None = None) -> dict[str, int]:
        """Walk the whole tree now and correct the index; returns the drift
        found. Writes a snapshot when this instance holds (or gets) the lease."""
        if not self.loaded:
            self.ensure_loaded(stop)
        with self._lock:
            self._sync_locked()
        self.reconciler.last_drift = {}
        walk = self.reconciler.start()
        while not walk.done:
            if stop is not None and stop.is_set():
                return {}
            self.reconciler.step(walk, 1 << 30)
        self._finish_walk(walk)
        if not self.read_only and self.lease.acquire():
            try:
                self.checkpoint()
            finally:
                self.lease.release()
        return dict(self.last_drift)

    # ---- snapshots -----------------------------------------------------------------------------

    def checkpoint(self) -> str:
        """Write the index as a snapshot (no walk: the ledger compacted), then
        let go of older snapshots and of logs it folded whose writers are done."""
        with self._lock:
            entries = self.index.snapshot_entries()
            offsets = {n: o for n, o in self.tail.offsets.items() if n not in self.tail.ignored}
            walked, other = self._walked, self._other_bytes
        name, size = compaction.write(self.ledger_dir, entries, offsets, walked, other, self.file_mode,
                                      self.ledger.dir_mode)
        self.checkpoints += 1
        with self._lock:
            self.tail.snap = Snapshot(name, time.time(), walked, offsets, other, [], True)
            self.tail.snap_bytes = size
            self.tail.snap_sizes[name] = size
        compaction.cleanup(self.ledger_dir, name, offsets, self.tail.offsets, self.tail.sealed, self.ledger.name,
                           self.folded_idle_s)
        return name

    # ---- the housekeeper's pass ---------------------------------------------------------------

    def maintain(self, stop: threading.Event | None = None) -> None:
        """Periodic work beyond the tail: adopt another instance's walk, advance
        or start our own reconcile walk (lease holder, every `reconcile_s`),
        or compact the logs into a snapshot."""
        if self.read_only:
            return
        self.ledger.retry()  # records kept while the ledger could not be written
        if self._walk is not None:
            self.reconciler.step(self._walk, 0.05)
            if self._walk.done:
                walk, self._walk = self._walk, None
                self._finish_walk(walk)
                try:
                    self.checkpoint()
                finally:
                    self.lease.release()
            return
        if self._adopt is not None:
            name, self._adopt = self._adopt, None
            snap = read_snapshot(self.ledger_dir / name)
            if snap is not None:
                with self._lock:
                    self._install(snap)
                    self._sync_locked()
            return
        snap = self.tail.snap
        newest_walk = max(self._walked, snap.walked if snap is not None else 0.0)
        # An outage now over (the directory unreachable, the ledger unwritable; records dropped from a full
        # backlog come only with one): only a walk accounts what went on meanwhile (a store whose rename
        # took effect though it reported an error, records the backlog could not keep).
        after_outage = self.troubles > self._troubles_walked and not self.ledger.backlog and self.tail.reachable
        if (self.reconcile_s > 0 and time.time() - newest_walk > self.reconcile_s) or after_outage:
            if self.lease.acquire():
                self.reconciler.last_drift = {}
                self._troubles_walked = self.troubles
                self._walk = self.reconciler.start()
            return
        due, many = compaction.due(self.tail.logs, self.tail.pending_log_bytes, self.tail.snap_bytes, snap is not None,
                                   self._folded_logs_at)
        if due and self.lease.acquire():
            if many:
                self._folded_logs_at = time.monotonic()
            try:
                self.checkpoint()
            finally:
                self.lease.release()

    def enforce(self) -> int:
        """Load if needed, tail the logs, and evict down to the low-water mark if over budget; returns bytes used."""
        self.ensure_loaded()
        with self._lock:
            self._sync_locked()
            if self.max_bytes and self.usage + self.in_flight.bytes > self.max_bytes:
                self._evict_locked()
            return self.usage

    def close(self) -> None:
        """Seal this process's log and drop the index (the housekeeper's stop)."""
        if self._walk is not None:
            self._walk = None
            self.lease.release()
        self.ledger.seal()
        with self._lock:
            self.loaded = False
            self.index.clear()
            self.tail.offsets = {}
            self.tail.snap = None

    def _evict_locked(self) -> None:
        """Evict the oldest leaves down to the low-water mark (writes in flight count)."""
        files, freed = self.eviction.run(lambda: self.usage + self.in_flight.bytes > self.target)
        self.evicted_files += files
        self.evicted_bytes += freed
        if files:
            logger.info("kvoffload: budget %d bytes: evicted %d files (%d bytes), %d bytes in use",
                        self.max_bytes, files, freed, self.usage)
