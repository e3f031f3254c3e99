"""The ledger's index of a cache directory: one entry per file (size,
recency, parent), the figures per (fingerprint, group), tombstones of
removals, and the eviction queue those entries feed. Memory only: no I/O,
no locking (the owner, `offload.store.cachedir.budget.DirBudget`, holds its lock).

Conflicting records are resolved by time: a removal newer than an addition
wins, an addition newer than a removal wins (a tombstone remembers a
removal for as long as a late addition may arrive).
"""

from __future__ import annotations

from collections.abc import Iterable

from offload.planner import cold_after, marked_admission, refreshes, time_rank
from offload.store.cachedir.ledger import PUT, Entry, Record
from offload.store.cachedir.paths import CHUNK_SUFFIX, group_dir_of, is_evictable_rel, parse_chunk_rel, parse_group_dir
from offload.store.evictor import LeafQueue

# An eviction link: (group directory, key prefix), as a child's header names its parent.
Link = tuple[str, int]


class IndexEntry:
    __slots__ = ("cold", "fig", "gdir", "parent", "seen", "size", "t")

    def __init__(self, size: int, t: float, parent: int | None, seen: int = 0, cold: bool = False) -> None:
        self.size = size
        self.t = t  # recency: mtime, or the time of the record that added it
        self.cold = cold  # admitted cold and not loaded since: ranks below every entry that is not
        self.parent = parent  # first 8 bytes of the parent key, as an int; None: stands alone
        self.seen = seen  # the walk that last saw the file
        # Its rel decoded once, when the index takes it (a record names a file many times over):
        # its group's [files, bytes] and its group directory (None and "" for a file that is no chunk).
        self.fig: list[int] | None = None
        self.gdir = ""

    def read_since(self, mtime: float) -> bool:
        """Whether a load touched the file (`mtime`) after its record (records keep 3 decimals)."""
        return mtime > self.t + 1e-3

    @property
    def rank(self) -> float:
        """Its place in the eviction order (lowest first): the worth model's, in seconds."""
        return time_rank(self.t, self.cold)


class UsageIndex:
    """Entries by rel (offload/store/cachedir/paths.py), their bytes and per-group
    figures, tombstones, and the `LeafQueue` of evictable files."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.entries: dict[str, IndexEntry] = {}
        self.queue: LeafQueue[str, Link] = LeafQueue()
        self.groups: dict[str, list[int]] = {}  # group directory -> [files, bytes]
        self._gdirs: dict[str, str] = {}
        self.bytes = 0
        self.tombs: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, rel: str) -> IndexEntry | None:
        return self.entries.get(rel)

    # ---- accounting -------------------------------------------------------------------------

    def _gdir(self, gdir: str) -> str:
        return self._gdirs.setdefault(gdir, gdir)  # one string per group directory, shared by its keys

    def link_of(self, rel: str) -> Link | None:
        """The link a chunk file's children name it by; None for other files."""
        c = parse_chunk_rel(rel)
        return None if c is None else (self._gdir(c.group_dir), c.key_prefix)

    def _decode(self, rel: str, e: IndexEntry) -> None:
        if rel.endswith(CHUNK_SUFFIX):  # a rel the index takes is valid (offload.store.cachedir.paths.valid_rel)
            gdir = self._gdir(group_dir_of(rel))
            fig = self.groups.get(gdir)
            if fig is None:
                fig = self.groups[gdir] = [0, 0]
            e.fig, e.gdir = fig, gdir

    def _account(self, rel: str, e: IndexEntry, push: bool = True) -> None:
        self.bytes += e.size
        fig = e.fig
        if fig is not None:
            fig[0] += 1
            fig[1] += e.size
            if e.parent is not None:
                self.queue.link((e.gdir, e.parent))
            if push:
                self.queue.push(e.rank, rel)
        elif push and is_evictable_rel(rel):
            self.queue.push(e.rank, rel)

    def _unaccount(self, rel: str, e: IndexEntry) -> None:
        self.bytes -= e.size
        fig = e.fig
        if fig is not None:
            fig[0] -= 1
            fig[1] -= e.size
            if e.parent is not None:
                prel = self.queue.unlink((e.gdir, e.parent))
                if prel is not None:
                    pe = self.entries.get(prel)
                    if pe is not None:
                        self.queue.push(pe.rank, prel)

    def add(self, rel: str, e: IndexEntry) -> None:
        old = self.entries.get(rel)
        if old is not None:
            self._unaccount(rel, old)
            e.fig, e.gdir = old.fig, old.gdir
        else:
            self._decode(rel, e)
        self.entries[rel] = e
        self._account(rel, e)

    def remove(self, rel: str) -> IndexEntry | None:
        e = self.entries.pop(rel, None)
        if e is not None:
            self._unaccount(rel, e)
        return e

    def touch(self, rel: str, e: IndexEntry, t: float) -> None:
        """`rel` was used at `t` (newer than its recency: loaded, or written again hot): requeue
        it, refreshed as the worth model says."""
        e.t = t
        e.cold = cold_after(e.cold)
        if e.fig is not None or is_evictable_rel(rel):
            self.queue.push(t, rel)

    def tomb(self, rel: str, t: float) -> None:
        prev = self.tombs.get(rel)
        if prev is None or t > prev:
            self.tombs[rel] = t

    def prune_tombs(self, keep_after: float) -> None:
        self.tombs = {r: t for r, t in self.tombs.items() if t >= keep_after}

    # ---- records and snapshots ----------------------------------------------------------------

    def apply(self, r: Record) -> None:
        """Fold one record in (records of several logs arrive in any order)."""
        if r.op == PUT:
            self.put(r.rel, r.t, r.size, r.parent, r.cold)
        else:
            self.drop(r.rel, r.t)

    def put(self, rel: str, t: float, size: int, parent: int | None, cold: bool = False) -> None:
        """Fold in a record of `rel` written at `t`."""
        tomb = self.tombs.get(rel)
        if tomb is not None and tomb >= t:
            return  # removed after this was written
        cur = self.entries.get(rel)
        if cur is not None:
            if cur.t >= t:
                return  # known (our own record read back, or an older duplicate write)
            if cur.size == size and cur.parent == parent:
                if refreshes(marked_admission(cold)):
                    self.touch(rel, cur, t)
                else:  # written again, cold: recency moves on (the file's mtime), its class stays
                    cur.t = t
                    self.queue.push(cur.rank, rel)
                return
        self.add(rel, IndexEntry(size, t, parent, cold=cold))

    def drop(self, rel: str, t: float) -> None:
        """Fold in a record of `rel` removed at `t`."""
        self.tomb(rel, t)
        cur = self.entries.get(rel)
        if cur is not None and cur.t <= t:
            self.remove(rel)

    def install(self, records: Iterable[Record]) -> None:
        """Replace the index with a snapshot's entries."""
        self.clear()
        for r in records:
            e = IndexEntry(r.size, r.t, r.parent, cold=r.cold)
            self._decode(r.rel, e)
            self.entries[r.rel] = e
            self._account(r.rel, e, push=False)
        self.rebuild_queue()

    def snapshot_entries(self) -> list[Entry]:
        return [(rel, e.size, e.t, e.parent, e.cold) for rel, e in self.entries.items()]

    def rebuild_queue(self) -> None:
        """Queue every evictable entry afresh (drops stale queue entries, unparks every node)."""
        self.queue.rebuild([(e.rank, rel) for rel, e in self.entries.items() if is_evictable_rel(rel)])

    def queue_bloated(self) -> bool:
        return len(self.queue) > 2 * len(self.entries) + 4096

    def by_group(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(files, bytes) per (fingerprint directory name, group)."""
        out = {}
        for gdir, (files, size) in list(self.groups.items()):
            if (key := parse_group_dir(gdir)) is not None:
                out[key] = (files, size)
        return out
