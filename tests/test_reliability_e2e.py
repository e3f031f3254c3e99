"""Reliability on real vLLM engines: corruption, failed loads between
lookup and load, foreign format versions, I/O errors, full disks, kill -9,
slow storage, a shared directory under a byte budget.

Engines run through the harness's engine runner (harness/engine.py: passes
the test releases one by one, a hold until killed) on the tiny Qwen3-Next
hybrid (group 0 = GDN state, group 1 = full attention). Faults are injected
in files or, where a file cannot be made to fail at the right moment, by
tests/faults/faulty_connector.py at our storage layer (never in vLLM). The
worker's counts come from the engine's own Prometheus samples. Each test
prints one RELIABILITY line: its row in docs/reliability.md.

Reference outputs are connector-loaded cold runs (loading any KV connector
can flip a near-tie bf16 token; see tests/test_e2e_fs.py); comparisons are exact.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import CHUNK, REPO, engine_args, layouts, random_prompt
from faults.report import record
from harness.engine import EngineRun, RunResult, RunSpec, start_engine
from ledger_instance import true_bytes
from offload.copier import crc32c
from offload.keys import chunk_keys, request_root
from offload.store.cachedir.ledger import PUT, Record, parse, read_lines
from offload.store.cachedir.paths import LAYOUT_DIR, LEDGER_DIR
from offload.store.format import HEADER_LEN

pytestmark = [pytest.mark.e2e, pytest.mark.long]  # `make test` stays within 12 minutes (docs/development.md)

GDN, ATTN = 0, 1
MODEL = "qwen3-next-tiny"
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "VLLM_CPU_KVCACHE_SPACE": "1"}
# Counts a run reports come from its engine's Prometheus samples after its last pass; a store lands
# after its request ended, so runs that count stores or evictions end with a pass of one prompt
# shorter than a chunk (nothing to store or restore), after SETTLE_S idle seconds: its steps report
# what landed meanwhile.
SETTLE_S = 2.0


def kv_config(cache: Path, faulty: bool = False, **extra) -> dict:
    return {"kv_connector": "OffloadConnector",
            "kv_connector_module_path": "faults.faulty_connector" if faulty else "offload.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": "fs", "path": str(cache), **extra}}


def start(models: Path, tmp: Path, name: str, prompts, order, kv=None, faults=None, max_tokens=2,
          extra_args=None, **spec) -> EngineRun:
    """An engine serving `order` (a list of passes) in a process of its own (files under tmp/name)."""
    run_spec = RunSpec(str(models / MODEL), prompts, kv, max_tokens, {**engine_args(True), **(extra_args or {})},
                       order=order, **spec)
    return start_engine(run_spec, {**ENV, "KVOFFLOAD_FAULTS": json.dumps(faults or {})}, tmp / name)


def serve(models, tmp, name, prompts, order, between=None, **kw) -> RunResult:
    return start(models, tmp, name, prompts, order, gated=between is not None, **kw).wait(900, between=between)


def phase(run: RunResult, p: int) -> dict[int, dict]:
    """Pass `p`'s results by prompt index, as dicts."""
    return {i: asdict(r) for i, r in run.by_pass(p).items()}


def counters(run: RunResult) -> dict:
    """The worker's counts, from the engine's Prometheus samples after its last pass."""
    def by_reason(name: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, labels, v in run.metrics:
            if n == name and v:
                out[labels["reason"]] = out.get(labels["reason"], 0) + int(v)
        return out

    return {"chunk_misses": by_reason("kvoffload_chunk_misses_total"),
            "stores_dropped": by_reason("kvoffload_stores_dropped_total"),
            "files_written": int(run.metric("kvoffload_stored_tokens_total", tier="fs")) // CHUNK,
            "evicted": int(run.metric("kvoffload_evictions_total", tier="fs"))}


def files_of(cache: Path, prompt: list[int], group: int) -> list[Path]:
    [(dirname, lay)] = list(layouts(cache).items())
    keys = chunk_keys(request_root(bytes.fromhex(lay["base_fingerprint"])), prompt, CHUNK)
    base = cache / LAYOUT_DIR / dirname / f"g{group}"
    return [base / k.hex()[:2] / f"{k.hex()}.kv" for k in keys]


def fix_header_crc(raw: bytearray) -> None:
    raw[HEADER_LEN - 4:HEADER_LEN] = struct.pack("<I", crc32c(bytes(raw[:HEADER_LEN - 4])))


# ---- corruption, version, vanishing and unreadable files (rows 2, 6, 9) -----------------

CORRUPTIONS = ["bitflip", "truncate", "zero_page", "header_field", "header_crc_only"]
N_CORRUPT = int(os.environ.get("KVOFFLOAD_CORRUPT_FILES", "200"))  # two per prompt: its g0 and g1 files
VERSIONS = [0, 1, 0, 2, 7]  # never FORMAT_VERSION (3)


def corrupt(path: Path, how: str, rng: random.Random) -> None:
    raw = bytearray(path.read_bytes())
    if how == "bitflip":  # one random bit of the payload
        i = rng.randrange(HEADER_LEN, len(raw))
        raw[i] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        raw = raw[: rng.randrange(0, len(raw))]
    elif how == "zero_page":  # a 4 KiB page of zeros, as a torn write or a bad block leaves
        while True:
            off = 4096 * rng.randrange(0, len(raw) // 4096)
            if any(raw[off:off + 4096]):
                break
        raw[off:off + 4096] = bytes(len(raw[off:off + 4096]))
    elif how == "header_field":  # tampered token range, header CRC recomputed to match
        raw[80:88] = struct.pack("<Q", struct.unpack("<Q", raw[80:88])[0] + CHUNK)
        fix_header_crc(raw)
    elif how == "header_crc_only":  # tampered group byte, header CRC left as it was
        raw[12] ^= 1
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def bad_files(models_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rel-bad")
    cache = tmp / "cache"
    rng = random.Random(55)
    n_ver, n_van, n_eio, n_ok = len(VERSIONS), 4, 2, 4
    n_bad = N_CORRUPT // 2
    prompts = [random_prompt(rng, 300) for _ in range(n_bad + n_ver)]
    prompts += [random_prompt(rng, 4 * CHUNK + 80) for _ in range(n_van)]
    prompts += [random_prompt(rng, 300) for _ in range(n_eio + n_ok)]
    idx = {"corrupt": range(n_bad), "version": range(n_bad, n_bad + n_ver)}
    idx["vanish"] = range(idx["version"].stop, idx["version"].stop + n_van)
    idx["eio"] = range(idx["vanish"].stop, idx["vanish"].stop + n_eio)
    idx["ok"] = range(idx["eio"].stop, idx["eio"].stop + n_ok)
    everything = list(range(len(prompts)))
    cold = serve(models_dir, tmp, "cold", prompts, [everything], kv=kv_config(cache))
    # Damage: two files each hit reads (the GDN state at the hit boundary and the
    # attention KV of chunk 0), every kind of damage on both groups. A load reads
    # all its files (in parallel), so pass 1 finds both, and pass 2 restores.
    def read_by_hit(i: int, group: int) -> Path:
        files = files_of(cache, prompts[i], group)
        return files[_hit(prompts[i]) // CHUNK - 1] if group == GDN else files[0]

    damaged = []
    for i in idx["corrupt"]:
        for group in (GDN, ATTN):
            how = CORRUPTIONS[(i + group) % len(CORRUPTIONS)]
            path = read_by_hit(i, group)
            corrupt(path, how, rng)
            damaged.append((i, group, how, path))
    for n, i in enumerate(idx["version"]):  # another format version where a v1 reader looks, valid CRC
        path = read_by_hit(i, n % 2)
        raw = bytearray(path.read_bytes())
        raw[8:10] = struct.pack("<H", VERSIONS[n])
        fix_header_crc(raw)
        path.write_bytes(bytes(raw))
        damaged.append((i, n % 2, f"version {VERSIONS[n]}", path))
    # Attention files: every chunk's (the lookup probes some of them). GDN: the
    # state at the hit boundary, the first one the lookup asks for.
    last = lambda i: files_of(cache, prompts[i], GDN)[_hit(prompts[i]) // CHUNK - 1].stem
    vanish = [{"group": ATTN, "keys": [p.stem for i in idx["vanish"][:2] for p in files_of(cache, prompts[i], ATTN)],
               "how": "delete"},
              {"group": GDN, "keys": [last(i) for i in idx["vanish"][2:3]], "how": "delete"},
              {"group": GDN, "keys": [last(i) for i in idx["vanish"][3:]], "how": "corrupt"}]
    eio_keys = [files_of(cache, prompts[i], ATTN)[0].stem for i in idx["eio"]]
    warm = serve(models_dir, tmp, "warm", prompts, [everything] * 2,
                 kv=kv_config(cache, faulty=True),
                 faults={"vanish_after_lookup": vanish, "eio_read_keys": eio_keys})
    return {"cache": cache, "prompts": prompts, "idx": idx, "cold": cold, "warm": warm, "damaged": damaged,
            "eio_keys": eio_keys}


def _hit(prompt: list[int]) -> int:
    return (len(prompt) - 1) // CHUNK * CHUNK


def test_corrupt_and_foreign_version_files_are_all_detected_counted_and_healed(bad_files):
    b = bad_files
    cold = phase(b["cold"], 0)
    p1, p2 = (phase(b["warm"], k) for k in range(2))
    for i in b["idx"]["corrupt"]:
        assert p1[i]["load_failed"] and p1[i]["restored_tokens"] == 0, f"prompt {i}, pass 1: not refused"
        assert p1[i]["output_ids"] == cold[i]["output_ids"], f"prompt {i}, pass 1: output differs"
    for i in b["idx"]["version"]:
        assert p1[i]["load_failed"] and p1[i]["output_ids"] == cold[i]["output_ids"], f"prompt {i}"
    # Pass 1 found both bad files of each prompt and its recompute stored them again:
    # pass 2 restores them all, identical.
    for i in list(b["idx"]["corrupt"]) + list(b["idx"]["version"]):
        assert p2[i]["restored_tokens"] == _hit(b["prompts"][i]) and not p2[i]["load_failed"], f"prompt {i}: {p2[i]}"
        assert p2[i]["output_ids"] == cold[i]["output_ids"], f"prompt {i}: output differs after healing"
    detected = sum(1 for _, _, _, path in b["damaged"]
                   if list(path.parents[2].glob(f"quarantine/{path.name}.*")))
    c = counters(b["warm"])
    q = list(b["cache"].glob(f"{LAYOUT_DIR}/*/quarantine/*"))
    n = len(b["damaged"])
    # + 1: the GDN state overwritten between lookup and load (next test)
    assert c["chunk_misses"].get("corrupt") == n + 1, c
    assert len(q) == n + 1
    for i in b["idx"]["ok"]:
        assert p1[i]["restored_tokens"] == _hit(b["prompts"][i]) and p1[i]["output_ids"] == cold[i]["output_ids"]
    kinds = {how for _, _, how, _ in b["damaged"]}
    groups = {g for _, g, _, _ in b["damaged"]}
    print(f"\ndamaged files: {n} ({N_CORRUPT} corrupt + {len(VERSIONS)} of other versions), groups {sorted(groups)}, "
          f"kinds {sorted(kinds)}; detected {detected}/{n}; counted corrupt={c['chunk_misses'].get('corrupt')}; "
          f"quarantined {len(q)}")
    assert groups == {GDN, ATTN} and detected == n and n == N_CORRUPT + len(VERSIONS)
    served = len(p1) + len(p2)
    record("2 corruption of files of both groups (bit flip, truncation, zeroed 4 KiB page, tampered header "
           "with and without a matching header CRC)",
           f"{N_CORRUPT} damaged files, both groups' files of {N_CORRUPT // 2} prompts",
           N_CORRUPT, served, 0, "none: every damaged chunk recomputed, re-stored, and restored in pass 2",
           detected=f"{detected - len(VERSIONS)}/{N_CORRUPT}", counted_corrupt=c["chunk_misses"].get("corrupt"))
    record("9 another format version (0, 2, 7) where a v1 reader looks, header CRC valid",
           f"{len(VERSIONS)} files", len(VERSIONS), len(VERSIONS) * 2, 0, "none: refused before any byte is used")


def test_a_file_that_vanishes_or_changes_between_lookup_and_load_is_recomputed(bad_files):
    b = bad_files
    cold, p1, p2 = phase(b["cold"], 0), phase(b["warm"], 0), phase(b["warm"], 1)
    for i in b["idx"]["vanish"]:
        assert p1[i]["load_failed"] and p1[i]["restored_tokens"] == 0, f"prompt {i}"
        assert p1[i]["output_ids"] == cold[i]["output_ids"], f"prompt {i}: output differs"
        assert p2[i]["restored_tokens"] == _hit(b["prompts"][i]) and p2[i]["output_ids"] == cold[i]["output_ids"]
    misses = counters(b["warm"])["chunk_misses"]
    assert misses.get("missing", 0) >= 3 and misses.get("corrupt", 0) >= 1, misses
    n = len(b["idx"]["vanish"])
    print(f"\nfiles deleted (3 prompts) or overwritten (1 prompt) between lookup and load: {n} prompts, "
          f"all recomputed with identical output; chunk misses {misses}")
    record("6 file deleted (attention files of 2 prompts, the GDN state of 1) or overwritten with garbage "
           "(the GDN state of 1) between the scheduler's lookup and the worker's load",
           "storage-layer hook right after the lookup saw the file", n, 2 * n, 0,
           "none: recomputed, re-stored, restored next pass")


def test_unreadable_file_is_a_miss_and_kept(bad_files):
    b = bad_files
    cold, p1 = phase(b["cold"], 0), phase(b["warm"], 0)
    for i in b["idx"]["eio"]:
        assert p1[i]["load_failed"] and p1[i]["output_ids"] == cold[i]["output_ids"]
    misses = counters(b["warm"])["chunk_misses"]
    assert misses.get("io_error") == 2 * len(b["idx"]["eio"]), misses  # every pass
    kept = [k for k in b["eio_keys"] if list(b["cache"].glob(f"{LAYOUT_DIR}/*/g1/*/{k}.kv"))]
    assert len(kept) == len(b["eio_keys"]), "a file that failed with EIO is not quarantined"
    record("3b EIO on read", "injected EIO on every read of 2 files", 4, 4, 0,
           "none: a miss and a recompute; the file is kept (it may be fine)")


def test_no_request_data_in_paths_and_default_modes(bad_files):
    cache = bad_files["cache"]
    names = [p.relative_to(cache).as_posix() for p in cache.rglob("*")]
    pat = re.compile("^" + re.escape(LAYOUT_DIR)
                     + r"(/[0-9a-f]{64}(/layout\.json|/g\d+(/[0-9a-f]{2}(/[0-9a-f]{64}\.kv)?)?"
                     r"|/quarantine(/[0-9a-f]{64}\.kv\.[0-9a-f]{8})?)?"
                     # ledgers are named by host tag, pid and a random tag: nothing from a request
                     r"|/ledger-v1(/[0-9a-f]{8}-\d+-[0-9a-f]{8}\.log|/snapshot-\d{13}-[0-9a-f]{8}\.snap|/lease)?)?$")
    bad = [n for n in names if not pat.match(n)]
    assert not bad, bad[:5]
    modes = {(p.is_dir(), oct(p.stat().st_mode & 0o777)) for p in cache.rglob("*")}
    assert {m for d, m in modes if not d} == {"0o640"}, modes
    record("8 paths and modes after a real run", "-", 1, len(names), 0, "-",
           detail=f"{len(names)} paths: only hex names; modes {sorted(modes)}")
    assert {m for d, m in modes if d} == {"0o750"}, modes


# ---- a full disk (row 3) ------------------------------------------------------------------

def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                       capture_output=True)
    return r.returncode == 0


def _full_disk_run(models_dir, tmp_path):
    """The engine run of the test below, on the session's background lane (tests/conftest.py, PREFETCH)."""
    rng = random.Random(33)
    prompts = [random_prompt(rng, 4 * CHUNK + 100) for _ in range(8)]  # ~2.2 MB of files each
    mnt = tmp_path / "small"
    mounted = _mount_tmpfs(mnt, "6m")
    flag = tmp_path / "disk-full"
    if mounted:
        grow, faults, how = f"mount -o remount,size=256m {mnt}", None, "6 MiB tmpfs"
    else:
        flag.touch()
        grow, faults, how = f"rm {flag}", {"enospc_while": str(flag)}, "ENOSPC injected at commit"
    every = list(range(len(prompts)))
    try:
        # Space returns between the first pass and the second.
        run = serve(models_dir, tmp_path, "full", prompts, [every] * 3,
                    between=lambda p: p == 0 and subprocess.run(grow, shell=True, check=True),
                    kv=kv_config(mnt / "cache", faulty=not mounted), faults=faults)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)])
    return run, prompts, every, how


@pytest.mark.prefetch.with_args(_full_disk_run)
def test_full_disk_drops_and_counts_stores_serves_every_request_and_recovers(prefetched):
    """A cache on a 6 MiB tmpfs (or, where mounting is not permitted, ENOSPC
    injected at commit while a flag file exists) fills up during the first
    pass; space returns before the second; the third restores everything."""
    run, prompts, every, how = prefetched(_full_disk_run)
    p1, p2, p3 = (phase(run, k) for k in range(3))
    c = counters(run)
    dropped = c["stores_dropped"].get("no_space", 0)
    assert dropped > 0, c
    # Every exception the connector catches in a store or a load is counted with reason "error" (and
    # one it did not catch would have failed the run): the full disk raised none.
    errors = {n: run.metric(n, reason="error") for n in ("kvoffload_stores_dropped_total",
                                                         "kvoffload_failed_loads_total")}
    assert not any(errors.values()), f"exceptions in the connector's stores or loads: {errors}"
    for i in every:
        assert p2[i]["output_ids"] == p1[i]["output_ids"] and p3[i]["output_ids"] == p1[i]["output_ids"], i
        assert p3[i]["restored_tokens"] == _hit(prompts[i]) and not p3[i]["load_failed"], f"prompt {i}: {p3[i]}"
    print(f"\nfull disk ({how}): {3 * len(prompts)} requests served, stores dropped no_space={dropped}, "
          f"files written {c['files_written']}; after space returned every prompt restored "
          f"({sum(p3[i]['restored_tokens'] for i in every)} tokens)")
    record(f"3 full disk ({how}), space returned between passes", "ENOSPC on every store once full",
           dropped, 3 * len(prompts), 0, "only the dropped stores, re-stored once space returned",
           stores_dropped_no_space=dropped, corrupt_misses=c["chunk_misses"].get("corrupt", 0))
    assert c["chunk_misses"].get("corrupt", 0) == 0


# ---- kill -9 with stores in flight, and slow storage (rows 1 and 5) ---------------------------

KILL_CYCLES = int(os.environ.get("KVOFFLOAD_ENGINE_KILL_CYCLES", "1"))
DECODE_TOKENS = 48
# Both engines of the decode comparison have the same OpenMP core layout: tests/conftest.py gives every
# test engine VLLM_CPU_NUM_OF_RESERVED_CPU=0 (vLLM would otherwise reserve a core for the scheduler only
# without a connector; docs/operations.md#cpu-machines).


def _decode_tps(results) -> float:
    """Median decode tokens/s per request (time after the first token)."""
    import statistics

    return statistics.median((DECODE_TOKENS - 1) / max(r.wall_s - r.ttft_s, 1e-9) for r in results)


class RssPeak:
    """Peak resident memory of a run's process session (engine core and workers included)."""

    def __init__(self, run: EngineRun) -> None:
        self.run, self.peak, self._stop = run, 0, threading.Event()
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()

    def _loop(self) -> None:
        sid = self.run.proc.pid
        while not self._stop.is_set():
            total = 0
            for d in Path("/proc").iterdir():
                if not d.name.isdigit():
                    continue
                try:
                    if os.getsid(int(d.name)) != sid:
                        continue
                    for ln in (d / "status").read_text().splitlines():
                        if ln.startswith("VmRSS:"):
                            total += int(ln.split()[1]) * 1024
                except (OSError, ValueError):
                    continue
            self.peak = max(self.peak, total)
            time.sleep(0.5)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def test_kill9_with_stores_in_flight_and_slow_storage(models_dir, tmp_path):
    """Every storing engine writes through a slow store path (each commit
    waits 0.5 s, at most 1 MiB of staged stores pending) and is killed with
    SIGKILL (the whole process group) right after its last request, with
    stores in flight. The next engine verifies: outputs identical to the
    connector-loaded cold run, no corrupt load, no temporary file left.
    Decode throughput is compared with a run without the connector."""
    rng = random.Random(77)
    shared = random_prompt(rng, 2 * CHUNK)
    prompts = [shared + random_prompt(rng, 200 + 40 * i) if i % 2 else random_prompt(rng, 700 + 30 * i)
               for i in range(12)]
    every = list(range(len(prompts)))
    cache = tmp_path / "cache"
    # The no-connector run and the first slow-store run serve at the same time, two passes each (24
    # decode samples): on shared cores both then see the same load, and their medians compare.
    base = start(models_dir, tmp_path, "noconn", prompts, [every, every], max_tokens=DECODE_TOKENS)
    base_rss = RssPeak(base)
    reference = None
    tmp_seen = corrupt = restored = served = recomputed = 0
    slow_tps, peaks, dropped = [], [], {}
    for cycle in range(KILL_CYCLES):
        run = start(models_dir, tmp_path, f"kill{cycle}", prompts, [every, every],
                    kv=kv_config(cache, faulty=True, max_pending_store_bytes=1 << 20), hold=True,
                    faults={"slow_commit_s": 0.5}, max_tokens=DECODE_TOKENS)
        rss = RssPeak(run)
        try:
            run.wait_pass(1)
            if cycle == 0:
                base_result = base.wait(900)
                base_peak = base_rss.stop()
                base_tps = _decode_tps(base_result.results)
        finally:
            run.kill()  # SIGKILL to the process group, stores in flight
            peaks.append(rss.stop())
            base.kill()  # exited already, unless something above failed
        killed = run.result()
        served += len(killed.results)
        if reference is None:
            reference = {i: r.output_ids for i, r in killed.by_pass(0).items()}
        for i, r in zip(killed.index_of, killed.results):
            assert r.output_ids == reference[i], f"cycle {cycle}, prompt {i}: output differs after restart"
            restored += r.restored_tokens
            recomputed += r.load_failed
        slow_tps.append(_decode_tps(killed.results))
        # The engine's own Prometheus samples, taken after its last request (before the kill).
        for name, labels, value in killed.metrics:
            if name == "kvoffload_stores_dropped_total":
                dropped[labels.get("reason")] = dropped.get(labels.get("reason"), 0) + int(value)
            if name == "kvoffload_failed_loads_total" and labels.get("reason") == "corrupt":
                corrupt += int(value)
        tmp_seen += len([p for p in cache.rglob("*") if ".tmp" in p.name])
        # SIGKILL while it held after its last pass: its connector's shutdown never ran.
        assert run.proc.returncode == -signal.SIGKILL, "the engine was meant to die without its shutdown"
    final = serve(models_dir, tmp_path, "final", prompts, [every, every], kv=kv_config(cache), max_tokens=DECODE_TOKENS)
    c = counters(final)
    corrupt += c["chunk_misses"].get("corrupt", 0)
    for i, r in zip(final.index_of, final.results):
        assert r.output_ids == reference[i], f"final run, prompt {i}: output differs"
        restored += r.restored_tokens
        recomputed += r.load_failed
    # A store dropped at the kill (or by backpressure) can leave a later chunk without an earlier
    # one: the lookup then offers a hit whose load misses a file ('missing'), a recompute. Never corrupt.
    assert corrupt == 0 and set(c["chunk_misses"]) <= {"missing"}, c
    assert not [p for p in cache.rglob("*") if ".tmp" in p.name], "temporary files left after restart"
    assert restored > 0, "nothing was ever restored: the kill test proves nothing"
    assert dropped.get("backpressure", 0) > 0, f"no store dropped by policy under slow storage: {dropped}"
    ratio = slow_tps[0] / base_tps
    served_after = len(final.results)
    print(f"\nengine kill -9 cycles: {KILL_CYCLES}; requests {served + served_after}; tokens restored {restored}; "
          f"corrupt loads {corrupt}; loads that missed a file and recomputed {recomputed}; "
          f"tmp files seen right after kills {tmp_seen}; decode throughput vs "
          f"no connector, served side by side (slow store path): {ratio:.3f}; peak RSS of killed engines "
          f"{[p >> 20 for p in peaks]} MiB (no connector: {base_peak >> 20} MiB); stores dropped {dropped}")
    record("1b kill -9 of a real engine (process group) with stores in flight", "SIGKILL after the last "
           "request, slow store path (0.5 s per commit) so stores are pending", KILL_CYCLES,
           served + served_after, corrupt, "only stores in flight at the kill; outputs identical after restart",
           tokens_restored=restored)
    record("5 slow storage (0.5 s per commit, 1 MiB pending-store budget)", "sleep before every commit",
           KILL_CYCLES, served, 0, "stores beyond the pending budget dropped by policy",
           decode_throughput_vs_no_connector_side_by_side=round(ratio, 3), peak_rss_mib=[p >> 20 for p in peaks],
           peak_rss_no_connector_mib=base_peak >> 20, stores_dropped=dropped)
    # Bounded memory: staged stores are capped at 1 MiB; the rest is the connector's fixed cost.
    assert max(peaks) <= base_peak + (512 << 20), (peaks, base_peak)
    # Measured 0.993 with equal core layouts (docs/reliability.md, row 5). The machine is shared, so
    # the bound only says "no collapse": a forward step blocked on storage or an unbounded queue would
    # stall decoding entirely. Speed is reported, not asserted.
    assert ratio >= 0.5, f"decode throughput fell to {ratio:.2f} of the no-connector run"


@pytest.mark.long
@pytest.mark.parametrize("cycles", [20])
def test_kill9_real_engine_many_cycles(models_dir, tmp_path, cycles, monkeypatch):
    """The on-demand version of the test above: `pytest -m long` (about 40 s per cycle)."""
    global KILL_CYCLES
    monkeypatch.setattr(sys.modules[__name__], "KILL_CYCLES", cycles)
    test_kill9_with_stores_in_flight_and_slow_storage(models_dir, tmp_path)


# ---- two engines, one directory, one byte budget (row 4) ------------------------------------

SHARED_BUDGET = 32 << 20


def _ledger_account(top: Path) -> tuple[int, int, set[str], int]:
    """What the ledger's records of every instance say of the chunk files, folded in time order as a
    reader folds them (docs/format.md): (writes, removals, files it holds present, writes that landed
    on a file already there: two instances stored one key at once, the second rename replaced the
    first)."""
    records = []
    for log in (top / LEDGER_DIR).glob("*.log"):
        lines, _, _ = read_lines(log, 0)
        records += [r for r in map(parse, lines[1:]) if isinstance(r, Record) and r.rel.endswith(".kv")]
    live: set[str] = set()
    duplicates = 0
    for r in sorted(records, key=lambda r: (r.t, r.op != PUT)):
        if r.op == PUT:
            duplicates += r.rel in live
            live.add(r.rel)
        else:
            live.discard(r.rel)
    puts = sum(r.op == PUT for r in records)
    return puts, len(records) - puts, live, duplicates


def _shared_directory(models_dir, tmp_path, repeats: int) -> None:
    rng = random.Random(404)
    prefixes = [random_prompt(rng, 3 * CHUNK) for _ in range(12)]
    pool = [p + random_prompt(rng, 260 + rng.randrange(200)) for p in prefixes for _ in range(4)]
    handoff = [random_prompt(rng, 3 * CHUNK + 100) for _ in range(3)]
    settle = [len(pool) + len(handoff)]  # a prompt shorter than a chunk (see SETTLE_S)
    prompts = pool + handoff + [random_prompt(rng, CHUNK // 2)]
    ho = list(range(len(pool), len(pool) + len(handoff)))
    cache = tmp_path / "shared"
    kv = kv_config(cache, max_bytes=SHARED_BUDGET)
    order_a = [i for _ in range(repeats) for i in rng.sample(range(len(pool)), len(pool))]
    order_b = [i for _ in range(repeats) for i in rng.sample(range(len(pool)), len(pool))]
    # Passes: [] (the engine is up), the hand-off prompts, the load, the settling prompt.
    a, b = (start(models_dir, tmp_path, f"share-{n}", prompts, [[], ho, order, settle], kv=kv, max_tokens=4,
                  gated=True) for n, order in (("a", order_a), ("b", order_b)))
    top, peak, samples, stop = cache / LAYOUT_DIR, [0], [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], true_bytes(top))
            samples[0] += 1
            time.sleep(0.05)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.monotonic()
    try:
        # A stores the hand-off prompts once both are up; B serves them right after, then both run the load.
        a.wait_pass(0)
        b.wait_pass(0)
        a.release(1)
        a.wait_pass(1)
        time.sleep(0.5)
        a.release(2)
        b.release(1)
        b.wait_pass(1)
        b.release(2)
        for run in (a, b):
            run.wait_pass(2)
        time.sleep(SETTLE_S)
        for run in (a, b):
            run.release(3)
        ra, rb = a.wait(900), b.wait(900)
    finally:
        stop.set()
        t.join()
        a.kill()
        b.kill()
    wall = time.monotonic() - t0
    ca, cb = counters(ra), counters(rb)
    # The budget's own log line: evictions after the engines' last step never reach their metrics.
    evicted = sum(int(n) for run in (ra, rb) for n in re.findall(r"evicted (\d+) files", run.log))
    on_disk = {str(p.relative_to(top)) for p in top.rglob("*.kv")}
    present = len(on_disk)
    written = ca["files_written"] + cb["files_written"]
    # Every serve of a prompt, in either engine, restored or recomputed, gives the same tokens.
    outs: dict[int, list[int]] = {}
    served = 0
    for run in (ra, rb):
        for i, r in zip(run.index_of, run.results):
            served += 1
            assert outs.setdefault(i, r.output_ids) == r.output_ids, i
    handoff_restored = sum(r.restored_tokens for r in rb.by_pass(1).values())
    corrupt = ca["chunk_misses"].get("corrupt", 0) + cb["chunk_misses"].get("corrupt", 0)
    unaccounted = written - present - evicted
    recorded, removed, accounted, duplicates = _ledger_account(top)
    print(f"\nshared directory, 2 engines, budget {SHARED_BUDGET >> 20} MiB, {wall:.0f} s: {served} requests; "
          f"peak {peak[0] / SHARED_BUDGET:.3f} of the budget over {samples[0]} samples; written {written}, "
          f"evicted {evicted}, present {present}, unaccounted {unaccounted}; the ledger: {recorded} written, "
          f"{removed} removed, {duplicates} racing duplicates, {len(accounted - on_disk)} held present but gone; "
          f"misses A {ca['chunk_misses']} B {cb['chunk_misses']}; tokens B restored from A's files {handoff_restored}")
    assert corrupt == 0
    assert evicted > 0, "the budget never had to evict: the test proves nothing"
    assert peak[0] <= 1.05 * SHARED_BUDGET, f"directory reached {peak[0] / SHARED_BUDGET:.3f} of its budget"
    assert handoff_restored > 0, "engine B never used a file engine A stored"
    # The ledger is the count (the engines' counters give files written only to within a file or two:
    # tokens stored / chunk). Every eviction is a record; every file in the directory is in the account
    # folded from the records (a file it missed would let the directory pass its budget unseen); and a
    # file it holds present that is gone can only be a racing duplicate an eviction removed (an
    # overestimate, dropped at its next eviction): nothing went missing otherwise.
    assert removed >= evicted, (removed, evicted)
    assert on_disk <= accounted, sorted(on_disk - accounted)[:5]
    assert len(accounted - on_disk) <= duplicates, (sorted(accounted - on_disk)[:5], duplicates)
    record(f"4 two engines share one directory with a {SHARED_BUDGET >> 20} MiB budget, prefix-heavy load "
           f"({wall:.0f} s)", "concurrent stores, loads and evictions", 1, served, corrupt,
           f"none beyond {duplicates} racing duplicates", peak_of_budget=round(peak[0] / SHARED_BUDGET, 3),
           evicted_files=evicted, cross_instance_tokens_restored=handoff_restored)


def _shared_directory_once(models_dir, tmp_path):
    """The test below (~2 min, two engines), on the session's background lane (tests/conftest.py)."""
    _shared_directory(models_dir, tmp_path, repeats=1)


@pytest.mark.prefetch.with_args(_shared_directory_once)
def test_two_engines_share_a_directory_within_a_byte_budget(prefetched):
    prefetched(_shared_directory_once)


@pytest.mark.long
def test_two_engines_share_a_directory_for_minutes(models_dir, tmp_path):
    _shared_directory(models_dir, tmp_path, repeats=8)
