"""The byte budget as it was before the ledger (offload/store/budget.py at
commit 719a14d), kept verbatim as bench/scale.py's baseline: every pass walks
the whole of `<path>/kvoffload-v2/` (a stat per file, a header read per new
file) and every eviction round rebuilds its leaf heap from all entries. Not
used by the connector."""
from __future__ import annotations

import heapq
import logging
import os
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from offload.store.format import HEADER_LEN, ChunkHeader
from offload.store.hygiene import walk

logger = logging.getLogger(__name__)



@dataclass
class _Entry:
    size: int
    mtime: float
    parent: bytes | None  # first 8 bytes of the parent key; None: stands alone (Mamba, quarantine, tmp)


def _read_parent(path: str) -> tuple[bytes | None, bool]:
    """(parent key prefix, is_mamba) from a chunk file's header, without verifying it:
    an unreadable header makes the file a plain LRU entry."""
    try:
        with open(path, "rb", buffering=0) as f:
            raw = f.read(HEADER_LEN)
    except OSError:
        return None, True
    return ChunkHeader.peek_parent(raw)


def _group_of(top: Path, d: str) -> tuple[str, int] | None:
    """(fingerprint directory, group) of a directory `top/<fp>/g<group>/<kk>`."""
    parts = os.path.relpath(d, top).split(os.sep)
    if len(parts) == 3 and parts[1][:1] == "g" and parts[1][1:].isdigit():
        return parts[0], int(parts[1][1:])
    return None


class LegacyDirBudget:
    def __init__(self, top: Path, max_bytes: int, low_water: float = 0.8, rescan_s: float = 1.0) -> None:
        self.top = top  # <path>/kvoffload-v2
        self.max_bytes = max_bytes
        self.target = int(max_bytes * low_water)
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._usage = 0
        self._scanned_at = 0.0
        self.evicted_files = 0
        self.evicted_bytes = 0
        self.scan_s = 0.0
        # (files, bytes) per (fingerprint directory name, group), from the last scan.
        self.by_group: dict[tuple[str, int], tuple[int, int]] = {}

    def interval_s(self) -> float:
        """Pause between background passes. Below 70% of the budget: 0.1 s, or
        20 times the last scan (a large directory costs at most ~5% of one
        thread). Above it: 0.02 s, or twice the last scan."""
        if self._usage > 0.7 * self.max_bytes:
            return min(max(0.02, 2 * self.scan_s), self.rescan_s)
        return min(max(0.1, 20 * self.scan_s), 10 * self.rescan_s)

    @property
    def usage(self) -> int:
        return self._usage

    def note_write(self, path: Path, size: int) -> None:
        """Called after a file was written under its final name (any thread)."""
        self._usage += size  # an estimate until the next scan; races only blur it
        if self._usage <= self.max_bytes and time.monotonic() - self._scanned_at < self.rescan_s:
            return
        if not self._lock.acquire(blocking=False):
            return  # another I/O thread is scanning or evicting
        try:
            self._scan()
            if self._usage > self.max_bytes:
                self._evict()
        finally:
            self._lock.release()

    def enforce(self) -> int:
        """Scan, and evict down to the low-water mark if over budget; returns bytes used."""
        with self._lock:
            self._scan()
            if self._usage > self.max_bytes:
                self._evict()
            return self._usage

    # ---- internals (under the lock) ------------------------------------------

    def _scan(self) -> None:
        t0 = time.monotonic()
        seen: dict[str, _Entry] = {}
        usage = 0
        by_group: dict[tuple[str, int], tuple[int, int]] = {}
        for d, e in walk(self.top):
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            usage += st.st_size
            where = _group_of(self.top, d)
            if where is not None:
                n, b = by_group.get(where, (0, 0))
                by_group[where] = (n + e.name.endswith(".kv"), b + st.st_size)
            old = self._entries.get(e.path)
            if old is not None and old.size == st.st_size:
                old.mtime = st.st_mtime
                seen[e.path] = old
            elif e.name.endswith(".kv"):
                parent, _ = _read_parent(e.path)
                seen[e.path] = _Entry(st.st_size, st.st_mtime, parent)
            elif os.path.basename(d) == "quarantine":
                seen[e.path] = _Entry(st.st_size, st.st_mtime, None)
            # temporary files and layout.json count, but are not evicted here
        self._entries = seen
        self._usage = usage
        self.by_group = by_group
        now = time.monotonic()
        self.scan_s = now - t0
        self._scanned_at = now

    def _evict(self) -> None:
        # Children per (group directory, parent key prefix): a file with children is not a leaf.
        children: dict[tuple[str, bytes], int] = {}
        for path, ent in self._entries.items():
            if ent.parent is not None:
                k = (os.path.dirname(os.path.dirname(path)), ent.parent)
                children[k] = children.get(k, 0) + 1

        def key_of(path: str) -> tuple[str, bytes]:
            name = os.path.basename(path)
            return os.path.dirname(os.path.dirname(path)), bytes.fromhex(name[:16])

        def is_leaf(path: str) -> bool:
            if not path.endswith(".kv"):
                return True
            try:
                return children.get(key_of(path), 0) == 0
            except ValueError:  # not a hex name: not ours, evict as a leaf
                return True

        heap = [(e.mtime, p) for p, e in self._entries.items() if is_leaf(p)]
        heapq.heapify(heap)
        by_key = {}
        for p in self._entries:
            if p.endswith(".kv"):
                try:
                    by_key[key_of(p)] = p
                except ValueError:
                    pass
        freed = files = 0
        while heap and self._usage > self.target:
            _, path = heapq.heappop(heap)
            ent = self._entries.pop(path, None)
            if ent is None:
                continue
            try:
                os.unlink(path)
                freed += ent.size
                files += 1
            except FileNotFoundError:
                pass  # another instance evicted it: not ours to count, but the bytes are gone
            except OSError as e:
                logger.warning("kvoffload: eviction of %s failed: %s", path, e)
                continue
            self._usage -= ent.size
            if ent.parent is not None:
                k = (os.path.dirname(os.path.dirname(path)), ent.parent)
                children[k] -= 1
                if children[k] == 0 and k in by_key and by_key[k] in self._entries:
                    parent_path = by_key[k]
                    heapq.heappush(heap, (self._entries[parent_path].mtime, parent_path))
        self.evicted_files += files
        self.evicted_bytes += freed
        if files:
            logger.info("kvoffload: budget %d bytes: evicted %d files (%d bytes), %d bytes in use",
                        self.max_bytes, files, freed, self._usage)


