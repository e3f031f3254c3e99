"""Usage accounting of the file tier from per-instance ledgers: several
instances (processes, or accounts in this process) share one
directory of real chunk files; their accounted usage must stay within 5% of
the bytes on disk, eviction must keep the directory under its budget, a
crashed instance's torn or damaged line must be tolerated, and a reconcile
walk must correct what the ledger missed. No timing is asserted here; costs
are bench/scale.py's."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO
from ledger_instance import ATTN, FP, GDN, key, true_bytes, write_prompt
from offload.planner import GroupKind
from offload.store.cachedir import ledger as lg
from offload.store.cachedir.budget import IN_FLIGHT_SHARE, DirBudget
from offload.store.cachedir.housekeeper import Housekeeper
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.files import FileStore
from offload.store.format import ChunkHeader

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}


def instance(path: Path, acct: DirBudget) -> FileStore:
    """A FileStore writing through `acct`: one simulated engine in this process."""
    return dataclasses.replace(FileStore.open(str(path), FP), account=acct,
                               budget=acct if acct.max_bytes else None)


def logs(top: Path) -> list[Path]:
    return sorted(p for p in (top / lg.LEDGER_DIR).iterdir() if lg.LOG_NAME.match(p.name))


def chain_present(root: Path, owner: str, prompt: int) -> list[bool]:
    return [(root / f"g{ATTN}" / key(owner, prompt, c).hex()[:2] / f"{key(owner, prompt, c).hex()}.kv").exists()
            for c in range(4)]


# ---- the format -------------------------------------------------------------------------------


def test_records_round_trip_and_a_damaged_or_torn_line_is_never_misread(tmp_path):
    w = lg.LedgerWriter(tmp_path / "ledger-v1")
    rel = f"{'ab' * 32}/g1/cd/{'cd' * 32}.kv"
    assert w.put(rel, 4224, 1700000000.5, 0x0123456789ABCDEF) and w.drop(rel, 1700000001.25)
    path = tmp_path / "ledger-v1" / w.name
    lines, off, size = lg.read_lines(path, 0)
    assert off == size and lg.parse_header(lines[0])["kind"] == "log"
    assert [lg.parse(ln) for ln in lines[1:]] == [("+", 1700000000.5, 4224, 0x0123456789ABCDEF, rel, False),
                                                  ("-", 1700000001.25, 0, None, rel, False)]
    # A state admitted cold says so in its put line's optional last field.
    cold = lg.parse(lg.put_line(rel, 4224, 1700000002.0, None, cold=True).rstrip("\n"))
    assert cold == ("+", 1700000002.0, 4224, None, rel, True) and cold.cold
    # One flipped character anywhere: the CRC refuses the line.
    good = lines[1]
    for i in range(len(good)):
        bad = good[:i] + ("0" if good[i] != "0" else "1") + good[i + 1:]
        assert lg.parse(bad) is None, i
    # A record may only name a cache file: nothing outside the layout directory  is ever reached through one.
    for evil in ("../../etc/passwd", f"{'ab' * 32}/../../x", f"{'ab' * 32}/quarantine/..", "/etc/passwd",
                 f"{'ab' * 32}/g1/cd/x.kv"):
        assert lg.parse(lg.put_line(evil, 1, 1.0, None).rstrip("\n")) is None, evil
    # A line whose newline has not arrived (a write in progress, or a crash mid-write) is not read yet.
    full = lg.put_line(rel, 10, 2.0, None)
    with open(path, "a") as f:
        f.write(full[:20])
    lines2, off2, _ = lg.read_lines(path, off)
    assert lines2 == [] and off2 == off
    with open(path, "a") as f:
        f.write(full[20:])
    lines3, _, _ = lg.read_lines(path, off)
    assert [lg.parse(ln) for ln in lines3] == [("+", 2.0, 10, None, rel, False)]


# ---- several instances, one directory -----------------------------------------------------------


def _run_instances(tmp_path: Path, n: int, prompts: int, max_bytes: int) -> tuple[list[dict], list[int]]:
    cache = tmp_path / "cache"
    flag = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "ledger_instance.py"), str(cache), f"i{i}",
                               str(prompts), str(max_bytes), str(flag)], stdout=subprocess.PIPE, text=True,
                              env=ENV, cwd=REPO) for i in range(n)]
    deadline = time.monotonic() + 180
    while sum(1 for p in tmp_path.iterdir() if ".ready." in p.name) < n:
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "instances did not start"
        time.sleep(0.05)
    top = cache / LAYOUT_DIR
    peaks: list[int] = []
    flag.touch()
    while any(p.poll() is None for p in procs):  # the directory, sampled while they write
        peaks.append(true_bytes(top))
        time.sleep(0.01)
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs, peaks


def _within(samples: list[list[int]], frac: float) -> list[tuple]:
    """Samples whose truth (a walk, the other instances paused) is off the
    accounted usage by more than `frac` beyond what still changed while the
    walk ran (usage before and after it)."""
    bad = []
    for before, true, after in samples:
        if true < 1 << 20:
            continue  # too little on disk for a percentage to mean anything
        lo, hi = min(before, after), max(before, after)
        if not (lo - frac * true <= true <= hi + frac * true):
            bad.append((before, true, after))
    return bad


@pytest.mark.long  # 45–80 s: `make test` stays within 12 minutes on the slower CPU kind (docs/development.md)
def test_three_instances_writing_concurrently_account_within_5_percent(tmp_path):
    outs, _ = _run_instances(tmp_path, 3, 24, 0)
    truth = true_bytes(tmp_path / "cache" / LAYOUT_DIR)
    for o in outs:
        assert o["samples"], o["name"]
        assert not _within(o["samples"], 0.05), (o["name"], _within(o["samples"], 0.05))
        assert abs(o["usage"] - o["true"]) <= 0.05 * o["true"], o
        assert o["true"] == truth and o["bad_lines"] == 0
    # Shared prompts were written by every instance: duplicates are one file, counted once.
    assert all(o["usage"] == truth for o in outs), [(o["name"], o["usage"], truth) for o in outs]


def test_three_instances_under_one_budget_keep_the_directory_under_it(tmp_path):
    budget = 3 << 20  # ~15 MB written in all
    outs, peaks = _run_instances(tmp_path, 3, 24, budget)
    top = tmp_path / "cache" / LAYOUT_DIR
    truth = true_bytes(top)
    assert sum(o["evicted_files"] for o in outs) > 0, "the budget never had to evict: the test proves nothing"
    assert truth <= budget, truth
    assert max(peaks) <= 1.05 * budget, f"directory reached {max(peaks) / budget:.3f} of its budget"
    for o in outs:
        assert not _within(o["samples"], 0.05), (o["name"], _within(o["samples"], 0.05))
        assert abs(o["usage"] - truth) <= 0.05 * truth, o
    # Eviction went leaf first: every chain that is left is a prefix. (Not asserted for the shared
    # prompts: one instance may evict a chunk between another's "exists, skip" for it and that
    # instance's write of the next one, the store/evict race the lookup tolerates as a failed load.)
    root = top / FP.hex()
    for owner in ("i0", "i1", "i2"):
        for p in range(24):
            flags = chain_present(root, owner, p)
            assert flags == sorted(flags, reverse=True), (owner, p, flags)
    print(f"\nLEDGER three instances, budget {budget}: peak {max(peaks) / budget:.3f} over {len(peaks)} samples, "
          f"evicted {sum(o['evicted_files'] for o in outs)} files, final {truth}")


def test_two_accounts_in_one_process_see_each_others_writes_and_evictions(tmp_path):
    top = tmp_path / LAYOUT_DIR
    a = DirBudget(top)
    b = DirBudget(top, max_bytes=1 << 20)
    sa, sb = instance(tmp_path, a), instance(tmp_path, b)
    a.ensure_loaded(), b.ensure_loaded()
    for p in range(6):
        write_prompt(sa, "a", p)  # ~0.8 MB
    b.sync()
    assert b.usage == a.usage == true_bytes(top)
    time.sleep(0.02)
    for p in range(6):  # a's prefixes were loaded since: their first chunks are the most recently used
        for c in (0, 1):
            os.utime(top / FP.hex() / f"g{ATTN}" / key("a", p, c).hex()[:2] / f"{key('a', p, c).hex()}.kv")
    for p in range(6):
        write_prompt(sb, "b", p)  # b goes over its budget and evicts a's oldest leaves too
    assert b.evicted_files > 0 and true_bytes(top) <= 1 << 20
    for owner in ("a", "b"):  # leaves first: what is left of every chain is a prefix
        for p in range(6):
            flags = chain_present(top / FP.hex(), owner, p)
            assert flags == sorted(flags, reverse=True), (owner, p, flags)
    a.sync()
    assert a.usage == b.usage == true_bytes(top)
    assert [lg.parse_header(lg.read_lines(p, 0)[0][0])["kind"] for p in logs(top)] == ["log", "log"]


# ---- crashes -------------------------------------------------------------------------------------


def test_a_killed_instance_leaves_a_readable_ledger_and_a_torn_line_is_tolerated(tmp_path):
    cache, flag = tmp_path / "cache", tmp_path / "go"
    top = cache / LAYOUT_DIR
    p = subprocess.Popen([sys.executable, str(REPO / "tests" / "ledger_instance.py"), str(cache), "k", "0", "0",
                          str(flag), "--forever"], env=ENV, cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "go.ready.k").exists():
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.05)
        flag.touch()
        while sum(1 for _ in (top / FP.hex()).rglob("*.kv")) < 40:
            time.sleep(0.02)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    [dead] = logs(top)
    # A crash mid-write leaves a line without its newline; after it, a complete line damaged on disk.
    rel = f"{FP.hex()}/g{ATTN}/00/{'00' * 32}.kv"
    with open(dead, "a") as f:
        f.write(lg.put_line(rel, 123456, time.time(), None)[:30])
    b = DirBudget(top)
    b.ensure_loaded()
    truth = true_bytes(top)
    # The kill may have landed between a rename and its record: at most that file is missing.
    assert abs(b.usage - truth) <= 0.05 * truth and b.bad_lines == 0
    lines, _, _ = lg.read_lines(dead, 0)
    damaged = lines[5][:-3] + ("x" if lines[5][-3] != "x" else "y") + lines[5][-2:]
    raw = dead.read_text().replace(lines[5] + "\n", damaged + "\n")
    dead.write_text(raw)
    c = DirBudget(top)
    c.sync()  # no snapshot read: every line of the log, the damaged one skipped
    assert c.bad_lines == 1
    drift = b.reconcile()
    assert b.usage == truth, drift
    assert drift.get("added_files", 0) <= 2 and drift.get("removed_files", 0) == 0, drift


# ---- a ledger that cannot be written for a while ---------------------------------------------------


class _Unwritable:
    """The ledger directory made unwritable for real, as a network filesystem away from its
    server is: this process's open log closed behind the writer's back (its next write fails
    with EBADF), and the directory replaced by a plain file (a new log cannot be created)."""

    def __init__(self, top: Path, acct: DirBudget) -> None:
        self.d, self.aside, self.acct = top / lg.LEDGER_DIR, top / "ledger-away", acct

    def __enter__(self) -> None:
        if self.acct.ledger._fd is not None:
            os.close(self.acct.ledger._fd)
        self.d.rename(self.aside)
        self.d.write_text("")

    def __exit__(self, *exc) -> None:
        self.d.unlink()
        self.aside.rename(self.d)


def test_records_the_ledger_could_not_take_are_appended_once_it_can(tmp_path):
    top = tmp_path / LAYOUT_DIR
    a = DirBudget(top)
    sa = instance(tmp_path, a)
    write_prompt(sa, "a", 0)
    a.ensure_loaded()  # a walk, and its snapshot: b starts from it
    write_prompt(sa, "a", 3)  # this process's log is open
    with _Unwritable(top, a):
        write_prompt(sa, "a", 1)
        write_prompt(sa, "a", 2)
        (top / FP.hex() / f"g{ATTN}" / key("a", 0, 0).hex()[:2] / f"{key('a', 0, 0).hex()}.kv").unlink()
        a.note_remove(f"{FP.hex()}/g{ATTN}/{key('a', 0, 0).hex()[:2]}/{key('a', 0, 0).hex()}.kv")
        kept = a.ledger.backlog
        assert kept > 0 and a.ledger.failed > 0
        a.maintain()  # still unwritable: nothing lost, nothing appended
        assert a.ledger.backlog == kept and a.ledger.lost == 0
    walks = a.walks
    a.maintain()
    assert a.ledger.backlog == 0
    # Another instance reads every record, the removal after the additions, without a walk.
    b = DirBudget(top)
    b.ensure_loaded()
    assert b.walks == 0 and b.usage == a.usage == true_bytes(top)
    # After an outage the lease holder walks once (what went on meanwhile may not be in any record).
    deadline = time.monotonic() + 30
    while a.walks == walks:
        a.maintain()
        assert time.monotonic() < deadline
    a.maintain()
    assert a.walks == walks + 1 and a.usage == true_bytes(top)


def test_records_dropped_from_a_full_backlog_or_at_close_make_the_next_pass_walk(tmp_path, monkeypatch):
    monkeypatch.setattr(lg, "MAX_BACKLOG_LINES", 3)
    top = tmp_path / LAYOUT_DIR
    a = DirBudget(top)
    sa = instance(tmp_path, a)
    write_prompt(sa, "a", 9)
    a.ensure_loaded()
    before = sum(1 for _ in top.rglob("*.kv"))
    with _Unwritable(top, a):
        write_prompt(sa, "a", 0)
        written = sum(1 for _ in top.rglob("*.kv")) - before
        assert a.ledger.backlog == 3 and a.ledger.lost == written - 3
    walks = a.walks
    deadline = time.monotonic() + 30
    while a.walks == walks:  # the first pass appends the last three records and starts a walk
        a.maintain()
        assert time.monotonic() < deadline
    b = DirBudget(top)
    b.ensure_loaded()
    assert b.walks == 0 and b.usage == true_bytes(top)
    # Records still kept when the writer closes are counted lost, for the next walk.
    with _Unwritable(top, a):
        write_prompt(sa, "a", 1)
        a.close()
    assert a.ledger.lost > written - 3 and a.ledger.backlog == 0


# ---- reconcile and compaction --------------------------------------------------------------------


def test_reconcile_corrects_what_the_ledger_missed_and_other_instances_adopt_it(tmp_path):
    top = tmp_path / LAYOUT_DIR
    a = DirBudget(top)
    sa = instance(tmp_path, a)
    for p in range(5):
        write_prompt(sa, "a", p)
    a.ensure_loaded()
    b = DirBudget(top)
    b.ensure_loaded()  # from a's snapshot, no walk
    assert a.usage == b.usage == true_bytes(top)
    root = top / FP.hex()
    known = sorted(root.rglob("*.kv"))
    # Behind the ledger's back: a writer without a ledger, a file deleted by hand, one resized.
    plain = dataclasses.replace(FileStore.open(str(tmp_path), FP), account=None)
    write_prompt(plain, "unrecorded", 0)
    known[3].unlink()
    with open(known[7], "ab") as f:
        f.write(b"x" * 1000)
    stale = a.usage
    a.sync()
    # A pass only reads the ledger: it does not see any of it (its cost does not grow with the tree).
    assert a.usage == stale != true_bytes(top)
    drift = a.reconcile()
    assert a.usage == true_bytes(top)
    assert drift["added_files"] == 8 and drift["removed_files"] == 1 and drift["resized"] == 1, drift
    # b adopts a's walk through its snapshot, without walking itself.
    assert b.usage == stale
    b.sync()
    b.maintain()
    assert b.usage == true_bytes(top) and b.walks == 0


def test_checkpoint_folds_the_logs_and_a_new_instance_starts_from_it(tmp_path):
    top = tmp_path / LAYOUT_DIR
    writers = [DirBudget(top) for _ in range(3)]
    for i, w in enumerate(writers):
        write_prompt(instance(tmp_path, w), f"w{i}", 0)
        w.ledger.seal()  # these instances are done (a clean shutdown)
    assert len(logs(top)) == 3
    a = DirBudget(top, folded_idle_s=0.0)
    a.ensure_loaded()  # no snapshot yet: a walk, then a's first snapshot
    assert a.walks == 1 and a.usage == true_bytes(top)
    snap = a.describe()["snapshot"]
    assert snap is not None
    # The folded, sealed logs are gone: what they said is in the snapshot.
    assert logs(top) == []
    (top / FP.hex() / f"g{GDN}").rename(top / FP.hex() / "g9")  # behind the ledger's back: a new instance...
    b = DirBudget(top)
    b.ensure_loaded()
    assert b.walks == 0 and b.usage == a.usage, "...loads the snapshot and does not walk"
    (top / FP.hex() / "g9").rename(top / FP.hex() / f"g{GDN}")
    # Records after the snapshot are replayed on top of it.
    c = DirBudget(top)
    write_prompt(instance(tmp_path, c), "c", 0)
    d = DirBudget(top)
    d.ensure_loaded()
    assert d.usage == true_bytes(top) and d.walks == 0


def test_eviction_prefers_a_file_loaded_since_it_was_indexed(tmp_path):
    """Loads are not recorded: an eviction candidate's mtime is checked first."""
    top = tmp_path / LAYOUT_DIR
    a = DirBudget(top)
    store = instance(tmp_path, a)
    paths = []
    for i in range(6):
        h = ChunkHeader(FP, key("lru", i, 0), GDN, GroupKind.MAMBA, 0, 256, 1, 10_000)
        store.write(h, torch.zeros(10_000, dtype=torch.uint8))
        paths.append(store.file_path(GDN, h.key))
        time.sleep(0.01)
    a.ensure_loaded()
    os.utime(paths[0])  # loaded just now (FileStore touches a file it loaded)
    b = DirBudget(top, max_bytes=a.usage - 5000, low_water=1.0)
    b.enforce()
    assert paths[0].exists() and not paths[1].exists() and all(p.exists() for p in paths[2:])
    a.sync()
    assert a.usage == b.usage == true_bytes(top)


def test_a_write_in_flight_counts_against_the_budget_before_it_lands(tmp_path):
    """Eviction makes room for a write before it starts, and one instance's writes in flight are
    capped at IN_FLIGHT_SHARE of the budget (what another instance cannot see of them)."""
    top = tmp_path / LAYOUT_DIR
    acct = DirBudget(top, max_bytes=1 << 20)
    store = instance(tmp_path, acct)
    acct.ensure_loaded()
    for p in range(6):
        write_prompt(store, "w", p)  # ~0.8 MB: under the budget, nothing evicted
    assert acct.evicted_files == 0
    incoming = (1 << 20) - acct.usage + 64 * 1024  # lands 64 KiB over the budget
    with acct.reserving(incoming):
        assert acct.evicted_files > 0  # before a byte of it is written
        assert true_bytes(top) + incoming <= acct.target  # down to the low-water mark, the write counted
        assert acct.usage + acct.in_flight.bytes <= acct.target
    assert acct.in_flight.bytes == 0
    cap = int(acct.max_bytes * IN_FLIGHT_SHARE)
    entered = threading.Event()

    def second() -> None:
        with acct.reserving(cap // 2):
            entered.set()

    with acct.reserving(cap):  # a write larger than the cap goes alone
        t = threading.Thread(target=second)
        t.start()
        assert not entered.wait(0.3), "a second write passed the cap of bytes in flight"
    assert entered.wait(10)
    t.join()
    assert acct.in_flight.bytes == 0


def test_cold_states_are_evicted_first_until_loaded_and_stay_cold_across_a_restart(tmp_path):
    """A state admitted cold (`by_use`: a prompt's internal boundary) ranks
    below every other file, oldest cold first, in this process and in one
    that reads the ledger later; a load (FileStore touches the file) makes it
    an ordinary entry."""
    top = tmp_path / LAYOUT_DIR
    a = DirBudget(top)
    store = instance(tmp_path, a)
    paths = []
    for i in range(6):
        h = ChunkHeader(FP, key("cold", i, 0), GDN, GroupKind.MAMBA, 0, 256, 1, 10_000)
        store.write(h, torch.zeros(10_000, dtype=torch.uint8), cold=i in (3, 4, 5))
        paths.append(store.file_path(GDN, h.key))
        time.sleep(0.01)
    a.ensure_loaded()
    os.utime(paths[4])  # loaded: hot from now on
    size = a.usage // 6
    b = DirBudget(top, max_bytes=a.usage - size // 2, low_water=1.0)  # a restart: the ledger tells it all
    b.enforce()
    assert [p.exists() for p in paths] == [True, True, True, False, True, True], "the oldest cold file went first"
    c = DirBudget(top, max_bytes=true_bytes(top) - size // 2, low_water=1.0)
    c.enforce()
    assert [p.exists() for p in paths] == [True, True, True, False, True, False], "then the other cold one"
    c.max_bytes = true_bytes(top) - size // 2
    c.enforce()
    assert [p.exists() for p in paths] == [False, True, True, False, True, False], "then the oldest, loaded or not"
    a.sync()
    assert a.usage == c.usage == true_bytes(top)


def test_an_entry_whose_parent_was_evicted_is_not_written_behind_the_hole(tmp_path, monkeypatch):
    """The budget evicts leaves; a child that waited in the store queue while
    its parent went (before its write, or during it) is dropped, not left
    behind a hole a lookup's binary search would step over."""
    from offload.store.base import HostChunk, ParentGone, Placement
    from offload.store.buffers import BufferPool
    from offload.store.fs import FsData

    top = tmp_path / LAYOUT_DIR
    acct = DirBudget(top)
    store = instance(tmp_path, acct)
    data = FsData(store, direct=False)
    k = [key("gone", 0, c) for c in range(3)]

    def put(c: int, parent: bytes | None) -> bool:
        h = ChunkHeader(FP, k[c], ATTN, GroupKind.FULL_ATTENTION, c * 256, (c + 1) * 256, 1, 4096,
                        parent=parent[:8] if parent else bytes(8), parent_key=parent)
        chunk = HostChunk.pooled(BufferPool(), 4096)
        chunk.payload.fill_(c)
        try:
            return data.put(h, chunk, Placement())
        finally:
            chunk.release()

    assert put(0, None) and put(1, bytes(k[0]))
    store.remove(store.file_path(ATTN, k[1]))  # evicted: a leaf
    with pytest.raises(ParentGone):
        put(2, bytes(k[1]))
    assert not store.file_path(ATTN, k[2]).exists()
    real = FileStore.write_framed

    def evicting_meanwhile(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        self.remove(self.file_path(ATTN, k[0]))
        return out

    monkeypatch.setattr(FileStore, "write_framed", evicting_meanwhile)
    with pytest.raises(ParentGone):
        put(1, bytes(k[0]))
    assert not store.file_path(ATTN, k[1]).exists(), "written, then removed again"
    acct.ensure_loaded()
    assert acct.usage == true_bytes(top) and acct.files == 0, "the ledger says what is left: nothing"


def test_housekeeper_drives_its_account_and_seals_its_log_on_stop(tmp_path):
    top = tmp_path / LAYOUT_DIR
    acct = DirBudget(top, max_bytes=1 << 20)
    store = instance(tmp_path, acct)
    keeper = Housekeeper(store.root, 2, acct).start()
    for p in range(12):
        write_prompt(store, "h", p)
    deadline = time.monotonic() + 30
    while (keeper.latest() is None or sum(keeper.latest().bytes) != true_bytes(top)) and time.monotonic() < deadline:
        time.sleep(0.05)
    u = keeper.latest()
    assert sum(u.bytes) == true_bytes(top) <= 1 << 20 and acct.evicted_files > 0
    assert u.entries[ATTN] == sum(1 for _ in (top / FP.hex() / f"g{ATTN}").rglob("*.kv"))
    keeper.stop()
    [log] = logs(top)
    lines, _, _ = lg.read_lines(log, 0)
    assert isinstance(lg.parse(lines[-1]), lg.End), "a clean stop seals the log"
    assert not acct.loaded


def test_many_finished_logs_are_folded_even_without_many_records(tmp_path):
    """Each engine start leaves a log, and every pass opens every log: past MAX_LOGS
    the housekeeper writes a snapshot that folds the finished ones, which then go."""
    from offload.store.cachedir import compaction as bmod

    top = tmp_path / LAYOUT_DIR
    a = DirBudget(top, folded_idle_s=0.0)
    a.ensure_loaded()
    for i in range(bmod.MAX_LOGS + 8):  # short-lived instances, each a few records, then a clean stop
        w = DirBudget(top)
        write_prompt(instance(tmp_path, w), f"r{i}", 0)
        w.ledger.seal()
    a.sync()
    before = a.checkpoints
    a.maintain()  # few bytes of records: only the number of logs makes a checkpoint due
    assert a.checkpoints == before + 1 and logs(top) == []
    assert a.usage == true_bytes(top)
    b = DirBudget(top)
    b.ensure_loaded()
    assert b.usage == a.usage and b.walks == 0


def test_leaf_queue_pops_the_oldest_leaf_and_requeues_a_parent_its_last_child_frees():
    from offload.store.evictor import LeafQueue

    recency = {"root": 1.0, "child": 2.0, "alone": 3.0}
    links = {"root": "R", "child": None, "alone": None}
    q: LeafQueue[str, str] = LeafQueue()
    for n, t in recency.items():
        q.push(t, n)
    q.link("R")  # child chains from root
    current = recency.get
    assert q.pop(current, links.get) == "child", "root is older but not a leaf: parked"
    del recency["child"]
    parked = q.unlink("R")
    assert parked == "root" and not q.has_children("R")
    q.push(recency["root"], "root")
    recency["alone"] = 0.5  # used since it was queued at 3.0: that entry is stale
    q.push(0.5, "alone")
    assert q.pop(current, links.get) == "alone" and q.pop(current, links.get) == "root"
    assert q.pop(current, links.get) is None, "the stale entry of 'alone' is skipped"
