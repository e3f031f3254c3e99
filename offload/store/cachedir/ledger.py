"""Append-only ledgers of a cache directory: what files exist and their sizes,
kept without walking the tree (format: docs/format.md, "Ledger").

Every process that writes or evicts under the layout directory appends one
line per file it adds (`+`) or removes (`-`) to its own log in
`ledger-v1/` in it (offload/store/cachedir/paths.py). A process that needs the directory's usage reads
the newest snapshot (a full listing, written now and then) and then tails
every log from the offsets the snapshot folded in. A line is self-checking
(CRC-32), so a line torn by a crash, or half-visible on another NFS client,
is skipped or waited for, never misread.

This module is the format and its I/O only; `offload.store.cachedir.budget.DirBudget`
folds the records into an index and decides what to evict.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from offload.store.cachedir import hygiene
from offload.store.cachedir.paths import (  # noqa: F401
    CHUNK_REL,
    LEASE,
    LEDGER_DIR,
    LOG_NAME,
    OTHER_REL,
    SNAPSHOT_NAME,
    SNAPSHOT_TMP,
    log_name,
    snapshot_names,
    valid_rel,
)

logger = logging.getLogger(__name__)

LEDGER_VERSION = 1
MAGIC = "kvoffload-ledger"
# A put line's optional last field: the file entered the eviction order
# cold. Readers before it skip such a line as damaged (the file is accounted
# at their next walk).
COLD_MARK = " cold"
# A log past this size is sealed and a new one started, so that a long-lived
# instance's records become foldable (and removable) by the next snapshot.
MAX_LOG_BYTES = 64 << 20
# Lines a writer keeps while its ledger cannot be written (a network
# filesystem away, a full disk), about 100 bytes each; past it the oldest go.
MAX_BACKLOG_LINES = 200_000

PUT = "+"
DROP = "-"


class Record(NamedTuple):
    """One file added (`op` PUT) or removed (`op` DROP) at time `t`."""

    op: str
    t: float
    size: int  # 0 for a removal
    parent: int | None  # the parent key's first 8 bytes (chained groups); None: stands alone
    rel: str  # the file, relative to the layout directory (offload.store.cachedir.paths)
    cold: bool = False  # it entered the eviction order at the cold end (a state or a partial tail admitted cold)


class End(NamedTuple):
    """A log's seal (its value: when), or a snapshot's last line (its value: the entry count)."""

    n: float


class Offset(NamedTuple):
    """A snapshot's note that it folded log `log` up to byte `offset`."""

    log: str
    offset: int


Line = Record | End | Offset

# Builds a NamedTuple without its Python-level __new__: 4x cheaper, and parse runs once per record.
_tuple_new = tuple.__new__


def _crc(body: str) -> str:
    return f"{zlib.crc32(body.encode()):08x}"


def put_line(rel: str, size: int, t: float, parent: int | None, cold: bool = False) -> str:
    body = f"+ {t:.3f} {size} {'-' if parent is None else format(parent, '016x')} {rel}{COLD_MARK if cold else ''}"
    return f"{body} {_crc(body)}\n"


def drop_line(rel: str, t: float) -> str:
    body = f"- {t:.3f} 0 - {rel}"
    return f"{body} {_crc(body)}\n"


def end_line(n: float) -> str:
    body = f"end {n:.3f}" if isinstance(n, float) else f"end {n}"
    return f"{body} {_crc(body)}\n"


def offset_line(name: str, offset: int) -> str:
    body = f"@ {name} {offset}"
    return f"{body} {_crc(body)}\n"


def header_line(kind: str, extra: str = "") -> str:
    return f"{MAGIC} {LEDGER_VERSION} {kind} {hygiene.HOST_TAG} {os.getpid()} {time.time():.3f}{extra}\n"


def parse(line: str) -> Line | None:
    """A `Record`, an `End` or an `Offset`, or None for a line that fails its CRC or names
    something a record may not."""
    if len(line) < 12 or line[-9] != " ":
        return None
    body = line[:-9]
    if f"{zlib.crc32(body.encode()):08x}" != line[-8:]:  # _crc, inlined: once per line of every log
        return None
    f = body.split(" ")
    try:
        if f[0] in (PUT, DROP) and len(f) == 5:
            rel = f[4]
            if not valid_rel(rel):
                return None
            return _tuple_new(Record, (f[0], float(f[1]), int(f[2]), None if f[3] == "-" else int(f[3], 16), rel,
                                       False))
        if f[0] == PUT and len(f) == 6 and f[5] == "cold":
            rel = f[4]
            if not valid_rel(rel):
                return None
            return _tuple_new(Record, (f[0], float(f[1]), int(f[2]), None if f[3] == "-" else int(f[3], 16), rel,
                                       True))
        if f[0] == "end" and len(f) == 2:
            return End(float(f[1]))
        if f[0] == "@" and len(f) == 3 and LOG_NAME.match(f[1]):
            return Offset(f[1], int(f[2]))
    except ValueError:
        pass
    return None


def parse_header(line: str) -> dict | None:
    """Fields of a first line, or None if the file is not a ledger of this version."""
    f = line.rstrip("\n").split(" ")
    if len(f) < 6 or f[0] != MAGIC or f[1] != str(LEDGER_VERSION) or f[2] not in ("log", "snapshot"):
        return None
    try:
        h = {"kind": f[2], "host": f[3], "pid": int(f[4]), "created": float(f[5])}
        for kv in f[6:]:
            k, _, v = kv.partition("=")
            h[k] = float(v)
    except ValueError:
        return None
    return h


def read_lines(path: Path | str, offset: int) -> tuple[list[str], int, int]:
    """Complete lines of `path` from byte `offset`: (lines, offset after the
    last complete line, file size; -1 if the file is gone). A trailing
    fragment without its newline (a write in progress, or torn by a crash)
    is left for a later call."""
    try:
        fd = os.open(path, os.O_RDONLY)  # a fresh open revalidates NFS attributes (close-to-open)
    except FileNotFoundError:
        return [], offset, -1
    try:
        size = os.fstat(fd).st_size
        if size <= offset:
            return [], offset, size
        chunks = []
        pos = offset
        while pos < size:
            b = os.pread(fd, min(size - pos, 8 << 20), pos)
            if not b:
                break
            chunks.append(b)
            pos += len(b)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    end = data.rfind(b"\n") + 1
    if end == 0:
        return [], offset, size
    return data[:end].decode("utf-8", "replace").splitlines(), offset + end, size


class LedgerWriter:
    """This process's log in one ledger directory. Lines are appended with
    one write each (O_APPEND); the file is opened on the first record, so a
    process that only reads leaves no file behind."""

    def __init__(self, d: Path, file_mode: int = 0o640, dir_mode: int = 0o750, network: bool = False) -> None:
        self.dir = d
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.network = network
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = 0
        self.name: str | None = None
        self.size = 0
        self.bytes_written = 0
        self._dirty = False
        self._flushed_at = 0.0
        self.failed = 0  # appends that did not go through (each kept for a retry)
        self._backlog: list[str] = []  # texts not yet appended, oldest first
        self.lost = 0  # lines dropped from a full backlog: only a walk accounts their files

    def _open(self) -> int:
        """Start this process's log file; returns its descriptor (also kept in `_fd`)."""
        if not self.dir.is_dir():
            try:
                os.makedirs(self.dir, self.dir_mode, exist_ok=True)
                os.chmod(self.dir, self.dir_mode)
            except OSError:
                pass
        if os.path.islink(self.dir):
            raise OSError(errno.ELOOP, "ledger directory is a symbolic link", str(self.dir))
        self._pid = os.getpid()
        self.name = log_name(hygiene.HOST_TAG, self._pid)
        fd = os.open(self.dir / self.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_NOFOLLOW,
                     self.file_mode)
        os.fchmod(fd, self.file_mode)
        head = header_line("log").encode()
        os.write(fd, head)
        self._fd, self.size = fd, len(head)
        self.bytes_written += len(head)
        return fd

    def append(self, text: str) -> bool:
        """Append whole lines; False (and nothing raised) if the ledger cannot be
        written now. Such lines are kept, in order, and appended before the next
        ones once it can (`retry`): a record carries its own time, so a late one
        folds in where it belongs and a repeated one changes nothing."""
        with self._lock:
            if self._backlog:
                self._backlog.append(text)
                return self._drain_locked()
            if self._write_locked(text):
                return True
            self._keep_locked([text])
            return False

    def retry(self) -> bool:
        """Append the lines kept while the ledger could not be written; True when none are left."""
        with self._lock:
            return self._drain_locked() if self._backlog else True

    @property
    def backlog(self) -> int:
        """Lines waiting to be appended."""
        return len(self._backlog)

    def _drain_locked(self) -> bool:
        lines, self._backlog = self._backlog, []
        if self._write_locked("".join(lines)):
            logger.info("kvoffload: the ledger in %s takes writes again: appended %d deferred records",
                        self.dir, len(lines))
            return True
        self._keep_locked(lines)
        return False

    def _keep_locked(self, lines: list[str]) -> None:
        self._backlog = lines
        over = len(lines) - MAX_BACKLOG_LINES
        if over > 0:  # their files are found by the walk this prompts (`lost`)
            del self._backlog[:over]
            self.lost += over

    def _write_locked(self, text: str) -> bool:
        data = text.encode()
        try:
            if self._fd is not None and (self._pid != os.getpid() or self.size >= MAX_LOG_BYTES):
                self._seal_locked()  # forked child: its own log; or rotation
            fd = self._fd if self._fd is not None else self._open()
            n = os.write(fd, data)
            self.size += n
            self.bytes_written += n
            if n != len(data):  # a torn line: readers skip it; start a clean log (the whole text is kept)
                self._abandon_locked()
                self.failed += 1
                return False
            self._dirty = True
            if self.network and time.monotonic() - self._flushed_at > 0.5:
                self._flush_locked()
            return True
        except OSError as e:
            self.failed += 1
            if self.failed in (1, 100, 10000):
                logger.warning("kvoffload: cannot append to the ledger in %s (%s); its records are kept and "
                               "appended once it can", self.dir, e)
            self._abandon_locked()
            return False

    def put(self, rel: str, size: int, t: float, parent: int | None, cold: bool = False) -> bool:
        return self.append(put_line(rel, size, t, parent, cold))

    def drop(self, rel: str, t: float) -> bool:
        return self.append(drop_line(rel, t))

    def flush(self) -> None:
        """Make appended lines visible to other NFS clients (a no-op on a local filesystem)."""
        with self._lock:
            if self.network:
                self._flush_locked()

    def _flush_locked(self) -> None:
        if self._fd is not None and self._dirty:
            try:
                os.fdatasync(self._fd)
            except OSError:
                pass
            self._dirty = False
        self._flushed_at = time.monotonic()

    def seal(self) -> None:
        """End this log: a sealed log is never appended to again (the next
        record opens a new one), so a snapshot that folded it lets it go."""
        with self._lock:
            if self._backlog and not self._drain_locked():
                logger.warning("kvoffload: %d records could not be appended to the ledger in %s; the next "
                               "reconcile walk accounts their files", len(self._backlog), self.dir)
                self.lost += len(self._backlog)
                self._backlog = []
            self._seal_locked()

    def _seal_locked(self) -> None:
        if self._fd is None:
            return
        if self._pid == os.getpid():
            try:
                os.write(self._fd, end_line(time.time()).encode())
                self._flush_locked()
            except OSError:
                pass
        self._abandon_locked()

    def _abandon_locked(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
        self._fd, self.name, self.size, self._dirty = None, None, 0, False


@dataclass
class Snapshot:
    name: str
    created: float
    walked: float  # when the walk behind it started (a checkpoint carries its base's)
    offsets: dict[str, int]
    other: int = 0  # bytes of files no record can name (found by the walk)
    entries: list[Record] = field(default_factory=list)
    complete: bool = False


def read_snapshot(path: Path, head_only: bool = False) -> Snapshot | None:
    """A snapshot's header and offsets (and, unless `head_only`, its entries);
    None if it is not a complete snapshot of this version (or cannot be opened;
    an error while reading it is raised)."""
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(open(path, encoding="utf-8", errors="replace"))
        except OSError:
            return None
        h = parse_header(f.readline())
        if h is None or h["kind"] != "snapshot" or "walked" not in h:
            return None
        snap = Snapshot(path.name, h["created"], h["walked"], {}, int(h.get("other", 0)))
        for line in f:
            r = parse(line.rstrip("\n"))
            if r is None:
                return None  # written through a temporary name, so a bad line is damage, not a tear
            if isinstance(r, Offset):
                snap.offsets[r.log] = r.offset
            elif isinstance(r, End):
                snap.complete = int(r.n) == len(snap.entries) or head_only
                return snap if snap.complete else None
            elif head_only:
                snap.complete = True
                return snap
            else:
                snap.entries.append(r)
    return None


# One file in a snapshot, as the index holds it: (rel, size, t, parent, cold). A plain tuple: a
# checkpoint builds one per file in the directory.
Entry = tuple[str, int, float, "int | None", bool]


def write_snapshot(d: Path, entries: Iterable[Entry], offsets: dict[str, int], walked: float, file_mode: int,
                   other: int = 0) -> tuple[str, int]:
    """Write a snapshot of `entries` atomically
    (temporary name, then rename); returns (name, bytes)."""
    ms = int(time.time() * 1000)
    tmp_name, name = snapshot_names(ms)
    tmp = d / tmp_name
    n = 0
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, file_mode)
    try:
        os.fchmod(fd, file_mode)
        with os.fdopen(fd, "w", encoding="utf-8", buffering=1 << 20) as f:
            f.write(header_line("snapshot", f" walked={walked:.3f} other={other}"))
            for log, off in sorted(offsets.items()):
                f.write(offset_line(log, off))
            for rel, size, t, parent, cold in entries:
                f.write(put_line(rel, size, t, parent, cold))
                n += 1
            f.write(end_line(n))
            f.flush()
            os.fdatasync(f.fileno())
        os.replace(tmp, d / name)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return name, (d / name).stat().st_size


def writer_gone(name: str, mtime: float, now: float, other_host_age_s: float) -> bool:
    """Whether the process that wrote log `name` will append no more: this
    host's and not alive (or a reused pid), or another host's and idle for
    `other_host_age_s`."""
    m = LOG_NAME.match(name)
    if m is None:
        return True
    if m.group("host") == hygiene.HOST_TAG:
        started = hygiene.pid_started_at(int(m.group("pid")))
        return started is None or (started > 0 and started > mtime + 1.0)
    return now - mtime >= other_host_age_s
