"""The owner of a cache directory (offload/store/cachedir/owners.py): shared by an
explicit reference count, closed by its last user, a stop that never closes
the account under a running housekeeping pass, and two owners of one
directory in one process behaving as two processes would."""

from __future__ import annotations

import pickle
import threading
import time
from pathlib import Path

from ledger_instance import ATTN, FP, true_bytes, write_prompt
from offload.store.cachedir import ledger as lg
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.housekeeper import Housekeeper
from offload.store.cachedir.owners import CacheDirs, Shared
from offload.store.cachedir.paths import LEDGER_DIR, LOG_NAME, top_dir
from offload.store.files import FileStore
from offload.store.options import FsOptions


def wait_for(cond, timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def logs(top: Path) -> list[Path]:
    return sorted(p for p in (top / LEDGER_DIR).iterdir() if LOG_NAME.match(p.name))


def sealed(log: Path) -> bool:
    lines, _, _ = lg.read_lines(log, 0)
    return isinstance(lg.parse(lines[-1]), lg.End)


def test_shared_counts_users_and_hands_the_value_back_to_the_last():
    s: Shared[str, object] = Shared()
    made = []
    a = s.acquire("k", lambda: made.append(1) or object())
    b = s.acquire("k", lambda: made.append(1) or object())
    assert a is b and made == [1] and s.users("k") == 2
    assert s.release("k") is None and "k" in s, "one user left"
    assert s.release("k") is a and "k" not in s and s.users("k") == 0
    assert s.release("k") is None, "releasing an unknown key is a no-op"
    c = s.acquire("k", object)
    assert c is not a, "made afresh after the last release"


def test_stores_of_one_cache_dirs_share_an_owner_closed_by_the_last(tmp_path):
    dirs = CacheDirs()
    top = top_dir(tmp_path)
    a = FileStore.open(str(tmp_path), FP, dirs=dirs)
    b = FileStore.open(str(tmp_path), FP, dirs=dirs)
    assert a.account is b.account and dirs.users(top) == 2
    other = FileStore.open(str(tmp_path), FP, dirs=CacheDirs())
    assert other.account is not a.account, "another CacheDirs shares nothing"
    write_prompt(a, "x", 0)
    [log] = logs(top)
    a.close()
    a.close()  # idempotent: one hold, one release
    assert dirs.users(top) == 1 and not sealed(log), "still used by b"
    b.close()
    assert dirs.users(top) == 0 and sealed(log), "the last user closes the owner: its log is sealed"
    c = FileStore.open(str(tmp_path), FP, dirs=dirs)
    assert c.account is not a.account, "a new owner after the last release"
    c.close()
    other.close()


def test_conflicting_max_bytes_the_smallest_applies(tmp_path):
    dirs = CacheDirs()
    path = str(tmp_path)
    a = FileStore.open(path, FP, options=FsOptions(path=path, max_bytes=2 << 20), dirs=dirs)
    b = FileStore.open(path, FP, options=FsOptions(path=path, max_bytes=1 << 20), dirs=dirs)
    c = FileStore.open(path, FP, options=FsOptions(path=path, max_bytes=4 << 20), dirs=dirs)
    d = FileStore.open(path, FP, options=FsOptions(path=path), dirs=dirs)
    assert a.account is b.account is c.account is d.account
    assert a.account.max_bytes == 1 << 20, "the smallest budget any opener gave"
    for s in (a, b, c, d):
        s.close()


def test_the_first_housekeeper_of_an_owner_drives_and_the_owner_stops_it(tmp_path):
    dirs = CacheDirs()
    a = FileStore.open(str(tmp_path), FP, dirs=dirs)
    ref = a.ref
    assert ref is not None
    k1 = ref.dir.housekeeper(a.root, 2).start()
    k2 = ref.dir.housekeeper(a.root, 2).start()
    assert k1.drive and not k2.drive, "one driver per account"
    write_prompt(a, "x", 0)
    wait_for(lambda: k2.latest() is not None and sum(k2.latest().entries) == 8, what="the reader's figures")
    a.close()  # the last user: the owner stops both and closes the account
    assert not k1._thread.is_alive() and not k2._thread.is_alive()
    assert not a.account.loaded


class _Blocking(DirBudget):
    """An account whose enforce blocks until released: a pass that outlives stop's wait."""

    def __init__(self, top: Path) -> None:
        super().__init__(top)
        self.entered = threading.Event()
        self.go = threading.Event()
        self.closes = 0

    def enforce(self) -> int:
        self.entered.set()
        self.go.wait(60)
        return super().enforce()

    def close(self) -> None:
        self.closes += 1
        super().close()


def test_stop_never_closes_the_account_under_a_running_pass(tmp_path):
    store = FileStore.open(str(tmp_path), FP)
    write_prompt(store, "x", 0)
    acct = _Blocking(top_dir(tmp_path))
    keeper = Housekeeper(store.root, 2, acct).start()
    assert acct.entered.wait(30), "the pass started"
    assert keeper.stop(wait_s=0.1) is False, "the pass is still running: stop says so"
    assert acct.closes == 0 and acct.loaded, "nothing closed under it"
    acct.go.set()
    wait_for(lambda: acct.closes == 1, what="the thread closing the account when its pass returned")
    wait_for(lambda: not keeper._thread.is_alive(), what="the thread to end")
    assert not acct.loaded and acct.closes == 1
    store.close()


def test_stop_of_an_idle_housekeeper_closes_at_once(tmp_path):
    store = FileStore.open(str(tmp_path), FP)
    acct = DirBudget(top_dir(tmp_path))
    keeper = Housekeeper(store.root, 2, acct).start()
    wait_for(lambda: keeper.latest() is not None, what="a first pass")
    assert keeper.stop() is True and not keeper._thread.is_alive() and not acct.loaded
    store.close()


def test_two_owners_of_one_directory_in_one_process_behave_like_two_processes(tmp_path):
    path = str(tmp_path)
    top = top_dir(tmp_path)
    opts = FsOptions(path=path, max_bytes=1 << 20)
    a = FileStore.open(path, FP, options=opts, dirs=CacheDirs())
    b = FileStore.open(path, FP, options=opts, dirs=CacheDirs())
    assert a.account is not b.account
    write_prompt(a, "a", 0)
    write_prompt(b, "b", 0)
    names = [p.name for p in logs(top)]
    assert len(names) == 2 and len(set(names)) == 2, "each owner appends to its own log"
    # The lease: a holder's (a live pid of this host) is never taken over by the other.
    assert a.account.lease.acquire()
    assert not b.account.lease.acquire()
    a.account.lease.release()
    assert b.account.lease.acquire()
    b.account.lease.release()
    # Each reads the other's records; a removal recorded by one (a tombstone) removes the file from the other.
    for acct in (a.account, b.account):
        acct.enforce()
        assert acct.usage == true_bytes(top)
    victim = sorted(a.root.glob(f"g{ATTN}/*/*.kv"))[-1]
    victim.unlink()
    a.account.note_remove(a.rel(victim))
    b.account.sync()
    assert b.account.usage == a.account.usage == true_bytes(top)
    # Eviction by one is followed by the other.
    # A budget below the options' 1 MiB floor (these files are small): set on the account itself.
    small = FileStore.open(path, FP, options=FsOptions(path=path), dirs=CacheDirs())
    small.account.max_bytes = true_bytes(top) // 2
    small.account.enforce()
    assert small.account.evicted_files > 0 and true_bytes(top) <= small.account.max_bytes
    b.account.sync()
    assert b.account.usage == small.account.usage == true_bytes(top)
    for s in (a, b, small):
        s.close()
    assert all(sealed(p) for p in logs(top)), "every owner sealed its own log"


def test_attached_cache_dirs_follow_their_anchor_and_not_a_pickled_copy():
    class Anchor:
        pass

    x, y = Anchor(), Anchor()
    assert CacheDirs.attached(x) is CacheDirs.attached(x)
    assert CacheDirs.attached(y) is not CacheDirs.attached(x)
    dirs = CacheDirs.attached(x)
    dirs.engines.acquire("k", object)
    copy = pickle.loads(pickle.dumps(dirs))
    assert isinstance(copy, CacheDirs) and "k" not in copy.engines, "another process starts empty"


def test_a_file_pinned_for_a_load_outlives_the_eviction_that_would_have_taken_it(tmp_path):
    """Between a lookup and the read of a hit, an eviction (a store making room, another
    instance's pass) must not take the files the load needs: the oldest leaves of the directory,
    the first an evictor takes, are what a restarted engine's hits read. Pinning them for the
    load moves their recency on, as the read will."""
    from ledger_instance import DEPTH, key
    from offload.store.fs import FsIndex

    path = str(tmp_path)
    top = top_dir(tmp_path)
    store = FileStore.open(path, FP, options=FsOptions(path=path), dirs=CacheDirs())
    write_prompt(store, "old", 0)
    time.sleep(0.02)
    write_prompt(store, "new", 0)
    leaf = store.file_path(ATTN, key("old", 0, DEPTH - 1))
    time.sleep(0.02)
    assert FsIndex(store).pin(ATTN, key("old", 0, DEPTH - 1)) is not None
    store.account.max_bytes = true_bytes(top) * 3 // 4  # the oldest leaves go first
    store.account.enforce()
    assert store.account.evicted_files > 0, "the budget forced an eviction"
    assert leaf.exists(), "the pinned file was kept"
    store.close()
