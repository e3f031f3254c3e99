"""`kvoffload stats PATH [--json] [--ledger]`: what a cache directory holds.
`kvoffload stats --config CONFIG | --lmcache-url URL [--json]`: what an LMCache tier's Redis remote holds.

One row per fingerprint directory (one model, layout and TP rank): the model,
chunk size, dtype, per group its kind, files and bytes, the number of chunks,
the longest stored chain, quarantined and temporary files, and the age of the
oldest and newest file (by mtime: when it was stored). Reads headers only.
Then the usage as the engines account it (the ledger: newest snapshot plus
every instance's log since) next to what the walk found, and the difference.

--ledger prints only the ledger's figures, per fingerprint and group, without
walking the tree: its cost is reading the snapshot and the logs, not a stat
per file (a walk only where the directory has no snapshot yet).

With --config (a kv-transfer-config: its lmcache tier's remote_url) or
--lmcache-url, the same per fingerprint and group for the objects in that
Redis: objects and bytes, chunks, the longest chain, objects that LMCache or
the loader would refuse (header, name, length or LMCache metadata record
wrong), and how long since they were last used (Redis's idle time). Reads each
object's `HEADER_LEN`-byte header and LMCache's metadata record only. Model and layout
come from a file tier of the config holding the same fingerprint, if any.

Exit codes: 0; 2 not a cache directory, no lmcache remote in CONFIG, or the
remote cannot be read.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from offload.cli.cache import (
    LAYOUT_VERSION_DIR,
    Cache,
    FpDir,
    NotACache,
    age,
    find_root,
    human,
    ledger_view,
    scan,
)
from offload.cli.chains import Chunk, chunks


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="models, layouts, groups, chunks, bytes and ages of a cache directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", nargs="?",
                   help=f"the connector's 'path' (or its {LAYOUT_VERSION_DIR}/ or a fingerprint directory)")
    p.add_argument("--config", metavar="CONFIG",
                   help="kv-transfer-config JSON file: report its lmcache tier's remote (remote_url)")
    p.add_argument("--lmcache-url", metavar="URL",
                   help="report this LMCache remote, e.g. redis://127.0.0.1:6379 (with --config: which of its remotes)")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S",
                   help="bound on each Redis operation, seconds (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    p.add_argument("--ledger", action="store_true", help="the ledger's usage figures only, without a walk")
    p.set_defaults(func=run)


def longest_chain_tokens(ch: dict[str, Chunk]) -> int:
    """Tokens of the longest restorable prefix: where the last complete entry not below a hole
    ends (a partial tail ends inside a chunk, so it is counted to its last token, not as a chunk)."""
    return max((c.end for c in ch.values() if c.complete and c.orphan is None), default=0)


def _size(p: Path) -> int:
    try:
        return p.lstat().st_size
    except OSError:
        return 0  # gone since the listing


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
        "longest_chain_tokens": longest_chain_tokens(ch),
        "files": len(fp.files),
        "bytes": sum(f.size for f in fp.files),
        "quarantined_files": len(fp.quarantine),
        "quarantined_bytes": sum(_size(q) for q in fp.quarantine),
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
    if "warm_start_candidates" in led:
        w = led["warm_start_candidates"]
        print(f"  warm start reads from {w['files']} files not stored cold ({human(w['bytes'])}), most recent "
              "first, up to warm_start_share of an engine's host memory")
    if "walk" in led:
        w = led["walk"]
        pct = 100.0 * led["drift_bytes"] / w["bytes"] if w["bytes"] else 0.0
        print(f"  the walk found {w['files']} files, {human(w['bytes'])}: the ledger is off by "
              f"{led['drift_bytes']:+d} bytes ({pct:+.2f}%), {led['drift_files']:+d} files "
              "(a live directory differs by its writes in flight; the engines correct drift at each reconcile)")
    if table:
        for fp, groups in led["fingerprints"].items():
            print(f"  {fp[:16]}…  " + ", ".join(
                f"g{g['group']}: {g['files']} files {human(g['bytes'])}"
                + (f" ({g['cold_files']} stored cold, {human(g['cold_bytes'])})" if g["cold_files"] else "")
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
    if args.config or args.lmcache_url:
        if args.path:
            print("kvoffload stats: give PATH (a file tier's directory) or --config/--lmcache-url (an LMCache "
                  "remote), not both", file=sys.stderr)
            return 2
        return run_remote(args)
    if not args.path:
        print("kvoffload stats: give PATH (a file tier's directory), or --config CONFIG / --lmcache-url URL "
              "for an LMCache tier's remote", file=sys.stderr)
        return 2
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


# ---- an LMCache tier's remote ------------------------------------------------------------


class UsageError(Exception):
    pass


def remote_from_config(config: str, url: str | None) -> tuple[str, list[Path]]:
    """(the remote URL to read, the file tiers' layout directories) of a kv-transfer-config."""
    from offload.config import tier_dicts, tier_kind

    try:
        doc = json.loads(Path(config).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--config {config}: cannot read JSON: {e}") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--config {config}: must hold a JSON object (a kv-transfer-config)")
    tiers = [(t, tier_kind(t)) for t in tier_dicts(doc) if isinstance(t, dict)]
    fs_dirs = [Path(t["path"]) / LAYOUT_VERSION_DIR for t, kind in tiers
               if kind is not None and kind.holds_files and isinstance(t.get("path"), str)]
    lm = [(t, kind.remote_key) for t, kind in tiers if kind is not None and kind.remote_key]
    remotes = list(dict.fromkeys(t[key] for t, key in lm if isinstance(t.get(key), str)))
    if not lm:
        where = f"; its file tiers: `kvoffload stats {fs_dirs[0].parent}`" if fs_dirs else ""
        raise UsageError(f"--config {config}: no tier with \"store\": \"lmcache\"{where}")
    if not remotes:
        raise UsageError(f"--config {config}: its lmcache tier has no remote_url: its objects live only in the "
                         "engine process's LMCache pool, which no other process can read (see tier=\"lmcache\" "
                         "on the dashboard, and the engine log's 'LMCache storage engine stats' line)")
    if url is not None:
        if url not in remotes:
            raise UsageError(f"--lmcache-url {url}: not a remote_url of --config {config} (it names "
                             f"{', '.join(remotes)}); drop --config to read any other remote")
        return url, fs_dirs
    if len(remotes) > 1:
        raise UsageError(f"--config {config} names {len(remotes)} LMCache remotes ({', '.join(remotes)}); "
                         "pick one with --lmcache-url")
    return remotes[0], fs_dirs


def describe_remote(fp: FpDir) -> dict:
    lay = fp.layout or {}
    kinds = fp.group_kinds()
    groups = []
    for g in sorted({f.group for f in fp.files} | set(kinds)):
        objs = [f for f in fp.files if f.group == g]
        groups.append({"group": g, "kind": kinds[g].value if g in kinds else None, "objects": len(objs),
                       "bytes": sum(f.size for f in objs), "bad_objects": sum(f.problem is not None for f in objs)})
    ch = chunks(fp)
    idle = [f.idle_s for f in fp.files if f.idle_s is not None]
    return {
        "fingerprint": fp.path.name,
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
        "longest_chain_tokens": longest_chain_tokens(ch),
        "objects": len(fp.files),
        "bytes": sum(f.size for f in fp.files),
        "bad_objects": sum(f.problem is not None for f in fp.files),
        "problems": [{"key": str(f.path), "group": f.group, "problem": f.problem}
                     for f in fp.files if f.problem is not None],
        "max_idle_s": max(idle) if idle else None,
        "min_idle_s": min(idle) if idle else None,
    }


def report_remote(rem) -> dict:
    dirs = [describe_remote(fp) for fp in rem.dirs]
    return {"remote": rem.url, "server": rem.server, "fingerprints": dirs,
            "total_objects": sum(d["objects"] for d in dirs) + len(rem.unreadable),
            "total_bytes": sum(d["bytes"] for d in dirs) + sum(u.size for u in rem.unreadable),
            "unreadable_objects": [{"key": u.key, "bytes": u.size, "problem": u.problem} for u in rem.unreadable],
            "metadata_only_records": rem.metadata_only,
            "vanished_objects": rem.vanished,
            "unrecognised_keys": rem.unrecognised_keys,
            "other_key_schemes": rem.other_schemes,
            "other_keys": rem.other_keys}


SHOW_PROBLEMS = 5  # per fingerprint in the table; --json lists them all


def print_remote(rep: dict) -> None:
    sv = rep["server"]
    cap = human(sv["maxmemory"]) if sv.get("maxmemory") else "no maxmemory"
    n = len(rep["fingerprints"])
    print(f"LMCache remote {rep['remote']} (Redis {sv.get('redis_version')}, {human(sv.get('used_memory') or 0)} "
          f"used of {cap}, {sv.get('maxmemory_policy')}, {sv.get('evicted_keys')} keys evicted since start): "
          f"{n} fingerprint{'' if n == 1 else 's'}, {rep['total_objects']} objects, {human(rep['total_bytes'])}")
    for d in rep["fingerprints"]:
        print(f"\n{d['fingerprint'][:16]}…  model {d['model'] or '?'}  {d['dtype'] or '?'}  "
              f"chunk {d['chunk_size'] or '?'}  tp {d['tp_size'] or '?'}  layout {d['kv_cache_layout'] or '?'}")
        if d["layout_problem"]:
            print(f"  layout: {d['layout_problem']}")
        print(f"  {'group':<7}{'kind':<16}{'objects':>9}{'bytes':>12}{'bad':>6}")
        for g in d["groups"]:
            print(f"  g{g['group']:<6}{g['kind'] or '?':<16}{g['objects']:>9}{human(g['bytes']):>12}"
                  f"{g['bad_objects']:>6}")
        used = (f"; last used {age(d['min_idle_s'])} to {age(d['max_idle_s'])} ago"
                if d["max_idle_s"] is not None else "")
        print(f"  chunks {d['chunks']} ({d['complete_chunks']} complete), longest chain "
              f"{d['longest_chain_tokens']} tokens, {human(d['bytes'])}{used}")
        for b in d["problems"][:SHOW_PROBLEMS]:
            print(f"  bad g{b['group']} {b['key']}: {b['problem']}")
        if len(d["problems"]) > SHOW_PROBLEMS:
            print(f"  ... {len(d['problems']) - SHOW_PROBLEMS} more bad objects (--json lists them)")
    print(f"\nunreadable objects {len(rep['unreadable_objects'])} (header does not verify), metadata-only records "
          f"{rep['metadata_only_records']} (bytes evicted), unrecognised keys {rep['unrecognised_keys']}, "
          f"other keys in this database {rep['other_keys']}")
    for u in rep["unreadable_objects"][:SHOW_PROBLEMS]:
        print(f"  unreadable {u['key']}: {u['problem']}")
    if len(rep["unreadable_objects"]) > SHOW_PROBLEMS:
        print(f"  ... {len(rep['unreadable_objects']) - SHOW_PROBLEMS} more (--json lists them)")
    for scheme, count in sorted(rep["other_key_schemes"].items()):
        print(f"note: {count} keys under {scheme}@, another key scheme; not read")
    if rep["vanished_objects"]:
        print(f"note: {rep['vanished_objects']} objects went away during the scan (evicted or replaced)")
    if not sv.get("no_touch"):
        print(f"note: Redis {sv.get('redis_version')} has no CLIENT NO-TOUCH (7.2+): reading the headers counted "
              "as a use of each object in its eviction order")


def run_remote(args: argparse.Namespace) -> int:
    from offload.cli.remote import RemoteError, scan_remote

    try:
        url, fs_dirs = remote_from_config(args.config, args.lmcache_url) if args.config else (args.lmcache_url, [])
        if not args.timeout > 0:
            raise UsageError(f"--timeout {args.timeout}: must be > 0 seconds")
        rem = scan_remote(url, args.timeout, fs_dirs)
    except (UsageError, RemoteError) as e:
        print(f"kvoffload stats: {e}", file=sys.stderr)
        return 2
    rep = report_remote(rem)
    if args.json:
        print(json.dumps(rep, indent=2))
    else:
        print_remote(rep)
    return 0
