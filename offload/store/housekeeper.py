"""One housekeeper per cache directory and connector: a single scan feeds
both the usage figures (per group, for metrics) and the byte budget.

A shared directory is filled by every instance, so only a scan tells what it
holds. The housekeeper's thread is started with the scheduler's file-tier
index and stopped with it (the connector's shutdown); nothing runs at module
level. With a budget, each pass is the budget's own scan of
`<path>/kvoffload-v1` (os.scandir: one getdents per directory, one stat per
file, no reads) followed by eviction when over; the per-group figures of this
fingerprint come out of the same walk. Without a budget, a pass scans only
this fingerprint's group directories. The scheduler reads the latest figures
without blocking.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from offload.store.base import TierUsage
from offload.store.budget import DirBudget

logger = logging.getLogger(__name__)


def scan_groups(root: Path, num_groups: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(files, bytes) per group under `root/g<group>/<kk>/*.kv`; temporary
    files count as bytes (they take space) but not as entries."""
    files, sizes = [0] * num_groups, [0] * num_groups
    for g in range(num_groups):
        try:
            subdirs = list(os.scandir(root / f"g{g}"))
        except OSError:
            continue
        for sub in subdirs:
            try:
                entries = list(os.scandir(sub.path)) if sub.is_dir(follow_symlinks=False) else []
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:  # removed by another instance while we scanned
                    continue
                sizes[g] += st.st_size
                files[g] += e.name.endswith(".kv")
    return tuple(files), tuple(sizes)


class Housekeeper:
    def __init__(self, root: Path, num_groups: int, budget: DirBudget | None = None,
                 interval_s: float = 10.0) -> None:
        self.root = root  # <path>/kvoffload-v1/<fingerprint>
        self.num_groups = num_groups
        self.budget = budget
        self.interval_s = interval_s
        self._latest: TierUsage | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Housekeeper:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvoffload-housekeeper", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def latest(self) -> TierUsage | None:
        return self._latest

    def pass_once(self) -> TierUsage:
        """One scan: enforce the budget (if any), and measure this fingerprint's groups."""
        if self.budget is not None:
            self.budget.enforce()
            figures = [self.budget.by_group.get((self.root.name, g), (0, 0)) for g in range(self.num_groups)]
            files, sizes = tuple(f for f, _ in figures), tuple(b for _, b in figures)
        else:
            files, sizes = scan_groups(self.root, self.num_groups)
        try:
            capacity = shutil.disk_usage(self.root.parent.parent).total
        except OSError:
            capacity = None
        self._latest = TierUsage(entries=files, bytes=sizes, capacity_bytes=capacity)
        return self._latest

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.pass_once()
            except Exception:  # housekeeping must never take the engine down
                logger.exception("kvoffload: housekeeping of %s failed", self.root)
            wait = self.budget.interval_s() if self.budget is not None else self.interval_s
            if self._stop.wait(wait):
                return
