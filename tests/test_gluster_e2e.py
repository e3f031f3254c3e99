"""Two nodes, one cache directory on a real network filesystem, faults on the way: real vLLM engines on
the tiny hybrid (qwen3-next-tiny), each on its own FUSE mount of one GlusterFS replica-2 volume
(tests/gluster.py), sharing one directory under one byte budget.

- Engine A (node 1) and engine B (node 2) serve conversations (a system prefix shared by the turns, each
  turn extending the one before) at the same time, in different orders, A twelve times (vLLM's own prefix cache
  emptied in between); A first stores hand-off prompts that only it serves. A reference engine, on a
  local directory with the connector loaded but reading no cache at all (`skip_prefix_cache`), gives
  every prompt's tokens.
- While they serve, the test injects: engine B killed -9 while it stores, and in turn both bricks full
  (ENOSPC) and freed, a brick killed (SIGKILL) and restarted (self-heal), the whole volume stopped and
  started.
- Engine C then starts on node 2 and serves the hand-off prompts and the conversations: what A stored on
  node 1 comes back on node 2.

Asserted: every token of every request (A, B before its kill, C) equals the reference's; no corrupt
load (the engines' own Prometheus samples); a failed load is a miss and a recompute (its tokens are
the reference's too); every fault came while A served; the budget evicts, and the directory, walked
through node 1 while the engines run, stays within the budget plus 2 MiB (each node reads the other's
records up to a second late, through the mount's attribute cache, plus its 1 s poll: the other's stores
meanwhile); C restores the hand-off prompts A stored whose files are still there; after the run
`kvoffload fsck` finds no corrupt file, and after `--repair` (chain holes a dropped store left) it is
clean; the ledger's total is within 5% of a walk. The counts are printed as one JSON line (GLUSTER-E2E).
"""

from __future__ import annotations

import json
import os
import random
import re
import threading
import time
from pathlib import Path

import pytest

import gluster
from conftest import CHUNK, REPO, engine_args, random_prompt
from harness.cli import CliRun, run_cli
from harness.client import wait_until
from harness.engine import EngineRun, RunSpec, start_engine
from offload.store.cachedir.paths import LAYOUT_DIR

pytestmark = [pytest.mark.e2e, pytest.mark.long]

MODEL = "qwen3-next-tiny"
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), "VLLM_CPU_KVCACHE_SPACE": "1"}
BUDGET = 10 << 20
PROBLEM_KINDS = ("corrupt", "unauthenticated", "foreign-key", "orphaned-tmp", "unknown-layout", "chain-hole")
OVERSHOOT = 2 << 20  # what the other node stores in the second or two before this one reads its records
TOKENS = 4
# A's conversation passes (each a turn order): enough that A still serves when the last fault comes
SEEDS = (1, 2, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
LAST = len(SEEDS) + 1  # A's last conversation pass (pass 0 starts it, pass 1 stores the hand-off prompts)


@pytest.fixture(scope="module")
def volume(tmp_path_factory):
    why = gluster.unavailable()
    if why:
        pytest.skip(why)
    # tmpfs bricks, so that the full-brick fault needs a filler of 256 MiB, not of the host's disk
    v = gluster.Volume(tmp_path_factory.mktemp("gluster"), brick_bytes=(256 << 20, 256 << 20)).start()
    try:
        yield v
    finally:
        v.close()


def kv(path: Path, **extra) -> dict:
    return {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": "fs", "path": str(path), **extra}}


def start(models: Path, tmp: Path, name: str, prompts, order, config, **spec) -> EngineRun:
    return start_engine(RunSpec(str(models / MODEL), prompts, config, TOKENS, engine_args(True), order=order, **spec),
                        ENV, tmp / name)


def walk_bytes(top: Path) -> int | None:
    """Bytes of the files under the layout directory but the ledger and temporaries; None while the volume
    cannot be read."""
    total = 0
    try:
        for d, dirs, names in os.walk(top, onerror=lambda e: (_ for _ in ()).throw(e)):
            if d == str(top) and "ledger-v1" in dirs:
                dirs.remove("ledger-v1")
            for n in names:
                if ".tmp" not in n:
                    try:
                        total += os.lstat(os.path.join(d, n)).st_size
                    except FileNotFoundError:
                        pass
    except OSError:
        return None
    return total


def drift_detail(top: Path, wall0: float) -> dict:
    """Which files the ledger and a walk disagree on, with their mtimes (s since the run began): where the
    ledger drifted, the fault it drifted at."""
    from offload.store.cachedir.budget import DirBudget
    from offload.store.cachedir.paths import LEDGER_DIR, is_tmp_name

    acct = DirBudget(top, read_only=True)
    acct.ensure_loaded()
    walked: dict[str, tuple[int, float]] = {}
    for d, dirs, names in os.walk(top):
        if d == str(top) and LEDGER_DIR in dirs:
            dirs.remove(LEDGER_DIR)
        for n in names:
            if not is_tmp_name(n):
                st = os.lstat(os.path.join(d, n))
                walked[os.path.relpath(os.path.join(d, n), top)] = (st.st_size, st.st_mtime)
    led = set(acct.index.entries)
    only_walk = sorted(set(walked) - led)
    only_ledger = sorted(led - set(walked))
    return {"only_walk": len(only_walk), "only_walk_bytes": sum(walked[r][0] for r in only_walk),
            "only_walk_mtime_s": sorted(round(walked[r][1] - wall0, 1) for r in only_walk)[:30],
            "only_ledger": len(only_ledger), "only_ledger_bytes": sum(acct.index.entries[r].size for r in only_ledger),
            "only_ledger_t_s": sorted(round(acct.index.entries[r].t - wall0, 1) for r in only_ledger)[:30]}


def served(run: EngineRun) -> int:
    return len(run.served())


def cli(*args: str) -> CliRun:
    """`kvoffload ARGS` in a process of its own (harness/cli.py)."""
    return run_cli(*args, env=ENV, timeout_s=600)


def test_two_nodes_share_one_directory_through_brick_volume_disk_and_engine_faults(volume, models_dir, tmp_path):
    rng = random.Random(35)
    convs = []
    for _ in range(8):
        turn = random_prompt(rng, 2 * CHUNK)  # the system prompt and history the turns share
        turns = []
        for _t in range(3):
            turn = turn + random_prompt(rng, 60 + rng.randrange(120))  # the last reply and a new question
            turns.append(turn)
        convs.append(turns)
    conv_prompts = [t for turns in convs for t in turns]
    handoff = [random_prompt(rng, 3 * CHUNK + 40) for _ in range(4)]
    prompts = conv_prompts + handoff + [random_prompt(rng, CHUNK // 2)]
    ho = list(range(len(conv_prompts), len(conv_prompts) + len(handoff)))
    settle = [len(prompts) - 1]

    def turn_order(seed: int) -> list[int]:  # every conversation's turns in order, conversations interleaved
        r = random.Random(seed)
        left = {c: 0 for c in range(len(convs))}
        out = []
        while left:
            c = r.choice(sorted(left))
            out.append(c * 3 + left[c])
            left[c] += 1
            if left[c] == 3:
                del left[c]
        return out

    n1, n2 = (m / "kvcache" for m in volume.mounts)
    n1.mkdir(mode=0o750)
    wait_until(n2.is_dir, 10, "the cache directory on node 2")
    top = n1 / LAYOUT_DIR
    shared = kv(n1, max_bytes=BUDGET), kv(n2, max_bytes=BUDGET)
    t0 = time.monotonic()
    wall0 = time.time()
    ref = start(models_dir, tmp_path, "reference", prompts, [list(range(len(prompts)))], kv(tmp_path / "refcache"),
                skip_prefix_cache=True)
    # A: up, then the hand-off prompts, then twelve passes of the conversations (vLLM's prefix cache emptied in
    # between, so later passes restore from the directory), each ending with the hand-off prompts again (their
    # loads keep them recent: the budget evicts other files first), then a settling prompt. B: up, then one pass.
    a = start(models_dir, tmp_path, "node1-a", prompts,
              [[], ho, *(turn_order(k) + ho for k in SEEDS), settle], shared[0], gated=True)
    b = start(models_dir, tmp_path, "node2-b", prompts, [[], turn_order(3)], shared[1], gated=True, hold=True)
    faults: list[dict] = []
    peak, samples, stop = [0], [0], threading.Event()
    timeline: list[tuple[float, int]] = []  # (s since start, bytes) of the walks above the budget

    def sample():
        while not stop.is_set():
            got = walk_bytes(top)
            if got is not None:
                peak[0] = max(peak[0], got)
                samples[0] += 1
                if got > BUDGET:
                    timeline.append((round(time.monotonic() - t0, 1), got))
            stop.wait(0.2)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        a.wait_pass(0)
        a.release(1)
        a.wait_pass(1)  # A's hand-off prompts are stored (a gated pass lands its stores)
        b.wait_pass(0)
        sampler.start()
        for p in range(2, LAST + 1):
            a.release(p)  # A serves its passes without a stop: the faults below come while it serves
        b.release(1)

        def after(n: int, what: str) -> int:
            """Until A has served `n` more requests (or has none left); returns how many it served."""
            base = served(a)
            wait_until(lambda: served(a) >= base + n or a.passes_done() > LAST or a.proc.poll() is not None, 600,
                       what, interval_s=0.2)
            return served(a) - base

        # 1. engine B killed -9 while it stores (its pass stores every new chunk), beside the faults below
        def kill_b() -> None:
            wait_until(lambda: served(b) >= 6 or b.proc.poll() is not None, 900, "B's load", interval_s=0.1)
            b.kill()
            faults.append({"fault": "engine B killed -9 while storing", "served_before": served(b),
                           "at_s": round(time.monotonic() - t0, 1)})
        killer = threading.Thread(target=kill_b, daemon=True)
        killer.start()
        wait_until(lambda: served(a) >= len(ho) + 2, 900, "A's load to begin", interval_s=0.1)
        # 2. both bricks full, then freed
        t = time.monotonic()
        filler = volume.fill()
        full = not volume.writable(volume.mounts[1])  # node 2 is refused too
        n = after(2, "A to serve on a full volume")
        took = volume.unfill(filler)
        faults.append({"fault": "bricks full (ENOSPC), then freed", "at_s": round(t - t0, 1),
                       "served_meanwhile": n, "refused_writes": full,
                       "s": round(time.monotonic() - t, 1), "writable_again_s": round(took, 1)})
        # 3. a brick killed mid-run, restarted, healed
        t = time.monotonic()
        pid = volume.kill_brick(1)  # the second: with client quorum the first must stay for writes
        n = after(3, "A to serve through a dead brick")
        volume.start_force()
        wait_until(lambda: volume.heal_pending() == 0, 120, "self-heal", interval_s=1)
        faults.append({"fault": "brick killed and restarted", "at_s": round(t - t0, 1), "pid": pid,
                       "served_meanwhile": n, "s": round(time.monotonic() - t, 1)})
        # 4. the volume stopped under load and started again
        t = time.monotonic()
        volume.stop()
        n = after(2, "A to serve while the volume is stopped")
        volume.start_again()
        faults.append({"fault": "volume stopped and started", "at_s": round(t - t0, 1), "served_meanwhile": n,
                       "s": round(time.monotonic() - t, 1)})
        killer.join(900)
        a.wait_pass(LAST)
        time.sleep(2.0)  # stores of A's last pass land; the settling pass reports them
        a.release(LAST + 1)
        ra = a.wait(900)
        rref = ref.wait(900)
    finally:
        stop.set()
        for run in (a, b, ref):
            run.kill()
    rb = b.result()
    if sampler.is_alive():
        sampler.join()
    # The hand-off files A stored before every fault: those still present must come back on node 2.
    from offload.keys import chunk_keys, request_root

    lay = json.loads(next(top.glob("*/layout.json")).read_text())
    fpdir = next(top.glob("*/layout.json")).parent
    root = request_root(bytes.fromhex(lay["base_fingerprint"]))
    def there(g: int, k) -> bool:
        return (fpdir / f"g{g}" / k.hex()[:2] / f"{k.hex()}.kv").exists()

    # three chunks restore with their attention KV (group 1) and the GDN state at the third one's end (group 0)
    whole = [all(there(1, k) for k in chunk_keys(root, handoff[i], CHUNK)[:3])
             and there(0, chunk_keys(root, handoff[i], CHUNK)[2]) for i in range(len(handoff))]
    c = start(models_dir, tmp_path, "node2-c", prompts, [ho + turn_order(5)], shared[1])
    try:
        rc = c.wait(900)
    finally:
        c.kill()
    wall = time.monotonic() - t0
    reference = {i: r.output_ids for i, r in rref.by_pass(0).items()}
    wrong, failed = [], 0
    for name, run in (("A", ra), ("B", rb), ("C", rc)):
        for i, r in zip(run.index_of, run.results):
            failed += r.load_failed
            if r.output_ids != reference[i]:
                wrong.append((name, i, r.output_ids, reference[i]))

    def misses(run) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, labels, v in run.metrics:
            if n == "kvoffload_chunk_misses_total" and v:
                out[labels["reason"]] = out.get(labels["reason"], 0) + int(v)
        return out

    def dropped(run) -> dict[str, int]:
        out: dict[str, int] = {}
        for n, labels, v in run.metrics:
            if n == "kvoffload_stores_dropped_total" and v:
                out[labels.get("reason", "")] = out.get(labels.get("reason", ""), 0) + int(v)
        return out

    cross = sum(r.restored_tokens for i, r in rc.by_pass(0).items() if i in ho) + rb.restored_tokens
    # B's first pass can restore only what A stored (vLLM's own prefix cache holds B's own prefixes)
    cross_requests = sum(1 for i, r in rc.by_pass(0).items() if i in ho and r.restored_tokens) + sum(
        1 for r in rb.results if r.restored_tokens)
    # The budget's own log lines: evictions after an engine's last step never reach its metrics.
    evicted = sum(int(n) for run in (ra, rb, rc) for n in re.findall(r"evicted (\d+) files", run.log))
    restored_ho = {i: r.restored_tokens for i, r in rc.by_pass(0).items() if i in ho}
    # After: fsck through node 2 (no engine runs), then the ledger against a walk.
    fsck1 = cli("fsck", str(n2))  # every problem on its own line (the report's), then the summary
    fsck2 = cli("fsck", str(n2), "--repair", "-q") if fsck1.returncode != 0 else fsck1
    fsck3 = cli("fsck", str(n2), "-q")
    st = cli("stats", str(n1), "--json")
    assert st.returncode == 0 and st.stdout.strip(), (st.returncode, st.stdout[-2000:], st.stderr[-4000:])
    stats = json.loads(st.stdout)
    walked = stats["ledger"]["walk"]["bytes"]
    drift = stats["ledger"]["drift_bytes"]
    report = {
        "wall_s": round(wall), "budget": BUDGET, "requests": len(ra.results) + len(rb.results) + len(rc.results),
        "requests_by_engine": {"A": len(ra.results), "B_before_kill": len(rb.results), "C": len(rc.results)},
        "restored_tokens": {"A": ra.restored_tokens, "B": rb.restored_tokens, "C": rc.restored_tokens},
        "cross_node_restored_tokens": cross, "cross_node_restored_requests": cross_requests,
        "evicted_files": evicted, "handoff_restored": restored_ho, "handoff_whole_before_c": whole,
        "faults": faults, "failed_loads": failed, "misses": {"A": misses(ra), "C": misses(rc)},
        "stores_dropped": {"A": dropped(ra), "C": dropped(rc)}, "tokens_wrong": len(wrong),
        "peak_of_budget": round(peak[0] / BUDGET, 3), "samples": samples[0], "over_budget_walks": timeline[:20],
        "fsck": [fsck1.returncode, fsck2.returncode, fsck3.returncode], "fsck_first": fsck1.stdout.strip()[-600:],
        "fsck_problems": [ln for ln in fsck1.stdout.splitlines() if ln.split(" ")[0] in PROBLEM_KINDS][:20],
        "ledger_bytes": walked + drift, "walk_bytes": walked, "ledger_drift_bytes": drift,
        "ledger_drift": drift_detail(top, wall0),
        "ledger_append_failures_logged": {n: run.log.count("cannot append to the ledger") for n, run in
                                          (("A", ra), ("B", rb), ("C", rc))},
    }
    (tmp_path / "gluster_e2e.json").write_text(json.dumps(report, indent=1))
    print("\nGLUSTER-E2E " + json.dumps(report))
    assert not wrong, wrong[:5]
    assert len(faults) == 4, faults
    assert all(f.get("served_meanwhile", 1) > 0 for f in faults), f"a fault came after the load ended: {faults}"
    assert [f["refused_writes"] for f in faults if "refused_writes" in f] == [True], faults
    assert evicted > 0, "the budget never had to evict: the test proves nothing"
    corrupt = misses(ra).get("corrupt", 0) + misses(rc).get("corrupt", 0)
    assert corrupt == 0, report
    assert cross > 0, "node 2 never restored what node 1 stored"
    for i, w in zip(ho, whole):
        if w:  # all three chunks of a hand-off prompt still there: node 2 restores them
            assert restored_ho[i] >= 3 * CHUNK, (i, report)
    assert peak[0] <= BUDGET + OVERSHOOT, report
    assert " 0 corrupt" in fsck1.stdout, fsck1.stdout
    assert fsck3.returncode == 0 and "clean" in fsck3.stdout, fsck3.stdout
    assert abs(drift) <= 0.05 * walked, report


def test_the_gluster_bench_measures_both_directories_at_small_size(tmp_path):
    """bench/gluster_fs.py at 8 MiB, one repetition: every row of both directories, GB/s and CPU per GB."""
    if gluster.unavailable():
        pytest.skip(gluster.unavailable())
    from bench.gluster_fs import main

    assert main(["--mib", "8", "--file-mib", "1", "--reps", "1", "--dir", str(tmp_path), "--out-dir",
                 str(tmp_path / "out")]) == 0
    doc = json.loads((tmp_path / "out" / "gluster_fs.json").read_text())
    rows = {(r["fs"], r["op"]): r for r in doc["rows"]}
    assert set(rows) == {(f, o) for f in ("local", "gluster") for o in ("dd write", "dd read", "ours store",
                                                                         "ours load", "vLLM x16 store",
                                                                         "vLLM x16 load")}
    assert all(r["gb_s"] > 0 for r in rows.values())
    # On the mount the GlusterFS processes work for every byte; locally there are none.
    assert rows[("gluster", "ours store")]["gluster_cpu_s_per_gb"] > 0
    assert rows[("local", "ours store")]["gluster_cpu_s_per_gb"] == 0
    assert doc["mount_fs"].startswith("fuse.glusterfs")
