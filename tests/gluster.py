"""A real network filesystem for tests: a GlusterFS replica-2 volume on two
bricks in local directories, and two FUSE mounts of it, each its own client
with its own attribute and directory-entry caches (what two nodes sharing a
cache directory over the network see).

`make setup` installs the Debian packages (glusterfs-server, glusterfs-client);
nothing is installed here. `unavailable()` says why a machine cannot run it
(no /dev/fuse, no gluster binaries, not root), and the fixture skips with
that reason.

`Volume.start` starts glusterd if none runs (and stops it at the end if it
started it and no other test volume is left), creates a volume with a name of
its own (`kvt<pid>x<n>`), so that test sessions running at the same time on
one machine do not meet, and mounts it twice. Every gluster command holds
`/tmp/kvoffload-gluster.lock` (flock) while it runs: glusterd serialises
volume operations with a cluster lock and refuses a second one meanwhile
("Another transaction is in progress").

Faults for the long runs: `kill_brick` (SIGKILL to one brick process) and
`start_force` (brings a killed brick back, then self-heal copies what it
missed), `stop`/`start` of the whole volume (the mounts stay and return
errors meanwhile), `fill` (a filler file through a mount until tmpfs
bricks refuse writes with ENOSPC) and `unfill`.

`probe(a, b)` measures what the filesystem does across two mounts: what the
file tier assumes of it (docs/operations.md, "Supported filesystems").
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from harness.client import wait_until

LOCK = "/tmp/kvoffload-gluster.lock"
PREFIX = "kvt"
BINARIES = ("glusterd", "gluster", "glusterfs")


def unavailable() -> str | None:
    """Why this machine cannot run a GlusterFS volume with FUSE mounts; None if it can."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: this kernel or container has no FUSE, so GlusterFS cannot be mounted"
    try:
        if "fuse" not in Path("/proc/filesystems").read_text().split():
            return "the kernel lists no 'fuse' filesystem in /proc/filesystems"
    except OSError:
        pass
    missing = [b for b in BINARIES if shutil.which(b) is None and not os.path.exists(f"/usr/sbin/{b}")]
    if missing:
        return (f"GlusterFS is not installed ({', '.join(missing)} missing): 'make setup' installs the Debian "
                "packages glusterfs-server and glusterfs-client (as root)")
    if os.geteuid() != 0:
        return "glusterd, brick processes and FUSE mounts of GlusterFS need root"
    return None


def _bin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


@contextlib.contextmanager
def _locked():
    fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def gluster(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """`gluster --mode=script ARGS`, one at a time on this machine; retried while glusterd says another
    transaction is in progress."""
    deadline = time.monotonic() + timeout
    while True:
        with _locked():
            p = subprocess.run([_bin("gluster"), "--mode=script", *args], capture_output=True, text=True,
                               timeout=max(5.0, deadline - time.monotonic()))
        busy = "nother transaction" in (p.stdout + p.stderr) or "Locking failed" in (p.stdout + p.stderr)
        if p.returncode == 0 or not busy or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if check and p.returncode != 0:
        raise RuntimeError(f"gluster {' '.join(args)}: rc {p.returncode}: {p.stdout.strip()} {p.stderr.strip()}")
    return p


def glusterd_running() -> bool:
    try:
        p = subprocess.run([_bin("gluster"), "--mode=script", "volume", "list"], capture_output=True,
                           text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return p.returncode == 0


def fs_type(path: Path) -> str:
    from offload.store.cachedir import hygiene

    return hygiene.fs_type(path)


_serial = [0]


@dataclass
class Volume:
    """A replica-2 volume on two local bricks and two FUSE mounts of it, under `base`."""

    base: Path
    mount_options: str = ""
    # Bricks on tmpfs mounts of these sizes (bytes; None: a plain directory): a brick that fills up.
    brick_bytes: tuple[int | None, int | None] = (None, None)
    name: str = ""
    host: str = field(default_factory=socket.gethostname)
    started_glusterd: int | None = None  # pid of the glusterd this volume started
    mounted: list[Path] = field(default_factory=list)

    @property
    def bricks(self) -> list[Path]:
        return [self.base / "brick1", self.base / "brick2"]

    @property
    def mounts(self) -> list[Path]:
        return [self.base / "node1", self.base / "node2"]

    def start(self) -> Volume:
        _serial[0] += 1
        self.name = self.name or f"{PREFIX}{os.getpid()}x{_serial[0]}"
        for d in (*self.bricks, *self.mounts):
            d.mkdir(parents=True, exist_ok=True)
        for d, size in zip(self.bricks, self.brick_bytes):
            if size is not None:
                subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(d)],
                               check=True, timeout=60, capture_output=True)
                self.mounted.append(d)
        with _locked():
            if not glusterd_running():
                log = self.base / "glusterd.log"
                pidf = self.base / "glusterd.pid"
                subprocess.run([_bin("glusterd"), "-p", str(pidf), "-l", str(log)], check=True, timeout=60)
                wait_until(glusterd_running, 60, "glusterd to answer")
                self.started_glusterd = int(pidf.read_text().split()[0])
        gluster("volume", "create", self.name, "replica", "2",
                *(f"{self.host}:{b}" for b in self.bricks), "force")
        # A client notices a brick that went away at once (the connection drops on this host); across hosts
        # the default 42 s ping timeout would hold every operation that long.
        gluster("volume", "set", self.name, "network.ping-timeout", "5")
        # Client quorum, as docs/config-reference.md advises: on replica 2, writes need the first brick,
        # so the two never take different writes to one file (a split-brain reads EIO until resolved by hand).
        gluster("volume", "set", self.name, "cluster.quorum-type", "auto")
        gluster("volume", "start", self.name)
        for m in self.mounts:
            self.mount(m)
        return self

    def mount(self, m: Path) -> None:
        cmd = ["mount", "-t", "glusterfs"]
        if self.mount_options:
            cmd += ["-o", self.mount_options]
        subprocess.run([*cmd, f"{self.host}:/{self.name}", str(m)], check=True, timeout=60, capture_output=True)
        wait_until(lambda: fs_type(m) == "fuse.glusterfs", 30, f"the FUSE mount at {m}")
        self.mounted.append(m)

    def umount(self, m: Path) -> None:
        if subprocess.run(["umount", str(m)], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(m)], capture_output=True, timeout=60)
        if m in self.mounted:
            self.mounted.remove(m)

    # ---- faults ------------------------------------------------------------------------------

    def brick_pids(self) -> dict[str, int]:
        """{brick path: pid} of the brick processes online now (`gluster volume status --xml`)."""
        import xml.etree.ElementTree as ET

        p = gluster("volume", "status", self.name, "--xml", check=False)
        pids = {}
        with contextlib.suppress(ET.ParseError):
            for node in ET.fromstring(p.stdout).iter("node"):
                path, status, pid = node.findtext("path"), node.findtext("status"), node.findtext("pid")
                if path in {str(b) for b in self.bricks} and status == "1" and pid and pid.isdigit():
                    pids[path] = int(pid)
        return pids

    def kill_brick(self, i: int) -> int:
        pid = self.brick_pids()[str(self.bricks[i])]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not _alive(pid), 30, f"brick process {pid} to exit")
        # glusterd restarts a brick only if its pid file names no process, and a zombie counts as one; where
        # nothing reaps the daemon's zombie soon (seen in gVisor sandboxes), its pid file goes instead.
        for pidf in Path(f"/var/run/gluster/vols/{self.name}").glob("*.pid"):
            with contextlib.suppress(OSError, ValueError):
                if int(pidf.read_text().split()[0]) == pid:
                    pidf.unlink()
        return pid

    def start_force(self) -> None:
        """Restart bricks that are down (`volume start force`); self-heal then copies what they missed."""
        gluster("volume", "start", self.name, "force")
        wait_until(lambda: len(self.brick_pids()) == 2, 60, "both bricks online")
        wait_until(self.connected, 60, "both mounts and self-heal connected to both bricks", interval_s=0.2)

    def stop(self) -> None:
        gluster("volume", "stop", self.name)

    def start_again(self) -> None:
        gluster("volume", "start", self.name)
        wait_until(lambda: len(self.brick_pids()) == 2, 60, "both bricks online")
        # The clients reconnect on their own, each brick in its own time; until both mounts are back on both
        # bricks a write may land on one replica only.
        wait_until(self.connected, 60, "both mounts and self-heal connected to both bricks", interval_s=0.2)
        for m in self.mounts:
            wait_until(lambda m=m: self.writable(m), 60, f"{m} to take writes again", interval_s=0.2)

    def connected(self) -> bool:
        """Whether every brick has both mounts and the self-heal daemon as clients."""
        import xml.etree.ElementTree as ET

        p = gluster("volume", "status", self.name, "clients", "--xml", check=False)
        counts = {}
        with contextlib.suppress(ET.ParseError):
            for node in ET.fromstring(p.stdout).iter("node"):
                path, n = node.findtext("path"), node.findtext("clientsStatus/clientCount")
                if path in {str(b) for b in self.bricks} and n and n.isdigit():
                    counts[path] = int(n)
        return len(counts) == 2 and min(counts.values()) >= len(self.mounts) + 1

    def writable(self, mount: Path) -> bool:
        """Whether a small write through `mount` succeeds now."""
        probe = mount / f".writable.{os.getpid()}"
        try:
            probe.write_bytes(b"x" * 65536)
            probe.unlink()
            return True
        except OSError:
            return False

    def heal_pending(self) -> int:
        """Entries self-heal still has to copy (`volume heal info`), summed over bricks; -1 if unknown."""
        p = gluster("volume", "heal", self.name, "info", check=False)
        if p.returncode != 0:
            return -1
        return sum(int(line.split(":")[1]) for line in p.stdout.splitlines()
                   if line.startswith("Number of entries:") and line.split(":")[1].strip().isdigit())

    def fill(self) -> Path:
        """Fill the bricks (tmpfs ones: `brick_bytes`) through mount 1 with a file outside any cache directory,
        until they refuse even a 4 KiB write (ENOSPC); returns the filler's path."""
        p = self.mounts[0] / f".filler.{os.getpid()}"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for step in (4 << 20, 64 << 10, 4 << 10):  # smaller blocks fill what a larger one did not fit in
                block, eio = b"\0" * step, 0
                while True:
                    try:
                        os.write(fd, block)
                    except OSError as e:
                        # EIO: one replica refused and the other took it (the bricks fill a block apart)
                        if e.errno == errno.EIO and eio < 20:
                            eio += 1
                            continue
                        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                            raise
                        break
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        return p

    def unfill(self, filler: Path, timeout: float = 30) -> float:
        """Remove the filler; returns the seconds until a write succeeds again (a brick rechecks its free
        space every few seconds)."""
        t0 = time.monotonic()
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()
        wait_until(lambda: self.writable(self.mounts[0]), timeout, "the bricks to take writes again", interval_s=0.2)
        return time.monotonic() - t0

    # ---- teardown ------------------------------------------------------------------------------

    def close(self) -> None:
        for m in [m for m in self.mounted if m in self.mounts]:
            self.umount(m)
        if self.name:
            gluster("volume", "stop", self.name, "force", check=False)
            gluster("volume", "delete", self.name, check=False)
        for m in list(self.mounted):  # tmpfs bricks
            self.umount(m)
        with _locked():
            if self.started_glusterd is not None:
                left = subprocess.run([_bin("gluster"), "--mode=script", "volume", "list"], capture_output=True,
                                      text=True, timeout=30).stdout.split()
                if not [v for v in left if v.startswith(PREFIX)] and _alive(self.started_glusterd):
                    os.kill(self.started_glusterd, signal.SIGTERM)
                    with contextlib.suppress(TimeoutError):
                        wait_until(lambda: not _alive(self.started_glusterd), 30, "glusterd to exit")
                    # its self-heal daemon outlives it; it serves no volume any more
                    _kill_orphan_shd()
        shutil.rmtree(self.base, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _kill_orphan_shd() -> None:
    """glusterd's self-heal daemon, by the pid file glusterd wrote for it."""
    for pidf in Path("/var/run/gluster").glob("shd/*.pid") if Path("/var/run/gluster").is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidf.read_text().split()[0])
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"glustershd" in cmd:
                os.kill(pid, signal.SIGTERM)


# ---- what the filesystem does across two mounts ---------------------------------------------------


def probe(a: Path, b: Path, seconds: float = 3.0) -> dict:
    """Measure, through mount `a` and mount `b` of one directory: how late one mount sees the other's
    creates, appends and unlinks; whether a file renamed over another on `a` is ever read torn on `b`
    (and which errors a reader meets meanwhile); sub-second mtimes; O_DIRECT; O_EXCL, flock and fcntl
    locks across mounts."""
    from offload.store.buffers import probe_o_direct
    from offload.store.cachedir import hygiene

    name = f"probe.{os.getpid()}.{os.urandom(3).hex()}"
    da, db = a / name, b / name
    da.mkdir()
    out: dict = {"fs_type": hygiene.fs_type(da), "network": hygiene.is_network_fs(da)}
    try:
        # creates
        t0 = time.monotonic()
        (da / "c").write_bytes(b"x")
        wait_until(lambda: (db / "c").exists(), 10, "a create to show on the other mount", interval_s=0.001)
        out["create_visible_s"] = round(time.monotonic() - t0, 3)
        # appends: one line at a time, each read back through a fresh open on the other mount
        fd = os.open(da / "log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o640)
        delays = []
        try:
            for i in range(3):
                line = f"line {i} {'x' * 60}\n".encode()
                os.write(fd, line)
                os.fdatasync(fd)
                t0 = time.monotonic()

                def seen(line=line):
                    f = os.open(db / "log", os.O_RDONLY)
                    try:
                        return os.pread(f, 1 << 16, 0).endswith(line)
                    finally:
                        os.close(f)
                wait_until(seen, 10, "an append to show on the other mount", interval_s=0.002)
                delays.append(time.monotonic() - t0)
        finally:
            os.close(fd)
        out["append_visible_s_max"] = round(max(delays), 3)
        # unlinks
        os.unlink(da / "c")
        t0 = time.monotonic()
        wait_until(lambda: not (db / "c").exists(), 10, "an unlink to show on the other mount", interval_s=0.001)
        out["unlink_visible_s"] = round(time.monotonic() - t0, 3)
        out.update(_rename_race(da, db, seconds))
        # mtimes: sub-second, and a utime on one mount is what the other reads
        (da / "m").write_bytes(b"x")
        fracs = set()
        for _ in range(5):
            os.utime(da / "m")
            fracs.add(os.stat(da / "m").st_mtime_ns % 1_000_000_000)
            time.sleep(0.011)
        out["mtime_subsecond"] = len(fracs) > 1
        t = time.time() + 10.25
        os.utime(da / "m", (t, t))
        t0 = time.monotonic()
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: abs(os.stat(db / "m").st_mtime - t) < 1e-3, 5, "a utime on the other mount")
        out["utime_visible_s"] = round(time.monotonic() - t0, 3)
        out["o_direct_write"] = probe_o_direct(da)
        out["o_direct_read"] = _direct_read(da / "m")
        # O_EXCL create, flock and fcntl locks: exclusive across mounts?
        os.close(os.open(da / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        try:
            os.close(os.open(db / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            out["o_excl_exclusive"] = False
        except FileExistsError:
            out["o_excl_exclusive"] = True
        for kind, lock in (("flock", fcntl.flock), ("fcntl", fcntl.lockf)):
            fa = os.open(da / "x", os.O_RDWR)
            fb = os.open(db / "x", os.O_RDWR)
            try:
                lock(fa, fcntl.LOCK_EX | fcntl.LOCK_NB)
                try:
                    lock(fb, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    out[f"{kind}_exclusive"] = False
                except OSError:
                    out[f"{kind}_exclusive"] = True
            finally:
                os.close(fa)
                os.close(fb)
    finally:
        shutil.rmtree(da, ignore_errors=True)
    return out


def _rename_race(da: Path, db: Path, seconds: float) -> dict:
    """A writer on `da` renames new complete files over one name; a reader on `db` reads that name in a loop
    and checks each read's CRC. Counts reads, torn reads (must be 0) and errors by errno name."""
    stop = threading.Event()
    reads, torn, errors = [0], [0], {}

    def writer():
        i = 0
        while not stop.is_set():
            body = os.urandom(256 << 10) + bytes([i % 256]) * 4096
            tmp = da / f"f.tmp.{i}"
            tmp.write_bytes(zlib.crc32(body).to_bytes(4, "big") + body)
            os.rename(tmp, da / "f")
            i += 1

    def reader():
        while not stop.is_set():
            try:
                data = (db / "f").read_bytes()
            except OSError as e:
                n = errno.errorcode.get(e.errno or 0, str(e.errno))
                errors[n] = errors.get(n, 0) + 1
                continue
            reads[0] += 1
            if len(data) < 4 or zlib.crc32(data[4:]) != int.from_bytes(data[:4], "big"):
                torn[0] += 1

    (da / "f").write_bytes(b"\0\0\0\0")  # crc32(b"") == 0: a complete (empty) file
    ts = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in ts:
        t.join()
    return {"rename_reads": reads[0], "rename_torn": torn[0], "rename_read_errors": errors}


def _direct_read(path: Path) -> bool:
    import mmap

    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
        try:
            return os.preadv(fd, [buf], 0) >= 0
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()


if __name__ == "__main__":  # python tests/gluster.py: start a volume, probe it, tear it down
    import sys
    import tempfile

    why = unavailable()
    if why:
        sys.exit(f"gluster: {why}")
    v = Volume(Path(tempfile.mkdtemp(prefix="kvgluster."))).start()
    try:
        print(json.dumps(probe(*v.mounts), indent=1))
    finally:
        v.close()
