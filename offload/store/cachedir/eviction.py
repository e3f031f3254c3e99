"""Eviction from one cache directory: the oldest leaves of its index first
(`offload.store.evictor`), each file checked with one stat before it goes (one
loaded since it was indexed goes back in the queue), unlinked and recorded in
the ledger. Its budget (`offload.store.cachedir.budget`) runs it under its lock
and says how far.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from offload.store.cachedir import hygiene
from offload.store.cachedir.ledger import LedgerWriter
from offload.store.cachedir.usage_index import UsageIndex

logger = logging.getLogger(__name__)


class Eviction:
    def __init__(self, top: Path, index: UsageIndex, ledger: LedgerWriter) -> None:
        self.top = top
        self.index = index
        self.ledger = ledger
        self._real_top = os.path.realpath(top)
        self._safe_dirs: set[str] = set()

    def _dir_safe(self, path: str) -> bool:
        d = os.path.dirname(path)
        if d in self._safe_dirs:
            return True
        if hygiene.escapes(Path(d), self._real_top):
            return False
        self._safe_dirs.add(d)
        return True

    def _current(self, rel: str) -> float | None:
        e = self.index.get(rel)
        return None if e is None else e.rank

    def run(self, over: Callable[[], bool]) -> tuple[int, int]:
        """Evict the oldest leaves while `over()`; returns (files, bytes) evicted."""
        freed = files = 0
        rebuilt = False
        top = str(self.top)
        index = self.index
        while over():
            rel = index.queue.pop(self._current, index.link_of)
            if rel is None:
                if rebuilt or not len(index):
                    break
                index.rebuild_queue()  # parked parents whose counts drifted, or a queue emptied by stale pops
                rebuilt = True
                continue
            e = index.get(rel)
            assert e is not None
            path = f"{top}/{rel}"
            if not self._dir_safe(path):
                index.remove(rel)
                logger.warning("kvoffload: %s resolves outside the cache directory; not evicted", path)
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                index.remove(rel)  # gone without a record we have read (yet)
                continue
            except OSError:
                continue
            if e.read_since(st.st_mtime):  # loaded since it was indexed: recency moves on
                index.touch(rel, e, st.st_mtime)
                continue
            # The record's time is taken before the unlink: another instance may store the same key
            # again right after it, and its record must fold in after ours (a time taken once this
            # thread runs again could pass it, and the new file would go unaccounted).
            now = time.time()
            try:
                os.unlink(path)
            except FileNotFoundError:
                index.remove(rel)  # another instance evicted it: not ours to count
                continue
            except OSError as err:
                logger.warning("kvoffload: eviction of %s failed: %s", path, err)
                continue
            index.remove(rel)
            index.tombs[rel] = now
            self.ledger.drop(rel, now)
            freed += st.st_size
            files += 1
        if index.queue_bloated():
            index.rebuild_queue()
        return files, freed
