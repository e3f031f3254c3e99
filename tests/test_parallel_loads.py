"""A request's files are loaded in parallel: the worker
half's load path on real files, a real FileStore and real KV-cache-shaped
tensors (no engine, no mock).

What a load guarantees, whatever order its files finish in:
- a hit only when every file of the request was read, verified and scattered;
- every bad file of the request is found in the same pass: counted as a chunk
  miss by reason, and quarantined when corrupt, so the recompute re-stores all
  of them and the next pass restores;
- verified files still fill the host-memory slots reserved for them
  (promotion), even when another file of the request failed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from offload.config import parse_config
from offload.connector.metadata import FileRef, LoadEntry, LoadJob, OffloadMetadata, StoreJob, TierSlot
from offload.connector.worker import WorkerSide
from offload.copier import GroupPages, LayerPages
from offload.keys import ChunkKey, Fingerprint
from offload.metrics import Recorder
from offload.planner import GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.base import Placement, TierContext, TierIndex
from offload.store.cachedir.owners import CacheDirs
from offload.store.format import HEADER_LEN
from offload.store.stack import build_stack

FP = Fingerprint(b"\x0b" * 32)
CHUNK = 64  # tokens; attention blocks of 16 (4 pages per chunk file), one Mamba state per chunk
BS = 16
CHUNKS = 6
FILES = 2 * CHUNKS  # per chunk: the Mamba state (group 0), then the attention pages (group 1)


class KV:
    """A small hybrid KV cache in host memory: group 0 Mamba-like (one
    padded page per block), group 1 attention [K/V, blocks, 16, 2, 64]."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(11)
        self.mamba = torch.randint(0, 256, (CHUNKS + 2, 8192), dtype=torch.uint8, generator=g)
        self.attn = torch.randint(0, 256, (2, CHUNKS * CHUNK // BS + 4, BS, 2, 64), dtype=torch.uint8, generator=g)
        nb_m, nb_a = self.mamba.shape[0], self.attn.shape[1]
        state = self.mamba[:, :6144]  # the padding after it is not part of a page
        self.pages = [GroupPages([LayerPages.from_tensor(state, nb_m)], nb_m, torch.device("cpu")),
                      GroupPages([LayerPages.from_tensor(self.attn, nb_a)], nb_a, torch.device("cpu"))]
        self.ids = [[[c + 1] for c in range(CHUNKS)],  # scattered, as a free list leaves them
                    [[(4 * c + 3 * k) % nb_a for k in range(4)] for c in range(CHUNKS)]]
        self.keys = [ChunkKey(bytes([c + 1]) * 32) for c in range(CHUNKS)]

    def planner(self) -> HybridOffloadPlanner:
        return HybridOffloadPlanner([GroupSpec(GroupKind.MAMBA, CHUNK, self.pages[0].page_bytes, 1),
                                     GroupSpec(GroupKind.FULL_ATTENTION, BS, self.pages[1].page_bytes, 1)], CHUNK)

    def ref(self, c: int, g: int) -> FileRef:
        return FileRef(g, GroupKind.MAMBA if g == 0 else GroupKind.FULL_ATTENTION, self.keys[c], c * CHUNK,
                       (c + 1) * CHUNK, len(self.ids[g][c]), self.keys[c - 1][:8] if c else bytes(8))

    def entries(self) -> list[tuple[int, int]]:
        """(chunk, group) of every file, in load-job order."""
        return [(c, g) for c in range(CHUNKS) for g in (0, 1)]

    def snapshot(self) -> list[torch.Tensor]:
        return [self.pages[g].gather([b for ids in self.ids[g] for b in ids]) for g in (0, 1)]

    def zero(self) -> None:
        self.saved = (self.mamba.clone(), self.attn.clone())
        self.mamba.zero_()
        self.attn.zero_()

    def recompute(self) -> None:
        """Put back what was there before `zero` (what recomputing the prompt does)."""
        self.mamba.copy_(self.saved[0])
        self.attn.copy_(self.saved[1])


def build(kv: KV, tiers: list[dict], io_threads: int) -> tuple[WorkerSide, list[TierIndex]]:
    """One connector's worker half over real tiers, and the tiers' indices
    (bottom-up, as the connector builds them)."""
    cfg = parse_config({"tiers": tiers, "io_threads": io_threads})
    planner = kv.planner()
    stack = build_stack([(t.store, t.options()) for t in cfg.tiers], TierContext(planner, FP, FP, dirs=CacheDirs()))
    indices = stack.indices()
    worker = WorkerSide(cfg, planner, FP, stack.data, [[], []], [Recorder(t.tier_name) for t in cfg.tiers])
    worker.pages = kv.pages
    worker.tiers = stack.data(torch.device("cpu"))
    return worker, indices


def store(kv: KV, worker: WorkerSide, tier: int, only: set[tuple[int, int]] | None = None) -> None:
    """Store entries into one tier, as a step's wait_for_save does, and wait for the writes."""
    meta = OffloadMetadata(stores=[StoreJob("s", kv.ref(c, g), tuple(kv.ids[g][c]), (TierSlot(tier),))
                                   for c, g in kv.entries() if only is None or (c, g) in only])
    worker.wait_for_save(meta)
    deadline = time.monotonic() + 30
    while worker.stores.in_flight:
        assert time.monotonic() < deadline, "stores still pending after 30 s"
        time.sleep(0.005)


def load(kv: KV, worker: WorkerSide, job: LoadJob) -> bool:
    """Run one load job to completion; True if the request restored."""
    worker.start_load_kv(OffloadMetadata(loads=[job]))
    deadline = time.monotonic() + 30
    while True:
        r = worker.get_transfer_results()
        if job.req_id in r.finished_recving:
            return job.req_id not in r.failed_recving
        assert time.monotonic() < deadline, "load not finished after 30 s"
        time.sleep(0.002)


def job_from(kv: KV, tier: int, promote: list[tuple[TierSlot, ...]] | None = None, req: str = "r") -> LoadJob:
    entries = kv.entries()
    ups = promote or [() for _ in entries]
    return LoadJob(req, tuple(LoadEntry(kv.ref(c, g), tuple(enumerate(kv.ids[g][c])), TierSlot(tier), up)
                              for (c, g), up in zip(entries, ups, strict=True)))


def counters(worker: WorkerSide, tier: int = 0) -> dict[str, float]:
    """The tier's counter series (name|labels -> value) recorded since the last call."""
    stats = worker.recorders[tier].take()
    out: dict[str, float] = {}
    for name, series in (stats.data["c"] if stats else {}).items():
        for key, v in series.items():
            out[f"{name}|{key}"] = out.get(f"{name}|{key}", 0) + v
    return out


def misses(worker: WorkerSide, tier: int = 0) -> dict[str, float]:
    """The tier's chunk misses so far, by reason (its Recorder's running totals)."""
    return worker.recorders[tier].by("kvoffload_chunk_misses", "reason")


def metric(c: dict[str, float], name: str, label: str) -> float:
    """Sum of the series of `name` with `label` among their label values."""
    return sum(v for k, v in c.items() if k.split("|")[0] == name and label in k.split("|")[1:])


def file_of(worker: WorkerSide, kv: KV, c: int, g: int, tier: int = 0) -> Path:
    return worker.tiers[tier].store.file_path(g, kv.keys[c])


def flip_payload_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[HEADER_LEN + len(raw) // 3] ^= 0x10
    path.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[:-4096])


@pytest.fixture
def kv() -> KV:
    return KV()


@pytest.mark.parametrize("io_threads", [1, 4])
@pytest.mark.parametrize("bad", [(0, 1), (0, FILES - 1), (FILES - 2, FILES - 1), (3, 8), (8, 3)],
                         ids=lambda b: f"files{b[0]}+{b[1]}" if isinstance(b, tuple) else str(b))
@pytest.mark.parametrize("direct_reads", [False, True], ids=["buffered", "o_direct"])
def test_two_corrupt_files_of_one_request_are_both_quarantined_in_one_pass(kv, tmp_path, bad, io_threads,
                                                                          direct_reads):
    worker, _ = build(kv, [{"store": "fs", "path": str(tmp_path / "c"), "direct_reads": direct_reads}],
                      io_threads)
    try:
        store(kv, worker, 0)
        want = kv.snapshot()
        entries = kv.entries()
        paths = [file_of(worker, kv, *entries[i]) for i in bad]
        flip_payload_byte(paths[0])  # a checksum failure
        truncate(paths[1])  # a size failure
        counters(worker)
        kv.zero()

        assert not load(kv, worker, job_from(kv, 0)), "a request with two corrupt files was reported restored"
        c = counters(worker)
        assert misses(worker) == {"corrupt": 2}, misses(worker)
        assert metric(c, "kvoffload_checksum_failures", "mamba") + \
            metric(c, "kvoffload_checksum_failures", "full_attention") == 2
        assert metric(c, "kvoffload_failed_loads", "corrupt") == 1  # one request, one failed load
        assert metric(c, "kvoffload_restored_bytes", "mamba") + \
            metric(c, "kvoffload_restored_bytes", "full_attention") == 0  # a failed load restores nothing
        quarantined = sorted(p.name.rsplit(".", 1)[0] for p in (worker.tiers[0].store.root / "quarantine").iterdir())
        assert quarantined == sorted(p.name for p in paths)
        assert not any(p.exists() for p in paths)
        others = [file_of(worker, kv, *e) for i, e in enumerate(entries) if i not in bad]
        assert all(p.exists() for p in others), "a good file was quarantined"

        # The recompute stores what is missing (what vLLM does after a failed load);
        # the next pass restores every page exactly.
        kv.recompute()
        store(kv, worker, 0)
        kv.zero()
        assert load(kv, worker, job_from(kv, 0, req="r2"))
        assert all(a.equal(b) for a, b in zip(kv.snapshot(), want)), "restored bytes differ"
        assert misses(worker) == {"corrupt": 2}  # nothing new
        data = worker.tiers[0]
        if direct_reads:  # this filesystem (ext4, tmpfs refuses) decides which path ran
            # The truncated file fails its size check before a read; the flipped one is read whole,
            # its CRC left to the scatter's pass where the read was O_DIRECT.
            assert data.direct_read_count + data.buffered_read_count == 2 * FILES - 2 + (data.direct_read_count > 0)
    finally:
        worker.shutdown()


@pytest.mark.parametrize("order", ["missing-first", "corrupt-first"])
def test_mixed_failures_count_every_file_and_name_the_gravest(kv, tmp_path, order):
    """A file deleted after the lookup and a corrupt one: both are counted by
    their reason; the request's reason does not depend on which came first."""
    worker, _ = build(kv, [{"store": "fs", "path": str(tmp_path / "c")}], 2)
    try:
        store(kv, worker, 0)
        entries = kv.entries()
        first, second = (2, 9)
        gone, bad = (first, second) if order == "missing-first" else (second, first)
        os.unlink(file_of(worker, kv, *entries[gone]))
        flip_payload_byte(file_of(worker, kv, *entries[bad]))
        counters(worker)
        assert not load(kv, worker, job_from(kv, 0))
        assert misses(worker) == {"missing": 1, "corrupt": 1}
        c = counters(worker)
        assert metric(c, "kvoffload_failed_loads", "corrupt") == 1
        assert metric(c, "kvoffload_failed_loads", "missing") == 0
    finally:
        worker.shutdown()


def test_a_good_request_restores_exact_bytes_and_counts_them_once(kv, tmp_path):
    worker, _ = build(kv, [{"store": "fs", "path": str(tmp_path / "c")}], 4)
    try:
        store(kv, worker, 0)
        want = kv.snapshot()
        kv.zero()
        counters(worker)
        assert load(kv, worker, job_from(kv, 0))
        assert all(a.equal(b) for a, b in zip(kv.snapshot(), want))
        c = counters(worker)
        moved = metric(c, "kvoffload_restored_bytes", "mamba") + metric(c, "kvoffload_restored_bytes", "full_attention")
        assert moved == sum(t.numel() for t in want)
        assert worker.recorders[0].total("kvoffload_restored_bytes") == moved and not misses(worker)
    finally:
        worker.shutdown()


def test_promotion_fills_the_reserved_slots_of_every_verified_file(kv, tmp_path):
    """Host memory over files: a load from files puts each verified entry
    into its reserved host slot, also when another file of the request is
    corrupt (the slot of the corrupt one stays empty: a later load from it
    is a miss, never wrong bytes)."""
    worker, indices = build(kv, [{"store": "cpu", "cpu_bytes": 8 << 20},
                                 {"store": "fs", "path": str(tmp_path / "c")}], 4)
    try:
        store(kv, worker, 1)  # files only (as after a restart)
        want = kv.snapshot()
        entries = kv.entries()
        bad = 5
        flip_payload_byte(file_of(worker, kv, *entries[bad], tier=1))
        promote = []
        for c, g in entries:
            slot = indices[0].reserve(g, kv.keys[c], kv.keys[c - 1] if c else None)
            assert slot is not None
            promote.append((TierSlot(0, slot.slot),))
        kv.zero()
        assert not load(kv, worker, job_from(kv, 1, promote))
        assert worker.stores.drain(30) == 0  # promotions are writes of the store threads
        host = worker.tiers[0]
        for i, ((c, g), (up,)) in enumerate(zip(entries, promote)):
            held = host.holds(worker.kv.header(kv.ref(c, g)), Placement(up.slot))
            assert held == (i != bad), f"file {i}: promoted={held}"
        # The promoted entries restore from host memory, byte for byte.
        good = [i for i in range(FILES) if i != bad]
        job = LoadJob("h", tuple(LoadEntry(kv.ref(*entries[i]), tuple(enumerate(kv.ids[entries[i][1]][entries[i][0]])),
                                           TierSlot(0, promote[i][0].slot)) for i in good))
        kv.zero()
        assert load(kv, worker, job)
        got = kv.snapshot()
        for i in good:
            c, g = entries[i]
            n = kv.pages[g].page_bytes * len(kv.ids[g][c])
            offset = sum(kv.pages[g].page_bytes * len(kv.ids[g][cc]) for cc in range(c))
            assert got[g][offset:offset + n].equal(want[g][offset:offset + n]), f"file {i}"
    finally:
        worker.shutdown()


def test_a_load_does_not_wait_for_its_promotion_and_a_load_meanwhile_reads_the_queued_copy(
        kv, tmp_path, monkeypatch):
    """With the host tier's writes held, a load from files that promotes every entry into host
    memory still finishes; a second load, planned from the host slots while those promotions are
    queued, restores the exact bytes from the queued copies; once released, the slots hold them."""
    import threading

    from offload.store.cpu import CpuData

    worker, indices = build(kv, [{"store": "cpu", "cpu_bytes": 8 << 20},
                                 {"store": "fs", "path": str(tmp_path / "c")}], 4)
    release, real_put = threading.Event(), CpuData.put

    def held_put(self, *a, **k):
        assert release.wait(30), "promotion held past the test's deadline"
        return real_put(self, *a, **k)
    try:
        store(kv, worker, 1)
        want = kv.snapshot()
        entries = kv.entries()
        promote = [(TierSlot(0, indices[0].reserve(g, kv.keys[c], kv.keys[c - 1] if c else None).slot),)
                   for c, g in entries]
        monkeypatch.setattr(CpuData, "put", held_put)
        kv.zero()
        assert load(kv, worker, job_from(kv, 1, promote)), "the load waited for its promotions"
        assert all(not f.done() for f in worker.stores.in_flight) and len(worker.stores.in_flight) == FILES
        kv.zero()
        host_job = LoadJob("h", tuple(LoadEntry(kv.ref(c, g), tuple(enumerate(kv.ids[g][c])), up)
                                      for (c, g), (up,) in zip(entries, promote)))
        assert load(kv, worker, host_job)
        assert all(a.equal(b) for a, b in zip(kv.snapshot(), want))
        release.set()
        assert worker.stores.drain(30) == 0
        host = worker.tiers[0]
        assert all(host.holds(worker.kv.header(kv.ref(c, g)), Placement(up.slot))
                   for (c, g), (up,) in zip(entries, promote))
    finally:
        release.set()
        worker.shutdown()


def test_a_promotion_the_store_pool_no_longer_takes_is_dropped_and_leaves_nothing_held(kv, tmp_path):
    """The store threads gone under a load's promotion (shutdown racing it): the promotion is a
    reported drop, the chunk is back to its one holder, and no pending bytes or queued copy remain."""
    from offload.store.base import HostChunk
    from offload.store.buffers import BufferPool

    worker, indices = build(kv, [{"store": "cpu", "cpu_bytes": 8 << 20},
                                 {"store": "fs", "path": str(tmp_path / "c")}], 4)
    try:
        c, g = kv.entries()[0]
        header = worker.kv.header(kv.ref(c, g))
        up = TierSlot(0, indices[0].reserve(g, kv.keys[c], None).slot)
        chunk = HostChunk.pooled(BufferPool(), header.payload_len)
        worker.stores.pool.shutdown(wait=True)
        assert worker.stores.promote(up, header, chunk) is False
        assert chunk.refs == 1 and worker.stores.pending_bytes == 0
        assert worker.writes.queued_copy(0, header) is None
        assert (0, header.group, bytes(header.key)) in worker.stores.take_dropped()
    finally:
        worker.shutdown()


def _ramfs(path: Path) -> str | None:
    """Mount a ramfs (a filesystem that refuses O_DIRECT) at `path`; why not, where it cannot be."""
    import subprocess

    path.mkdir()
    r = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(path)], capture_output=True, text=True)
    return None if r.returncode == 0 else f"cannot mount a ramfs here: {r.stderr.strip() or r.returncode}"


def test_the_default_reads_with_o_direct_where_the_filesystem_takes_it_and_buffered_where_it_refuses(kv, tmp_path):
    """No `direct_reads` key: every load is an O_DIRECT read where the filesystem takes one
    (the disk under tmp_path), and where it refuses (ramfs) the first read falls back and every
    later one is buffered; the restored bytes are exact either way."""
    from offload.store.buffers import probe_o_direct

    places = {"disk": tmp_path / "disk"}
    ram = tmp_path / "ram"
    why = _ramfs(ram)
    if why is None:
        places["ramfs"] = ram
    try:
        for name, where in places.items():
            worker, indices = build(kv, [{"store": "fs", "path": str(where / "c")}], 4)
            try:
                store(kv, worker, 0)
                want = kv.snapshot()
                kv.zero()
                assert load(kv, worker, job_from(kv, 0, req=f"{name}-1"))
                assert load(kv, worker, job_from(kv, 0, req=f"{name}-2"))
                assert all(a.equal(b) for a, b in zip(kv.snapshot(), want)), f"{name}: restored bytes differ"
                data = worker.tiers[0]
                takes_direct = probe_o_direct(where / "probe")
                assert not (name == "ramfs" and takes_direct), "ramfs has no O_DIRECT"
                if takes_direct:
                    assert (data.direct_read_count, data.buffered_read_count) == (2 * FILES, 0), name
                else:
                    assert data.direct_read_count == 0 and data.buffered_read_count == 2 * FILES, name
                    assert data.direct_reads is False, "a refusal switches the tier to buffered reads"
            finally:
                worker.shutdown()
                for ix in indices:
                    ix.close()
    finally:
        if why is None:
            import subprocess

            subprocess.run(["umount", "-l", str(ram)], check=False)  # lazily: a ledger log may close late
    if why is not None:
        pytest.skip(f"the disk half ran; {why}")

