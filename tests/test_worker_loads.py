"""The worker half's load path on real files and real CPU pages: a request's
files load in parallel on the load threads, the request finishes exactly once,
after its last file, and one bad file fails the whole request (a recompute),
never a partial restore reported as success."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from offload.config import parse_config
from offload.connector.metadata import FileRef, LoadJob, OffloadMetadata, StoreJob
from offload.connector.worker import WorkerSide
from offload.planner import GroupKind, GroupSpec, HybridOffloadPlanner
from offload.store.fs import FileStore, FsData

FP = bytes(range(32))
BLOCK, CHUNK, BLOCKS = 16, 64, 80
OK, BAD = 30, 60  # first destination block of each request: disjoint ranges
SHAPE = (2, BLOCKS, BLOCK, 2, 32)  # K/V, blocks, tokens, heads, head size (bf16-sized bytes as uint8)


def _worker(tmp_path: Path, seed: int) -> tuple[WorkerSide, torch.Tensor]:
    page_bytes = 2 * BLOCK * 2 * 32
    planner = HybridOffloadPlanner([GroupSpec(GroupKind.FULL_ATTENTION, BLOCK, page_bytes, 1)], CHUNK)
    cfg = parse_config({"store": "fs", "path": str(tmp_path), "hybrid_chunk_size": CHUNK, "io_threads": 4})
    store = FileStore.open(str(tmp_path), FP)
    w = WorkerSide(cfg, planner, FP, lambda device: FsData(store), [["layer.0"]])
    kv = torch.randint(0, 256, SHAPE, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    w.register_kv_caches({"layer.0": kv}, BLOCKS, {"model": "test"})
    return w, kv


def _ref(chunk: int) -> FileRef:
    key = bytes([chunk + 1]) * 32
    parent = bytes([chunk]) * 8 if chunk else bytes(8)
    return FileRef(0, GroupKind.FULL_ATTENTION, key, chunk * CHUNK, (chunk + 1) * CHUNK, CHUNK // BLOCK, parent)


def _blocks(chunk: int, base: int) -> tuple[int, ...]:
    n = CHUNK // BLOCK
    return tuple(range(base + chunk * n, base + (chunk + 1) * n))


def _finish(w: WorkerSide, want: set[str], timeout_s: float = 30) -> tuple[set[str], set[str]]:
    done: set[str] = set()
    failed: set[str] = set()
    deadline = time.monotonic() + timeout_s
    while done != want and time.monotonic() < deadline:
        r = w.get_transfer_results()
        assert not (r.finished_recving & done), "a request reported finished twice"
        done |= r.finished_recving
        failed |= r.failed_recving
        time.sleep(0.01)
    return done, failed


def test_parallel_file_loads_restore_every_page_and_fail_whole_requests(tmp_path: Path) -> None:
    chunks = 6
    src, src_kv = _worker(tmp_path, seed=1)
    stored = [*range(chunks), chunks + 1]
    src.wait_for_save(OffloadMetadata(stores=[StoreJob("w", _ref(c), _blocks(c % chunks, 1)) for c in stored]))
    src.shutdown()
    assert src.counters.files_written == len(stored)
    bad = FileStore.open(str(tmp_path), FP).file_path(0, _ref(chunks + 1).key)
    raw = bytearray(bad.read_bytes())
    raw[-1] ^= 0xFF  # one payload bit: the checksum fails
    bad.write_bytes(bytes(raw))

    dst, dst_kv = _worker(tmp_path, seed=2)
    before = dst_kv.clone()
    # "ok": every good chunk into blocks OK..; "bad": three files, the middle one corrupt;
    # "refused": failed by the scheduler before any I/O.
    jobs = [LoadJob("ok", tuple(_ref(c) for c in range(chunks)),
                    tuple(tuple(enumerate(_blocks(c, OK))) for c in range(chunks)))]
    jobs.append(LoadJob("bad", (_ref(0), _ref(chunks + 1), _ref(1)),
                        tuple(tuple(enumerate(_blocks(c, BAD))) for c in range(3))))
    jobs.append(LoadJob("refused", (), (), fail_reason="allocation mismatch"))
    dst.start_load_kv(OffloadMetadata(loads=jobs))
    done, failed = _finish(dst, {"ok", "bad", "refused"})
    assert done == {"ok", "bad", "refused"} and failed == {"bad", "refused"}

    n = CHUNK // BLOCK
    restored = dst_kv[:, OK:OK + chunks * n]
    assert torch.equal(restored, src_kv[:, 1:1 + chunks * n]), "a restored page differs from the stored one"
    untouched = [b for b in range(BLOCKS) if not (OK <= b < OK + chunks * n or BAD <= b < BAD + 3 * n)]
    assert torch.equal(dst_kv[:, untouched], before[:, untouched]), "a load wrote outside its blocks"
    assert dst.counters.bytes_read >= chunks * n * dst.pages[0].page_bytes
    assert sum(dst.counters.chunk_misses.values()) >= 1

    stats = dst.recorder.take()
    assert stats is not None
    failures = {k.split("|")[-1]: v for k, v in stats.data["c"]["kvoffload_failed_loads"].items() if v}
    assert failures == {"corrupt": 1, "allocation mismatch": 1}, failures
    samples = [x for v in stats.data["h"]["kvoffload_load_seconds"].values() for x in v]
    assert len(samples) == 1  # one successful request, observed once, after its last file
    dst.shutdown()
