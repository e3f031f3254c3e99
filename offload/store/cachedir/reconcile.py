"""Reconciling the ledger's index with the tree: a walk, in slices, that
corrects drift (a crash between a rename and its record, a file removed by
hand). Walks build a new directory's first index, and run every
`reconcile_s` in one instance (the lease holder); the others adopt the
snapshot it writes.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path

from offload.store.cachedir.lease import Lease
from offload.store.cachedir.paths import LEDGER_DIR, is_chunk_rel, is_tmp_name, valid_rel
from offload.store.cachedir.usage_index import IndexEntry, UsageIndex
from offload.store.format import HEADER_LEN, ChunkHeader

logger = logging.getLogger(__name__)


def read_parent(path: str) -> int | None:
    """Parent key prefix from a chunk file's header, without verifying it:
    an unreadable header makes the file a plain LRU entry."""
    try:
        with open(path, "rb", buffering=0) as f:
            raw = f.read(HEADER_LEN)
    except OSError:
        return None
    parent, _ = ChunkHeader.peek_parent(raw)
    return None if parent is None else int.from_bytes(parent, "big")


class Walk:
    """A walk of the tree in slices: its files are merged into the live index
    as it goes (records keep arriving meanwhile), and at its end every entry
    it did not see and no record touched since it started is dropped, except
    under a directory it could not list (a transient error must not look
    like a deletion)."""

    def __init__(self, top: Path, epoch: int) -> None:
        self.top = str(top)
        self.stack = [self.top]
        self.epoch = epoch
        self.started = time.time()
        self.t0 = time.monotonic()
        self.files = 0
        self.other = 0  # bytes of files whose names no record can carry
        self.unlisted: list[str] = []  # relative directories that could not be read
        self.done = False

    def _rel(self, path: str) -> str:
        return path.removeprefix(self.top + "/")

    def batch(self, n: int) -> list[tuple[str, int, float]]:
        """About `n` more files, as (rel, size, mtime); sets `done` at the end."""
        out: list[tuple[str, int, float]] = []
        while self.stack:
            d = self.stack.pop()
            try:
                with os.scandir(d) as it:
                    entries = list(it)
            except FileNotFoundError:
                continue  # removed meanwhile: nothing under it exists
            except OSError:
                self.unlisted.append(self._rel(d) + "/")
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
                if is_tmp_name(e.name):
                    continue  # in flight: counted once renamed (and recorded) under its final name
                if not stat.S_ISREG(st.st_mode):
                    continue
                self.files += 1
                rel = self._rel(e.path)
                if valid_rel(rel):
                    out.append((rel, st.st_size, st.st_mtime))
                else:
                    self.other += st.st_size
            if len(out) >= n:
                return out
        self.done = True
        return out


class Reconciler:
    """Merges walks into an index under its owner's lock, and counts the drift
    each walk found (`last_drift`: added/removed files and bytes, resized)."""

    def __init__(self, top: Path, index: UsageIndex, lock: threading.Lock, lease: Lease) -> None:
        self.top = top
        self.index = index
        self.lock = lock
        self.lease = lease
        self._epoch = 0
        self.walks = 0
        self.walk_s = 0.0  # the last walk, start to end
        self.last_drift: dict[str, int] = {}

    def _drift(self, what: str, n: int) -> None:
        self.last_drift[what] = self.last_drift.get(what, 0) + n

    def start(self) -> Walk:
        self._epoch += 1
        return Walk(self.top, self._epoch)

    def step(self, walk: Walk, deadline_s: float) -> None:
        """Merge walked files into the index for about `deadline_s` seconds."""
        end = time.monotonic() + deadline_s
        index = self.index
        while not walk.done and time.monotonic() < end:
            batch = walk.batch(512)
            new = [(rel, read_parent(f"{self.top}/{rel}") if is_chunk_rel(rel) else None)
                   for rel, _, _ in batch if index.get(rel) is None]  # headers read outside the lock
            parents = dict(new)
            with self.lock:
                for rel, size, mtime in batch:
                    e = index.get(rel)
                    if e is not None:
                        e.seen = walk.epoch
                        if e.size != size:
                            index.add(rel, IndexEntry(size, max(e.t, mtime), e.parent, walk.epoch))
                            self._drift("resized", 1)
                        elif e.read_since(mtime):
                            index.touch(rel, e, mtime)
                        continue
                    tomb = index.tombs.get(rel)
                    if tomb is not None and tomb >= mtime:
                        continue  # removed (and recorded) after the walk saw it
                    parent = parents[rel] if rel in parents else (
                        read_parent(f"{self.top}/{rel}") if is_chunk_rel(rel) else None)
                    index.add(rel, IndexEntry(size, mtime, parent, walk.epoch))
                    self._drift("added_files", 1)
                    self._drift("added_bytes", size)
            self.lease.refresh()

    def finish(self, walk: Walk, initial: bool = False) -> None:
        """Drop what the walk did not see (and no record touched since it
        started); the caller takes `walk.other` and `walk.started`."""
        index = self.index
        with self.lock:
            unlisted = tuple(walk.unlisted)
            gone = [rel for rel, e in index.entries.items()
                    if e.seen != walk.epoch and e.t < walk.started and not (unlisted and rel.startswith(unlisted))]
            for rel in gone:
                e = index.remove(rel)
                self._drift("removed_files", 1)
                self._drift("removed_bytes", e.size if e is not None else 0)
            if index.queue_bloated():
                index.rebuild_queue()
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
