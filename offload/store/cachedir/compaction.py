"""Compaction of a ledger directory: when a snapshot is worth writing, and
what it lets go of once written (older snapshots, stale temporaries, logs
it folded whole whose writers are done). Only the lease holder compacts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from offload.store.cachedir.ledger import Entry, write_snapshot, writer_gone
from offload.store.cachedir.paths import LOG_NAME, SNAPSHOT_NAME, SNAPSHOT_TMP

COMPACT_MIN_BYTES = 8 << 20  # log bytes since the newest snapshot before a checkpoint is worth writing
FOLDED_IDLE_S = 60.0  # a folded log must be this idle before it goes (every reader has tailed it)
OTHER_HOST_IDLE_S = 3600.0  # another host's unsealed log: its writer is presumed gone after this
MAX_LOGS = 32  # more logs than this (restarts leave one each) and a checkpoint folds the finished ones
MIN_CHECKPOINT_S = 600.0
SNAPSHOT_TMP_AGE_S = 3600.0  # a snapshot's temporary file this old was left by a crash


def due(logs: int, pending_log_bytes: int, snap_bytes: int, has_snapshot: bool,
        folded_logs_at: float) -> tuple[bool, bool]:
    """(a checkpoint is due, because of the number of logs): when the logs
    since the snapshot outgrow it, when many logs (each a file every pass
    opens) have piled up (at most every MIN_CHECKPOINT_S), or for a new
    directory's first snapshot (later starts need no walk)."""
    many = logs > MAX_LOGS and time.monotonic() - folded_logs_at > MIN_CHECKPOINT_S
    return (many or pending_log_bytes > max(COMPACT_MIN_BYTES, snap_bytes)
            or (not has_snapshot and logs > 0)), many


def write(ledger_dir: Path, entries: list[Entry], offsets: dict[str, int], walked: float, other: int,
          file_mode: int, dir_mode: int) -> tuple[str, int]:
    """Write a snapshot; returns (name, bytes)."""
    ledger_dir.mkdir(mode=dir_mode, exist_ok=True)
    return write_snapshot(ledger_dir, entries, offsets, walked, file_mode, other)


def cleanup(ledger_dir: Path, newest: str, folded: dict[str, int], read: dict[str, int], sealed: set[str],
            own_log: str | None, folded_idle_s: float = FOLDED_IDLE_S) -> None:
    """After snapshot `newest` (which folded each log of `folded` up to its
    offset): remove older snapshots but the previous one, stale temporaries,
    and logs folded whole (`read`: what this instance has read of each) that
    are idle and whose writer is done (sealed, or gone)."""
    try:
        names = os.listdir(ledger_dir)
    except OSError:
        return
    now = time.time()
    snaps = sorted(n for n in names if SNAPSHOT_NAME.match(n))
    keep = set(snaps[-2:]) | {newest}  # the previous one too: a reader may be opening it
    for n in names:
        path = ledger_dir / n
        try:
            stale_snapshot = SNAPSHOT_NAME.match(n) and n not in keep and n < newest
            if stale_snapshot or (SNAPSHOT_TMP.match(n) and now - os.stat(path).st_mtime > SNAPSHOT_TMP_AGE_S):
                os.unlink(path)
            elif LOG_NAME.match(n) and n != own_log and n in folded:
                st = os.stat(path)
                if now - st.st_mtime < folded_idle_s or folded[n] != read.get(n, -1):
                    continue
                # Folded whole (a torn tail of a dead writer is no record) and its writer is done.
                if n in sealed or writer_gone(n, st.st_mtime, now, OTHER_HOST_IDLE_S):
                    os.unlink(path)
        except OSError:
            continue
