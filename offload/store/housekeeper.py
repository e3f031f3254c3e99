"""One housekeeper per cache directory and connector: it keeps the
directory's account (`offload.store.budget.DirBudget`) current and feeds both
the usage figures (per group, for metrics) and the byte budget.

A shared directory is filled by every instance. Each instance records what
it writes and evicts in its own log (`offload.store.ledger`); a pass reads
the new lines of every log (one listing of the ledger directory and one
read per log, however many files the cache holds), evicts when over budget,
and now and then compacts the logs into a snapshot or, every
`reconcile_s`, advances a walk of the tree that corrects drift. The thread
is started with the scheduler's file-tier index and stopped with it (the
connector's shutdown), which seals this process's log; nothing runs at
module level. The scheduler reads the latest figures without blocking.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

from offload.store.base import TierUsage
from offload.store.budget import DirBudget, account_for

logger = logging.getLogger(__name__)


class Housekeeper:
    def __init__(self, root: Path, num_groups: int, budget: DirBudget | None = None) -> None:
        self.root = root  # <path>/kvoffload-v2/<fingerprint>
        self.num_groups = num_groups
        self.account = budget if budget is not None else account_for(root.parent)
        self._latest: TierUsage | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner = False

    @property
    def budget(self) -> DirBudget | None:
        return self.account if self.account.max_bytes else None

    def start(self) -> Housekeeper:
        if self._thread is None:
            # One driver per account: a second housekeeper of the same directory
            # in this process only reads the figures.
            with _OWNERS_LOCK:
                self._owner = id(self.account) not in _OWNERS
                _OWNERS.add(id(self.account))
            self._thread = threading.Thread(target=self._run, name="kvoffload-housekeeper", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._owner:
                self.account.close()
                with _OWNERS_LOCK:
                    _OWNERS.discard(id(self.account))

    def latest(self) -> TierUsage | None:
        return self._latest

    def pass_once(self) -> TierUsage | None:
        """Tail the ledgers (loading the index first if needed), do what is
        due, enforce the budget, and measure this fingerprint's groups."""
        acct = self.account
        if not acct.ensure_loaded(self._stop):
            return None
        if self._owner or self._thread is None:
            acct.enforce()
            acct.maintain(self._stop)
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
        while not self._stop.is_set():
            try:
                self.pass_once()
            except Exception:  # housekeeping must never take the engine down
                logger.exception("kvoffload: housekeeping of %s failed", self.root)
            if self._stop.wait(self.account.interval_s() if self._owner else 1.0):
                return


_OWNERS: set[int] = set()
_OWNERS_LOCK = threading.Lock()
