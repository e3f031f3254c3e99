"""`kvoffload fsck PATH [--repair]`: verify every file of a cache directory.

Checks, per chunk file, what a reader checks before it restores one
(docs/format.md): header magic, version and CRC, size against the header,
identity (key = file name, fingerprint = directory, group = g<N>, kind and
chunk range = layout.json), and the payload CRC-32C. Also finds:

- orphaned temporary files: `<name>.kv.tmp.<pid>.<hex>` or `.layout.*.tmp`
  older than --tmp-age seconds (a write takes milliseconds; younger ones are
  reported as in flight, not as problems);
- files of unknown layout: chunk files in a fingerprint directory without a
  readable layout.json, or in a group that layout.json does not list;
  entries that are not named as the format says, and symbolic links
  (never followed). Entries directly under the layout directory that are not
  fingerprint directories are reported and left to the operator;
- with the deployment key (--config, --key-file or --key-env; by reference,
  as the connector's `auth` option), MAC failures: "unauthenticated" files
  claim one of the given keys but their MAC does not verify, or it verifies
  for another chunk (a copy under another name); "foreign-key" files carry no
  MAC or another key's. Without a key, MACs are not checked (it says so);
- chain holes: a chunk whose parent chunk (header `parent`) is missing or
  incomplete. The lookup's binary search could step over the hole and report
  a hit whose load fails (a recompute, never wrong output, but a waste).

It also compares the usage the engines account for (the ledger:
ledger-v1/ in the layout directory, docs/format.md) with what the walk found, and
prints the difference; that is not a problem by itself (writes in flight,
and the engines correct drift at each reconcile).

--repair moves corrupt and unauthenticated files and files of unknown layout
to the fingerprint directory's quarantine/ (as the connector does; it leaves
foreign-key files alone, as the connector does), deletes orphaned temporary
files and deletes the chunks below a chain hole, then reconciles the ledger
with the files (a new snapshot, which the engines adopt). Run it while no engine
writes to the directory, or accept that a file written meanwhile is judged
as it was seen.

Exit codes: 0 clean; 1 problems found and left (no --repair, or some could
not be repaired); 2 usage error, or PATH is not a cache directory;
3 problems found and all repaired.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from offload.cli.cache import (
    Cache,
    FpDir,
    NotACache,
    human,
    is_stale_tmp,
    ledger_view,
    scan,
    unlink,
)
from offload.cli.chains import chunks
from offload.store.auth import AuthRef, KeyConfigError, Keyring, load_keyring
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.paths import LAYOUT_DIR, quarantine_dir, quarantined_path
from offload.store.options import DEFAULT_ORPHAN_AGE_S

EXIT_CLEAN, EXIT_PROBLEMS, EXIT_USAGE, EXIT_REPAIRED = 0, 1, 2, 3


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fsck", help="verify headers and checksums; find orphaned tmp files and unknown layouts",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help=f"the connector's 'path' (or its {LAYOUT_DIR}/ or a fingerprint directory)")
    p.add_argument("--repair", action="store_true", help="quarantine bad files, delete orphaned tmp files and "
                   "chunks below chain holes")
    p.add_argument("--tmp-age", type=float, default=DEFAULT_ORPHAN_AGE_S, metavar="SECONDS",
                   help="a temporary file older than this is orphaned (default 3600, the connector's "
                   "orphan_tmp_age_s); one of this host whose writer is gone is orphaned at once")
    p.add_argument("--config", metavar="FILE", help="a kv-transfer-config JSON: verify MACs with the 'auth' keys of "
                   "its filesystem tier for PATH (the key files or environment variables it names)")
    p.add_argument("--key-file", action="append", default=[], metavar="FILE",
                   help="verify MACs with the key in FILE (owner-only mode; repeat for previous keys)")
    p.add_argument("--key-env", action="append", default=[], metavar="NAME",
                   help="verify MACs with the key in environment variable NAME (repeatable)")
    p.add_argument("-q", "--quiet", action="store_true", help="print the summary only")
    p.set_defaults(func=run)


def quarantine(fp: FpDir, path: Path) -> bool:
    try:
        quarantine_dir(fp.path).mkdir(mode=0o750, exist_ok=True)
        os.replace(path, quarantined_path(fp.path, path.name))
        return True
    except OSError:
        return False


def keyring_of(args: argparse.Namespace) -> Keyring | None:
    """The keys named by --config / --key-file / --key-env (all verify; none
    signs here). Raises KeyConfigError naming the option, never the key."""
    refs: list[AuthRef] = []
    if args.config:
        from offload.config import tier_dicts, tier_kind

        try:
            doc = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise KeyConfigError(f"--config={args.config!r}: cannot read it as JSON ({e})") from None
        # A tier that keeps files, or one without `store` (the config's check names that).
        tiers = [t for t in tier_dicts(doc) if isinstance(t, dict) and t.get("auth")
                 and (t.get("store") is None or getattr(tier_kind(t), "holds_files", False))]
        here = os.path.realpath(args.path)
        mine = [t for t in tiers if t.get("path") and here.startswith(os.path.realpath(t["path"]))] or tiers
        if not mine:
            raise KeyConfigError(f"--config={args.config!r}: no filesystem tier with 'auth' in it")
        for t in mine:
            a = t["auth"]
            refs.append(AuthRef(a.get("key_file"), a.get("key_env"), tuple(a.get("previous_key_files", ())),
                                tuple(a.get("previous_key_envs", ())), field=f"--config {args.config}: auth"))
    for i, f in enumerate(args.key_file):
        refs.append(AuthRef(key_file=os.path.abspath(f), field=f"--key-file[{i}]"))
    for i, v in enumerate(args.key_env):
        refs.append(AuthRef(key_env=v, field=f"--key-env[{i}]"))
    if not refs:
        return None
    rings = [load_keyring(r) for r in refs]
    return Keyring.merged(rings)


def problems(cache: Cache, tmp_age: float) -> list[tuple[str, FpDir | None, Path, str]]:
    """(kind, fingerprint dir, path, detail) for every problem; kind is
    corrupt | unauthenticated | foreign-key | orphaned-tmp | unknown-layout | chain-hole."""
    out: list[tuple[str, FpDir | None, Path, str]] = []
    for p, why in cache.other:
        out.append(("unknown-layout", None, p, why))
    for fp in cache.dirs:
        out += [(f.problem_kind, fp, f.path, f.problem) for f in fp.files if f.problem]
        out += [("orphaned-tmp", fp, t, f"older than {tmp_age:.0f} s") for t in fp.tmp if is_stale_tmp(t, tmp_age)]
        out += [("unknown-layout", fp, p, why) for p, why in fp.unknown]
        for c in chunks(fp).values():
            if c.orphan:
                out += [("chain-hole", fp, f.path, f"chunk {c.pos}: {c.orphan}") for f in c.files]
    return out


def repair(kind: str, fp: FpDir | None, path: Path) -> bool:
    if kind in ("corrupt", "unauthenticated", "unknown-layout"):
        return fp is not None and quarantine(fp, path)
    if kind == "foreign-key":
        return False  # another deployment's (or written without a key): not ours to move
    unlink(path)  # orphaned tmp, chunk below a hole; already gone counts as repaired
    return True


def run(args: argparse.Namespace) -> int:
    try:
        keyring = keyring_of(args)
    except KeyConfigError as e:
        print(f"kvoffload fsck: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        cache = scan(args.path, verify_payloads=True, keyring=keyring)
    except NotACache as e:
        print(f"kvoffload fsck: {e}", file=sys.stderr)
        return EXIT_USAGE
    found = problems(cache, args.tmp_age)
    n_files = sum(len(fp.files) for fp in cache.dirs)
    in_flight = sum(1 for fp in cache.dirs for t in fp.tmp if not is_stale_tmp(t, args.tmp_age))
    left = 0
    for kind, fp, path, detail in found:
        fixed = repair(kind, fp, path) if args.repair else False
        left += not fixed
        if not args.quiet:
            action = (" -> " + ("deleted" if kind in ("orphaned-tmp", "chain-hole") else "quarantined")
                      if fixed else (" -> left alone" if args.repair and kind == "foreign-key"
                                     else " -> NOT repaired" if args.repair else ""))
            print(f"{kind:<16}{path}: {detail}{action}")
    kinds = ("corrupt", "unauthenticated", "foreign-key", "orphaned-tmp", "unknown-layout", "chain-hole")
    counts = {k: sum(1 for p in found if p[0] == k) for k in kinds}
    quarantined = sum(len(fp.quarantine) for fp in cache.dirs)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    dirs = f"{len(cache.dirs)} fingerprint dir{'' if len(cache.dirs) == 1 else 's'}"
    print(f"fsck {cache.root}: {n_files} chunk files in {dirs} checked; "
          f"{summary}; {in_flight} temporary files in flight; {quarantined} files already in quarantine")
    if keyring is None:
        print("MACs not checked: no key given (--config, --key-file or --key-env)")
    else:
        print(f"MACs checked with {len(keyring.key_ids)} key{'s' if len(keyring.key_ids) != 1 else ''} "
              f"(key ids {', '.join(k.hex() for k in keyring.key_ids)})")
    for p in cache.other_versions:
        print(f"note: {p} is another format version; not checked")
    if args.repair:
        acct = DirBudget(cache.root)
        drift = acct.reconcile()
        fixed = drift.get("added_files", 0) + drift.get("removed_files", 0) + drift.get("resized", 0)
        print(f"ledger: reconciled with the files, {fixed} entries corrected; "
              + ("new snapshot written" if acct.checkpoints else "no snapshot written: an engine holds the lease "
                 "(it walks now; the engines correct drift themselves)"))
    else:
        led = ledger_view(cache.root)
        print(f"ledger: {led['files']} files, {human(led['bytes'])} accounted; the files: {led['walk']['files']}, "
              f"{human(led['walk']['bytes'])} (off by {led['drift_bytes']:+d} bytes; --repair reconciles)")
    if not found:
        print("clean")
        return EXIT_CLEAN
    if args.repair and not left:
        print(f"repaired all {len(found)} problems")
        return EXIT_REPAIRED
    print(f"{left} problems left" + ("" if args.repair else "; run with --repair to fix them"))
    return EXIT_PROBLEMS
