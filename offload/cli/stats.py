"""`kvoffload stats PATH [--json] [--ledger]`: what a cache directory holds.

One row per fingerprint directory (one model, layout and TP rank): the model,
chunk size, dtype, per group its kind, files and bytes, the number of chunks,
the longest stored chain, quarantined and temporary files, and the age of the
oldest and newest file (by mtime: when it was stored). Reads headers only.
Then the usage as the engines account it (the ledger: newest snapshot plus
every instance's log since) next to what the walk found, and the difference.

--ledger prints only the ledger's figures, per fingerprint and group, without
walking the tree: its cost is reading the snapshot and the logs, not a stat
per file (a walk only where the directory has no snapshot yet).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from offload.store.fs import LAYOUT_VERSION_DIR
from offload.cli.cache import Cache, FpDir, NotACache, age, chunks, find_root, human, ledger_view, scan


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="models, layouts, groups, chunks, bytes and ages of a cache directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="the connector's 'path' (or its kvoffload-v1/ or a fingerprint directory)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--ledger", action="store_true", help="the ledger's usage figures only, without a walk")
    p.set_defaults(func=run)


def describe(fp: FpDir, now: float) -> dict:
    lay = fp.layout or {}
    kinds = fp.group_kinds()
    groups = []
    for g in sorted({f.group for f in fp.files} | set(kinds)):
        files = [f for f in fp.files if f.group == g]
        groups.append({"group": g, "kind": kinds[g].value if g in kinds else None, "files": len(files),
                       "bytes": sum(f.size for f in files),
                       "bad_files": sum(f.problem is not None for f in files)})
    ch = chunks(fp)
    mtimes = [f.mtime for f in fp.files]
    return {
        "fingerprint": fp.path.name,
        "path": str(fp.path),
        "model": lay.get("model"),
        "dtype": lay.get("dtype"),
        "cache_dtype": lay.get("cache_dtype"),
        "tp_size": lay.get("tp_size"),
        "chunk_size": lay.get("chunk_size"),
        "kv_cache_layout": lay.get("kv_cache_layout"),
        "layout_problem": fp.layout_problem,
        "groups": groups,
        "chunks": len(ch),
        "complete_chunks": sum(c.complete for c in ch.values()),
        "longest_chain_tokens": (max((c.pos + 1 for c in ch.values() if c.complete), default=0)
                                 * (fp.chunk_size or 0)),
        "files": len(fp.files),
        "bytes": sum(f.size for f in fp.files),
        "quarantined_files": len(fp.quarantine),
        "quarantined_bytes": sum(q.lstat().st_size for q in fp.quarantine),
        "tmp_files": len(fp.tmp),
        "unknown_entries": len(fp.unknown),
        "oldest_age_s": round(now - min(mtimes), 1) if mtimes else None,
        "newest_age_s": round(now - max(mtimes), 1) if mtimes else None,
    }


def report(cache: Cache) -> dict:
    now = time.time()
    dirs = [describe(fp, now) for fp in cache.dirs]
    return {"root": str(cache.root), "fingerprints": dirs,
            "total_files": sum(d["files"] for d in dirs),
            "total_bytes": sum(d["bytes"] + d["quarantined_bytes"] for d in dirs),
            "other_entries": [str(p) for p, _ in cache.other],
            "other_format_versions": [str(p) for p in cache.other_versions],
            "ledger": ledger_view(cache.root)}


def print_ledger(led: dict, table: bool) -> None:
    snap = (f"snapshot {age(led['snapshot_age_s'])} old" if led["snapshot"] else "no snapshot (indexed by a walk)")
    walked = f"last walk {age(led['last_walk_age_s'])} ago" if led["last_walk_age_s"] is not None else "never walked"
    logs = f"{led['logs']} log{'' if led['logs'] == 1 else 's'}"
    print(f"\nledger: {led['files']} files, {human(led['bytes'])} accounted; {logs} "
          f"({led['sealed_logs']} sealed), {human(led['ledger_bytes'])} of records; {snap}; {walked}; "
          f"{led['bad_lines']} damaged lines skipped; read in {led['load_s']:.2f} s")
    if "walk" in led:
        w = led["walk"]
        pct = 100.0 * led["drift_bytes"] / w["bytes"] if w["bytes"] else 0.0
        print(f"  the walk found {w['files']} files, {human(w['bytes'])}: the ledger is off by "
              f"{led['drift_bytes']:+d} bytes ({pct:+.2f}%), {led['drift_files']:+d} files "
              "(a live directory differs by its writes in flight; the engines correct drift at each reconcile)")
    if table:
        for fp, groups in led["fingerprints"].items():
            print(f"  {fp[:16]}…  " + ", ".join(f"g{g['group']}: {g['files']} files {human(g['bytes'])}"
                                               for g in groups))


def print_table(rep: dict) -> None:
    print(f"cache {rep['root']}: {len(rep['fingerprints'])} fingerprint director"
          f"{'y' if len(rep['fingerprints']) == 1 else 'ies'}, {rep['total_files']} chunk files, "
          f"{human(rep['total_bytes'])}")
    for d in rep["fingerprints"]:
        print(f"\n{d['fingerprint'][:16]}…  model {d['model']}  {d['dtype']}  chunk {d['chunk_size']}  "
              f"tp {d['tp_size']}  layout {d['kv_cache_layout']}")
        if d["layout_problem"]:
            print(f"  layout: {d['layout_problem']}")
        print(f"  {'group':<7}{'kind':<16}{'files':>7}{'bytes':>12}{'bad':>6}")
        for g in d["groups"]:
            print(f"  g{g['group']:<6}{g['kind'] or '?':<16}{g['files']:>7}{human(g['bytes']):>12}{g['bad_files']:>6}")
        oldest = age(d["oldest_age_s"]) if d["oldest_age_s"] is not None else "-"
        newest = age(d["newest_age_s"]) if d["newest_age_s"] is not None else "-"
        print(f"  chunks {d['chunks']} ({d['complete_chunks']} complete), longest chain "
              f"{d['longest_chain_tokens']} tokens, {human(d['bytes'])}; stored {newest} to {oldest} ago")
        print(f"  quarantine {d['quarantined_files']} files ({human(d['quarantined_bytes'])}), "
              f"temporary {d['tmp_files']}, unrecognised {d['unknown_entries']}")
    for p in rep["other_format_versions"]:
        print(f"\nnote: {p} is another format version; not read")
    print_ledger(rep["ledger"], table=False)


def run(args: argparse.Namespace) -> int:
    if args.ledger:
        try:
            root = find_root(args.path)
        except NotACache as e:
            print(f"kvoffload stats: {e}", file=sys.stderr)
            return 2
        top = root if root.name == LAYOUT_VERSION_DIR else root.parent
        led = ledger_view(top, walk=False)
        if args.json:
            print(json.dumps({"root": str(top), "ledger": led}, indent=2))
        else:
            print(f"cache {top}")
            print_ledger(led, table=True)
        return 0
    try:
        cache = scan(args.path)
    except NotACache as e:
        print(f"kvoffload stats: {e}", file=sys.stderr)
        return 2
    rep = report(cache)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_table(rep)
    return 0
