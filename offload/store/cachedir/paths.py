"""The file tier's directory layout, encoded and decoded in one place
(format: docs/format.md). Every store, the ledger and the CLI name paths
through this module; nothing else spells the layout out.

    <path>/kvoffload-v3/                                  LAYOUT_DIR ("top"; v<FORMAT_VERSION>)
    <path>/kvoffload-v3/ledger-v1/                        LEDGER_DIR: logs, snapshots, the lease
    <path>/kvoffload-v3/<fingerprint hex>/                a fingerprint directory ("root")
    <path>/kvoffload-v3/<fingerprint hex>/layout.json     LAYOUT_FILE
    <path>/kvoffload-v3/<fingerprint hex>/g<group>/<key[:2]>/<key hex>.kv
    <path>/kvoffload-v3/<fingerprint hex>/quarantine/<name>.<8 hex>

A *rel* is a path relative to the layout directory, as the ledger records
it (`<fingerprint hex>/g<group>/<xx>/<key hex>.kv`). Temporary files are
`<final name>.tmp.<pid>.<8 hex>[.<host tag>]` and `.layout.<32 hex>.tmp`.
"""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path
from typing import NamedTuple

from offload.keys import FORMAT_VERSION

LAYOUT_DIR = f"kvoffload-v{FORMAT_VERSION}"
LAYOUT_DIR_GLOB = "kvoffload-v*"  # every format version's layout directory (tools report foreign ones)
LEDGER_DIR = "ledger-v1"
LAYOUT_FILE = "layout.json"
QUARANTINE = "quarantine"
CHUNK_SUFFIX = ".kv"
GROUP_PREFIX = "g"
KEY_PREFIX_HEX = 16  # a chunk header's `parent` field: the first 8 bytes of the parent's key

# What a ledger record may name, relative to the layout directory: nothing
# else is ever unlinked through a ledger (a forged line cannot reach outside).
CHUNK_REL = re.compile(r"[0-9a-f]{64}/g[0-9]{1,5}/[0-9a-f]{2}/[0-9a-f]{64}\.kv")  # fullmatch
OTHER_REL = re.compile(r"^[0-9a-f]{64}/(?:layout\.json|quarantine/[^/\s]+)$")
HEX64 = re.compile(r"^[0-9a-f]{64}$")
GROUP_DIR = re.compile(r"^g(\d+)$")
PREFIX_DIR = re.compile(r"^[0-9a-f]{2}$")
CHUNK_FILE = re.compile(r"^([0-9a-f]{64})\.kv$")
CHUNK_TMP_FILE = re.compile(r"^([0-9a-f]{64})\.kv\.tmp\.(\d+)\.[0-9a-f]{8}(?:\.[0-9a-f]{8})?$")  # optional host tag

# Temporary files (offload/store/cachedir/hygiene.py says when one is an orphan).
TMP_RE = re.compile(r"\.tmp\.(?P<pid>\d+)\.(?P<rand>[0-9a-f]{8})(?:\.(?P<host>[0-9a-f]{8}))?$")
LAYOUT_TMP_RE = re.compile(r"^\.layout\.[0-9a-f]{32}\.tmp$")

# The ledger directory's files.
LOG_NAME = re.compile(r"^(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-[0-9a-f]{8}\.log$")
SNAPSHOT_NAME = re.compile(r"^snapshot-(?P<ms>\d{13})-[0-9a-f]{8}\.snap$")
SNAPSHOT_TMP = re.compile(r"^\.snapshot-\d{13}-[0-9a-f]{8}\.tmp$")
LEASE = "lease"


class ChunkRel(NamedTuple):
    """A chunk file's rel, decoded."""

    fingerprint: str  # hex
    group: int
    key: str  # hex

    @property
    def group_dir(self) -> str:
        """`<fingerprint hex>/g<group>`: the directory whose files chain to each other."""
        return f"{self.fingerprint}/{GROUP_PREFIX}{self.group}"

    @property
    def key_prefix(self) -> int:
        """The first 8 bytes of the key, as a child's header names it (`parent`)."""
        return int(self.key[:KEY_PREFIX_HEX], 16)


# ---- encoding -------------------------------------------------------------------------

def top_dir(path: str | Path) -> Path:
    """The layout directory under a configured `path`."""
    return Path(path) / LAYOUT_DIR


def fingerprint_dir(path: str | Path, fp_hex: str) -> Path:
    """A fingerprint directory under a configured `path`."""
    return Path(path) / LAYOUT_DIR / fp_hex


def ledger_dir(top: str | Path) -> Path:
    return Path(top) / LEDGER_DIR


def quarantine_dir(root: Path) -> Path:
    return root / QUARANTINE


def chunk_name(key_hex: str) -> str:
    return f"{key_hex}{CHUNK_SUFFIX}"


def chunk_rel(fp_hex: str, group: int, key_hex: str) -> str:
    return f"{fp_hex}/{GROUP_PREFIX}{group}/{key_hex[:2]}/{chunk_name(key_hex)}"


def _fanout_dir(root: Path, group: int, first_byte_hex: str) -> Path:
    return root / f"{GROUP_PREFIX}{group}" / first_byte_hex


def chunk_path(root: Path, group: int, key_hex: str) -> Path:
    """A chunk file under fingerprint directory `root`."""
    return _fanout_dir(root, group, key_hex[:2]) / chunk_name(key_hex)


def fanout_dirs(root: Path, group: int) -> list[Path]:
    """Every directory `chunk_path` puts a file of `group` in: one per first byte of a key."""
    return [_fanout_dir(root, group, f"{i:02x}") for i in range(256)]


def quarantined_path(root: Path, name: str) -> Path:
    """Where a bad file called `name` goes: a fresh name in quarantine/."""
    return quarantine_dir(root) / f"{name}.{uuid.uuid4().hex[:8]}"


def tmp_path(final: Path, host_tag: str) -> Path:
    """`<final name>.tmp.<pid>.<8 hex>.<host tag>` beside `final`."""
    return final.with_name(f"{final.name}.tmp.{os.getpid()}.{uuid.uuid4().hex[:8]}.{host_tag}")


def layout_tmp_path(target: Path) -> Path:
    return target.with_name(f".layout.{uuid.uuid4().hex}.tmp")


def log_name(host_tag: str, pid: int) -> str:
    return f"{host_tag}-{pid}-{uuid.uuid4().hex[:8]}.log"


def snapshot_names(ms: int) -> tuple[str, str]:
    """(temporary name, final name) of a snapshot written at `ms`."""
    tag = uuid.uuid4().hex[:8]
    return f".snapshot-{ms:013d}-{tag}.tmp", f"snapshot-{ms:013d}-{tag}.snap"


# ---- decoding -------------------------------------------------------------------------

def valid_rel(rel: str) -> bool:
    """Whether a ledger record may name `rel`."""
    return bool(CHUNK_REL.fullmatch(rel) or (OTHER_REL.match(rel) and not rel.endswith(("/.", "/.."))))


def is_chunk_rel(rel: str) -> bool:
    return bool(CHUNK_REL.fullmatch(rel))


def parse_chunk_rel(rel: str) -> ChunkRel | None:
    """The parts of a chunk file's rel; None for any other rel. Cheap: `rel`
    is assumed to be one a record may name (`valid_rel`)."""
    parts = rel.split("/")
    if len(parts) != 4 or not parts[3].endswith(CHUNK_SUFFIX) or not parts[1].startswith(GROUP_PREFIX):
        return None
    group = parts[1].removeprefix(GROUP_PREFIX)
    if not group.isdigit():
        return None
    return ChunkRel(parts[0], int(group), parts[3].removesuffix(CHUNK_SUFFIX))


def group_dir_of(rel: str) -> str:
    """The group directory (`<fingerprint hex>/g<group>`) of a chunk file's rel,
    which must be one (`is_chunk_rel`). Cheap: the ledger's index calls it per file."""
    return rel.rsplit("/", 2)[0]


def parse_group_dir(gdir: str) -> tuple[str, int] | None:
    """(fingerprint hex, group) of a group directory's rel; None for any other rel."""
    fp, _, name = gdir.partition("/")
    group = group_of_dir(name)
    return None if group is None or not HEX64.match(fp) else (fp, group)


def is_quarantined_rel(rel: str) -> bool:
    parts = rel.split("/")
    return len(parts) == 3 and parts[1] == QUARANTINE


def is_evictable_rel(rel: str) -> bool:
    """Chunk files and quarantined files are evicted; layout files stay."""
    return rel.endswith(CHUNK_SUFFIX) or is_quarantined_rel(rel)


def is_tmp_name(name: str) -> bool:
    """A temporary file in flight (counted once renamed under its final name)."""
    return bool(TMP_RE.search(name) or LAYOUT_TMP_RE.match(name))


def group_of_dir(name: str) -> int | None:
    """The group of a `g<group>` directory name; None for any other name."""
    m = GROUP_DIR.match(name)
    return int(m.group(1)) if m else None


def key_of_file(name: str) -> str | None:
    """The key hex of a chunk file's name; None for any other name."""
    if not name.endswith(CHUNK_SUFFIX):
        return None
    k = name.removesuffix(CHUNK_SUFFIX)
    return k if HEX64.match(k) else None


def key_prefix_hex(key_hex: str) -> str:
    """The part of a key a child's header names (`parent`), as hex."""
    return key_hex[:KEY_PREFIX_HEX]


def rel_of(top: Path | str, path: Path | str) -> str:
    """`path` (under the layout directory `top`) as a ledger names it."""
    p, t = str(path), f"{top}/"
    return p.removeprefix(t) if p.startswith(t) else os.path.relpath(p, top)
