"""Cache-directory hygiene for the filesystem tier: orphaned temporary files,
symlinks, and permissions. See docs/format.md ("Temporary files") and
docs/reliability.md.

Temporary files are `<final name>.tmp.<pid>.<8 hex>` (any writer) or
`<final name>.tmp.<pid>.<8 hex>.<host tag>` (`FileStore.tmp_path`). A writer
killed mid-write (kill -9, OOM, power loss) leaves one behind; it is never
visible under a final name, so it is garbage, not corruption. The rule that
removes it must not remove a file that a live writer, possibly on another NFS
client, is still writing (that writer's rename would then fail, and its store
would be dropped: a lost store, never a wrong byte):

* the pid is this host's (host tag equal to ours, or the directory is on a
  local filesystem, where no other host writes) and that process is gone, or
  was started after the file was last written (pid reuse): remove now;
* otherwise (another host's tag, or an untagged file on a network
  filesystem) only once the pid is not alive here and the file is older than
  `NET_GRACE_S`, or in any case once it is older than `orphan_tmp_age_s`.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import psutil

from offload.store.cachedir.paths import GROUP_PREFIX, LAYOUT_TMP_RE, QUARANTINE, TMP_RE

logger = logging.getLogger(__name__)

NET_GRACE_S = 120.0
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "ceph", "glusterfs", "lustre", "gpfs", "beegfs",
              "9p", "afs", "ocfs2", "gfs2")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


HOST_TAG = f"{zlib.crc32(f'{socket.gethostname()}|{_boot_id()}'.encode()):08x}"


def pid_started_at(pid: int) -> float | None:
    """Wall-clock start time of a live local process (seconds since the
    epoch, as a file's mtime); None if it is gone. Returns 0.0 when alive but
    the start time is unknown."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's
    except OSError:
        return None
    try:
        return psutil.Process(pid).create_time()  # boot time + the kernel's start ticks
    except (psutil.Error, OSError):
        return 0.0


def fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` ('' if unknown)."""
    try:
        real = os.path.realpath(path)
        best, kind = "", ""
        for part in psutil.disk_partitions(all=True):  # in mount order: the last of equal mount points is on top
            mnt = part.mountpoint
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, part.fstype
        return kind
    except OSError:
        return ""


def is_network_fs(path: Path) -> bool:
    kind = fs_type(path)
    return kind in NETWORK_FS or kind.startswith("fuse")


def is_orphan(name: str, mtime: float, now: float, local_only: bool, max_age_s: float) -> bool:
    """Whether temporary file `name` (last written at `mtime`) is garbage (module doc)."""
    age = now - mtime
    if age >= max_age_s:
        return True
    if LAYOUT_TMP_RE.match(name):
        return age >= NET_GRACE_S  # layout.json is written once at start-up, in microseconds
    m = TMP_RE.search(name)
    if m is None:
        return False
    pid, host = int(m.group("pid")), m.group("host")
    ours = host == HOST_TAG or (host is None and local_only)
    started = pid_started_at(pid)
    gone = started is None or (started > 0 and started > mtime + 1.0)
    if not gone:
        return False
    return ours or age >= NET_GRACE_S


def walk(root: str | Path, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, os.DirEntry]]:
    """Every entry under `root` that is not a directory, as (its directory,
    entry), depth first. Symlinks are entries, never followed; directories
    named in `skip`, and directories that cannot be read (removed meanwhile
    by another engine, which is normal on a shared cache), are passed over."""
    stack = [str(root)]
    while stack:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                except OSError:
                    continue
                if not is_dir:
                    yield d, e
                elif e.name not in skip:
                    stack.append(e.path)


def clean_orphans(root: Path, max_age_s: float, local_only: bool | None = None) -> tuple[int, int]:
    """Remove orphaned temporary files under `root` (a fingerprint directory).
    Returns (removed, kept): kept are temporary files that may still be written."""
    if local_only is None:
        local_only = not is_network_fs(root)
    now = time.time()
    removed = kept = 0
    for _, e in walk(root, skip=frozenset({QUARANTINE})):
        if ".tmp" not in e.name:
            continue
        try:
            mtime = e.stat(follow_symlinks=False).st_mtime
        except OSError:
            continue
        if is_orphan(e.name, mtime, now, local_only, max_age_s):
            try:
                os.unlink(e.path)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError as err:
                logger.warning("kvoffload: cannot remove orphaned %s: %s", e.path, err)
        else:
            kept += 1
    if removed:
        logger.info("kvoffload: removed %d orphaned temporary files under %s", removed, root)
    return removed, kept


def umask() -> int | None:
    """The process umask, read without changing it (os.umask would race other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


def world_writable(path: Path) -> int | None:
    """The mode of `path` if every user may write it, else None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return stat.S_IMODE(st.st_mode) if st.st_mode & stat.S_IWOTH else None


def escapes(path: Path, real_root: str) -> bool:
    """Whether `path` resolves (symlinks followed) outside `real_root`."""
    real = os.path.realpath(path)
    return not (real == real_root or real.startswith(real_root.rstrip("/") + "/"))


def move_symlinks_aside(root: Path, qdir: Path) -> int:
    """Move symlinked directories or files inside the fingerprint directory
    `root` (g<group>/, g<group>/<xx>/ and the chunk files in them) to
    `qdir`: a cache directory never follows a link out of itself."""
    moved = 0
    candidates: list[str] = []
    try:
        with os.scandir(root) as it:
            for e in it:
                if e.name.startswith(GROUP_PREFIX) or e.name == QUARANTINE:
                    candidates.append(e.path)
                    if e.is_dir(follow_symlinks=False) and e.name.startswith(GROUP_PREFIX):
                        with os.scandir(e.path) as sub:
                            candidates.extend(s.path for s in sub)
    except OSError:
        return 0
    for p in candidates:
        if os.path.islink(p):
            try:
                if p == str(qdir):  # quarantine itself: move it beside, a real one is made on demand
                    os.replace(p, root / f".quarantine.symlink.{os.urandom(4).hex()}")
                    moved += 1
                    continue
                qdir.mkdir(parents=True, exist_ok=True)
                os.replace(p, qdir / f"{os.path.basename(p)}.symlink.{os.urandom(4).hex()}")
                moved += 1
                logger.warning("kvoffload: %s is a symbolic link; moved it to %s (the cache never "
                               "follows links out of its directory)", p, qdir)
            except OSError as err:
                if err.errno != errno.ENOENT:
                    logger.warning("kvoffload: cannot move symlink %s aside: %s", p, err)
    return moved
