"""Item 4: longest-prefix lookup of a 128K-token prompt against a directory of
100k chunk files, cold (dentry/inode caches dropped) and warm.

The lookup is the scheduler's: `HybridOffloadPlanner.lookup` (binary search
over full-attention chunk existence, then a walk down until the Mamba state
exists) over `FsIndex.contains` (one stat per probe). Metadata calls are
counted by wrapping `contains`, and cross-checked with strace where available
(stat-family and open calls on paths under the cache directory). For contrast,
a probe of every chunk (what a lookup that stats one file per chunk does).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import REPO, drop_page_cache, filesystem_of, median, table, write_results
from offload.keys import Fingerprint, chunk_keys, request_root
from offload.planner import GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.files import FileStore
from offload.store.fs import FsIndex

CHUNK = 256
FP = Fingerprint(bytes(range(32, 64)))
GROUPS = [GroupSpec(GroupKind.MAMBA, 256, 1 << 20, 24), GroupSpec(GroupKind.FULL_ATTENTION, 64, 1 << 20, 8)]


def _prompt(tokens: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(2, 1000) for _ in range(tokens)]


def build_dir(root: str, tokens: int, stored: int, total_files: int) -> FileStore:
    """`stored` chunks of the prompt (both groups), the rest random keys."""
    store = FileStore.open(root, FP)
    keys = chunk_keys(request_root(FP), _prompt(tokens), CHUNK)
    rng = random.Random(1)
    names = [(g, k) for k in keys[:stored] for g in (0, 1)]
    names += [(i % 2, rng.randbytes(32)) for i in range(total_files - len(names))]
    made = set()
    for g, k in names:
        p = store.file_path(g, k)
        if p.parent not in made:
            p.parent.mkdir(parents=True, exist_ok=True)
            made.add(p.parent)
        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o640))
    return store


PLANNER = HybridOffloadPlanner(GROUPS, CHUNK)  # built once per engine


def lookup_once(store: FileStore, tokens: list[int], all_chunks: bool = False) -> tuple[int, int, float]:
    """(hit chunks, metadata calls, seconds); keys are derived outside the timing
    (the scheduler derives them once per request)."""
    planner = PLANNER
    keys = chunk_keys(request_root(FP), tokens, CHUNK)
    index = FsIndex(store)
    calls = 0

    def present(g, c) -> bool:
        nonlocal calls
        calls += 1
        return index.contains(g, keys[c])
    t0 = time.perf_counter()
    if all_chunks:  # one stat per chunk until the first missing one
        hit = 0
        while hit < planner.max_hit_chunks(len(tokens)) and present(1, hit):
            hit += 1
    else:
        hit = planner.lookup(len(tokens), present).chunks
    return hit, calls, time.perf_counter() - t0


MARK = "/.kvoffload-bench-lookup-{}"


def _mark(path: str) -> None:
    try:
        os.stat(path)
    except OSError:
        pass


def probe(root: str, tokens: int) -> None:
    """One lookup between two marker stats, for strace (the store is opened
    first: opening tidies the directory, which is not part of a lookup)."""
    store = FileStore.open(root, FP)
    prompt = _prompt(tokens)
    for i in range(2):  # the first lookup in a process, then a later one
        _mark(MARK.format(f"begin{i}"))
        lookup_once(store, prompt)
        _mark(MARK.format(f"end{i}"))


def strace_count(root: str, tokens: int) -> list[int] | None:
    """Filesystem calls (stat family, open, access) during the first and a
    second lookup in a fresh process, per strace."""
    if shutil.which("strace") is None:
        return None
    with tempfile.NamedTemporaryFile(suffix=".strace") as out:
        cmd = ["strace", "-f", "-qq", "-o", out.name, "-e", "trace=%stat,%file", sys.executable, "-m",
               "bench.lookup", "--probe", root, "--tokens", str(tokens)]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if r.returncode != 0:
            return None
        lines = Path(out.name).read_text().splitlines()
    counts = []
    for i in range(2):
        try:
            b = next(j for j, ln in enumerate(lines) if MARK.format(f"begin{i}") in ln)
            e = next(j for j, ln in enumerate(lines) if MARK.format(f"end{i}") in ln)
        except StopIteration:
            return None
        counts.append(sum(1 for ln in lines[b + 1:e]
                          if re.search(r"\b(\w*stat\w*|access|faccessat2?|open|openat|readlink\w*)\(", ln)))
    return counts


def run(tokens: int, files: int, stored_frac: float, reps: int, dir: str | None = None,
        out_dir: Path | None = None) -> dict:
    work = tempfile.mkdtemp(prefix="kvoffload-lookup-", dir=dir)
    prompt = _prompt(tokens)
    n_chunks = tokens // CHUNK
    max_hit = (tokens - 1) // CHUNK
    stored = int(max_hit * stored_frac)
    try:
        t0 = time.perf_counter()
        store = build_dir(work, tokens, stored, files)
        build_s = time.perf_counter() - t0
        n_files = sum(len(f) for _, _, f in os.walk(store.root))
        res = {}
        for name, every in (("binary search (ours)", False), ("one stat per chunk", True)):
            cold, warm = [], []
            for _ in range(reps):
                method = drop_page_cache()
                hit, calls, s = lookup_once(store, prompt, every)
                cold.append(s)
            for _ in range(max(reps, 20)):
                hit, calls, s = lookup_once(store, prompt, every)
                warm.append(s)
            res[name] = {"hit_chunks": hit, "metadata_calls": calls, "cold_s": cold, "warm_s": warm,
                         "median_cold_ms": median(cold) * 1e3, "median_warm_ms": median(warm) * 1e3}
        assert res["binary search (ours)"]["hit_chunks"] == stored, res
        t0 = time.perf_counter()
        chunk_keys(request_root(FP), prompt, CHUNK)
        keys_ms = (time.perf_counter() - t0) * 1e3
        st = strace_count(work, tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    bound = math.ceil(math.log2(n_chunks)) + 2
    ours = res["binary search (ours)"]
    doc = {"prompt_tokens": tokens, "chunks": n_chunks, "stored_chunks": stored, "files": n_files,
           "filesystem": filesystem_of(work if dir is None else dir), "cold_method": method,
           "build_s": build_s, "bound_calls": bound, "strace_metadata_calls": st,
           "key_derivation_ms": keys_ms, "results": res,
           "goal_calls_met": ours["metadata_calls"] <= bound}
    print(f"{tokens}-token prompt ({n_chunks} chunks, {stored} stored) against {n_files} files on "
          f"{doc['filesystem']}; cold = {method}; median of {reps} cold, {max(reps, 20)} warm")
    print(table(["lookup", "hit chunks", "metadata calls", "bound", "cold", "warm"],
                [[k, v["hit_chunks"], v["metadata_calls"], bound if k.startswith("binary") else "-",
                  f"{v['median_cold_ms']:.2f} ms", f"{v['median_warm_ms'] * 1e3:.0f} us"] for k, v in res.items()]))
    print(f"strace, filesystem calls per lookup (first in a process, later): {st}; "
          f"key derivation (once per request, not a lookup cost): {keys_ms:.2f} ms")
    print(f"wrote {write_results('lookup', doc, out_dir)}")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--stored-frac", type=float, default=0.6)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # one lookup, for strace
    a = ap.parse_args(argv)
    if a.probe:
        probe(a.probe, a.tokens)
        return 0
    run(a.tokens, a.files, a.stored_frac, a.reps, a.dir, a.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
