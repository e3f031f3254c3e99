"""A housekeeper keeps a cache directory's account
(`offload.store.cachedir.budget.DirBudget`) current and feeds both the usage figures
of one fingerprint (per group, for metrics) and the byte budget.

A shared directory is filled by every instance. Each instance records what
it writes and evicts in its own log (`offload.store.cachedir.ledger`); a pass reads
the new lines of every log (one listing of the ledger directory and one
read per log, however many files the cache holds), evicts when over budget,
and now and then compacts the logs into a snapshot or, every
`reconcile_s`, advances a walk of the tree that corrects drift. The
directory's owner (`offload.store.cachedir.owners.CacheDir`) makes one housekeeper
per fingerprint directory; one of them *drives* the account, the others only
read its figures. The thread is started with the scheduler's file-tier index
and stopped with it (the connector's shutdown), which seals this process's
log. The scheduler reads the latest figures without blocking.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from offload.store.cachedir.budget import DirBudget
from offload.store.tier_usage import TierUsage

logger = logging.getLogger(__name__)

STOP_WAIT_S = 5.0  # how long `stop` waits for a pass in progress


class Housekeeper:
    def __init__(self, root: Path, num_groups: int, budget: DirBudget | None = None, drive: bool = True) -> None:
        """`root`: a fingerprint directory; `budget`: the directory's account
        (a private one, reading the same ledger, without it); `drive`: this
        housekeeper tails, evicts and compacts, and closes the account when it
        stops (one per account)."""
        self.root = root  # a fingerprint directory (offload/store/cachedir/paths.py)
        self.num_groups = num_groups
        self.account = budget if budget is not None else DirBudget(root.parent)
        self.drive = drive
        self._latest: TierUsage | None = None
        # This fingerprint's chunk entries, gathered once on this thread when asked (warm start's
        # candidates: a pass over the whole index, which the scheduling path must not make).
        self._want_entries = False
        self._entries: list | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._exit_lock = threading.Lock()
        self._exited = False
        self._close_on_exit = False  # set by a stop that could not wait for the thread
        self.stopped = False

    @property
    def budget(self) -> DirBudget | None:
        return self.account if self.account.max_bytes else None

    def start(self) -> Housekeeper:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvoffload-housekeeper", daemon=True)
            self._thread.start()
        return self

    def stop(self, wait_s: float = STOP_WAIT_S) -> bool:
        """Stop the thread and, if this housekeeper drives the account, close
        it. Never closes under a running pass: if the thread has not returned
        within `wait_s`, this logs so, the thread closes the account itself
        when its pass returns, and the result is False."""
        self.stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=wait_s)
            with self._exit_lock:
                running = not self._exited
                if running:
                    self._close_on_exit = self.drive
            if running:
                logger.warning("kvoffload: housekeeping of %s did not stop within %.0f s (a pass is still "
                               "running); its account closes when the pass returns", self.root, wait_s)
                return False
        if self.drive:
            self.account.close()
        return True

    def latest(self) -> TierUsage | None:
        return self._latest

    def chunk_entries(self) -> list | None:
        """`DirBudget.chunk_entries` of this fingerprint, once a pass has gathered them (None until
        then: the first call asks for them)."""
        self._want_entries = True
        return self._entries

    def pass_once(self) -> TierUsage | None:
        """Tail the ledgers (loading the index first if needed), do what is
        due, enforce the budget, and measure this fingerprint's groups."""
        acct = self.account
        if not acct.ensure_loaded(self._stop):
            return None
        if self.drive or self._thread is None:
            acct.enforce()
            acct.maintain(self._stop)
        if self._want_entries and self._entries is None:
            self._entries = acct.chunk_entries(self.root.name)
        figures = acct.by_group
        fp = self.root.name
        per = [figures.get((fp, g), (0, 0)) for g in range(self.num_groups)]
        try:
            capacity = shutil.disk_usage(self.root.parent.parent).total
        except OSError:
            capacity = None
        self._latest = TierUsage(entries=tuple(f for f, _ in per), bytes=tuple(b for _, b in per),
                                 capacity_bytes=capacity, budget_bytes=acct.max_bytes or None)
        return self._latest

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self.pass_once()
                except Exception:  # housekeeping must never take the engine down
                    logger.exception("kvoffload: housekeeping of %s failed", self.root)
                if self._stop.wait(self.account.interval_s() if self.drive else 1.0):
                    return
        finally:
            with self._exit_lock:
                self._exited = True
                if self._close_on_exit:
                    self.account.close()
