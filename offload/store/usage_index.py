"""The ledger's index of a cache directory: one entry per file (size,
recency, parent), the figures per (fingerprint, group), tombstones of
removals, and the eviction queue those entries feed. Memory only: no I/O,
no locking (the owner, `offload.store.budget.DirBudget`, holds its lock).

Conflicting records are resolved by time: a removal newer than an addition
wins, an addition newer than a removal wins (a tombstone remembers a
removal for as long as a late addition may arrive).
"""

from __future__ import annotations

from collections.abc import Iterable

from offload.store.evictor import LeafQueue
from offload.store.ledger import PUT, Entry, Record
from offload.store.paths import is_evictable_rel, parse_chunk_rel

# An eviction link: (group directory, key prefix), as a child's header names its parent.
Link = tuple[str, int]


class IndexEntry:
    __slots__ = ("parent", "seen", "size", "t")

    def __init__(self, size: int, t: float, parent: int | None, seen: int = 0) -> None:
        self.size = size
        self.t = t  # recency: mtime, or the time of the record that added it
        self.parent = parent  # first 8 bytes of the parent key, as an int; None: stands alone
        self.seen = seen  # the walk that last saw the file


class UsageIndex:
    """Entries by rel (offload/store/paths.py), their bytes and per-group
    figures, tombstones, and the `LeafQueue` of evictable files."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.entries: dict[str, IndexEntry] = {}
        self.queue: LeafQueue[str, Link] = LeafQueue()
        self.groups: dict[tuple[str, int], list[int]] = {}  # (fingerprint, group) -> [files, bytes]
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

    def _account(self, rel: str, e: IndexEntry, push: bool = True) -> None:
        self.bytes += e.size
        c = parse_chunk_rel(rel)
        if c is not None:
            fig = self.groups.get((c.fingerprint, c.group))
            if fig is None:
                fig = self.groups[(c.fingerprint, c.group)] = [0, 0]
            fig[0] += 1
            fig[1] += e.size
            if e.parent is not None:
                self.queue.link((self._gdir(c.group_dir), e.parent))
            if push:
                self.queue.push(e.t, rel)
        elif push and is_evictable_rel(rel):
            self.queue.push(e.t, rel)

    def _unaccount(self, rel: str, e: IndexEntry) -> None:
        self.bytes -= e.size
        c = parse_chunk_rel(rel)
        if c is not None:
            fig = self.groups[(c.fingerprint, c.group)]
            fig[0] -= 1
            fig[1] -= e.size
            if e.parent is not None:
                prel = self.queue.unlink((self._gdir(c.group_dir), e.parent))
                if prel is not None:
                    pe = self.entries.get(prel)
                    if pe is not None:
                        self.queue.push(pe.t, prel)

    def add(self, rel: str, e: IndexEntry) -> None:
        old = self.entries.get(rel)
        if old is not None:
            self._unaccount(rel, old)
        self.entries[rel] = e
        self._account(rel, e)

    def remove(self, rel: str) -> IndexEntry | None:
        e = self.entries.pop(rel, None)
        if e is not None:
            self._unaccount(rel, e)
        return e

    def touch(self, rel: str, e: IndexEntry, t: float) -> None:
        """`rel` was used at `t` (newer than its recency): requeue it."""
        e.t = t
        if is_evictable_rel(rel):
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
            tomb = self.tombs.get(r.rel)
            if tomb is not None and tomb >= r.t:
                return  # removed after this was written
            cur = self.entries.get(r.rel)
            if cur is not None:
                if cur.t >= r.t:
                    return  # known (our own record read back, or an older duplicate write)
                if cur.size == r.size and cur.parent == r.parent:
                    self.touch(r.rel, cur, r.t)
                    return
            self.add(r.rel, IndexEntry(r.size, r.t, r.parent))
        else:
            self.tomb(r.rel, r.t)
            cur = self.entries.get(r.rel)
            if cur is not None and cur.t <= r.t:
                self.remove(r.rel)

    def install(self, records: Iterable[Record]) -> None:
        """Replace the index with a snapshot's entries."""
        self.clear()
        for r in records:
            e = IndexEntry(r.size, r.t, r.parent)
            self.entries[r.rel] = e
            self._account(r.rel, e, push=False)
        self.rebuild_queue()

    def snapshot_entries(self) -> list[Entry]:
        return [Entry(rel, e.size, e.t, e.parent) for rel, e in self.entries.items()]

    def rebuild_queue(self) -> None:
        """Queue every evictable entry afresh (drops stale queue entries, unparks every node)."""
        self.queue.rebuild([(e.t, rel) for rel, e in self.entries.items() if is_evictable_rel(rel)])

    def queue_bloated(self) -> bool:
        return len(self.queue) > 2 * len(self.entries) + 4096

    def by_group(self) -> dict[tuple[str, int], tuple[int, int]]:
        """(files, bytes) per (fingerprint directory name, group)."""
        return {k: (v[0], v[1]) for k, v in list(self.groups.items())}
