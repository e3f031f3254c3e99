"""Shared helpers: timing, medians, cold page cache, results, tables."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The one median of tests/ and bench/ (None values skipped, NaN when there is nothing), re-exported.
from harness.client import median  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
GB = 1e9


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class Sample:
    wall_s: float
    cpu_s: float


@contextmanager
def measure(out: list[Sample]):
    c0, t0 = cpu_seconds(), time.perf_counter()
    yield
    out.append(Sample(time.perf_counter() - t0, cpu_seconds() - c0))


def drop_page_cache(files: Sequence[str | os.PathLike] = ()) -> str:
    """Make the next reads of `files` come from the device. Returns the method.

    `echo 3 > /proc/sys/vm/drop_caches` (after a sync) where permitted (root,
    not in a restricted container); otherwise posix_fadvise(DONTNEED) per file,
    which drops clean pages of those files only.
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def filesystem_of(path: str | os.PathLike) -> str:
    """Filesystem type and device of `path` (from /proc/mounts, longest match)."""
    path = os.path.realpath(path)
    best = ("?", "?", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[2]):
                best = (fstype, dev, mnt)
    except OSError:
        pass
    return f"{best[0]} on {best[1]} (mounted at {best[2]})"


def machine() -> dict[str, Any]:
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    return {"cpu": model, "cores": os.cpu_count(), "mem_gib": mem_gib,
            "kernel": platform.release(), "loadavg_at_start": os.getloadavg()[0],
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def write_results(name: str, doc: dict[str, Any], out_dir: Path | None = None) -> Path:
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **doc}, indent=2) + "\n")
    return path


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)
    cells = [[fmt(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


def repeat(n: int, fn: Callable[[], Sample]) -> list[Sample]:
    return [fn() for _ in range(n)]


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:
        return "?"


def interleaved(ops: dict[str, Callable[[], Any]], reps: int,
                sync: Callable[[], Any] = lambda: None) -> dict[str, list[float]]:
    """Seconds of each op over `reps` rounds, the ops interleaved within a round so that
    background load hits all alike; `sync` runs before each timing (a device's queue drained)."""
    times: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(reps):
        for k, fn in ops.items():
            sync()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def copy_bench_main(run: Callable[..., Any], doc: str, argv: list[str] | None, gib: float) -> int:
    """The command line of the copy benchmarks: run(gib, reps, tiny, out_dir)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--gib", type=float, default=gib)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out-dir", type=Path, default=None)
    a = ap.parse_args(argv)
    run(a.gib, a.reps, a.tiny, a.out_dir)
    return 0

