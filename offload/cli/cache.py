"""Read-only view of a cache directory, shared by `stats`, `fsck` and `gc`.

`scan(PATH)` walks the layout directory under PATH (offload/store/cachedir/paths.py, docs/format.md),
classifies every entry and reads each chunk file's `HEADER_LEN`-byte header. The chains its
files form are offload/cli/chains.py.

Nothing here writes. `verify_payloads=True` also reads every payload and
checks its CRC-32C (fsck), and its MAC with a `keyring` (fsck with a key);
otherwise only headers are read (stats, gc).
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

from offload.planner import GroupKind
from offload.store.auth import Keyring
from offload.store.cachedir import hygiene
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.paths import (
    CHUNK_FILE,
    CHUNK_TMP_FILE,
    GROUP_DIR,
    HEX64,
    LAYOUT_DIR,
    LAYOUT_DIR_GLOB,
    LAYOUT_FILE,
    LAYOUT_TMP_RE,
    LEDGER_DIR,
    PREFIX_DIR,
    QUARANTINE,
    is_tmp_name,
    parse_group_dir,
)
from offload.store.format import HEADER_LEN, MAC_OFFSET, NO_KEY, ChunkHeader, FormatError, header_of

LAYOUT_VERSION_DIR = LAYOUT_DIR
# How a layout.json group spec repr names each kind (vLLM's KVCacheSpec class names).
SPEC_KINDS = (("MambaSpec", GroupKind.MAMBA), ("SlidingWindow", GroupKind.SLIDING_WINDOW),
              ("ChunkedLocal", GroupKind.CHUNKED_LOCAL), ("FullAttentionSpec", GroupKind.FULL_ATTENTION))


class NotACache(Exception):
    """PATH holds no kvoffload cache directory."""


@dataclass
class ChunkFile:
    path: Path
    group: int
    key: str  # hex, from the file name
    size: int
    mtime: float
    atime: float
    header: ChunkHeader | None = None
    problem: str | None = None  # why the file cannot be restored; None if it can (as far as checked)
    # What kind of problem: "corrupt" (damage), "unauthenticated" (claims the given key: a bad MAC, or a
    # valid MAC on another chunk's file), "foreign-key" (no MAC, or a key that was not given).
    problem_kind: str = "corrupt"

    @property
    def used(self) -> float:
        """Last use: the later of the last read (atime) and the store (mtime)."""
        return max(self.mtime, self.atime)


@dataclass
class FpDir:
    """One fingerprint directory: one model/layout/TP rank."""

    path: Path
    layout: dict | None = None
    layout_problem: str | None = None
    files: list[ChunkFile] = field(default_factory=list)
    tmp: list[Path] = field(default_factory=list)  # <name>.kv.tmp.<pid>.<hex> and .layout.*.tmp
    quarantine: list[Path] = field(default_factory=list)
    unknown: list[tuple[Path, str]] = field(default_factory=list)  # (path, why)

    @property
    def chunk_size(self) -> int | None:
        return (self.layout or {}).get("chunk_size")

    def layout_kinds(self) -> dict[int, GroupKind]:
        """Kind of each group, from the spec names in layout.json."""
        kinds: dict[int, GroupKind] = {}
        for i, g in enumerate((self.layout or {}).get("groups", [])):
            spec = str(g.get("spec", "")) if isinstance(g, dict) else ""
            kind = next((k for name, k in SPEC_KINDS if spec.startswith(name)), None)  # names share no prefix
            if kind is not None:
                kinds[i] = kind
        return kinds

    def group_kinds(self) -> dict[int, GroupKind]:
        """Kind of each group: from layout.json, else from the files' headers."""
        kinds = self.layout_kinds()
        for f in self.files:
            if f.header is not None:
                kinds.setdefault(f.group, f.header.kind)
        return kinds


@dataclass
class Cache:
    root: Path  # the layout directory under PATH
    dirs: list[FpDir]
    other: list[tuple[Path, str]]  # entries under root that are not fingerprint directories
    other_versions: list[Path]  # kvoffload-v<N> directories of another format version (not ours to judge)
    ledger: Path | None = None  # ledger-v1/: the usage accounting's logs and snapshots (docs/format.md)


def find_root(path: str | Path) -> Path:
    """Accept the configured `path`, its layout directory, or a fingerprint directory."""
    p = Path(path)
    if not p.is_dir():
        raise NotACache(f"{p}: not a directory")
    if (p / LAYOUT_VERSION_DIR).is_dir():
        return p / LAYOUT_VERSION_DIR
    if p.name == LAYOUT_VERSION_DIR:
        return p
    if HEX64.match(p.name) and p.parent.name == LAYOUT_VERSION_DIR:
        return p
    raise NotACache(f"{p}: no {LAYOUT_VERSION_DIR}/ directory here; give the connector's 'path'")


def scan(path: str | Path, verify_payloads: bool = False, keyring: Keyring | None = None) -> Cache:
    """`keyring` (with `verify_payloads`): check every file's MAC too."""
    root = find_root(path)
    if HEX64.match(root.name):  # a single fingerprint directory
        return Cache(root.parent, [_scan_fp(root, verify_payloads, keyring)], [], [])
    dirs, other, ledger = [], [], None
    for e in sorted(root.iterdir()):
        if e.is_dir() and not e.is_symlink() and HEX64.match(e.name):
            dirs.append(_scan_fp(e, verify_payloads, keyring))
        elif e.name == LEDGER_DIR and e.is_dir() and not e.is_symlink():
            ledger = e
        else:
            other.append((e, "not a fingerprint directory (64 hex digits)"))
    versions = [d for d in sorted(root.parent.glob(LAYOUT_DIR_GLOB)) if d.name != LAYOUT_VERSION_DIR and d.is_dir()]
    return Cache(root, dirs, other, versions, ledger)


# ---- the ledger: usage as the connector accounts it ---------------------------------------


def tree_bytes(root: Path) -> tuple[int, int]:
    """(files, bytes) of every regular file under the layout directory `root` but
    temporary files in flight and the ledger: what the ledger accounts for,
    measured by a walk."""
    files = total = 0
    for _, e in hygiene.walk(root, skip=frozenset({LEDGER_DIR})):
        if is_tmp_name(e.name):
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            files += 1
            total += st.st_size
    return files, total


def ledger_view(root: Path, walk: bool = True) -> dict:
    """What the connector's account says about the layout directory `root`, read
    only: the newest snapshot and every log since (a walk only where there is
    no snapshot), per fingerprint and group, and the time it took. With
    `walk`, also what a walk finds and the difference (drift)."""
    acct = DirBudget(root, read_only=True)
    t0 = time.perf_counter()
    acct.ensure_loaded()
    out = acct.describe()
    out["load_s"] = round(time.perf_counter() - t0, 3)
    if walk:
        files, nbytes = tree_bytes(root)
        out["walk"] = {"files": files, "bytes": nbytes}
        out["drift_bytes"] = out["bytes"] - nbytes
        out["drift_files"] = out["files"] - files
    # States stored cold (state_policy by_use: a prompt's internal boundary) and not loaded since.
    cold: dict[tuple[str, int], list[int]] = {}
    for e in acct.index.entries.values():
        if e.cold and (fg := parse_group_dir(e.gdir)) is not None:
            c = cold.setdefault(fg, [0, 0])
            c[0] += 1
            c[1] += e.size
    groups: dict[str, list[dict]] = {}
    for (fp, g), (n, b) in sorted(acct.by_group.items()):
        cn, cb = cold.get((fp, g), (0, 0))
        groups.setdefault(fp, []).append({"group": g, "files": n, "bytes": b, "cold_files": cn, "cold_bytes": cb})
    out["fingerprints"] = groups
    # What warm start would choose from (offload/connector/warm.py): every chunk file not stored cold.
    hot = [e.size for e in acct.index.entries.values() if not e.cold and parse_group_dir(e.gdir) is not None]
    out["warm_start_candidates"] = {"files": len(hot), "bytes": sum(hot)}
    return out


def record_removal(acct: DirBudget, path: Path) -> None:
    """Tell the live engines' accounts (through this tool's own log) that a file went."""
    rel = acct.rel(path)
    if rel is not None:
        acct.note_remove(rel)


def _scan_fp(d: Path, verify: bool, keyring: Keyring | None = None) -> FpDir:
    fp = FpDir(d)
    try:
        fp.layout = json.loads((d / LAYOUT_FILE).read_text())
        if not isinstance(fp.layout, dict) or not isinstance(fp.layout.get("groups"), list):
            fp.layout, fp.layout_problem = None, "layout.json has no 'groups' list"
    except FileNotFoundError:
        fp.layout_problem = "no layout.json"
    except (OSError, ValueError) as e:
        fp.layout_problem = f"layout.json unreadable: {e}"
    n_groups = len(fp.layout["groups"]) if fp.layout else None
    for e in sorted(d.iterdir()):
        m = GROUP_DIR.match(e.name)
        if e.is_symlink():
            fp.unknown.append((e, "symbolic link (never followed)"))
        elif e.name == LAYOUT_FILE:
            continue
        elif e.name == QUARANTINE and e.is_dir():
            fp.quarantine.extend(sorted(q for q in e.iterdir() if q.is_symlink() or q.is_file()))
        elif LAYOUT_TMP_RE.match(e.name):
            fp.tmp.append(e)
        elif m and e.is_dir():
            group = int(m.group(1))
            if n_groups is not None and group >= n_groups:
                why = f"group g{group} not in layout.json ({n_groups} groups)"
            else:
                why = fp.layout_problem
            _scan_group(fp, e, group, why, verify, keyring)
        else:
            fp.unknown.append((e, "unrecognised entry"))
    return fp


def _scan_group(fp: FpDir, gdir: Path, group: int, unknown_layout: str | None, verify: bool,
                keyring: Keyring | None) -> None:
    kinds = fp.layout_kinds()
    for sub in sorted(gdir.iterdir()):
        if sub.is_symlink() or not (sub.is_dir() and PREFIX_DIR.match(sub.name)):
            fp.unknown.append((sub, "unrecognised entry"))
            continue
        for f in sorted(sub.iterdir()):
            m = CHUNK_FILE.match(f.name)
            if f.is_symlink():
                fp.unknown.append((f, "symbolic link (never followed)"))
            elif CHUNK_TMP_FILE.match(f.name):
                fp.tmp.append(f)
            elif not m or not f.is_file() or not f.name.startswith(sub.name):
                fp.unknown.append((f, "unrecognised entry"))
            elif unknown_layout:
                fp.unknown.append((f, f"unknown layout: {unknown_layout}"))
            else:
                try:
                    st = f.stat()
                except FileNotFoundError:
                    continue  # evicted since the listing (or, on a network filesystem, listed late)
                except OSError as e:
                    fp.unknown.append((f, f"cannot stat: {e.strerror}"))
                    continue
                cf = ChunkFile(f, group, m.group(1), st.st_size, st.st_mtime, st.st_atime)
                _check(fp, cf, verify, kinds, keyring)
                fp.files.append(cf)


def _check(fp: FpDir, cf: ChunkFile, verify: bool, kinds: dict[int, GroupKind],
           keyring: Keyring | None = None) -> None:
    """Header (always), payload CRC (when `verify`) and MAC (when `verify`
    with a `keyring`), as FileStore.read_into would (offload/store/auth.py)."""
    mac_ok = False
    try:
        with _open_noatime(cf.path) as fh:
            raw = fh.read(HEADER_LEN)
            h = header_of(raw, cf.size)
            cf.header = h
            if (problem := h.size_problem(cf.size)) is not None:
                raise FormatError(problem)
            hasher = None
            if verify and keyring is not None:
                key = keyring.key(h.key_id)
                if key is None:
                    cf.problem_kind = "foreign-key"
                    cf.problem = ("no MAC (written without a key)" if h.key_id == NO_KEY
                                  else f"key id {h.key_id.hex()} is not one of the given keys")
                else:
                    hasher = key.start(h.mac)
            if verify:
                from offload.copier import crc32c

                crc = 0
                while block := fh.read(8 << 20):
                    crc = crc32c(block, crc)
                    if hasher is not None:
                        hasher.update(block)
                if crc != h.payload_crc:
                    raise FormatError("payload checksum mismatch")
                if hasher is not None:
                    hasher.update(raw[:MAC_OFFSET])
                    mac_ok = hasher.verify(h.mac)
                    if not mac_ok:
                        cf.problem_kind = "unauthenticated"
                        cf.problem = f"MAC mismatch under key id {h.key_id.hex()}"
            if h.key.hex() != cf.key or h.fingerprint.hex() != fp.path.name or h.group != cf.group:
                raise FormatError("header identity (key, fingerprint or group) does not match the file's place")
            cs = fp.chunk_size
            # One chunk, or a partial tail inside one: from the chunk's start (a hybrid's
            # tail), or from a unit boundary inside it (attention-only tail entries) to a
            # boundary inside it (docs/format.md).
            if cs:
                inside = 0 < h.token_end - h.token_start <= cs and h.token_start // cs == (h.token_end - 1) // cs
                if not inside or (h.token_start % cs and h.token_end % cs == 0):
                    raise FormatError(f"token range [{h.token_start}, {h.token_end}) is neither one chunk of {cs} "
                                      "nor a partial tail inside one")
            kind = kinds.get(cf.group)
            if kind is not None and kind is not h.kind:
                raise FormatError(f"kind {h.kind.value}, layout.json says g{cf.group} is {kind.value}")
    except (FormatError, OSError) as e:
        if mac_ok:  # signed with our key, for another place: a copy, not damage
            cf.problem_kind, cf.problem = "unauthenticated", f"valid MAC, but {e} (a file copied under another name)"
        else:
            cf.problem_kind, cf.problem = "corrupt", str(e)


def _open_noatime(path: Path):
    """Read without touching atime (gc's recency), where the kernel lets us."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOATIME", 0))
    except PermissionError:  # O_NOATIME needs the file's owner
        fd = os.open(path, os.O_RDONLY)
    return os.fdopen(fd, "rb")


def is_stale_tmp(p: Path, max_age_s: float, now: float | None = None) -> bool:
    """The connector's orphan rule (offload/store/cachedir/hygiene.py::is_orphan): a
    temporary file of this host whose writer is gone, or one older than
    `max_age_s` from any host."""
    try:
        mtime = p.stat().st_mtime
    except OSError:
        return False
    return hygiene.is_orphan(p.name, mtime, now or time.time(), not hygiene.is_network_fs(p.parent), max_age_s)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def age(seconds: float) -> str:
    s = max(0.0, seconds)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.1f}{unit}"
    return f"{s:.0f}s"


def unlink(p: Path) -> bool:
    try:
        os.unlink(p)
        return True
    except FileNotFoundError:
        return False
