"""What one owner has read of a cache directory's ledger (`offload.store.cachedir.ledger`): how
far into each instance's log, which logs are sealed or not ours to read, the newest snapshot's
head and the ledger directory's sizes. `read` tails the new lines into the usage index; its
budget (`offload.store.cachedir.budget`) calls it under its lock.
"""

from __future__ import annotations

import os
from pathlib import Path

from offload.store.cachedir.ledger import PUT, End, Record, Snapshot, parse, parse_header, read_lines, read_snapshot
from offload.store.cachedir.paths import LOG_NAME, SNAPSHOT_NAME
from offload.store.cachedir.usage_index import UsageIndex


class LogTail:
    def __init__(self, ledger_dir: Path) -> None:
        self.dir = ledger_dir
        self.offsets: dict[str, int] = {}  # log name -> bytes consumed
        self.log_sizes: dict[str, int] = {}
        self.logs = 0
        self.sealed: set[str] = set()
        self.ignored: set[str] = set()  # logs of another version or damaged headers
        self.ledger_bytes = 0
        self.pending_log_bytes = 0  # log bytes past the newest snapshot's offsets
        self.snap: Snapshot | None = None  # head (no entries) of the newest snapshot known
        self.snap_bytes = 0
        self.snap_sizes: dict[str, int] = {}
        self.unreachable = 0  # passes that could not list the ledger directory
        self.reachable = True  # the last pass listed the ledger directory
        self.bad_lines = 0

    def newest_snapshot(self, full: bool) -> Snapshot | None:
        """The newest readable snapshot (`full`: with its entries, else its head)."""
        try:
            names = sorted((n for n in os.listdir(self.dir) if SNAPSHOT_NAME.match(n)), reverse=True)
        except OSError:
            return None
        for n in names:  # the newest readable one; an older one if the newest was just replaced
            snap = read_snapshot(self.dir / n, head_only=not full)
            if snap is not None:
                try:
                    self.snap_sizes[n] = (self.dir / n).stat().st_size
                except OSError:
                    continue
                return snap
        return None

    def read(self, index: UsageIndex, walked: float | None) -> str | None:
        """Read every log's new lines into `index`; the name of a snapshot newer than `walked` (the
        start of the walk behind the index; None while it is not loaded) to adopt, if one appeared.
        A directory that cannot be listed keeps every offset (`reachable` false)."""
        adopt = None
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            names = []
        except OSError:
            self.unreachable += 1
            self.reachable = False
            return None
        total = pending = 0
        seen = set()
        newest = self.snap.name if self.snap is not None else ""
        for name in names:
            if LOG_NAME.match(name):
                seen.add(name)
                path = self.dir / name
                off = self.offsets.get(name, 0)
                if name in self.sealed and name in self.log_sizes and self.log_sizes[name] == off:
                    total += off  # sealed and read to its end: it never changes again
                    base = self.snap.offsets.get(name, 0) if self.snap is not None else 0
                    pending += max(0, off - base)
                    continue
                if name in self.ignored:
                    try:
                        total += os.stat(path).st_size
                    except OSError:
                        pass
                    continue
                try:
                    lines, new_off, size = read_lines(path, off)
                except OSError:
                    continue  # as above, for this log: read from the same offset next time
                if size < 0:
                    continue
                total += size
                self.log_sizes[name] = size
                if off == 0 and lines:
                    if parse_header(lines[0]) is None:
                        self.ignored.add(name)
                        continue
                    lines = lines[1:]
                self.offsets[name] = new_off
                put, drop = index.put, index.drop
                for line in lines:
                    r = parse(line)
                    if type(r) is Record:  # the common line first: once per file written anywhere
                        op, t, size, parent, rel, cold = r
                        if op == PUT:
                            put(rel, t, size, parent, cold)
                        else:
                            drop(rel, t)
                    elif r is None:
                        self.bad_lines += 1  # torn or damaged: its file is found again by the next walk
                    elif isinstance(r, End):
                        self.sealed.add(name)
                base = self.snap.offsets.get(name, 0) if self.snap is not None else 0
                pending += max(0, size - base)
            elif SNAPSHOT_NAME.match(name):
                snap_size = self.snap_sizes.get(name)
                if snap_size is None:
                    try:
                        snap_size = self.snap_sizes[name] = os.stat(self.dir / name).st_size
                    except OSError:
                        continue
                total += snap_size
                if name > newest:
                    head = read_snapshot(self.dir / name, head_only=True)
                    if head is not None:
                        if walked is not None and head.walked > walked:
                            adopt = name
                        self.snap, self.snap_bytes, newest = head, snap_size, name
        for name in list(self.offsets):
            if name not in seen:
                del self.offsets[name]
                self.sealed.discard(name)
                self.log_sizes.pop(name, None)
        self.logs = len(seen)
        self.snap_sizes = {n: s for n, s in self.snap_sizes.items() if n in names}
        self.ledger_bytes = total
        self.pending_log_bytes = pending
        self.reachable = True
        return adopt
