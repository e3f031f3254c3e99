"""The chunk files of one fingerprint directory: `FileStore`, their one writer and reader.

Layout (see offload/store/cachedir/paths.py and docs/format.md): a layout directory
under the configured path, one directory per fingerprint in it, and one file
per (group, key) under `g<group>/<key[:2]>/`.
Files appear under their final name only when complete (temporary file in the
same directory, then rename), so a reader sees a whole file or none. Any read
that fails verification is a miss and the file is moved to quarantine/, so it
is not found again.

Contract: `FileStore.open` tidies the directory once per owner and refuses a
world-writable one; `write_framed` is the one chunk writer (atomic, signed with
the deployment key where there is one, a ledger record per file);
`read_into`/`read_framed` return verified payloads or raise `ChunkMiss`, a
transient error leaving the file in place; `quarantine` and `remove` keep the
ledger's account right. The start-up checks of a cache directory are
offload/store/dir_checks.py; the tier's halves over it are offload/store/fs.py.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch

from offload import copier
from offload.keys import ChunkKey, Fingerprint
from offload.planner import GroupKind
from offload.store.auth import Keyring, Unauthenticated, begin_entry, close_entry, frame, open_keyring
from offload.store.base import ChunkMiss, HostChunk, MissReason, OptionError, PayloadMac
from offload.store.buffers import BufferPool
from offload.store.cachedir import hygiene, paths
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.owners import CacheDirs, DirRef
from offload.store.cachedir.paths import (
    LAYOUT_FILE,
    chunk_path,
    fanout_dirs,
    fingerprint_dir,
    layout_tmp_path,
    quarantine_dir,
    quarantined_path,
    rel_of,
    top_dir,
)
from offload.store.format import HEADER_LEN, ChunkHeader, FormatError, header_of
from offload.store.options import (
    DEFAULT_ORPHAN_AGE_S,
    DEFAULT_RECONCILE_S,
    DIR_MODE,
    FILE_MODE,
    FsOptions,
)

logger = logging.getLogger(__name__)

# Read errors after which the file may still be good: a miss, not a quarantine. The transport errors
# (ENOTCONN first) are a network filesystem's client without its server: a volume stopped, a server
# restarting; the file reads again once it is back.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ESTALE,
                              errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.EACCES, errno.EPERM,
                              errno.ENOTCONN, errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED,
                              errno.EHOSTDOWN, errno.EHOSTUNREACH, errno.ENETDOWN, errno.ENETUNREACH})
_UMASK = hygiene.umask()
# How often a directory that vanished, or was being made elsewhere, is walked again.
DIR_RACE_ERRNOS = frozenset({errno.ENOENT, errno.ESTALE})
DIR_RACE_TRIES = 4


@dataclass(frozen=True)
class FileStore:
    root: Path  # a fingerprint directory (offload/store/cachedir/paths.py)
    fingerprint: Fingerprint
    fsync: bool = False
    file_mode: int = FILE_MODE
    dir_mode: int = DIR_MODE
    budget: DirBudget | None = field(default=None, compare=False, repr=False)
    # realpath of `root`: nothing is read or written where a path resolves outside it.
    real_root: str = field(default="", compare=False, repr=False)
    _safe_dirs: set = field(default_factory=set, compare=False, repr=False)
    # The directory's usage account (the ledger this process appends to); `budget` is it when max_bytes is set.
    account: DirBudget | None = field(default=None, compare=False, repr=False)
    # The deployment's keys: writes are signed, reads verified (offload/store/auth.py); None: CRC only.
    keyring: Keyring | None = field(default=None, compare=False, repr=False)
    # This store's hold on the directory's owner (offload/store/cachedir/owners.py); released by `close`.
    ref: DirRef | None = field(default=None, compare=False, repr=False)

    @classmethod
    def open(cls, path: str, fp: Fingerprint, fsync: bool = False, options: FsOptions | None = None,
             dirs: CacheDirs | None = None) -> FileStore:
        """Open (and tidy, once per owner) the fingerprint directory under `path`.

        `options` give modes, the byte budget, the orphan age and the key
        (defaults without them). `dirs` holds the directory's owner, shared
        with every store opened through the same object (a private one
        without it); `close` lets go of it. A world-writable cache directory
        is refused, and so is a key that cannot be used (OptionError naming
        the option).
        """
        cfg = options
        keyring = open_keyring(cfg.auth) if cfg is not None else None
        base = Path(path)
        for d in (base, top_dir(base), fingerprint_dir(base, fp.hex())):
            mode = hygiene.world_writable(d)
            if mode is not None:
                raise OptionError(
                    f"path={path!r}: {d} is writable by every user (mode {mode:04o}), so anyone "
                    f"could plant, replace or link cache files; run 'chmod o-w {d}' or choose another path "
                    f"(dir_mode sets the mode of directories the connector creates)")
        root = fingerprint_dir(base, fp.hex())
        ref = (dirs if dirs is not None else CacheDirs()).open(
            top_dir(base), cfg.max_bytes if cfg is not None else None,
            cfg.reconcile_interval_s if cfg is not None else DEFAULT_RECONCILE_S,
            cfg.file_mode if cfg is not None else FILE_MODE, cfg.dir_mode if cfg is not None else DIR_MODE)
        account = ref.dir.account
        store = cls(root, fp, fsync or (cfg is not None and cfg.fsync),
                    cfg.file_mode if cfg is not None else FILE_MODE,
                    cfg.dir_mode if cfg is not None else DIR_MODE,
                    account if account.max_bytes else None, os.path.realpath(root), account=account,
                    keyring=keyring, ref=ref)
        # Once per owner, at open: restarts rely on orphans going. The byte
        # budget and usage figures are the scheduler index's `Housekeeper`.
        orphan_age_s = cfg.orphan_tmp_age_s if cfg is not None else DEFAULT_ORPHAN_AGE_S
        ref.dir.tidy_once(root, lambda: store.tidy(orphan_age_s) if root.is_dir() else None)
        return store

    def close(self) -> None:
        """Let go of the directory's owner (the last user closes it: log sealed)."""
        if self.ref is not None:
            self.ref.release()

    # ---- housekeeping: orphans, symlinks, budget ---------------------------------

    def tidy(self, orphan_age_s: float = DEFAULT_ORPHAN_AGE_S) -> tuple[int, int]:
        """Move symlinks out of the way and remove orphaned temporary files;
        returns (orphans removed, temporary files kept as possibly live)."""
        hygiene.move_symlinks_aside(self.root, quarantine_dir(self.root))
        return hygiene.clean_orphans(self.root, orphan_age_s)

    def _dir_ok(self, d: Path) -> bool:
        """`d` (inside root) resolves inside root: no symlink leads out."""
        if d in self._safe_dirs:
            return True
        if hygiene.escapes(d, self.real_root):
            return False
        try:
            if d.is_dir():
                self._safe_dirs.add(d)
        except OSError:
            pass  # unreachable now (a network filesystem without its server): checked again next time
        return True

    def prepare_dir(self, final: Path) -> None:
        """Create the directory of `final` with `dir_mode`; raise OSError(ELOOP)
        if it resolves outside the cache directory (a planted symlink)."""
        d = final.parent
        if d in self._safe_dirs:
            return
        for attempt in range(DIR_RACE_TRIES):
            try:
                self._make_dirs(d)
                break
            except OSError as e:
                # Another node of a shared volume made the same directory at the same moment
                # (GlusterFS answers the loser ENOENT or ESTALE): a fresh walk finds it.
                if e.errno not in DIR_RACE_ERRNOS or attempt == DIR_RACE_TRIES - 1:
                    raise
                time.sleep(0.01 * 2 ** attempt)
        if not self._dir_ok(d) or not self._dir_ok(self.root):
            raise OSError(errno.ELOOP, "cache subdirectory resolves outside the cache directory", str(d))

    def _make_dirs(self, d: Path) -> None:
        missing = []
        p = d
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        for m in reversed(missing):
            try:
                os.mkdir(m, self.dir_mode)
            except FileExistsError:
                continue
            if _UMASK is None or self.dir_mode & _UMASK:
                os.chmod(m, self.dir_mode)

    def make_dirs(self, groups: int) -> int:
        """Make the directories files of groups 0..`groups`-1 go in (`fanout_dirs`) at start-up:
        made by the first stores, their journalled mkdirs queue at the device among loads' reads.
        One that cannot be made now is made by its first store. Returns how many were made."""
        made = 0
        for g in range(groups):
            dirs = fanout_dirs(self.root, g)
            try:
                self.prepare_dir(dirs[0].parent / "x")
                have = set(os.listdir(dirs[0].parent))
                for d in dirs:
                    if d.name not in have:
                        self.prepare_dir(d / "x")
                        made += 1
            except OSError as e:  # a read-only or unreachable cache directory: the stores say so
                logger.warning("kvoffload: cannot make the directories of group %d under %s now (%s); "
                               "they are made at their first store", g, self.root, e)
        return made

    def tmp_path(self, final: Path) -> Path:
        """`<final name>.tmp.<pid>.<8 hex>.<host tag>` (see offload/store/cachedir/hygiene.py)."""
        return paths.tmp_path(final, hygiene.HOST_TAG)

    def rel(self, path: Path) -> str:
        """`path` (inside root) as the ledger names it: relative to the layout directory."""
        return rel_of(self.root.parent, path)

    def written(self, final: Path, nbytes: int, parent: bytes | None = None, cold: bool = False) -> None:
        """After a file appeared under its final name: exact mode, and a ledger
        record (the budget evicts at once if this write took it over)."""
        if _UMASK is None or self.file_mode & _UMASK:
            try:
                os.chmod(final, self.file_mode)
            except OSError:
                pass  # evicted or replaced meanwhile
        if self.account is not None:
            self.account.note_write(self.rel(final), nbytes,
                                    None if not parent or parent == bytes(8) else int.from_bytes(parent, "big"),
                                    cold)

    # ---- files ----------------------------------------------------------------------

    def file_path(self, group: int, key: ChunkKey) -> Path:
        return chunk_path(self.root, group, key.hex())

    def contains(self, group: int, key: ChunkKey) -> bool:
        path = self.file_path(group, key)
        return os.path.exists(path) and self._dir_ok(path.parent)

    def write_layout(self, description: dict) -> None:
        """Record what the fingerprint stands for (for operators and tools).

        If a layout file exists, its tensor layout must equal ours: the same
        fingerprint with different page bytes would load garbage.
        """
        target = self.root / LAYOUT_FILE
        self.prepare_dir(target)
        doc = json.dumps(description, indent=2, sort_keys=True)
        if target.exists():
            existing = json.loads(target.read_text())
            if existing.get("tensors") != description.get("tensors"):
                raise RuntimeError(
                    f"cache directory {self.root} holds files of another KV tensor layout under the "
                    f"same fingerprint ({target}); use a different 'path' for this deployment"
                )
            return
        tmp = layout_tmp_path(target)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, self.file_mode)
        if _UMASK is None or self.file_mode & _UMASK:
            os.fchmod(fd, self.file_mode)
        with os.fdopen(fd, "w") as f:
            f.write(doc)
        os.replace(tmp, target)
        self.written(target, len(doc.encode()))

    def write(self, header: ChunkHeader, payload: torch.Tensor, cold: bool = False) -> bool:
        """Write one chunk file from a bare payload (tools, tests). False if it existed."""
        if payload.numel() != header.payload_len:
            # The file would contradict its own header and be quarantined by every reader.
            raise ValueError(f"payload has {payload.numel()} bytes, header says {header.payload_len}")
        chunk = HostChunk.pooled(BufferPool(), payload.numel())
        chunk.payload.copy_(payload.reshape(-1))
        return self.write_framed(header, chunk, direct=False, cold=cold)[0]

    def write_framed(self, header: ChunkHeader, chunk: HostChunk, direct: bool,
                     cold: bool = False) -> tuple[bool, bool]:
        """The one chunk writer: write `chunk` (a pooled buffer with the
        header's room in front) atomically; the payload CRC (and, with a key,
        the MAC) is computed here, on the I/O thread. Returns (written,
        O_DIRECT used); written is False if the file existed (same key, same
        bytes)."""
        assert chunk.buf is not None
        n = chunk.payload.numel()
        if n != header.payload_len:
            raise ValueError(f"payload has {n} bytes, header says {header.payload_len}")
        final = self.file_path(header.group, header.key)
        # os.path.exists, not Path.exists: an error other than ENOENT (ENOTCONN: a network filesystem without
        # its server) is "not there"; the write below then fails alone, as a dropped store
        if os.path.exists(final):
            return False, False  # another request or instance stored it
        raw = frame(header, chunk.payload, self.keyring, chunk.crc, chunk.fed_mac(self.keyring))
        chunk.buf[:HEADER_LEN].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        with self.account.reserving(HEADER_LEN + n) if self.account is not None else nullcontext():
            for attempt in range(DIR_RACE_TRIES):
                self.prepare_dir(final)  # modes, and no planted symlink leads out of the cache
                try:
                    used = copier.write_file_direct(str(self.tmp_path(final)), str(final), chunk.buf,
                                                    HEADER_LEN + n, self.fsync, self.file_mode, direct=direct)
                    break
                except OSError as e:
                    # The directory went after it was made or seen (removed from a live cache): make it again.
                    if e.errno not in DIR_RACE_ERRNOS or attempt == DIR_RACE_TRIES - 1:
                        raise
                    self._safe_dirs.discard(final.parent)
        # A Mamba state stands alone: no parent, whatever its header carries.
        self.written(final, HEADER_LEN + n, None if header.kind is GroupKind.MAMBA else header.parent, cold)
        return True, used

    def read_header(self, group: int, key: ChunkKey) -> ChunkHeader | None:
        """The header of the chunk file of (`group`, `key`) if it is one of ours by name and by
        its own checks; None otherwise (no quarantine here: the payload read that follows
        verifies everything again and deals with a bad file)."""
        path = self.file_path(group, key)
        if not self._dir_ok(path.parent):
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                raw, size = os.pread(fd, HEADER_LEN, 0), os.fstat(fd).st_size
            finally:
                os.close(fd)
            header = header_of(raw, size)
        except (OSError, FormatError):
            return None
        if (header.fingerprint != self.fingerprint or header.group != group or bytes(header.key) != bytes(key)
                or header.size_problem(size) is not None):
            return None
        return header

    def read_into(self, expected: ChunkHeader, out: torch.Tensor) -> None:
        """Fill `out` with the verified payload, or raise ChunkMiss.

        `out` must be a contiguous uint8 CPU tensor of exactly
        `expected.payload_len` bytes (ValueError otherwise).
        """
        if (out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous()
                or out.numel() != expected.payload_len):
            # A caller bug, not a bad file: checked before the read so that a
            # good file is not reported corrupt and quarantined.
            raise ValueError(f"out must be a contiguous uint8 CPU tensor of {expected.payload_len} bytes, "
                             f"got {out.numel()} x {out.dtype} on {out.device}")
        crc = self.keyring is None  # with a key the MAC is checked instead (close_entry)
        self._read(expected, lambda path: copier.read_file(path, HEADER_LEN, out, crc), out)

    def read_framed(self, expected: ChunkHeader, chunk: HostChunk, crc_later: bool = False) -> bool:
        """Read the whole file into `chunk` (a pooled buffer: header room, then
        the payload), with O_DIRECT where the filesystem allows it, and verify
        it as `read_into` does. Returns whether O_DIRECT was used. `crc_later`:
        the CRC (without a key) or the MAC (with one, where the copier hashes)
        is left to the caller's pass over the payload (`HostChunk.crc_due`,
        `mac_due`); a mismatch there quarantines the file as one here does."""
        buf = chunk.buf
        if buf is None or chunk.payload.numel() != expected.payload_len:
            raise ValueError(f"chunk must be a pooled buffer with a payload of {expected.payload_len} bytes")
        used = [False]
        with_crc = self.keyring is None and not crc_later

        def direct(path: str) -> tuple[bytes, int]:
            raw, crc, used[0] = copier.read_file_direct(path, HEADER_LEN, buf, expected.payload_len, with_crc)
            return raw, crc
        header, mac, settle = self._read(expected, direct, chunk.payload, crc_later)
        if crc_later and self.keyring is None:
            path = self.file_path(expected.group, expected.key)
            chunk.crc_due = header.payload_crc
            chunk.corrupt = lambda: self._refused(path, FormatError("payload checksum mismatch"))
        chunk.mac_due, chunk.settle_mac = mac, settle
        return used[0]

    def _refused(self, path: Path, e: Exception) -> ChunkMiss:
        """The miss for a file that failed its checks; it goes to quarantine unless it is another
        deployment's (an Unauthenticated that claims no key of ours)."""
        if not isinstance(e, Unauthenticated) or e.quarantine:
            self.quarantine(path)
        return ChunkMiss(MissReason.UNAUTHENTICATED if isinstance(e, Unauthenticated) else MissReason.CORRUPT,
                         f"{path}: {e}")

    def _read(self, expected: ChunkHeader, read: Callable[[str], tuple[bytes, int]], payload: torch.Tensor,
              later: bool = False) -> tuple[ChunkHeader, PayloadMac | None, Callable[[PayloadMac], None] | None]:
        """Run `read(path)` -> (header bytes, payload CRC) on the chunk's file (the payload lands
        in `payload`) and verify the result (`begin_entry`); every way it can fail is a ChunkMiss,
        and a file bad for good goes to quarantine. What `later` leaves to the caller: the CRC,
        or a MAC returned with the check that settles it once the caller's pass fed it."""
        path = self.file_path(expected.group, expected.key)
        if not self._dir_ok(path.parent):
            raise ChunkMiss(MissReason.UNSAFE, f"{path.parent} resolves outside the cache directory")
        try:
            if stat.S_ISLNK(os.lstat(path).st_mode):
                self.quarantine(path)  # moves the link itself, never its target
                raise ChunkMiss(MissReason.UNSAFE, f"{path} is a symbolic link")
            raw, crc = read(str(path))
        except FileNotFoundError:
            raise ChunkMiss(MissReason.MISSING, str(path)) from None
        except OSError as e:
            if e.errno in TRANSIENT_ERRNOS:  # the file may be fine: a miss, but keep it
                raise ChunkMiss(MissReason.IO_ERROR, f"{path}: {e}") from None
            raise self._refused(path, e) from None  # unreadable for good (e.g. a directory in its place)
        except ValueError as e:  # wrong size (truncated or extended)
            raise self._refused(path, e) from None
        try:
            header, mac = begin_entry(raw, None if self.keyring is not None else crc, expected, payload,
                                      self.keyring, later)
        except (FormatError, Unauthenticated) as e:
            raise self._refused(path, e) from None
        if self.budget is not None:
            try:
                os.utime(path)  # recency for LRU eviction, visible to every instance
            except OSError:
                pass
        if mac is None:
            return header, None, None

        def settle(fed: PayloadMac) -> None:
            try:
                close_entry(raw, header, expected, payload, None, fed)
            except (FormatError, Unauthenticated) as e:
                raise self._refused(path, e) from None
        return header, mac, settle

    def remove(self, path: Path) -> None:
        """Delete a file this process wrote, and say so in the ledger."""
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        if self.account is not None:
            self.account.note_remove(self.rel(path))

    def quarantine(self, path: Path) -> None:
        """Move a bad file aside so lookups stop finding it; keep it for fsck."""
        qdir = quarantine_dir(self.root)
        try:
            if os.path.islink(qdir):
                raise OSError(errno.ELOOP, "quarantine is a symbolic link", str(qdir))
            if not qdir.exists():
                self.prepare_dir(qdir / "x")
            moved = quarantined_path(self.root, path.name)
            os.replace(path, moved)
        except OSError as e:  # another reader moved it first, or read-only dir
            logger.debug("quarantine of %s skipped: %s", path, e)
            return
        if self.account is not None:  # the bytes moved: the ledger says so (they stay within the budget)
            self.account.note_remove(self.rel(path))
            try:
                self.account.note_write(self.rel(moved), os.lstat(moved).st_size)
            except OSError:
                pass
