"""Usage accounting and byte budget of a filesystem cache directory:
prefix-closed LRU eviction, fed by the directory's ledgers, not by walks.

One `DirBudget` per cache directory and process accounts for everything
under `<path>/kvoffload-v2/` (every fingerprint, quarantine and layout files;
the ledger directory is reported apart), so several engines sharing one directory, each with
the same `max_bytes`, keep it within the budget together. Its index (one
entry per file: size, recency, parent) is the newest snapshot plus every
instance's log records since (`offload.store.ledger`); keeping it current
costs a listing of the ledger directory and a read of the new lines, however
many files the cache holds. A full walk happens only to build a first
snapshot, and every `reconcile_s` by one instance (the lease holder), spread
over housekeeping passes; it corrects drift (a crash between a rename and
its record, a file removed by hand), and the other instances adopt its
snapshot. Conflicting records are resolved by time: a removal newer than an
addition wins, an addition newer than a removal wins.

Eviction keeps presence prefix-closed, which the lookup's binary search
assumes: in an attention or windowed group a file is evicted only when no
file of that group chains from it (its children name it in the header's
`parent` field), so the oldest *leaf* goes first and its parent becomes a
leaf in turn. Mamba states stand alone and are plain LRU. Recency is the
file's mtime: the write, or the last successful load (`FileStore` touches a
file it loaded), so it is shared between processes. Loads are not recorded;
an eviction candidate's mtime is checked with one stat before it goes, and a
file touched since it was indexed goes back in the queue.
"""

from __future__ import annotations

import heapq
import logging
import os
import stat
import threading
import time
from pathlib import Path

from offload.store import hygiene
from offload.store.format import HEADER_LEN, ChunkHeader
from offload.store.ledger import (CHUNK_REL, LEDGER_DIR, LOG_NAME, SNAPSHOT_NAME, SNAPSHOT_TMP, Lease, LedgerWriter,
                                  Snapshot, parse, parse_header, read_lines, read_snapshot, valid_rel, write_snapshot,
                                  writer_gone)
from offload.store.options import DEFAULT_RECONCILE_S

logger = logging.getLogger(__name__)

TOMB_S = 600.0  # how long a removal overrides older additions that arrive late (NFS lag, slow tails)
COMPACT_MIN_BYTES = 8 << 20  # log bytes since the newest snapshot before a checkpoint is worth writing
FOLDED_IDLE_S = 60.0  # a folded log must be this idle before it goes (every reader has tailed it)
OTHER_HOST_IDLE_S = 3600.0  # another host's unsealed log: its writer is presumed gone after this
MAX_LOGS = 32  # more logs than this (restarts leave one each) and a checkpoint folds the finished ones
MIN_CHECKPOINT_S = 600.0


class _Entry:
    __slots__ = ("size", "t", "parent", "seen")

    def __init__(self, size: int, t: float, parent: int | None, seen: int = 0) -> None:
        self.size = size
        self.t = t  # recency: mtime, or the time of the record that added it
        self.parent = parent  # first 8 bytes of the parent key, as an int; None: stands alone
        self.seen = seen  # the walk that last saw the file


def _read_parent(path: str) -> int | None:
    """Parent key prefix from a chunk file's header, without verifying it:
    an unreadable header makes the file a plain LRU entry."""
    try:
        with open(path, "rb", buffering=0) as f:
            raw = f.read(HEADER_LEN)
    except OSError:
        return None
    parent, _ = ChunkHeader.peek_parent(raw)
    return None if parent is None else int.from_bytes(parent, "big")


class _Walk:
    """A walk of the tree in slices: its files are merged into the live index
    as it goes (records keep arriving meanwhile), and at its end every entry
    it did not see and no record touched since it started is dropped, except
    under a directory it could not list (a transient error must not look
    like a deletion)."""

    def __init__(self, top: Path, epoch: int) -> None:
        self.top = str(top)
        self.stack = [self.top]
        self.prefix = len(self.top) + 1
        self.epoch = epoch
        self.started = time.time()
        self.t0 = time.monotonic()
        self.files = 0
        self.other = 0  # bytes of files whose names no record can carry
        self.unlisted: list[str] = []  # relative directories that could not be read
        self.done = False

    def batch(self, n: int) -> list[tuple[str, int, float]]:
        out: list[tuple[str, int, float]] = []
        while self.stack:
            d = self.stack.pop()
            try:
                with os.scandir(d) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue  # removed meanwhile: nothing under it exists
            except OSError:
                self.unlisted.append(d[self.prefix:] + "/")
                continue
            for e in entries:
                try:
                    if e.is_dir(follow_symlinks=False):
                        if not (d == self.top and e.name == LEDGER_DIR):
                            self.stack.append(e.path)
                        continue
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # removed by another instance meanwhile
                name = e.name
                if hygiene.TMP_RE.search(name) or hygiene.LAYOUT_TMP_RE.match(name):
                    continue  # in flight: counted once renamed (and recorded) under its final name
                if not stat.S_ISREG(st.st_mode):
                    continue
                self.files += 1
                rel = e.path[self.prefix:]
                if valid_rel(rel):
                    out.append((rel, st.st_size, st.st_mtime))
                else:
                    self.other += st.st_size
            if len(out) >= n:
                return out
        self.done = True
        return out


class DirBudget:
    def __init__(self, top: Path, max_bytes: int | None = None, low_water: float = 0.8, rescan_s: float = 1.0,
                 reconcile_s: float = DEFAULT_RECONCILE_S, file_mode: int = 0o640, dir_mode: int = 0o750,
                 read_only: bool = False, folded_idle_s: float = FOLDED_IDLE_S) -> None:
        self.top = Path(top)  # <path>/kvoffload-v2
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
        self._clear()
        self._offsets: dict[str, int] = {}  # log name -> bytes consumed
        self._log_sizes: dict[str, int] = {}
        self._logs = 0
        self._folded_logs_at = float("-inf")  # the last checkpoint made for the number of logs
        self._sealed: set[str] = set()
        self._ignored: set[str] = set()  # logs of another version or damaged headers
        self._synced_at = 0.0
        self._ledger_bytes = 0
        self._other_bytes = 0
        self._pending_log_bytes = 0  # log bytes past the newest snapshot's offsets
        self._snap: Snapshot | None = None  # head (no entries) of the newest snapshot known
        self._snap_bytes = 0
        self._snap_sizes: dict[str, int] = {}
        self._walked = 0.0  # start of the walk behind our index (ours, or an adopted snapshot's)
        self._adopt: str | None = None
        self._walk: _Walk | None = None
        self._epoch = 0
        self._tombs_pruned_at = 0.0
        self._real_top = os.path.realpath(self.top)
        self._safe_dirs: set[str] = set()
        self.evicted_files = 0
        self.evicted_bytes = 0
        self.bad_lines = 0
        self.scan_s = 0.0  # the last sync (ledger tail)
        self.walks = 0
        self.walk_s = 0.0  # the last walk, start to end
        self.checkpoints = 0
        self.last_drift: dict[str, int] = {}

    def _clear(self) -> None:
        self._index: dict[str, _Entry] = {}
        self._heap: list[tuple[float, str]] = []
        self._parked: dict[tuple[str, int], str] = {}
        self._children: dict[tuple[str, int], int] = {}
        self._groups: dict[tuple[str, int], list[int]] = {}
        self._gdirs: dict[str, str] = {}
        self._bytes = 0
        self._tombs: dict[str, float] = {}

    # ---- figures -----------------------------------------------------------------------

    @property
    def target(self) -> int:
        return int((self.max_bytes or 0) * self.low_water)

    @property
    def usage(self) -> int:
        """Bytes under the directory as accounted, the ledger directory aside
        (its size is `ledger_bytes`; compaction bounds it, see docs/format.md)."""
        return self._bytes + self._other_bytes

    @property
    def ledger_bytes(self) -> int:
        return self._ledger_bytes

    @property
    def files(self) -> int:
        return len(self._index)

    @property
    def by_group(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(files, bytes) per (fingerprint directory name, group)."""
        return {k: (v[0], v[1]) for k, v in list(self._groups.items())}

    def describe(self) -> dict:
        """The ledger's state, for tools (`kvoffload stats`, benchmarks)."""
        now = time.time()
        logs = [n for n in self._offsets if n not in self._ignored]
        return {"bytes": self.usage, "files": self.files, "ledger_bytes": self._ledger_bytes,
                "logs": len(logs), "sealed_logs": len(self._sealed & set(logs)),
                "snapshot": self._snap.name if self._snap is not None else None,
                "snapshot_age_s": round(now - self._snap.created, 1) if self._snap is not None else None,
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
            real = os.path.realpath(p)
            if not real.startswith(self._real_top + "/"):
                return None
            p, top = real, self._real_top
        rel = p[len(top) + 1:]
        return rel if valid_rel(rel) else None

    def note_write(self, rel: str, size: int, parent: int | None = None) -> None:
        """A file appeared under its final name (any thread): record it, and
        in a process whose index is loaded, evict at once if over budget."""
        t = time.time()
        self.ledger.put(rel, size, t, parent)
        if not self.loaded or not self._lock.acquire(blocking=False):
            return  # the next sync reads the record back
        try:
            self._apply(("+", t, size, parent, rel))
            if self.max_bytes:
                # Near the budget, every write first reads the other instances'
                # new records (one listing and a read per log): they may have
                # filled or freed the room since the last pass.
                if self.usage > 0.9 * self.max_bytes or time.monotonic() - self._synced_at > self.rescan_s:
                    self._sync_locked()
                if self.usage > self.max_bytes:
                    self._evict_locked()
        finally:
            self._lock.release()

    def note_remove(self, rel: str) -> None:
        """A file went away other than by eviction (moved to quarantine, deleted by a tool)."""
        t = time.time()
        self.ledger.drop(rel, t)
        if self.loaded:
            with self._lock:
                self._apply(("-", t, 0, None, rel))

    # ---- index ------------------------------------------------------------------------------

    def _gdir(self, rel: str) -> str:
        g = rel[:rel.index("/", 65)]
        return self._gdirs.setdefault(g, g)  # one string per group directory, shared by its keys

    def _account(self, rel: str, e: _Entry, push: bool = True) -> None:
        self._bytes += e.size
        if rel[65] == "g" and rel.endswith(".kv"):
            gd = self._gdir(rel)
            k = (rel[:64], int(gd[66:]))
            fig = self._groups.get(k)
            if fig is None:
                fig = self._groups[k] = [0, 0]
            fig[0] += 1
            fig[1] += e.size
            if e.parent is not None:
                ck = (gd, e.parent)
                self._children[ck] = self._children.get(ck, 0) + 1
            if push:
                heapq.heappush(self._heap, (e.t, rel))
        elif push and rel[65:75] == "quarantine":
            heapq.heappush(self._heap, (e.t, rel))

    def _unaccount(self, rel: str, e: _Entry) -> None:
        self._bytes -= e.size
        if rel[65] == "g" and rel.endswith(".kv"):
            gd = self._gdir(rel)
            fig = self._groups[(rel[:64], int(gd[66:]))]
            fig[0] -= 1
            fig[1] -= e.size
            if e.parent is not None:
                ck = (gd, e.parent)
                n = self._children.get(ck, 0) - 1
                if n > 0:
                    self._children[ck] = n
                else:
                    self._children.pop(ck, None)
                    prel = self._parked.pop(ck, None)  # the parent is a leaf now: back in the queue
                    pe = self._index.get(prel) if prel is not None else None
                    if pe is not None:
                        heapq.heappush(self._heap, (pe.t, prel))

    def _add(self, rel: str, e: _Entry) -> None:
        old = self._index.get(rel)
        if old is not None:
            self._unaccount(rel, old)
        self._index[rel] = e
        self._account(rel, e)

    def _remove(self, rel: str) -> _Entry | None:
        e = self._index.pop(rel, None)
        if e is not None:
            self._unaccount(rel, e)
        return e

    def _apply(self, r: tuple) -> None:
        op, t, size, parent, rel = r
        if op == "+":
            tomb = self._tombs.get(rel)
            if tomb is not None and tomb >= t:
                return  # removed after this was written
            cur = self._index.get(rel)
            if cur is not None:
                if cur.t >= t:
                    return  # known (our own record read back, or an older duplicate write)
                if cur.size == size and cur.parent == parent:
                    cur.t = t
                    if rel.endswith(".kv") or rel[65:75] == "quarantine":
                        heapq.heappush(self._heap, (t, rel))
                    return
            self._add(rel, _Entry(size, t, parent))
        else:
            prev = self._tombs.get(rel)
            if prev is None or t > prev:
                self._tombs[rel] = t
            cur = self._index.get(rel)
            if cur is not None and cur.t <= t:
                self._remove(rel)

    def _install(self, snap: Snapshot) -> None:
        """Replace the index with a snapshot's; the caller syncs from its offsets."""
        self._clear()
        for _, t, size, parent, rel in snap.entries:
            e = _Entry(size, t, parent)
            self._index[rel] = e
            self._account(rel, e, push=False)
        self._rebuild_heap()
        self._offsets = dict(snap.offsets)
        self._other_bytes = snap.other
        self._walked = snap.walked

    def _rebuild_heap(self) -> None:
        self._heap = [(e.t, rel) for rel, e in self._index.items()
                      if rel.endswith(".kv") or rel[65:75] == "quarantine"]
        heapq.heapify(self._heap)
        self._parked.clear()

    # ---- loading and tailing ---------------------------------------------------------------

    def ensure_loaded(self, stop: threading.Event | None = None) -> bool:
        """Build the index: the newest snapshot and the logs since, or, where
        there is none, a walk (which then becomes the first snapshot)."""
        if self.loaded:
            return True
        with self._load_lock:
            if self.loaded:
                return True
            snap = self._newest_snapshot(full=True)
            if snap is not None:
                with self._lock:
                    self._install(snap)
                    self._snap, self._snap_bytes = snap, self._snap_sizes.get(snap.name, 0)
                    snap.entries = []
                    self._sync_locked()
                self.loaded = True
                return True
            with self._lock:
                self._sync_locked()  # records of writers already running go in first
            walk = _Walk(self.top, self._next_epoch())
            while not walk.done:
                if stop is not None and stop.is_set():
                    return False
                self._walk_step(walk, 1 << 30)
            self._finish_walk(walk, initial=True)
            self.loaded = True
        if not self.read_only and self.lease.acquire():
            try:
                self.checkpoint()
            finally:
                self.lease.release()
        return True

    def _next_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def _newest_snapshot(self, full: bool) -> Snapshot | None:
        try:
            names = sorted((n for n in os.listdir(self.ledger_dir) if SNAPSHOT_NAME.match(n)), reverse=True)
        except OSError:
            return None
        for n in names:  # the newest readable one; an older one if the newest was just replaced
            snap = read_snapshot(self.ledger_dir / n, head_only=not full)
            if snap is not None:
                try:
                    self._snap_sizes[n] = (self.ledger_dir / n).stat().st_size
                except OSError:
                    continue
                return snap
        return None

    def sync(self) -> None:
        """Read every log's new lines into the index (the steady-state pass)."""
        with self._lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        t0 = time.perf_counter()
        try:
            names = os.listdir(self.ledger_dir)
        except OSError:
            names = []
        total = pending = 0
        seen = set()
        newest = self._snap.name if self._snap is not None else ""
        for name in names:
            if LOG_NAME.match(name):
                seen.add(name)
                path = self.ledger_dir / name
                off = self._offsets.get(name, 0)
                if name in self._sealed and name in self._log_sizes and self._log_sizes[name] == off:
                    total += off  # sealed and read to its end: it never changes again
                    base = self._snap.offsets.get(name, 0) if self._snap is not None else 0
                    pending += max(0, off - base)
                    continue
                if name in self._ignored:
                    try:
                        total += os.stat(path).st_size
                    except OSError:
                        pass
                    continue
                lines, new_off, size = read_lines(path, off)
                if size < 0:
                    continue
                total += size
                self._log_sizes[name] = size
                if off == 0 and lines:
                    if parse_header(lines[0]) is None:
                        self._ignored.add(name)
                        continue
                    lines = lines[1:]
                self._offsets[name] = new_off
                for line in lines:
                    r = parse(line)
                    if r is None:
                        self.bad_lines += 1  # torn or damaged: its file is found again by the next walk
                    elif r[0] == "end":
                        self._sealed.add(name)
                    elif r[0] != "@":
                        self._apply(r)
                base = self._snap.offsets.get(name, 0) if self._snap is not None else 0
                pending += max(0, size - base)
            elif SNAPSHOT_NAME.match(name):
                size = self._snap_sizes.get(name)
                if size is None:
                    try:
                        size = self._snap_sizes[name] = os.stat(self.ledger_dir / name).st_size
                    except OSError:
                        continue
                total += size
                if name > newest:
                    head = read_snapshot(self.ledger_dir / name, head_only=True)
                    if head is not None:
                        if head.walked > self._walked and self.loaded:
                            self._adopt = name  # another instance walked: take its corrections
                        self._snap, self._snap_bytes, newest = head, size, name
        for name in list(self._offsets):
            if name not in seen:
                del self._offsets[name]
                self._sealed.discard(name)
                self._log_sizes.pop(name, None)
        self._logs = len(seen)
        self._snap_sizes = {n: s for n, s in self._snap_sizes.items() if n in names}
        self._ledger_bytes = total
        self._pending_log_bytes = pending
        now = time.time()
        if now - self._tombs_pruned_at > 60:
            keep_after = min(now - TOMB_S, self._walk.started if self._walk is not None else now)
            self._tombs = {r: t for r, t in self._tombs.items() if t >= keep_after}
            self._tombs_pruned_at = now
        if self.network:
            self.ledger.flush()
        self._synced_at = time.monotonic()
        self.scan_s = time.perf_counter() - t0

    # ---- walks ------------------------------------------------------------------------------

    def _walk_step(self, walk: _Walk, deadline_s: float) -> None:
        """Merge walked files into the index for about `deadline_s` seconds."""
        end = time.monotonic() + deadline_s
        while not walk.done and time.monotonic() < end:
            batch = walk.batch(512)
            new = [(rel, size, mtime, _read_parent(f"{self.top}/{rel}") if CHUNK_REL.match(rel) else None)
                   for rel, size, mtime in batch if rel not in self._index]  # headers read outside the lock
            parents = {rel: p for rel, _, _, p in new}
            with self._lock:
                for rel, size, mtime in batch:
                    e = self._index.get(rel)
                    if e is not None:
                        e.seen = walk.epoch
                        if e.size != size:
                            self._add(rel, _Entry(size, max(e.t, mtime), e.parent, walk.epoch))
                            self.last_drift["resized"] = self.last_drift.get("resized", 0) + 1
                        elif mtime > e.t:
                            e.t = mtime
                            if rel.endswith(".kv") or rel[65:75] == "quarantine":
                                heapq.heappush(self._heap, (mtime, rel))
                        continue
                    tomb = self._tombs.get(rel)
                    if tomb is not None and tomb >= mtime:
                        continue  # removed (and recorded) after the walk saw it
                    parent = parents[rel] if rel in parents else (
                        _read_parent(f"{self.top}/{rel}") if CHUNK_REL.match(rel) else None)
                    self._add(rel, _Entry(size, mtime, parent, walk.epoch))
                    self.last_drift["added_files"] = self.last_drift.get("added_files", 0) + 1
                    self.last_drift["added_bytes"] = self.last_drift.get("added_bytes", 0) + size
            self.lease.refresh()

    def _finish_walk(self, walk: _Walk, initial: bool = False) -> None:
        with self._lock:
            unlisted = tuple(walk.unlisted)
            gone = [rel for rel, e in self._index.items()
                    if e.seen != walk.epoch and e.t < walk.started and not (unlisted and rel.startswith(unlisted))]
            for rel in gone:
                e = self._remove(rel)
                self.last_drift["removed_files"] = self.last_drift.get("removed_files", 0) + 1
                self.last_drift["removed_bytes"] = self.last_drift.get("removed_bytes", 0) + e.size
            self._other_bytes = walk.other
            self._walked = walk.started
            if len(self._heap) > 2 * len(self._index) + 4096:
                self._rebuild_heap()
        self.walks += 1
        self.walk_s = time.monotonic() - walk.t0
        d = self.last_drift
        if initial:
            logger.info("kvoffload: no ledger snapshot in %s: indexed %d files by a walk in %.1f s",
                        self.top, walk.files, self.walk_s)
        elif d.get("added_files") or d.get("removed_files"):
            logger.info("kvoffload: reconcile of %s: %d files (%d bytes) were not in the ledger, %d (%d bytes) "
                        "no longer existed; %d files in %.1f s", self.top, d.get("added_files", 0),
                        d.get("added_bytes", 0), d.get("removed_files", 0), d.get("removed_bytes", 0),
                        walk.files, self.walk_s)

    def reconcile(self, stop: threading.Event | None = None) -> dict[str, int]:
        """Walk the whole tree now and correct the index; returns the drift
        found. Writes a snapshot when this instance holds (or gets) the lease."""
        if not self.loaded:
            self.ensure_loaded(stop)
        with self._lock:
            self._sync_locked()
        self.last_drift = {}
        walk = _Walk(self.top, self._next_epoch())
        while not walk.done:
            if stop is not None and stop.is_set():
                return {}
            self._walk_step(walk, 1 << 30)
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
            entries = [(rel, e.size, e.t, e.parent) for rel, e in self._index.items()]
            offsets = {n: o for n, o in self._offsets.items() if n not in self._ignored}
            walked, other = self._walked, self._other_bytes
        self.ledger_dir.mkdir(mode=self.ledger.dir_mode, exist_ok=True)
        name, size = write_snapshot(self.ledger_dir, entries, offsets, walked, self.file_mode, other)
        self.checkpoints += 1
        with self._lock:
            self._snap = Snapshot(name, time.time(), walked, offsets, other, [], True)
            self._snap_bytes = size
            self._snap_sizes[name] = size
        self._cleanup(name, offsets)
        return name

    def _cleanup(self, newest: str, offsets: dict[str, int]) -> None:
        try:
            names = os.listdir(self.ledger_dir)
        except OSError:
            return
        now = time.time()
        snaps = sorted(n for n in names if SNAPSHOT_NAME.match(n))
        keep = set(snaps[-2:]) | {newest}  # the previous one too: a reader may be opening it
        for n in names:
            path = self.ledger_dir / n
            try:
                if SNAPSHOT_NAME.match(n) and n not in keep and n < newest:
                    os.unlink(path)
                elif SNAPSHOT_TMP.match(n) and now - os.stat(path).st_mtime > 3600:
                    os.unlink(path)
                elif LOG_NAME.match(n) and n != self.ledger.name and n in offsets:
                    st = os.stat(path)
                    if now - st.st_mtime < self.folded_idle_s or offsets[n] != self._offsets.get(n, -1):
                        continue
                    # Folded whole (a torn tail of a dead writer is no record) and its writer is done.
                    if n in self._sealed or writer_gone(n, st.st_mtime, now, OTHER_HOST_IDLE_S):
                        os.unlink(path)
            except OSError:
                continue

    # ---- the housekeeper's pass ---------------------------------------------------------------

    def maintain(self, stop: threading.Event | None = None) -> None:
        """Periodic work beyond the tail: adopt another instance's walk, advance
        or start our own reconcile walk (lease holder, every `reconcile_s`),
        or compact the logs into a snapshot."""
        if self.read_only:
            return
        if self._walk is not None:
            self._walk_step(self._walk, 0.05)
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
        newest_walk = max(self._walked, self._snap.walked if self._snap is not None else 0.0)
        if self.reconcile_s > 0 and time.time() - newest_walk > self.reconcile_s:
            if self.lease.acquire():
                self.last_drift = {}
                self._walk = _Walk(self.top, self._next_epoch())
            return
        # Compaction: when the logs since the snapshot outgrow it, or when many logs
        # (each a file every pass opens) have piled up, at most every MIN_CHECKPOINT_S.
        many = self._logs > MAX_LOGS and time.monotonic() - self._folded_logs_at > MIN_CHECKPOINT_S
        due = (many or self._pending_log_bytes > max(COMPACT_MIN_BYTES, self._snap_bytes)
               or (self._snap is None and self._logs > 0))  # a new directory's first: later starts need no walk
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
            if self.max_bytes and self.usage > self.max_bytes:
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
            self._clear()
            self._offsets = {}
            self._snap = None

    # ---- eviction (under the lock) -------------------------------------------------------------

    def _dir_safe(self, path: str) -> bool:
        d = os.path.dirname(path)
        if d in self._safe_dirs:
            return True
        if hygiene.escapes(Path(d), self._real_top):
            return False
        self._safe_dirs.add(d)
        return True

    def _evict_locked(self) -> None:
        freed = files = 0
        rebuilt = False
        top = str(self.top)
        while self.usage > self.target:
            if not self._heap:
                if rebuilt or not self._index:
                    break
                self._rebuild_heap()  # parked parents whose counts drifted, or a heap emptied by stale pops
                rebuilt = True
                continue
            t, rel = heapq.heappop(self._heap)
            e = self._index.get(rel)
            if e is None or e.t != t:
                continue  # superseded
            if rel.endswith(".kv"):
                key = (self._gdir(rel), int(rel[-67:-51], 16))  # this file's key prefix, as its children name it
                if self._children.get(key, 0) > 0:
                    self._parked[key] = rel  # not a leaf: back in the queue when its last child goes
                    continue
            path = f"{top}/{rel}"
            if not self._dir_safe(path):
                self._remove(rel)
                logger.warning("kvoffload: %s resolves outside the cache directory; not evicted", path)
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                self._remove(rel)  # gone without a record we have read (yet)
                continue
            except OSError:
                continue
            if st.st_mtime > e.t + 1e-3:  # loaded since it was indexed: recency moves on
                e.t = st.st_mtime
                heapq.heappush(self._heap, (e.t, rel))
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                self._remove(rel)  # another instance evicted it: not ours to count
                continue
            except OSError as err:
                logger.warning("kvoffload: eviction of %s failed: %s", path, err)
                continue
            now = time.time()
            self._remove(rel)
            self._tombs[rel] = now
            self.ledger.drop(rel, now)
            freed += st.st_size
            files += 1
        if len(self._heap) > 2 * len(self._index) + 4096:
            self._rebuild_heap()
        self.evicted_files += files
        self.evicted_bytes += freed
        if files:
            logger.info("kvoffload: budget %d bytes: evicted %d files (%d bytes), %d bytes in use",
                        self.max_bytes, files, freed, self.usage)


_ACCOUNTS: dict[str, DirBudget] = {}
_ACCOUNTS_LOCK = threading.Lock()


def account_for(top: Path, max_bytes: int | None = None, reconcile_s: float = DEFAULT_RECONCILE_S,
                file_mode: int = 0o640, dir_mode: int = 0o750) -> DirBudget:
    """One account per directory and process (the scheduler and worker halves
    share it, and with it one log). A budget given by any opener applies."""
    key = os.path.realpath(top)
    with _ACCOUNTS_LOCK:
        b = _ACCOUNTS.get(key)
        if b is None:
            b = _ACCOUNTS[key] = DirBudget(Path(key), max_bytes, reconcile_s=reconcile_s, file_mode=file_mode,
                                           dir_mode=dir_mode)
        elif max_bytes is not None and (b.max_bytes is None or max_bytes < b.max_bytes):
            b.max_bytes = max_bytes
        return b


def budget_for(top: Path, max_bytes: int) -> DirBudget:
    return account_for(top, max_bytes)
