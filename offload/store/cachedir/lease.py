"""The lease of a cache directory's ledger (`ledger-v1/lease`, docs/format.md):
at most one instance at a time walks the tree or writes a snapshot."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from offload.store.cachedir import hygiene
from offload.store.cachedir.paths import LEASE


class Lease:
    """At most one instance at a time walks the tree or writes a snapshot:
    `ledger-v1/lease`, created exclusively. A holder refreshes its mtime while
    it works; a lease older than `stale_s`, or this host's with its process
    gone, is taken over (two holders after a race only duplicate work)."""

    def __init__(self, d: Path, stale_s: float = 600.0) -> None:
        self.path = d / LEASE
        self.stale_s = stale_s
        self.held = False
        self._touched = 0.0

    def acquire(self) -> bool:
        if self.held:
            return True
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o640)
            except FileExistsError:
                if not self._stale():
                    return False
                try:  # move the stale lease aside first, so that only one taker removes it
                    aside = self.path.with_name(f".lease.stale.{uuid.uuid4().hex[:8]}")
                    os.replace(self.path, aside)
                    os.unlink(aside)
                except OSError:
                    return False
                continue
            except OSError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(f"{hygiene.HOST_TAG} {os.getpid()} {time.time():.3f}\n")
            self.held, self._touched = True, time.monotonic()
            return True
        return False

    def _stale(self) -> bool:
        try:
            st = os.stat(self.path)
            host, pid, _ = self.path.read_text().split()
        except (OSError, ValueError):
            return True
        if time.time() - st.st_mtime > self.stale_s:
            return True
        if host == hygiene.HOST_TAG:
            started = hygiene.pid_started_at(int(pid))
            return started is None or (started > 0 and started > st.st_mtime + 1.0)
        return False

    def refresh(self) -> None:
        if self.held and time.monotonic() - self._touched > self.stale_s / 10:
            try:
                os.utime(self.path)
            except OSError:
                pass
            self._touched = time.monotonic()

    def release(self) -> None:
        if self.held:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.held = False
