"""Reliability of the filesystem tier below the engine: kill -9 of a
store-writing process on the worker's real store path, orphaned temporary
files, symlinks, permissions, the byte budget, foreign format versions.

Engine-level fault tests are in tests/test_reliability_e2e.py. Each test
prints one RELIABILITY line (the row of docs/reliability.md it backs).
"""

from __future__ import annotations

import os
import random
import signal
import stat
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from faults.report import record
from faults.store_writer import ATTN, FP, GDN, KvCache, expected_payload, key_of
from offload.copier import crc32c
from offload.store.base import ChunkMiss, OptionError
from offload.store.cachedir import hygiene
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.owners import CacheDirs
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.files import FileStore
from offload.store.format import HEADER_LEN, ChunkHeader

CYCLES = int(os.environ.get("KVOFFLOAD_KILL_CYCLES", "20"))
CHUNKS_PER_CYCLE = 100_000  # chunk index range of one writer process


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]


def _index_of(cycle: int, limit: int = 20_000) -> dict[str, int]:
    first = cycle * CHUNKS_PER_CYCLE
    return {key_of(i).hex(): i for i in range(first, first + limit)}


def test_kill9_of_store_writer_never_leaves_a_loadable_corrupt_file(tmp_path):
    """>= 20 SIGKILLs of a process writing 1 MiB attention and 35 KB GDN files
    through FsData + the C++ copier on 4 I/O threads. After each kill: the
    start-up tidy (what FileStore.open runs) removes every orphaned temporary
    file, and every file under a final name verifies and holds exactly the
    bytes that were gathered for it."""
    cache = tmp_path / "cache"
    rng = random.Random(5)
    kv = KvCache()
    totals = {"files_verified": 0, "corrupt_loads": 0, "orphans_removed": 0, "kills_mid_write": 0}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
    root = cache / LAYOUT_DIR / FP.hex()
    dirs = CacheDirs()  # one owner for the test, as for one engine: FileStore.open tidies once, here
    FileStore.open(str(cache), FP, dirs=dirs)
    # Each writer is a new process, forked from a parent that imported torch
    # once (an interpreter start per kill would cost ~4 s).
    zygote = subprocess.Popen([sys.executable, str(REPO / "tests" / "faults" / "store_writer.py"), "--zygote"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        for cycle in range(CYCLES):
            zygote.stdin.write(f"run {cache} {cycle * CHUNKS_PER_CYCLE}\n")
            zygote.stdin.flush()
            pid = ready = None
            while pid is None or not ready:
                line = zygote.stdout.readline().split()
                assert line and line[0] != "EXIT", "the writer process died before writing a file"
                if line[0] == "PID":
                    pid = int(line[1])
                elif line[0] == "READY":
                    ready = True
            time.sleep(rng.uniform(0.05, 0.5))
            os.kill(pid, signal.SIGKILL)
            status = zygote.stdout.readline().split()
            assert status[0] == "EXIT" and os.WIFSIGNALED(int(status[1])) and os.WTERMSIG(int(status[1])) == 9
            _verify_after_kill(cache, root, cycle, kv, totals, dirs)
    finally:
        zygote.kill()
        zygote.wait()
    print(f"\nkill -9 store-writer cycles: {CYCLES}, files verified: {totals['files_verified']}, "
          f"kills that hit a write in flight: {totals['kills_mid_write']}, "
          f"orphans removed: {totals['orphans_removed']}")
    assert totals["files_verified"] >= CYCLES
    assert totals["kills_mid_write"] >= 1, "no kill landed during a write: the test proves nothing about orphans"
    record("1a kill -9 of a store-writing process (FsData + C++ copier, 4 I/O threads)",
           "SIGKILL at a random time 50-500 ms into writing", CYCLES,
           f"{totals['files_verified']} files written and verified", totals["corrupt_loads"],
           "none (only the stores in flight at the kill)",
           orphans_removed=totals["orphans_removed"], kills_mid_write=totals["kills_mid_write"])


def _verify_after_kill(cache: Path, root: Path, cycle: int, kv: KvCache, totals: dict, dirs: CacheDirs) -> None:
    """What a restart sees: FileStore.open's tidy, then every file verified."""
    if True:
        orphans = _tmp_files(root)
        store = FileStore.open(str(cache), FP, dirs=dirs)  # tidies once per owner: before the first cycle
        removed, kept = store.tidy()
        assert kept == 0 and removed == len(orphans) and not _tmp_files(root), "orphans left behind"
        totals["orphans_removed"] += removed
        totals["kills_mid_write"] += bool(orphans)
        index = _index_of(cycle)
        for path in sorted(root.glob("g*/*/*.kv")):
            group, i = int(path.parts[-3][1:]), index[path.stem]
            header = kv.header(i, group)
            out = torch.empty(header.payload_len, dtype=torch.uint8)
            try:
                store.read_into(header, out)
            except ChunkMiss as e:
                totals["corrupt_loads"] += 1
                pytest.fail(f"cycle {cycle}: {path} under its final name does not verify: {e}")
            assert np.array_equal(out.numpy(), expected_payload(kv, i, group)), f"cycle {cycle}: {path} differs"
            totals["files_verified"] += 1
            path.unlink()  # keep the disk small; the next cycle writes new chunks


# ---- the orphan rule ------------------------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.mark.parametrize("case", ["local-dead", "tagged-dead", "own-live", "reused-pid", "other-host-young",
                                  "other-host-old", "untagged-nfs-dead-young", "untagged-nfs-dead-old",
                                  "layout-tmp-old", "layout-tmp-young"])
def test_orphan_rule(case):
    now = time.time()
    dead, me = _dead_pid(), os.getpid()
    final = "ab" * 32 + ".kv"
    other = "0badc0de" if hygiene.HOST_TAG != "0badc0de" else "0badc0df"
    name, mtime, local, expect = {
        "local-dead": (f"{final}.tmp.{dead}.12345678", now, True, True),
        "tagged-dead": (f"{final}.tmp.{dead}.12345678.{hygiene.HOST_TAG}", now, False, True),
        "own-live": (f"{final}.tmp.{me}.12345678.{hygiene.HOST_TAG}", now, True, False),
        # This pid was reused: the live process started after the file was last written.
        "reused-pid": (f"{final}.tmp.{me}.12345678", now - 10 * 86400 + 3600, True, True),
        "other-host-young": (f"{final}.tmp.{dead}.12345678.{other}", now - 5, False, False),
        "other-host-old": (f"{final}.tmp.{dead}.12345678.{other}", now - 300, False, True),
        "untagged-nfs-dead-young": (f"{final}.tmp.{dead}.12345678", now - 5, False, False),
        "untagged-nfs-dead-old": (f"{final}.tmp.{dead}.12345678", now - 300, False, True),
        "layout-tmp-old": (f".layout.{'c' * 32}.tmp", now - 300, True, True),
        "layout-tmp-young": (f".layout.{'c' * 32}.tmp", now - 1, True, False),
    }[case]
    if case == "reused-pid":
        started = hygiene.pid_started_at(me)
        if not started:
            pytest.skip("no /proc start time")
        mtime = started - 60
    assert hygiene.is_orphan(name, mtime, now, local_only=local, max_age_s=7 * 86400) is expect
    # Anything past orphan_tmp_age_s is an orphan, whoever wrote it.
    assert hygiene.is_orphan(name, now - 3601, now, local_only=local, max_age_s=3600)


def test_tidy_at_open_keeps_a_live_writers_file(tmp_path):
    store = FileStore.open(str(tmp_path), FP)
    d = store.root / "g1" / "ab"
    d.mkdir(parents=True)
    live = d / f"{'ab' * 32}.kv.tmp.{os.getpid()}.12345678.{hygiene.HOST_TAG}"
    dead = d / f"{'ab' * 32}.kv.tmp.{_dead_pid()}.87654321"
    live.write_bytes(b"x")
    dead.write_bytes(b"x")
    assert store.tidy() == (1, 1)
    assert live.exists() and not dead.exists()


# ---- symlinks, permissions, what names are made of ----------------------------------------

def _header(i: int, group: int = ATTN) -> ChunkHeader:
    return KvCache().header(i, group)


def _payload(h: ChunkHeader, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (h.payload_len,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_symlinked_group_dir_is_neither_written_nor_read_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    cache = tmp_path / "cache"
    good = FileStore.open(str(tmp_path / "elsewhere"), FP)
    h = _header(3)
    data = _payload(h)
    assert good.write(h, data)
    # An attacker's g1 points at a directory outside the cache, holding a valid file.
    root = cache / LAYOUT_DIR / FP.hex()
    root.mkdir(parents=True)
    (outside / h.key.hex()[:2]).mkdir()
    os.link(good.file_path(h.group, h.key), outside / h.key.hex()[:2] / f"{h.key.hex()}.kv")
    (root / "g1").symlink_to(outside, target_is_directory=True)
    store = FileStore(root, FP, real_root=os.path.realpath(root))
    assert not store.contains(h.group, h.key)
    with pytest.raises(ChunkMiss) as e:
        store.read_into(h, torch.empty(h.payload_len, dtype=torch.uint8))
    assert e.value.reason == "unsafe"
    h2 = _header(4)
    with pytest.raises(OSError) as e2:
        store.write(h2, _payload(h2))
    assert "outside the cache" in str(e2.value)
    assert sorted(p.name for p in outside.rglob("*.kv")) == [f"{h.key.hex()}.kv"], "nothing written outside"
    # At start-up the link is moved aside; the cache then works inside its own directory.
    opened = FileStore.open(str(cache), FP)
    assert not (root / "g1").is_symlink() and list((root / "quarantine").glob("g1.symlink.*"))
    assert opened.write(h2, _payload(h2)) and opened.file_path(1, h2.key).resolve().is_relative_to(root.resolve())
    record("8 symlinked g1 directory pointing outside the cache", "symlink g1 -> outside dir holding a valid file",
           1, "1 write refused, 1 read refused, link moved aside at start-up", 0, "none")


def test_a_directory_removed_from_a_live_cache_is_made_again_by_the_next_write(tmp_path):
    store = FileStore.open(str(tmp_path / "cache"), FP)
    h = _header(6)
    assert store.write(h, _payload(h))
    # An operator's tidying of a live cache: the file evicted, then its emptied directory removed.
    path = store.file_path(h.group, h.key)
    os.unlink(path)
    path.parent.rmdir()
    assert not path.parent.exists()
    assert store.write(h, _payload(h, seed=2)), "the write was dropped"
    out = torch.empty(h.payload_len, dtype=torch.uint8)
    store.read_into(h, out)
    assert torch.equal(out, _payload(h, seed=2))


def test_symlinked_chunk_file_is_not_followed(tmp_path):
    store = FileStore.open(str(tmp_path / "cache"), FP)
    secret = tmp_path / "secret"
    h = _header(5)
    secret.write_bytes(b"s" * (HEADER_LEN + h.payload_len))
    path = store.file_path(h.group, h.key)
    path.parent.mkdir(parents=True)
    path.symlink_to(secret)
    with pytest.raises(ChunkMiss) as e:
        store.read_into(h, torch.empty(h.payload_len, dtype=torch.uint8))
    assert e.value.reason == "unsafe"
    assert secret.read_bytes() == b"s" * (HEADER_LEN + h.payload_len), "target untouched"
    assert not os.path.lexists(path), "the link itself went to quarantine"


MODE_CASES = [(umask, fm, dm) for umask in (0o022, 0o077, 0o000)
              for fm, dm in ((None, None), ("0660", "0770"), ("0600", "0700"))]


def test_file_and_directory_modes_follow_config_whatever_the_umask(tmp_path):
    """file_mode / dir_mode are the exact modes of what the store creates
    (defaults owner+group: 0640 / 0750), under umasks 022, 077 and 000."""
    code = f"""
import os, sys
sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}]
from offload.config import parse_config
from offload.store.files import FileStore
import offload.store.files as files
from faults.store_writer import FP, KvCache
for n, (umask, fm, dm) in enumerate({MODE_CASES!r}):
    os.umask(umask)
    files._UMASK = umask
    extra = {{"store": "fs", "path": {str(tmp_path)!r} + f"/c{{n}}"}}
    if fm:
        extra |= {{"file_mode": fm, "dir_mode": dm}}
    opts = parse_config(extra).tiers[0].options()
    s = FileStore.open(opts.path, FP, options=opts)
    k = KvCache(); h = k.header(1, 1)
    s.write(h, k.pages[1].gather(k.fill(1, 1)))
    s.write_layout({{"tensors": {{}}}})
"""
    subprocess.run([sys.executable, "-c", code], check=True)
    for n, (umask, file_mode, dir_mode) in enumerate(MODE_CASES):
        want_f, want_d = int(file_mode or "0640", 8), int(dir_mode or "0750", 8)
        c = tmp_path / f"c{n}"
        files = [p for p in c.rglob("*") if p.is_file()]
        dirs = [p for p in c.rglob("*") if p.is_dir()] + [c]
        # A chunk file, layout.json and this process's ledger log; ledger-v1/ among the directories.
        assert len(files) == 3 and len(dirs) == 6 and (c / LAYOUT_DIR / "ledger-v1").is_dir()
        assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {want_f}, (umask, file_mode)
        assert {stat.S_IMODE(p.stat().st_mode) for p in dirs} == {want_d}, (umask, dir_mode)
        assert all(stat.S_IMODE(p.stat().st_mode) & 0o007 == 0 for p in files + dirs)


def test_world_writable_cache_dir_is_refused_naming_the_key(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o777)
    with pytest.raises(OptionError) as e:  # the connector prefixes the key path (test_reliability_config)
        FileStore.open(str(d), FP)
    msg = str(e.value)
    assert msg.startswith("path=") and "0777" in msg and "chmod o-w" in msg


def test_names_are_made_of_hashes_only(tmp_path):
    """Nothing from a request reaches a path: file names are chunk-key hex, and
    a prompt's token bytes never appear in any name (engine-level check in
    test_reliability_e2e)."""
    store = FileStore.open(str(tmp_path), FP)
    for i in range(4):
        for g in (GDN, ATTN):
            h = _header(i, g)
            store.write(h, _payload(h, i))
    import re

    names = [p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")]
    # The ledger's names are a host tag, a pid and random hex (docs/format.md "Ledger").
    pat = re.compile(rf"^{re.escape(LAYOUT_DIR)}(/[0-9a-f]{{64}}(/g\d+(/[0-9a-f]{{2}}(/[0-9a-f]{{64}}\.kv)?)?)?"
                     r"|/ledger-v1(/[0-9a-f]{8}-\d+-[0-9a-f]{8}\.log)?)?$")
    assert names and all(pat.match(n) for n in names), names


# ---- foreign format versions ---------------------------------------------------------------

@pytest.mark.parametrize("version", [0, 1, 2, 4, 0xFFFF])
def test_other_format_version_is_a_clean_miss(tmp_path, version):
    """A file of another version where this version's reader looks, with a header CRC
    that is valid for it: refused before any byte is interpreted."""
    store = FileStore.open(str(tmp_path), FP)
    h = _header(9)
    data = _payload(h)
    assert store.write(h, data)
    path = store.file_path(h.group, h.key)
    raw = bytearray(path.read_bytes())
    raw[8:10] = struct.pack("<H", version)
    raw[HEADER_LEN - 4:HEADER_LEN] = struct.pack("<I", crc32c(bytes(raw[:HEADER_LEN - 4])))
    path.write_bytes(bytes(raw))
    out = torch.zeros(h.payload_len, dtype=torch.uint8)
    with pytest.raises(ChunkMiss) as e:
        store.read_into(h, out)
    assert e.value.reason == "corrupt" and f"format version {version}" in str(e.value)
    # FsData.load scatters only after read_into returned: a refused file reaches no KV block.


# ---- the byte budget -----------------------------------------------------------------------

def _chain(store: FileStore, first: int, n: int, group: int = ATTN) -> list[Path]:
    kv = KvCache()
    paths = []
    for i in range(first, first + n):
        h = kv.header(i, group)
        store.write(h, kv.pages[group].gather(kv.fill(i, group)))
        paths.append(store.file_path(group, h.key))
        time.sleep(0.002)  # distinct mtimes
    return paths


def test_budget_evicts_leaves_first_and_keeps_every_group_prefix_closed(tmp_path):
    store = FileStore.open(str(tmp_path), FP)
    top = tmp_path / LAYOUT_DIR
    a = _chain(store, 0, 6)  # one prompt's attention chunks 0..5
    b = _chain(store, 100, 6)  # another prompt's
    gdn = _chain(store, 0, 6, GDN)
    # Prompt a was used last: its files are the most recent.
    for p in a:
        os.utime(p)
    size = a[0].stat().st_size
    total = sum(p.stat().st_size for p in a + b + gdn)
    budget = DirBudget(top, max_bytes=total - 3 * size, low_water=1.0)
    used = budget.enforce()
    assert used <= total - 3 * size
    present = lambda chain: [p.exists() for p in chain]
    for chain in (a, b):
        flags = present(chain)
        assert flags == sorted(flags, reverse=True), f"not prefix-closed: {flags}"
    # The least recently used chain lost its tail: b is shorter, a intact.
    assert all(present(a)) and sum(present(b)) < 6
    record("4a byte budget, prefix-closed LRU eviction (unit)", "directory 3 files over its budget", 1,
           "-", 0, "only least recently used leaves", evicted_files=budget.evicted_files)


def test_housekeeper_one_account_feeds_usage_and_budget_and_stops(tmp_path):
    from offload.store.cachedir.housekeeper import Housekeeper

    store = FileStore.open(str(tmp_path), FP)
    a = _chain(store, 0, 4)
    gdn = _chain(store, 0, 2, GDN)
    size = a[0].stat().st_size
    total = sum(p.stat().st_size for p in a + gdn)
    # No budget: the figures of this fingerprint's groups, from the ledger the store appended to.
    plain = Housekeeper(store.root, num_groups=2)
    u = plain.pass_once()
    assert u.entries[ATTN] == 4 and u.entries[GDN] == 2 and sum(u.bytes) == total
    assert u.bytes[ATTN] == sum(p.stat().st_size for p in a)
    # With a budget: the same figures, after its eviction.
    budget = DirBudget(tmp_path / LAYOUT_DIR, max_bytes=total - size, low_water=1.0)
    keeper = Housekeeper(store.root, num_groups=2, budget=budget).start()
    deadline = time.monotonic() + 30
    while keeper.latest() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    u = keeper.latest()
    assert u is not None and budget.evicted_files >= 1
    assert sum(u.entries) == 6 - budget.evicted_files
    left = [p for p in a + gdn if p.exists()]
    assert sum(u.bytes) == sum(p.stat().st_size for p in left) <= budget.usage <= total - size
    keeper.stop()
    assert not keeper._thread.is_alive(), "stopped with the connector"
    assert not budget.loaded, "the index is dropped with the housekeeper"
