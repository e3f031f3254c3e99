"""One engine-like instance on a shared cache directory, for tests/test_ledger.py.

`python tests/ledger_instance.py PATH NAME PROMPTS MAX_BYTES START_FLAG [--forever]`
writes real chunk files through `FileStore.write` (header, CRC, temporary name,
rename) with its own `DirBudget` (its own ledger log, index and, with
MAX_BYTES > 0, byte budget) and a running `Housekeeper`, as an engine's
scheduler and worker do. Each prompt is a chain of DEPTH attention chunks
(each naming its parent) with a Mamba state per chunk; every third prompt
is the same in every instance, so instances also write the same keys.

After each prompt it records its accounted usage twice around a walk of the
directory that measures the true bytes. A walk over a directory that others
write and evict at the same time can see a state that never existed, so the
instances write under a shared `flock` of START_FLAG.lock and a sample takes
it exclusively: the others pause for the walk, and write concurrently again
between samples. It prints one JSON line at the end:
the samples, its final usage and the true bytes once all instances are done
(it waits for `START_FLAG.done.*` of every instance). With --forever it
writes until killed (SIGKILL tests).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from offload.keys import ChunkKey, Fingerprint
from offload.planner import GroupKind
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.housekeeper import Housekeeper
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.files import FileStore
from offload.store.format import ChunkHeader

FP = Fingerprint(hashlib.sha256(b"kvoffload ledger test").digest())
GDN, ATTN = 0, 1
DEPTH = 4
LEDGER = "ledger-v1"


def true_bytes(top: Path) -> int:
    """What is on disk, measured independently of the code under test: every
    regular file under the layout directory  but the ledger and temporary files in flight."""
    total = 0
    for d, dirs, names in os.walk(top):
        if d == str(top) and LEDGER in dirs:
            dirs.remove(LEDGER)
        for n in names:
            if ".tmp" in n:
                continue
            try:
                total += os.lstat(os.path.join(d, n)).st_size
            except FileNotFoundError:
                pass
    return total


def key(owner: str, prompt: int, chunk: int) -> ChunkKey:
    return ChunkKey(hashlib.sha256(f"{owner}/{prompt}/{chunk}".encode()).digest())


def write_prompt(store: FileStore, owner: str, prompt: int) -> None:
    parent = bytes(8)
    for c in range(DEPTH):
        k = key(owner, prompt, c)
        size = (16 + bytes(k)[0] % 32) * 1024  # a key's bytes are the same whoever writes it
        h = ChunkHeader(FP, k, ATTN, GroupKind.FULL_ATTENTION, c * 256, (c + 1) * 256, 1, size, parent=parent)
        store.write(h, torch.full((size,), c, dtype=torch.uint8))
        g = ChunkHeader(FP, k, GDN, GroupKind.MAMBA, c * 256, (c + 1) * 256, 1, 4096)
        store.write(g, torch.full((4096,), c, dtype=torch.uint8))
        parent = bytes(k)[:8]


def main() -> None:
    path, name, prompts, max_bytes, flag = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    forever = "--forever" in sys.argv
    top = Path(path) / LAYOUT_DIR
    acct = DirBudget(top, max_bytes or None)
    store = dataclasses.replace(FileStore.open(path, FP), account=acct, budget=acct if max_bytes else None)
    keeper = Housekeeper(store.root, 2, acct).start()
    while not acct.loaded:
        time.sleep(0.01)
    Path(f"{flag}.ready.{name}").touch()
    while not os.path.exists(flag):
        time.sleep(0.005)
    samples = []
    p = 0
    lock = os.open(f"{flag}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    while forever or p < prompts:
        fcntl.flock(lock, fcntl.LOCK_SH)
        write_prompt(store, "shared" if p % 3 == 0 else name, p)
        fcntl.flock(lock, fcntl.LOCK_UN)
        p += 1
        if forever:
            continue
        fcntl.flock(lock, fcntl.LOCK_EX)
        time.sleep(0.1)  # evictions the last writes started (inline or in a housekeeper pass) finish
        acct.sync()
        before = acct.usage
        true = true_bytes(top)
        acct.sync()
        samples.append([before, true, acct.usage])
        fcntl.flock(lock, fcntl.LOCK_UN)
    Path(f"{flag}.done.{name}").touch()
    others = [n for n in os.listdir(os.path.dirname(flag) or ".") if ".ready." in n]
    deadline = time.monotonic() + 120
    while (sum(1 for n in os.listdir(os.path.dirname(flag) or ".") if ".done." in n) < len(others)
           and time.monotonic() < deadline):
        time.sleep(0.02)
    # The other housekeepers' last evictions: poll until this account agrees with the files (or a deadline;
    # the test then reports the difference).
    deadline = time.monotonic() + 10
    acct.sync()
    while acct.usage != true_bytes(top) and time.monotonic() < deadline:
        time.sleep(0.02)
        acct.sync()
    final = {"name": name, "samples": samples, "usage": acct.usage, "true": true_bytes(top),
             "evicted_files": acct.evicted_files, "bad_lines": acct.bad_lines, "scan_s": acct.scan_s}
    keeper.stop()
    print(json.dumps(final), flush=True)


if __name__ == "__main__":
    main()
