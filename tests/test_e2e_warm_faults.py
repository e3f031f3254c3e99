"""Faults during warm start, on real vLLM engines (the tiny hybrid, host memory over files:
configs/hybrid-tiered.json). A cold engine stores three prompts; three copies of its directory then
each meet one kind of fault while a new engine warm-starts on it:

* damaged entries: one attention file corrupt (a payload byte flipped), one deleted after the
  cold engine recorded it in the ledger (warm start finds it gone), one whose reads fail with EIO
  (tests/faults/faulty_connector.py at the read call: the suite runs as root, for whom a
  `chmod 000` file is still readable). Each is counted under its reason, none of them reaches host
  memory, and the engine serves every prompt with the reference's tokens (a request whose lookup
  was offered a damaged entry's slot before the failure was reported recomputes), then serves them
  again from host memory. The connector's unit tests (tests/test_connector_units.py) follow a
  corrupt file through the plan's slots;
* the engine killed (SIGKILL) while warm start reads (each file read slowed to 0.5 s), then started
  again on the same directory: `kvoffload fsck` finds nothing damaged before and after, and the
  second warm start completes, serving the prompts from host memory;
* a small host memory (8 MiB, a quarter of it for warm start): warm start stops at its share of it,
  and the engine serves every prompt;
* a full disk while warm start reads: every store to the files fails with ENOSPC
  (tests/faults/faulty_connector.py's `enospc_while`, injected at the file tier's write: a CI runner
  may not mount a small filesystem) while warm start's reads, slowed to SLOW_READ_S each, are still
  running. The engine serves new prompts (stored in host memory only: the stores to the files
  counted `no_space`, no file written), warm start completes with no failure, and a pass after it
  serves the cold engine's prompts and the new ones from host memory with the reference's tokens;
  `kvoffload fsck` finds the directory sound. (The injection fails the chunk files' writes only:
  the ledger's appends still land, as they would on a disk with a little room left.)

The reference is an engine with the do-nothing connector (tests/noop_connector.py), every prompt
computed. Engine starts: 6 (the cold engine beside the reference, then the three faults side by
side, then the restart after the kill), and 3 for the full disk (its own cold engine, reference and
restart, one after the other).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import time
from pathlib import Path

import pytest

from conftest import CHUNK, REPO, engine_args, layouts, random_prompt, shipped_config, side_by_side
from harness.cli import run_cli
from harness.client import metric_by_label, metric_sum
from harness.engine import RunSpec, run_engine, start_engine
from offload.keys import chunk_keys, request_root
from offload.store.cachedir.paths import LAYOUT_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.long]

rng = random.Random(4646)
PROMPTS = [random_prompt(rng, n) for n in (650, 820, 1000)]
KICK = random_prompt(rng, CHUNK // 2)  # shorter than a chunk: nothing to look up, nothing stored
HITS = [(len(p) - 1) // CHUNK * CHUNK for p in PROMPTS]
NEW = [random_prompt(rng, n) for n in (700, 900)]  # drawn after the rest: theirs stay as they were
ATTN = 1  # Qwen3-Next's groups: 0 the GDN states, 1 full attention
MAX_TOKENS = 12
SMALL_CPU, SMALL_SHARE = 8 << 20, 0.25
SLOW_READ_S = 0.5
FULL_SLOW_READ_S = 0.2  # the full disk's warm start: ~20 entries, ~4 s, the new prompts' pass well inside
FAULTS_ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


def spec(models_dir, kv: dict, order: list[list[int]], **kw) -> RunSpec:
    return RunSpec(str(models_dir / "qwen3-next-tiny"), [*PROMPTS, KICK], kv, MAX_TOKENS, engine_args(True),
                   order=order, **kw)


def tiered(path: Path, faulty: bool = False, cpu_bytes: int | None = None, **extra) -> dict:
    kv = copy.deepcopy(shipped_config("hybrid-tiered.json", path))
    kv["kv_connector_extra_config"].update(extra)
    if cpu_bytes is not None:
        kv["kv_connector_extra_config"]["tiers"][0]["cpu_bytes"] = cpu_bytes
    if faulty:
        kv["kv_connector_module_path"] = "faults.faulty_connector"
    return kv


def attn_file(cache: Path, prompt: list[int], chunk: int) -> Path:
    """The attention file of `prompt`'s chunk `chunk`, from its key."""
    [(name, lay)] = list(layouts(cache).items())
    k = chunk_keys(request_root(bytes.fromhex(lay["base_fingerprint"])), prompt, CHUNK)[chunk]
    return cache / LAYOUT_DIR / name / f"g{ATTN}" / k.hex()[:2] / f"{k.hex()}.kv"


def fsck(cache: Path) -> tuple[int, str]:
    r = run_cli("fsck", str(cache), "-q")
    return r.returncode, r.stdout + r.stderr[-2000:]


def restart_after_kill(models_dir, cache: Path, tmp_path: Path) -> dict:
    """An engine on `cache` whose reads are slowed serves the short prompt (gated passes, its metrics
    written at each pass's end) until its warm start has a plan, and is killed (SIGKILL) with the
    plan unfinished; fsck; a new engine on the same directory; fsck again."""
    faults = {"KVOFFLOAD_FAULTS": json.dumps({"slow_read_s": SLOW_READ_S})}
    d = start_engine(spec(models_dir, tiered(cache, faulty=True), [[3]] * 8, gated=True, hold=True,
                          pass_metrics=True), {**FAULTS_ENV, **faults}, tmp_path / "killed-engine")
    at_kill = None
    try:
        for p in range(8):
            d.wait_pass(p)
            m = d.metrics()
            if metric_sum(m, "kvoffload_warm_planned_entries", tier="cpu") > 0:
                at_kill = {k: metric_sum(m, f"kvoffload_warm_{k}", tier="cpu")
                           for k in ("planned_entries", "entries_total", "done")}
                break
            d.release(p + 1)
    finally:
        d.kill()
    fsck_after_kill = fsck(cache)
    again = run_engine(spec(models_dir, tiered(cache), [[3], [0, 1, 2]], pause_s=2.0))
    return {"at_kill": at_kill, "fsck_after_kill": fsck_after_kill, "again": again, "fsck_after": fsck(cache)}


def _faults(models_dir, tmp_path):
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath

    cold_dir = tmp_path / "cold"
    cold_dir.mkdir()
    cold, ref = side_by_side(
        lambda: run_engine(spec(models_dir, tiered(cold_dir), [[0, 1, 2]])),
        lambda: run_engine(spec(models_dir, NOOP, [[0, 1, 2]], skip_prefix_cache=True),
                           env={"PYTHONPATH": pythonpath()}))
    dirs = {name: tmp_path / name for name in ("damaged", "killed", "small")}
    for d in dirs.values():
        shutil.copytree(cold_dir, d)

    damaged = dirs["damaged"]
    corrupt, gone, eio = (attn_file(damaged, PROMPTS[0], 1), attn_file(damaged, PROMPTS[1], 2),
                          attn_file(damaged, PROMPTS[2], 1))
    raw = bytearray(corrupt.read_bytes())
    raw[-1] ^= 0xFF  # a payload byte: the header still reads, the CRC fails
    corrupt.write_bytes(raw)
    gone.unlink()  # the ledger still lists it
    # This one file (its group and shard): the same key names the chunk's state file too, which warm start reads.
    eio_tail = str(eio.relative_to(eio.parents[2])).removesuffix(".kv")
    eio_env = {**FAULTS_ENV, "KVOFFLOAD_FAULTS": json.dumps({"eio_read_keys": [eio_tail]})}
    small_kv = tiered(dirs["small"], cpu_bytes=SMALL_CPU, warm_start_share=SMALL_SHARE)
    small_files = sum(1 for _ in dirs["small"].glob(f"{LAYOUT_DIR}/*/g*/*/*.kv"))
    small_bytes = sum(p.stat().st_size for p in dirs["small"].glob(f"{LAYOUT_DIR}/*/g*/*/*.kv"))
    faulty, small, killed = side_by_side(
        lambda: run_engine(spec(models_dir, tiered(damaged, faulty=True), [[3], [0, 1, 2], [0, 1, 2]],
                                pause_s=2.0), env=eio_env),
        lambda: run_engine(spec(models_dir, small_kv, [[3], [0, 1, 2]], pause_s=2.0)),
        lambda: restart_after_kill(models_dir, dirs["killed"], tmp_path))
    return {"cold": cold, "ref": ref, "damaged": damaged, "corrupt": corrupt, "faulty": faulty, "small": small,
            "small_files": small_files, "small_bytes": small_bytes, "killed": killed}


@pytest.fixture(scope="module")
def runs(prefetched):
    return prefetched(_faults)


def after_restart(run) -> list:
    after = run.by_pass(1)
    return [after[i] for i in range(len(PROMPTS))]


def warm(run, name: str, **labels: str) -> float:
    return run.metric(f"kvoffload_warm_{name}", tier="cpu", **labels)


def reference(runs) -> list[list[int]]:
    ref = runs["ref"]
    assert all(r.cached_tokens == 0 for r in ref.results), "the reference computes every prompt"
    assert [r.output_ids for r in runs["cold"].results] == [r.output_ids for r in ref.results]
    return [r.output_ids for r in ref.results]


@pytest.mark.prefetch.with_args(_faults)
def test_corrupt_missing_and_unreadable_files_during_warm_start_are_counted_and_never_served(runs):
    want = reference(runs)
    run = runs["faulty"]
    served = after_restart(run)
    print(f"\ndamaged: warm failures {metric_by_label(run.metrics, 'kvoffload_warm_failures_total', 'reason')}, "
          f"{warm(run, 'entries_total'):.0f} of {warm(run, 'planned_entries'):.0f} planned copied; restored "
          f"per prompt {[r.restored_by_tier for r in served]}, failed loads {[r.load_failed for r in served]}")
    assert [r.output_ids for r in served] == want, "tokens differ from the reference's"
    # Each damaged entry counted once under its reason; the rest of the plan copied; warm start done.
    assert warm(run, "failures_total", reason="corrupt") == 1
    assert warm(run, "failures_total", reason="missing") == 1
    assert warm(run, "failures_total", reason="io_error") == 1
    assert warm(run, "failures_total") == 3
    assert warm(run, "done") == 1
    assert warm(run, "entries_total") == warm(run, "planned_entries") - 3 > 0
    # Nothing at or behind a damaged chunk came from host memory (or from anywhere): the corrupt chunk
    # 1 of prompt 0, the deleted chunk 2 of prompt 1, the unreadable chunk 1 of prompt 2.
    for r, first_bad in zip(served, (1, 2, 1)):
        assert r.restored_by_tier.get("cpu", 0) <= first_bad * CHUNK, r.restored_by_tier
        assert r.restored_tokens <= first_bad * CHUNK, r.restored_by_tier
    quarantined = list(runs["damaged"].glob(f"{LAYOUT_DIR}/*/quarantine/*"))
    assert [q.name.startswith(runs["corrupt"].name) for q in quarantined] == [True], quarantined
    # What host memory holds is sound: the prompts again (vLLM's prefix cache reset) restore from it
    # what the recompute stored there in place of the corrupt and the deleted chunk, with the
    # reference's tokens. The unreadable file is still there and still fails (a transient error is
    # not quarantined, and a store finds the chunk in the files): its prompt recomputes again.
    again = run.by_pass(2)
    again = [again[i] for i in range(len(PROMPTS))]
    print(f"damaged, pass 3: restored per prompt {[r.restored_by_tier for r in again]}, "
          f"failed loads {[r.load_failed for r in again]}")
    assert [r.output_ids for r in again] == want, "tokens differ from the reference's after the recompute"
    assert [r.restored_by_tier.get("cpu", 0) for r in again[:2]] == HITS[:2]
    assert not any(r.load_failed for r in again[:2])
    assert again[2].restored_tokens <= CHUNK, "nothing at or behind the unreadable chunk restored"


@pytest.mark.prefetch.with_args(_faults)
def test_an_engine_killed_during_warm_start_leaves_the_directory_sound_and_the_next_one_warms(runs):
    want = reference(runs)
    k = runs["killed"]
    print(f"\nkilled: warm start at the kill {k['at_kill']}; fsck exit {k['fsck_after_kill'][0]} after the kill, "
          f"{k['fsck_after'][0]} after the restart; restart: {warm(k['again'], 'entries_total'):.0f} of "
          f"{warm(k['again'], 'planned_entries'):.0f} copied in {warm(k['again'], 'seconds')} s")
    assert k["at_kill"] is not None, "the slowed engine never made a warm start plan in 8 passes"
    assert k["at_kill"]["done"] == 0 and k["at_kill"]["entries_total"] < k["at_kill"]["planned_entries"], \
        f"warm start was not running when the engine was killed: {k['at_kill']}"
    assert k["fsck_after_kill"][0] == 0, k["fsck_after_kill"][1]
    run = k["again"]
    planned = warm(run, "planned_entries")
    assert planned > 0 and warm(run, "entries_total") == planned and warm(run, "failures_total") == 0
    assert warm(run, "done") == 1
    served = after_restart(run)
    assert [r.restored_by_tier.get("cpu", 0) for r in served] == HITS
    assert [r.output_ids for r in served] == want, "tokens differ from the reference's"
    assert not any(r.load_failed for r in run.results)
    assert k["fsck_after"][0] == 0, k["fsck_after"][1]


@pytest.mark.prefetch.with_args(_faults)
def test_warm_start_in_a_small_host_memory_stops_at_its_share_and_the_engine_serves(runs):
    want = reference(runs)
    run = runs["small"]
    capacity = run.metric("kvoffload_capacity_bytes", tier="cpu")
    assert 0 < capacity <= SMALL_CPU
    share = SMALL_SHARE * capacity
    print(f"\nsmall: capacity {capacity:.0f} B, share {share:.0f} B, files {runs['small_files']} "
          f"({runs['small_bytes']} B); warm start planned {warm(run, 'planned_entries'):.0f}, copied "
          f"{warm(run, 'bytes_total'):.0f} B; restored per prompt {[r.restored_by_tier for r in after_restart(run)]}")
    assert runs["small_bytes"] > share, "the files fit the share: nothing to stop at"
    planned = warm(run, "planned_entries")
    assert 0 < planned < runs["small_files"], (planned, runs["small_files"])
    assert 0 < warm(run, "bytes_total") <= share
    assert warm(run, "done") == 1 and warm(run, "failures_total") == 0
    served = after_restart(run)
    assert [r.output_ids for r in served] == want, "tokens differ from the reference's"
    assert not any(r.load_failed for r in run.results)
    assert [r.restored_tokens for r in served] == HITS, "host memory and the files restore every prompt's hit"


# ---- a full disk while warm start reads -------------------------------------------------------------------

ALL = [*PROMPTS, KICK, *NEW]
NEW_I = [len(PROMPTS) + 1 + j for j in range(len(NEW))]


def full_spec(models_dir, kv: dict, order: list[list[int]], **kw) -> RunSpec:
    return RunSpec(str(models_dir / "qwen3-next-tiny"), ALL, kv, MAX_TOKENS, engine_args(True), order=order, **kw)


def kv_files(cache: Path) -> set[str]:
    return {str(p.relative_to(cache)) for p in cache.glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")}


def _full_disk(models_dir, tmp_path):
    """The cold engine stores PROMPTS; the reference computes every prompt; then a restart whose file
    writes fail with ENOSPC (the flag file stays for its whole run) and whose reads are slowed: pass 0
    the short prompt (warm start plans), pass 1 the new prompts while warm start reads, pass 2 the
    short prompt again (its steps publish what the workers counted until then: a worker's counts reach
    the metrics with the next step's output), pass 3 (once warm start had time to finish) everything.
    Its metrics are read at the end of each pass."""
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath

    cache = tmp_path / "cache"
    cache.mkdir()
    # One engine at a time: the full disk's timing needs the warm start slowed, not the machine.
    cold = run_engine(full_spec(models_dir, tiered(cache), [[0, 1, 2]]))
    every = [0, 1, 2, *NEW_I]
    ref = run_engine(full_spec(models_dir, NOOP, [every], skip_prefix_cache=True), env={"PYTHONPATH": pythonpath()})
    files_before = kv_files(cache)
    flag = tmp_path / "disk-full"
    flag.touch()
    faults = {"KVOFFLOAD_FAULTS": json.dumps({"enospc_while": str(flag), "slow_read_s": FULL_SLOW_READ_S})}
    d = start_engine(full_spec(models_dir, tiered(cache, faulty=True), [[3], NEW_I, [3], every], gated=True,
                               pass_metrics=True), {**FAULTS_ENV, **faults}, tmp_path / "full-engine")
    at_pass: list = []

    def between(p: int) -> None:
        at_pass.append(d.metrics())
        if p == 2:  # let warm start finish its reads (one slowed read each) before the last pass
            planned = metric_sum(at_pass[-1], "kvoffload_warm_planned_entries", tier="cpu")
            time.sleep(planned * FULL_SLOW_READ_S + 3.0)

    run = d.wait(between=between)
    return {"cold": cold, "ref": ref, "run": run, "at_pass": at_pass, "files_before": files_before,
            "files_after": kv_files(cache), "fsck": fsck(cache), "every": every}


@pytest.mark.prefetch.with_args(_full_disk)
def test_a_full_disk_during_warm_start_drops_the_stores_and_the_engine_serves_from_sound_host_memory(prefetched):
    r = prefetched(_full_disk)
    ref = r["ref"].by_pass(0)
    assert all(x.cached_tokens == 0 for x in ref.values()), "the reference computes every prompt"
    assert [x.output_ids for x in r["cold"].results] == [ref[i].output_ids for i in range(3)]
    run = r["run"]
    full = r["at_pass"][2]  # the steps right after the new prompts' pass: the disk full, warm start reading

    def at(samples, name: str, **labels: str) -> float:
        return metric_sum(samples, name, **labels)

    print(f"\nfull disk: after the new prompts: warm start {at(full, 'kvoffload_warm_entries_total', tier='cpu'):.0f}"
          f" of {at(full, 'kvoffload_warm_planned_entries', tier='cpu'):.0f} entries, stores dropped "
          f"{metric_by_label(full, 'kvoffload_stores_dropped_total', 'reason')}; at the end: warm start "
          f"{warm(run, 'entries_total'):.0f} of {warm(run, 'planned_entries'):.0f}, failures "
          f"{warm(run, 'failures_total'):.0f}; restored per prompt, last pass "
          f"{[x.restored_by_tier for x in run.by_pass(3).values()]}; files {len(r['files_before'])} before, "
          f"{len(r['files_after'])} after; fsck exit {r['fsck'][0]}")
    # The new prompts' stores had failed when their pass ended (a gated pass lands its stores
    # before it reports itself done); at the short prompt's steps after it they are counted
    # `no_space`, and warm start had not finished: the disk was full while warm start read.
    assert at(full, "kvoffload_stores_dropped_total", tier="fs", reason="no_space") > 0
    assert at(full, "kvoffload_warm_done", tier="cpu") == 0
    assert at(full, "kvoffload_warm_entries_total", tier="cpu") < at(full, "kvoffload_warm_planned_entries",
                                                                     tier="cpu")
    # At the end: `no_space` on the file tier (and the entries chained behind those
    # `parent_dropped`); no store dropped for another reason, no load failed, no entry missed.
    dropped = {k: v for k, v in metric_by_label(run.metrics, "kvoffload_stores_dropped_total", "reason").items() if v}
    assert run.metric("kvoffload_stores_dropped_total", tier="fs", reason="no_space") > 0, dropped
    assert set(dropped) <= {"no_space", "parent_dropped"}, dropped
    assert run.metric("kvoffload_stores_dropped_total", tier="cpu") == 0, dropped
    assert run.metric("kvoffload_failed_loads_total") == 0
    assert run.metric("kvoffload_chunk_misses_total") == 0
    assert not any(x.load_failed for x in run.results)
    # Warm start completed: every planned entry read, verified and put into host memory.
    planned = warm(run, "planned_entries")
    assert planned > 0 and warm(run, "entries_total") == planned and warm(run, "failures_total") == 0
    assert warm(run, "done") == 1
    # No file was written while the disk was full; what was there is sound.
    assert r["files_after"] == r["files_before"]
    assert r["fsck"][0] == 0, r["fsck"][1]
    # The engine served throughout, with the reference's tokens: the new prompts while the disk was
    # full, then everything from host memory (the warmed prompts, and the new ones their first pass
    # stored there), every hit whole.
    new = run.by_pass(1)
    assert [new[i].output_ids for i in NEW_I] == [ref[i].output_ids for i in NEW_I]
    last = run.by_pass(3)
    assert [last[i].output_ids for i in r["every"]] == [ref[i].output_ids for i in r["every"]]
    hits = [*HITS, *((len(p) - 1) // CHUNK * CHUNK for p in NEW)]
    assert [last[i].restored_by_tier.get("cpu", 0) for i in r["every"]] == hits
