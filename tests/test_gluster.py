"""The file tier on a real network filesystem, no engine: a GlusterFS replica-2
volume and two FUSE mounts of it (tests/gluster.py), each standing for one
node. Two instances share one cache directory, each through its own mount,
with its own ledger log, index and the same byte budget.

What the ledger, the budget, the lease, quarantine and fsck assume of the
filesystem is measured first (`probe`); then the same directory is written,
read, evicted, corrupted and crashed across the mounts. Each mount caches
attributes and directory entries for a second (GlusterFS's FUSE defaults), so
one node sees the other's appends, creates and unlinks late; the bounds below
say by how much that is allowed to show.

Skipped, with the reason, where FUSE or GlusterFS is missing (tests/gluster.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gluster
from conftest import REPO
from harness.cli import run_cli
from ledger_instance import ATTN, FP, GDN, key, true_bytes, write_prompt
from offload import cli
from offload.planner import GroupKind
from offload.store.base import ChunkMiss, MissReason, Placement
from offload.store.cachedir import hygiene
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.lease import Lease
from offload.store.cachedir.paths import LAYOUT_DIR, LEDGER_DIR
from offload.store.files import FileStore
from offload.store.format import ChunkHeader
from offload.store.fs import FsData

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "OMP_NUM_THREADS": "1"}
LAYOUT = {"chunk_size": 256, "groups": [{"spec": "MambaSpec(...)"}, {"spec": "FullAttentionSpec(...)"}],
          "tensors": {}}


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    why = gluster.unavailable()
    if why:
        pytest.skip(why)
    v = gluster.Volume(tmp_path_factory.mktemp("gluster")).start()
    try:
        yield v
    finally:
        v.close()


@pytest.fixture
def shared(volume, request):
    """A fresh cache directory on the volume: (its path through node 1's mount, through node 2's)."""
    name = f"{request.node.name[:40]}.{os.urandom(3).hex()}"
    a, b = (m / name for m in volume.mounts)
    a.mkdir(mode=0o750)
    gluster.wait_until(b.is_dir, 10, "the directory on the other mount")
    return a, b


def instance(path: Path, acct: DirBudget) -> FileStore:
    return dataclasses.replace(FileStore.open(str(path), FP), account=acct, budget=acct if acct.max_bytes else None)


def cli_run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_the_volume_does_what_the_file_tier_assumes(volume):
    got = gluster.probe(*volume.mounts, seconds=1.0)
    print("\nGLUSTER probe " + json.dumps(got, sort_keys=True))
    # Both mounts are network filesystems to the store: longer polls, ledger flushes, host-tagged temporaries.
    assert got["fs_type"] == "fuse.glusterfs" and got["network"], got
    # A file renamed into place is read whole or not at all from the other node; what a reader meets while
    # another node replaces it is an error the store treats as a miss (ENOENT: missing; ESTALE: transient).
    assert got["rename_reads"] > 50 and got["rename_torn"] == 0, got
    assert set(got["rename_read_errors"]) <= {"ENOENT", "ESTALE"}, got
    # The lease is an O_EXCL create; recency is the mtime, compared to the millisecond.
    assert got["o_excl_exclusive"] and got["mtime_subsecond"], got
    # The other node's appends, creates and unlinks arrive, within the attribute and entry cache's second.
    for k in ("append_visible_s_max", "create_visible_s", "unlink_visible_s", "utime_visible_s"):
        assert got[k] < 3.0, (k, got)
    assert got["o_direct_write"], got  # FsData probes it per directory; on this volume it is on


def test_a_file_written_on_one_node_is_read_verified_on_the_other_and_damage_is_quarantined(shared, capsys):
    a, b = shared
    top_a, top_b = a / LAYOUT_DIR, b / LAYOUT_DIR
    acct_a, acct_b = DirBudget(top_a), DirBudget(top_b)
    assert acct_a.network and acct_b.network
    sa, sb = instance(a, acct_a), instance(b, acct_b)
    sa.write_layout(LAYOUT)
    for p in range(4):
        write_prompt(sa, "n1", p)
    # Node 2 restores every chunk node 1 stored, byte for byte.
    restored = 0
    for p in range(4):
        for c in range(4):
            k = key("n1", p, c)
            size = (16 + bytes(k)[0] % 32) * 1024
            h = ChunkHeader(FP, k, ATTN, GroupKind.FULL_ATTENTION, c * 256, (c + 1) * 256, 1, size,
                            parent=bytes(8) if c == 0 else bytes(key("n1", p, c - 1))[:8])
            out = torch.empty(size, dtype=torch.uint8)
            gluster.wait_until(lambda h=h: sb.contains(h.group, h.key), 5, "node 1's file on node 2")
            sb.read_into(h, out)
            assert bool((out == c).all()), (p, c)
            restored += 1
    assert restored == 16
    # A payload byte flipped through node 1: node 2's read is a miss and moves the file to quarantine.
    k = key("n1", 0, 2)
    victim = sa.file_path(ATTN, k)
    with open(victim, "r+b") as f:
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    size = (16 + bytes(k)[0] % 32) * 1024
    h = ChunkHeader(FP, k, ATTN, GroupKind.FULL_ATTENTION, 512, 768, 1, size, parent=bytes(key("n1", 0, 1))[:8])

    def corrupt_seen():  # node 2 may hold the old bytes for its cache's second
        try:
            sb.read_into(h, torch.empty(size, dtype=torch.uint8))
        except ChunkMiss as e:
            return e.reason
        return None
    assert gluster.wait_until(corrupt_seen, 10, "the damaged file to be refused on node 2") is MissReason.CORRUPT
    gluster.wait_until(lambda: not sa.contains(ATTN, k), 5, "the quarantine seen from node 1")
    # Both accounts agree with a walk once each has read the other's log (within the mounts' cache second).
    for acct in (acct_a, acct_b):
        acct.ensure_loaded()
        gluster.wait_until(lambda acct=acct: (acct.sync(), acct.usage == true_bytes(top_a))[1], 10,
                           "the account to agree with a walk")
    # fsck from node 2: every file left verifies; the damaged one is kept in quarantine for inspection.
    rc, out = cli_run(capsys, "fsck", str(b))
    assert rc == 0 and "0 corrupt" in out and "1 files already in quarantine" in out, out
    r = run_cli("stats", str(a), "--json")  # its own process: a JSON stdout alone (harness/cli.py)
    rc, out = r.returncode, r.stdout
    rep = json.loads(out)
    assert rc == 0 and rep["ledger"]["drift_bytes"] == 0, rep["ledger"]


def test_the_lease_is_held_by_one_node_at_a_time(shared):
    a, b = shared
    for d in (a, b):
        (d / LEDGER_DIR).mkdir(exist_ok=True)
    la, lb = Lease(a / LEDGER_DIR), Lease(b / LEDGER_DIR)
    assert la.acquire()
    assert not lb.acquire(), "two nodes hold the lease at once"
    la.release()
    gluster.wait_until(lb.acquire, 5, "the released lease to be taken from the other node")
    assert not la.acquire()
    lb.release()


def _run_nodes(tmp_path: Path, caches: list[Path], prompts: int, max_bytes: int) -> tuple[list[dict], list[int]]:
    flag = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, str(REPO / "tests" / "ledger_instance.py"), str(c), f"n{i}",
                               str(prompts), str(max_bytes), str(flag)], stdout=subprocess.PIPE, text=True,
                              env=ENV, cwd=REPO) for i, c in enumerate(caches)]
    try:
        gluster.wait_until(lambda: sum(1 for p in tmp_path.iterdir() if ".ready." in p.name) == len(procs)
                           or any(p.poll() is not None for p in procs), 120, "the instances to start")
        assert all(p.poll() is None for p in procs), "an instance exited before it started"
        top = caches[0] / LAYOUT_DIR
        peaks: list[int] = []
        flag.touch()
        while any(p.poll() is None for p in procs):  # the directory, walked through node 1 while both write
            peaks.append(true_bytes(top))
            time.sleep(0.05)
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
            outs.append(json.loads(out.strip().splitlines()[-1]))
        return outs, peaks
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_nodes_under_one_budget_keep_the_directory_under_it_and_their_accounts_agree(shared, tmp_path, capsys):
    a, b = shared
    budget = 1 << 20  # ~2.5 MB written in all
    outs, peaks = _run_nodes(tmp_path, [a, b], 8, budget)
    top = a / LAYOUT_DIR
    truth = true_bytes(top)
    report = {"budget": budget, "peak": max(peaks), "samples": len(peaks), "final": truth,
              "evicted_files": sum(o["evicted_files"] for o in outs),
              "usage": [o["usage"] for o in outs], "bad_lines": sum(o["bad_lines"] for o in outs),
              "sample_errors": [max(abs(s[1] - s[0]) / max(s[1], 1) for s in o["samples"]) for o in outs]}
    with capsys.disabled():
        print("\nGLUSTER two nodes, one budget " + json.dumps(report))
    assert report["evicted_files"] > 0, "the budget never had to evict: the test proves nothing"
    assert truth <= budget, report
    # Each node sees the other's writes up to a second late (the mount's attribute cache) plus its poll: the
    # directory may overshoot by what the other wrote meanwhile. Bound: 15% of the budget.
    assert max(peaks) <= 1.15 * budget, report
    assert report["bad_lines"] == 0, report
    for o in outs:  # once both are done and have read each other's logs: exact
        assert o["usage"] == o["true"] == truth, (o["name"], o["usage"], o["true"], truth)
    # Leaves went first: what is left of every chain of one node's own prompts is a prefix.
    root = top / FP.hex()
    for owner in ("n0", "n1"):
        for p in range(8):
            if p % 3 == 0:
                continue  # the shared prompts: a store/evict race across nodes may leave a hole (a failed load)
            flags = [(root / f"g{ATTN}" / key(owner, p, c).hex()[:2] / f"{key(owner, p, c).hex()}.kv").exists()
                     for c in range(4)]
            assert flags == sorted(flags, reverse=True), (owner, p, flags)
    # fsck through node 2: every file verifies, the ledger agrees with the walk.
    FileStore.open(str(b), FP).write_layout(LAYOUT)
    rc, out = cli_run(capsys, "fsck", str(b), "--repair")
    assert rc in (0, 3) and " 0 corrupt" in out, out  # repaired: at most the shared prompts' chain holes
    rc, out = cli_run(capsys, "fsck", str(b))
    assert rc == 0 and "clean" in out, out


def test_a_node_killed_mid_write_leaves_a_directory_the_other_node_loads_and_tidies(shared, tmp_path, capsys):
    a, b = shared
    FileStore.open(str(a), FP).write_layout(LAYOUT)
    flag = tmp_path / "go"
    p = subprocess.Popen([sys.executable, str(REPO / "tests" / "ledger_instance.py"), str(a), "k", "0", "0",
                          str(flag), "--forever"], env=ENV, cwd=REPO, stdout=subprocess.DEVNULL)
    top_b = b / LAYOUT_DIR
    try:
        gluster.wait_until(lambda: (tmp_path / "go.ready.k").exists() or p.poll() is not None, 120,
                           "the writer to start")
        assert p.poll() is None
        flag.touch()
        gluster.wait_until(lambda: sum(1 for _ in (top_b / FP.hex()).rglob("*.kv")) >= 24, 60,
                           "24 files seen from node 2")
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    # Node 2 loads the directory from the dead node's log; the kill may have landed between a rename and its
    # record (one file per group) and node 2's view of the log may be a second old: poll.
    acct = DirBudget(top_b)
    acct.ensure_loaded()

    def agrees():
        acct.sync()
        t = true_bytes(top_b)
        return abs(acct.usage - t) <= 2 * (48 << 10) + 2 * 4200
    gluster.wait_until(agrees, 10, "node 2's account within two files of a walk")
    assert acct.bad_lines <= 1, acct.bad_lines  # at most the line the kill tore
    # Opening the directory on node 2 removes the dead writer's temporaries: same host tag, pid gone.
    store = FileStore.open(str(b), FP)
    assert not [q for q in (top_b / FP.hex()).rglob("*.tmp.*")], "a dead writer's temporary file was kept"
    rc, out = cli_run(capsys, "fsck", str(b))
    assert rc == 0 and "clean" in out, out
    store.close()
    assert hygiene.is_network_fs(top_b)


def test_budget_records_of_a_node_are_read_by_the_other(shared):
    """Evictions by one node reach the other's account through its log, without a walk."""
    a, b = shared
    acct_a, acct_b = DirBudget(a / LAYOUT_DIR), DirBudget(b / LAYOUT_DIR, max_bytes=600 << 10)
    sa, sb = instance(a, acct_a), instance(b, acct_b)
    acct_a.ensure_loaded(), acct_b.ensure_loaded()
    for p in range(4):
        write_prompt(sa, "a", p)  # ~0.5 MB
    gluster.wait_until(lambda: (acct_b.sync(), acct_b.usage == acct_a.usage)[1], 10, "node 2 to read node 1's log")
    for p in range(4):
        write_prompt(sb, "b", p)  # node 2 goes over its budget and evicts node 1's oldest leaves
    assert acct_b.evicted_files > 0
    assert true_bytes(a / LAYOUT_DIR) <= 600 << 10
    gluster.wait_until(lambda: (acct_a.sync(), acct_a.usage == true_bytes(a / LAYOUT_DIR))[1], 10,
                       "node 1 to read node 2's evictions")
    assert acct_a.walks == 1 and acct_b.walks <= 1  # the first load only
    # Node 1's Mamba states that node 2 evicted are gone from node 1's view too.
    gone = [p for p in range(4) for c in range(4)
            if not (a / LAYOUT_DIR / FP.hex() / f"g{GDN}" / key("a", p, c).hex()[:2] / f"{key('a', p, c).hex()}.kv")
            .exists()]
    assert gone, "node 2 evicted none of node 1's states"


def test_a_volume_outage_is_a_miss_that_keeps_the_file_and_the_account_resumes_where_it_was(volume, shared):
    """While the volume is stopped every operation fails with ENOTCONN: a read is a transient miss (the file
    is not quarantined: it is fine once the volume is back) and a ledger tail keeps its place (it does not
    read every log again from the start). Runs last in this module: it stops the shared volume."""
    a, b = shared
    acct_a, acct_b = DirBudget(a / LAYOUT_DIR), DirBudget(b / LAYOUT_DIR)
    sa, sb = instance(a, acct_a), instance(b, acct_b)
    acct_a.ensure_loaded(), acct_b.ensure_loaded()
    for p in range(2):
        write_prompt(sa, "o", p)
    gluster.wait_until(lambda: (acct_b.sync(), acct_b.usage == acct_a.usage > 0)[1], 10, "node 2 to read node 1's log")
    before = acct_b.describe()
    k = key("o", 0, 1)
    size = (16 + bytes(k)[0] % 32) * 1024
    h = ChunkHeader(FP, k, ATTN, GroupKind.FULL_ATTENTION, 256, 512, 1, size, parent=bytes(key("o", 0, 0))[:8])
    volume.stop()
    try:
        with pytest.raises(ChunkMiss) as miss:
            sb.read_into(h, torch.empty(size, dtype=torch.uint8))
        # A store's "already there?" is no, not an exception that would fail the whole request's stores;
        # the write itself then fails alone (the worker drops that one store).
        held = FsData(sb, direct=False).holds(h, Placement())
        with pytest.raises(OSError):
            sb.write(ChunkHeader(FP, key("o", 9, 0), ATTN, GroupKind.FULL_ATTENTION, 0, 256, 1, 4096, parent=bytes(8)),
                     torch.zeros(4096, dtype=torch.uint8))
        acct_b.sync()
        during = acct_b.describe()
    finally:
        volume.start_again()
    assert held is False
    assert miss.value.reason is MissReason.IO_ERROR, miss.value
    assert (during["logs"], during["bytes"]) == (before["logs"], before["bytes"]), (before, during)
    out = torch.empty(size, dtype=torch.uint8)
    gluster.wait_until(lambda: (sb.read_into(h, out), True)[1] if os.path.exists(sb.file_path(ATTN, k)) else False,
                       30, "the file to read again once the volume is back")
    assert bool((out == 1).all())
    acct_b.sync()
    assert acct_b.usage == true_bytes(b / LAYOUT_DIR) and acct_b.bad_lines == 0


@pytest.mark.parametrize("payload", [4 << 20, (4 << 20) + 1000])
def test_a_direct_store_with_a_partial_last_block_lands_on_the_mount_and_reads_back(shared, payload):
    """The file tier's default store (O_DIRECT for the aligned head, the partial last block
    buffered) on a FUSE mount, which refuses to take a file out of O_DIRECT: the store falls back
    to a buffered write, and the other node reads the bytes back."""
    from offload.store.base import HostChunk
    from offload.store.buffers import BufferPool

    a, b = shared
    writer = FsData(FileStore.open(str(a), FP))
    reader = FsData(FileStore.open(str(b), FP))
    k = key("direct", 0, 0)
    h = ChunkHeader(FP, k, ATTN, GroupKind.FULL_ATTENTION, 0, 256, 1, payload, parent=bytes(8))
    chunk = HostChunk.pooled(BufferPool(), payload)
    chunk.payload.copy_(torch.arange(payload, dtype=torch.int64).to(torch.uint8))
    try:
        assert writer.put(h, chunk, Placement()) is True
    finally:
        chunk.release()
    gluster.wait_until(lambda: reader.store.contains(h.group, h.key), 5, "the file on the other mount")
    got = reader.get(h, Placement(), BufferPool())
    try:
        assert torch.equal(got.payload, torch.arange(payload, dtype=torch.int64).to(torch.uint8))
    finally:
        got.release()
