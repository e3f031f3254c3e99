"""`kvoffload gc PATH --max-bytes N`: evict least recently used chunks until PATH fits.

The lookup binary-searches the full-attention files of a request's chain,
assuming presence is prefix-closed: if chunk k is stored, so is every chunk
before it. Deleting chunk k while chunk k+1 stays would let a lookup report a
hit whose load fails. So gc never leaves a hole:

- The unit of eviction is a *chunk*: every file of one key in one fingerprint
  directory (all groups: attention KV, windowed KV, the Mamba/GDN state).
  Within a chunk the full-attention files go first, so a concurrent lookup
  sees the chain end before it can miss a state.
- A chunk is evicted only after every chunk that chains from it (its
  descendants, found through the header's `parent` link). Each chunk's
  recency is the latest use in its subtree (using a descendant used its
  prefix), and chunks are evicted in order of (recency, deepest first), so a
  descendant always goes before its ancestor.
- A chunk whose parent is unknown (files written before the header carried
  the link: all-zero `parent` past chunk 0) counts as a descendant of every
  chunk one position earlier in its directory; evicting any of those evicts
  it too ("positions >= k" within the directory).
- Models without a full-attention group (pure Mamba) have no chains: each
  state stands alone, and a missing state only shortens a hit.

Before it evicts anything, gc deletes what no lookup can use: quarantined
files, files whose header does not verify, orphaned temporary files (older
than --tmp-age) and chunks below a hole (see `kvoffload fsck`). Then, as the
connector's budget does, the files stored cold (`state_policy` `by_use`: the
Mamba/GDN states at a prompt's internal boundaries and both halves of its
partial tail, marked so in the directory's ledger) and not loaded since,
oldest first, each on its own: nothing chains from them, so a missing one only
shortens a hit. Only then whole chunks.

Exit codes: 0 the directory fits; 1 it still does not (what is left is not
evictable: layout files, files in flight); 2 usage error or not a cache.

Recency is max(atime, mtime) of a chunk's files ("--lru atime", default):
mtime is when the file was stored, or last loaded where the file tier
refreshes it on a load; atime is the last read where the filesystem records
it (relatime: the first read after a write, then at most daily; noatime:
never). gc and fsck read headers with O_NOATIME, so they do not count as
use. "--lru mtime" ignores atime.

N accepts suffixes K, M, G, T (powers of 1024: 512M = 512 MiB) and counts
every file under PATH but the ledger (ledger-v1/ in the layout directory, the usage
accounting's records, outside the budget as in the connector). Every file gc
deletes is recorded in its own ledger log, so the engines' usage accounting
follows without a walk. Run gc while no engine serves from PATH, or accept that a chunk evicted
between a lookup and its load is a failed load (a recompute).
"""

from __future__ import annotations

import argparse
import sys

from offload.cli.cache import (
    Cache,
    ChunkFile,
    FpDir,
    NotACache,
    human,
    is_stale_tmp,
    record_removal,
    scan,
    unlink,
)
from offload.cli.chains import Chunk, chunks
from offload.planner import GroupKind, is_cold
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.paths import LAYOUT_DIR, rel_of
from offload.store.evictor import LeafQueue
from offload.store.options import DEFAULT_ORPHAN_AGE_S, parse_bytes


def parse_size(s: str) -> int:
    """Bytes as the config's byte keys take them (offload/store/options.py)."""
    try:
        return parse_bytes(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{s!r}: {e}") from None


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gc", help="evict least recently used chunks until the directory fits in N bytes",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help=f"the connector's 'path' (or its {LAYOUT_DIR}/ or a fingerprint directory)")
    p.add_argument("--max-bytes", type=parse_size, required=True, metavar="N", help="e.g. 1073741824, 512M, 2G")
    p.add_argument("--lru", choices=("atime", "mtime"), default="atime",
                   help="recency: max(atime, mtime) (default), or mtime (when stored) only")
    p.add_argument("--tmp-age", type=float, default=DEFAULT_ORPHAN_AGE_S, metavar="SECONDS",
                   help="a temporary file older than this is orphaned (default 3600, the connector's "
                   "orphan_tmp_age_s); one of this host whose writer is gone is orphaned at once")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted; delete nothing")
    p.set_defaults(func=run)


def eviction_order(fp: FpDir, by_mtime: bool) -> list[tuple[float, int, Chunk]]:
    """(subtree recency, -first token, chunk) of every good chunk (not below a hole).

    Sorted ascending, this is the order gc evicts in, across directories too:
    a descendant's recency is at most its ancestor's and its first token is
    larger, so it always sorts first. A chunk whose parent is unknown counts
    as a descendant of every chunk that starts earlier.
    """
    graph = {k: c for k, c in chunks(fp).items() if not c.orphan}
    recency = {k: (max(f.mtime for f in c.files) if by_mtime else c.used) for k, c in graph.items()}
    # By first token: an attention-only tail entry's parent may be in the
    # same chunk, but always starts before it.
    by_start: dict[int, list[Chunk]] = {}
    for c in graph.values():
        by_start.setdefault(c.start, []).append(c)
    unknown_below = float("-inf")  # latest recency of parent-unknown chunks that start later
    for start in sorted(by_start, reverse=True):  # children before parents
        for c in by_start[start]:
            recency[c.key] = max([recency[c.key], unknown_below]
                                 + [recency[ch.key] for ch in c.children if ch.key in recency])
        unknown_below = max([unknown_below] + [recency[c.key] for c in by_start[start]
                                               if c.parent is None and c.start > 0])
    return [(recency[k], -c.start, c) for k, c in graph.items()]


Node = tuple[int, str]  # (fingerprint directory's index, chunk key)


def eviction_queue(dirs: list[FpDir], by_mtime: bool) -> tuple[LeafQueue[Node, Node], dict[Node, tuple],
                                                                 dict[Node, list[Node]]]:
    """The connector's eviction order (offload/store/evictor.py) over the
    good chunks of `dirs`: (queue, node -> (recency key, chunk, directory),
    node -> its parents' nodes). A chunk is its own link: its children are
    linked to it, so it leaves only after them; the recency key (subtree
    recency, -position, key) already sorts descendants first, so the
    queue's order is that sort's."""
    queue: LeafQueue[Node, Node] = LeafQueue()
    nodes: dict[Node, tuple] = {}
    parents: dict[Node, list[Node]] = {}
    for i, fp in enumerate(dirs):
        order = eviction_order(fp, by_mtime)
        for r, p, c in order:
            nodes[(i, c.key)] = ((r, p, c.key), c, fp)
            queue.push((r, p, c.key), (i, c.key))
        for _, _, c in order:
            for ch in c.children:
                if (i, ch.key) in nodes:
                    queue.link((i, c.key))
                    parents.setdefault((i, ch.key), []).append((i, c.key))
    return queue, nodes, parents


def stored_cold(cache: Cache, ledger: DirBudget) -> list[tuple[float, ChunkFile, Chunk]]:
    """(mtime, file, its chunk) of every file of a good chunk that is cold by
    the worth model (`offload.planner.worth.is_cold`: the ledger marks it
    admitted cold, a state or a partial tail's attention page, and no load
    touched it since), oldest first: where every eviction order starts."""
    if not ledger.ensure_loaded():
        return []
    out = []
    for fp in cache.dirs:
        for c in chunks(fp).values():
            if c.orphan:
                continue
            for f in c.files:
                e = ledger.index.get(rel_of(cache.root, f.path))
                if e is not None and is_cold(e.cold, e.read_since(f.mtime)):
                    out.append((f.mtime, f, c))
    return sorted(out, key=lambda x: (x[0], str(x[1].path)))


def evict_chunk(c: Chunk, kinds: dict[int, GroupKind], dry_run: bool, acct: DirBudget | None = None) -> int:
    """Delete a chunk's files, full attention first; returns bytes freed."""
    freed = 0
    for f in sorted(c.files, key=lambda f: kinds.get(f.group) is not GroupKind.FULL_ATTENTION):
        if dry_run or unlink(f.path):
            freed += f.size
            if acct is not None:
                record_removal(acct, f.path)
    return freed


def run(args: argparse.Namespace) -> int:
    try:
        cache = scan(args.path)
    except NotACache as e:
        print(f"kvoffload gc: {e}", file=sys.stderr)
        return 2
    root = cache.root
    acct = None if args.dry_run else DirBudget(root)  # only to record what gc deletes, in its own log
    # Every file under PATH but the ledger (its records are accounting, outside the budget as in the connector).
    total = sum(p.lstat().st_size for p in root.rglob("*")
                if (p.is_file() or p.is_symlink()) and cache.ledger not in p.parents)
    start = total
    verb = "would delete" if args.dry_run else "deleted"
    # 1. What no lookup can use.
    waste = 0
    kinds: dict[int, dict[int, GroupKind]] = {}
    for fp in cache.dirs:
        dead = (list(fp.quarantine) + [t for t in fp.tmp if is_stale_tmp(t, args.tmp_age)]
                + [f.path for f in fp.files if f.problem])
        for p in dead:
            size = p.lstat().st_size
            if args.dry_run or unlink(p):
                waste += size
                if acct is not None:
                    record_removal(acct, p)
        kinds[id(fp)] = fp.group_kinds()
        for c in chunks(fp).values():
            if c.orphan:
                waste += evict_chunk(c, kinds[id(fp)], args.dry_run, acct)
    total -= waste
    print(f"gc {root}: {human(start)} in {sum(len(fp.files) for fp in cache.dirs)} chunk files; "
          f"limit {human(args.max_bytes)}; {verb} {human(waste)} of quarantined, corrupt, orphaned "
          f"temporary and unreachable files")
    # 2. Files stored cold and never loaded since, oldest first (the worth model's order, as the
    #    connector's budget follows it: every cold entry below every other).
    cold = stored_cold(cache, DirBudget(root, read_only=True)) if total > args.max_bytes else []
    cold_files = 0
    for _, f, c in cold:
        if total <= args.max_bytes:
            break
        if args.dry_run or unlink(f.path):
            total -= f.size
            cold_files += 1
            c.files.remove(f)
            if acct is not None:
                record_removal(acct, f.path)
    if cold:
        print(f"{verb} {cold_files} of {len(cold)} files stored cold and not loaded since")
    # 3. LRU chunks, descendants first, across all fingerprint directories.
    queue, nodes, parents = eviction_queue(cache.dirs, args.lru == "mtime")
    evicted = files = 0
    while total > args.max_bytes:
        n = queue.pop(lambda n: nodes[n][0] if n in nodes else None, lambda n: n)
        if n is None:
            break
        _, c, fp = nodes.pop(n)
        total -= evict_chunk(c, kinds[id(fp)], args.dry_run, acct)
        evicted += 1
        files += len(c.files)
        for par in parents.get(n, ()):
            back = queue.unlink(par)
            if back is not None and back in nodes:
                queue.push(nodes[back][0], back)
    print(f"{verb} {evicted} least recently used chunks ({files} files); {human(total)} left "
          f"({'fits' if total <= args.max_bytes else 'does NOT fit: the rest is layout files or in flight'})")
    return 0 if total <= args.max_bytes else 1

