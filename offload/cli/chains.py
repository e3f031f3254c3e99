"""The chains of a scanned cache directory, for `stats`, `fsck` and `gc`: `chunks()` groups a
fingerprint directory's good files by chunk key and links them into chains with the header's
`parent` field, which is what `gc` needs to evict without breaking the prefix-closed presence
the lookup relies on, and what finds the holes `fsck` reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from offload.cli.cache import ChunkFile, FpDir
from offload.planner import GroupKind
from offload.store.cachedir.paths import key_prefix_hex

NO_PARENT = bytes(8)


@dataclass
class Chunk:
    """All good files of one chunk key in one fingerprint directory."""

    key: str
    pos: int  # chunk index: token_start // chunk size
    files: list[ChunkFile]
    parent: bytes | None  # first 8 bytes of the parent's key; None: chunk 0, or unknown (older files)
    start: int = 0  # token range [start, end) (its files' headers): a parent ends where its child starts
    end: int = 0
    complete: bool = False  # every full-attention group has its file
    children: list[Chunk] = field(default_factory=list)
    orphan: str | None = None  # why a lookup could report a hit through this chunk that fails to load

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def used(self) -> float:
        return max(f.used for f in self.files)


def chunks(fp: FpDir) -> dict[str, Chunk]:
    """Good files by chunk key, linked parent -> children.

    A chunk whose header names a parent links to the entry whose key starts
    with those 8 bytes and whose token range ends where its own starts: the
    chunk one position earlier, or (attention-only tail entries inside a
    chunk) the tail entry one unit earlier. A chunk whose parent is
    unknown (all-zero `parent` past chunk 0: files written before the header
    carried the link) has no link; `gc` treats it as a possible descendant
    of every chunk at an earlier position in its directory (the safe side).

    `orphan` is set on every chunk below a hole: its parent is known and
    absent, incomplete (a full-attention file missing) or itself below a
    hole; or, parent unknown, no complete chunk sits one position earlier.
    The lookup's binary search could step over such a hole and report a hit
    whose load fails.
    """
    cs = fp.chunk_size
    out: dict[str, Chunk] = {}
    for f in fp.files:
        if f.problem is not None or f.header is None:
            continue
        h = f.header
        pos = h.token_start // (cs or (h.token_end - h.token_start) or 1)
        par = bytes(getattr(h, "parent", NO_PARENT))
        c = out.setdefault(f.key, Chunk(f.key, pos, [], None if par == NO_PARENT else par, h.token_start,
                                        h.token_end))
        c.files.append(f)
    full = {g for g, k in fp.group_kinds().items() if k is GroupKind.FULL_ATTENTION}
    if not full:  # no full-attention group: no chains; every state stands alone
        for c in out.values():
            c.complete = True
        return out
    by_prefix: dict[tuple[int, str], list[Chunk]] = {}  # (end token, key prefix)
    for c in out.values():
        c.complete = full <= {f.group for f in c.files}
        by_prefix.setdefault((c.end, key_prefix_hex(c.key)), []).append(c)
    good_at: set[int] = set()  # positions holding a complete chunk not below a hole
    for c in sorted(out.values(), key=lambda c: (c.start, c.end)):  # every parent before its children
        if c.start == 0:
            pass
        elif c.parent is None:
            if c.pos - 1 not in good_at:
                c.orphan = f"parent unknown and no complete chunk at position {c.pos - 1}"
        else:
            parents = by_prefix.get((c.start, c.parent.hex()), [])
            for p in parents:
                p.children.append(c)
            if not parents:
                c.orphan = "parent chunk missing"
            elif not any(p.complete and not p.orphan for p in parents):
                c.orphan = "parent chunk incomplete or itself below a hole"
        if c.complete and not c.orphan and (not cs or c.end - c.start == cs):  # a tail is no parent
            good_at.add(c.pos)
    return out
