"""How much a cache directory holds, measured off the scheduling path.

A shared directory is filled by every instance, so only a scan tells what it
holds. A daemon thread rescans every `interval_s` seconds (os.scandir: one
getdents per directory and one stat per file, no reads) and the scheduler
reads the latest figures without blocking.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

from offload.store.base import TierUsage


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


class DirectoryUsage:
    def __init__(self, root: Path, num_groups: int, interval_s: float = 10.0) -> None:
        self.root = root
        self.num_groups = num_groups
        self.interval_s = interval_s
        self._latest: TierUsage | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def _run(self) -> None:
        while True:
            files, sizes = scan_groups(self.root, self.num_groups)
            try:
                capacity = shutil.disk_usage(self.root.parent.parent).total
            except OSError:
                capacity = None
            self._latest = TierUsage(entries=files, bytes=sizes, capacity_bytes=capacity)
            if self._stop.wait(self.interval_s):
                return

    def latest(self) -> TierUsage | None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvoffload-usage", daemon=True)
            self._thread.start()
        return self._latest

    def stop(self) -> None:
        self._stop.set()
