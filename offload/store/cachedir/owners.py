"""Who owns a cache directory in this process, and how users share it.

A `CacheDir` owns one layout directory (`<path>/kvoffload-v<N>/`, see
offload/store/cachedir/paths.py): its usage account and ledger log
(`offload.store.cachedir.budget.DirBudget`, which holds the lease), the housekeeper
thread that drives the account, and the once-per-fingerprint tidy at open.
It is made by the first opener and closed when its last user lets go.

Users share owners through a `CacheDirs`, an ordinary object with a
reference count per directory (and per LMCache storage engine): whoever
builds the tiers holds one and hands it to every tier it builds
(`TierContext.dirs`), and a MultiConnector hands the same one to all its
children. Nothing here is module-level state.

Two `CacheDirs` on one directory in one process behave like two processes:
each owner appends to its own log (names carry a random tag, not only the
pid), reads the other's records by tailing it, and the lease file lets one
of them at a time walk or write a snapshot (a lease held by a live pid of
this host is never taken over). vLLM-CPU runs its workers in processes of
their own, so there the scheduler's and the worker's connector never share
an owner; where both halves live in one process (vLLM's uniproc executor),
they share one if, and only if, both are given the same `CacheDirs`
(`CacheDirs.attached`).

Budget given by several openers of one directory: every engine sharing a
directory must configure the same `max_bytes`; where openers in one process
disagree, the smallest applies (so that no opener's limit is exceeded) and
a warning names both values.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Generic, TypeVar

from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.housekeeper import Housekeeper

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Shared(Generic[K, V]):
    """Values made on first `acquire` of a key and handed back by the last
    `release`: a reference count per key, thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[K, list[Any]] = {}  # key -> [value, users]

    def acquire(self, key: K, make: Callable[[], V]) -> V:
        """The value of `key`, made by `make()` when no one holds it; each
        call must be matched by one `release`."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                item = self._items[key] = [make(), 0]
            item[1] += 1
            return item[0]

    def release(self, key: K) -> V | None:
        """Let go of `key`; returns its value when this was its last user
        (the caller closes it), else None. Releasing an unknown key is a no-op."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            item[1] -= 1
            if item[1] > 0:
                return None
            del self._items[key]
            return item[0]

    def users(self, key: K) -> int:
        with self._lock:
            item = self._items.get(key)
            return 0 if item is None else item[1]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._items


class CacheDir:
    """The owner of one layout directory in this process (module doc)."""

    def __init__(self, top: Path, max_bytes: int | None, reconcile_s: float, file_mode: int, dir_mode: int) -> None:
        self.top = Path(top)
        self.account = DirBudget(self.top, max_bytes, reconcile_s=reconcile_s, file_mode=file_mode,
                                 dir_mode=dir_mode)
        self._lock = threading.Lock()
        self._tidied: set[str] = set()
        self._keepers: list[Housekeeper] = []
        self.closed = False

    def apply_budget(self, max_bytes: int | None) -> None:
        """Another opener's `max_bytes`: the smallest given applies (module doc)."""
        cur = self.account.max_bytes
        if max_bytes is None or max_bytes == cur:
            return
        if cur is not None:
            logger.warning("kvoffload: %s is opened with max_bytes=%d and max_bytes=%d in this process; the "
                           "smaller applies (give every engine sharing a directory the same max_bytes)",
                           self.top, cur, max_bytes)
        if cur is None or max_bytes < cur:
            self.account.max_bytes = max_bytes

    def tidy_once(self, root: Path, tidy: Callable[[], object]) -> bool:
        """Run `tidy()` for fingerprint directory `root` unless this owner did
        already; returns whether it ran."""
        key = os.path.realpath(root)
        with self._lock:
            if key in self._tidied:
                return False
            self._tidied.add(key)
        tidy()
        return True

    def housekeeper(self, root: Path, num_groups: int) -> Housekeeper:
        """A housekeeper for fingerprint directory `root` (not started). The
        first of this owner's live housekeepers drives the account (tail,
        evict, compact, reconcile); the others only read its figures."""
        with self._lock:
            self._keepers = [k for k in self._keepers if not k.stopped]
            keeper = Housekeeper(root, num_groups, self.account, drive=not any(k.drive for k in self._keepers))
            self._keepers.append(keeper)
            return keeper

    def close(self) -> bool:
        """Stop this owner's housekeepers and close the account (seal the log,
        drop the index). Returns False, closing nothing under it, when a
        housekeeper thread did not stop: that thread closes the account
        itself when its pass returns."""
        with self._lock:
            keepers, self._keepers = self._keepers, []
        stopped = all([k.stop() for k in keepers])
        if stopped:
            self.account.close()
        self.closed = True
        return stopped


class DirRef:
    """One user's hold on a `CacheDir`; `release` is idempotent."""

    def __init__(self, dirs: CacheDirs, key: str, cache_dir: CacheDir) -> None:
        self.dirs = dirs
        self.key = key
        self.dir = cache_dir
        self._released = False
        self._lock = threading.Lock()

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
        last = self.dirs.dirs.release(self.key)
        if last is not None:
            last.close()


class CacheDirs:
    """The cache directories (and LMCache storage engines) of one connector,
    or of every connector that is handed the same object: shared by
    reference count, closed by their last user."""

    _ANCHOR_ATTR = "_kvoffload_cache_dirs"

    def __init__(self) -> None:
        self.dirs: Shared[str, CacheDir] = Shared()
        self.engines: Shared[Hashable, Any] = Shared()  # LMCache storage engines, keyed by their options

    def __reduce__(self) -> tuple:
        # Another process (a pickled anchor) starts with its own, empty registry.
        return (CacheDirs, ())

    @classmethod
    def attached(cls, anchor: object) -> CacheDirs:
        """The `CacheDirs` kept on `anchor` (made on first use): an object that
        both halves of a connector see in one process (vLLM's config), so
        that they share their owners, and separate processes (which each
        unpickle their own anchor) do not."""
        dirs = getattr(anchor, cls._ANCHOR_ATTR, None)
        if dirs is None:
            dirs = cls()
            object.__setattr__(anchor, cls._ANCHOR_ATTR, dirs)
        return dirs

    def open(self, top: Path, max_bytes: int | None, reconcile_s: float, file_mode: int, dir_mode: int) -> DirRef:
        """Hold the owner of layout directory `top`, making it on first use;
        the caller releases the returned reference when done."""
        key = os.path.realpath(top)
        cd = self.dirs.acquire(key, lambda: CacheDir(Path(key), max_bytes, reconcile_s, file_mode, dir_mode))
        cd.apply_budget(max_bytes)
        return DirRef(self, key, cd)

    def users(self, top: Path) -> int:
        return self.dirs.users(os.path.realpath(top))
