"""Warm start as logic (offload/connector/warm.py's plan, the host-memory index's warm slots) and
on a real file tier (the candidates its ledger index gives). The engines' proof is in
tests/test_e2e_warm_start.py."""

from __future__ import annotations

import dataclasses
import hashlib
import time

import torch

from offload.connector.warm import WarmPlanner, choose
from offload.keys import ChunkKey, Fingerprint
from offload.metrics import Recorder
from offload.planner import GroupKind
from offload.store.base import WarmCandidate
from offload.store.cachedir.budget import DirBudget
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.files import FileStore
from offload.store.format import ChunkHeader
from offload.store.fs import FsIndex
from test_cpu_index import FRAME, hybrid, k

MAMBA, FULL = GroupKind.MAMBA, GroupKind.FULL_ATTENTION
G_STATE, G_ATTN = 0, 1
CHAINED = [False, True]


def cand(group: int, i: int, parent: int | None, t: float, size: int = 100) -> WarmCandidate:
    return WarmCandidate(group, k(i), None if parent is None else k(parent)[:8], size, t)


def test_the_most_recent_entries_come_with_their_chain_and_states_only_with_their_chunk():
    cands = [
        cand(G_ATTN, 1, None, 1.0), cand(G_ATTN, 2, 1, 2.0), cand(G_ATTN, 3, 2, 9.0),  # 3 is the hottest
        cand(G_STATE, 3, None, 8.0),  # the state at chunk 3's boundary
        cand(G_STATE, 7, None, 10.0),  # a state whose chunk's attention entry is gone: never alone
        cand(G_ATTN, 5, 4, 7.0),  # its parent (4) is not in the directory: no chain to restore
        cand(G_ATTN, 6, None, 0.5),
    ]
    got = choose(cands, CHAINED, anchor=G_ATTN, budget=10_000)
    names = [(c.group, int.from_bytes(c.key, "little")) for c in got]
    # Chunk 3 first with what it needs, parents before children; then its state; then what is left.
    assert names == [(G_ATTN, 1), (G_ATTN, 2), (G_ATTN, 3), (G_STATE, 3), (G_ATTN, 6)]
    # Within a budget: the hottest closed prefix that fits, nothing half.
    assert [int.from_bytes(c.key, "little") for c in choose(cands, CHAINED, G_ATTN, budget=300)] == [1, 2, 3]
    # 250 bytes: chunk 3's chain (300) does not fit, chunk 2's (200) does, and then nothing else.
    small = choose(cands, CHAINED, G_ATTN, budget=250)
    assert [(c.group, int.from_bytes(c.key, "little")) for c in small] == [(G_ATTN, 1), (G_ATTN, 2)]


def test_warm_slots_take_free_room_only_and_are_offered_before_their_bytes_land():
    _, idx = hybrid(4)
    for i in range(3):  # three frames in use
        assert idx.reserve(G_ATTN, k(i), k(i - 1) if i else None) is not None
    assert idx.reserve_warm(G_ATTN, k(10), None) is not None  # the last free frame
    assert idx.reserve_warm(G_ATTN, k(11), k(10)) is None, "warm start never evicts"
    assert all(idx.contains(G_ATTN, k(i)) for i in range(3))
    # Offered at once, and a load may pin it (the worker waits for the bytes or reads them itself).
    assert idx.contains(G_ATTN, k(10)) and idx.pin(G_ATTN, k(10)) is not None
    assert idx.usage().warm_hits == 1
    idx.unpin(G_ATTN, k(10))
    # Never evicted before the worker settles it: a new entry finds no room.
    assert idx.reserve(G_ATTN, k(20), None) is not None  # evicts an old leaf instead
    assert idx.contains(G_ATTN, k(10))
    idx.promotion_done(G_ATTN, k(10), landed=False)  # the worker could not read it
    assert not idx.contains(G_ATTN, k(10))


def _write(store: FileStore, group: int, kind: GroupKind, i: int, parent: int | None, nbytes: int) -> None:
    h = ChunkHeader(store.fingerprint, ChunkKey(k(i)), group, kind, i * 256, (i + 1) * 256, 1, nbytes,
                    parent=k(parent)[:8] if parent is not None else bytes(8))
    store.write(h, torch.full((nbytes,), i, dtype=torch.uint8))


def test_a_file_tier_offers_its_ledger_and_the_plan_fills_free_host_memory(tmp_path):
    fp = Fingerprint(hashlib.sha256(b"warm start").digest())
    acct = DirBudget(tmp_path / LAYOUT_DIR)
    store = dataclasses.replace(FileStore.open(str(tmp_path), fp), account=acct)
    for i in range(1, 4):  # a chain of three chunks, each with its state; then one cold state
        _write(store, G_ATTN, FULL, i, i - 1 if i > 1 else None, FRAME)
        time.sleep(0.01)
        _write(store, G_STATE, MAMBA, i, None, 400_000)
        time.sleep(0.01)
    store.write(ChunkHeader(fp, ChunkKey(k(9)), G_STATE, MAMBA, 0, 256, 1, 400_000),
                torch.zeros(400_000, dtype=torch.uint8), cold=True)
    fs = FsIndex(store)
    assert fs.warm_candidates() is None, "unknown until the ledger index is loaded"
    acct.ensure_loaded()
    cands = fs.warm_candidates()
    assert sorted((c.group, int.from_bytes(c.key, "little")) for c in cands) == \
        sorted([(G_ATTN, i) for i in range(1, 4)] + [(G_STATE, i) for i in (1, 2, 3, 9)])
    cold = next(c for c in cands if c.key == k(9))
    assert all(cold.t < c.t for c in cands if c is not cold), "the newest entry, stored cold, ranks below every other"
    assert {c.parent for c in cands if c.group == G_ATTN} == {None, k(1)[:8], k(2)[:8]}
    _, cpu = hybrid(4)  # room for 4 of the 6 entries at most; the share allows half of it
    planner = WarmPlanner([cpu, fs], [MAMBA, FULL], 1, 1.0, 1, Recorder("cpu"))
    planner.poll()
    got = planner.take()
    assert [(e.group, int.from_bytes(e.key, "little")) for e in got] == \
        [(G_ATTN, 1), (G_ATTN, 2), (G_ATTN, 3), (G_STATE, 3)], "the hottest chain, its newest state, in 4 frames"
    assert all(e.source == 1 and e.slot.tier == 0 for e in got)
    assert planner.take() == ()
    planner.settle([(e.group, e.key, True) for e in got])
    assert all(cpu.contains(e.group, ChunkKey(e.key)) for e in got)
    acct.close()
