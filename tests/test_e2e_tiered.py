"""The tiered service on real vLLM engines: configs/hybrid-tiered.json is one
OffloadConnector with a tier stack (host memory, then files): which tier
restores, promotion, a host tier too small for the working set. Weights are a
MultiConnector's business: its test runs our two tiers as two children.

Reference outputs are pass 1 of the cold process: the same engine with the
connector loaded and nothing restored (asserted); see test_e2e_cpu.py for why.
"""

from __future__ import annotations

import random

import pytest

from conftest import CHUNK, engine_args, random_prompt, shipped_config, side_by_side
from harness.engine import RunSpec, run_engine
from offload.config import tier_dicts

pytestmark = pytest.mark.e2e

rng = random.Random(5)
PROMPTS = [random_prompt(rng, n) for n in (700, 900, 1100)]
HITS = [(len(p) - 1) // CHUNK * CHUNK for p in PROMPTS]
# Attention only: whole chunks (a chunk-aligned prompt hits whole: vLLM computes
# its last token again on top of the restored KV), or the tail of whole blocks
# behind them, as the plan's planner states it for vLLM's blocks here.
LLAMA_PROMPTS = [*PROMPTS, random_prompt(rng, 768)]


def tiered(path, cpu_bytes: int | None = None) -> dict:
    kv = shipped_config("hybrid-tiered.json", path)
    if cpu_bytes is not None:
        tier_dicts(kv)[0]["cpu_bytes"] = cpu_bytes
    # Promotion is what these tests follow: warm start would put the files' entries into host
    # memory on its own after a restart (tests/test_e2e_warm_start.py).
    kv["kv_connector_extra_config"]["warm_start"] = False
    return kv


def weighted(path, fs_weight: float) -> dict:
    """The same two tiers as two children of our MultiConnector, which picks
    by matched tokens x load_weight."""
    cpu, fs = tier_dicts(tiered(path))
    child = {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
             "kv_role": "kv_both"}
    return {"kv_connector": "OffloadMultiConnector", "kv_connector_module_path": "offload.multi_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"children": [
                {**child, "kv_connector_extra_config": cpu},
                {**child, "kv_connector_extra_config": fs, "load_weight": fs_weight}]}}


def serve(models_dir, kv, pause_s: float = 0.0):
    run = run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), PROMPTS, kv, 12, engine_args(True), passes=2,
                             pause_s=pause_s))
    n = len(PROMPTS)
    return run, run.results[:n], run.results[n:]


def by_tier(results, tier):
    return [r.restored_by_tier.get(tier, 0) for r in results]


def files_written(run, tier: str) -> float:
    """Bytes the worker stored into `tier` (its metrics, as Prometheus exports them)."""
    return run.metric("kvoffload_stored_bytes_total", tier=tier)


# The engine runs go on the session's background lane (tests/conftest.py, PREFETCH): they overlap
# the unit tests instead of following them.


def _runs(models_dir, tmp_path):
    cache, other = tmp_path / "tiered", tmp_path / "w"
    cache.mkdir()
    other.mkdir()
    cold = serve(models_dir, tiered(cache))
    # The restart, and the weighted MultiConnector on a directory of its own, side by side.
    restart, weighted_run = side_by_side(lambda: serve(models_dir, tiered(cache)),
                                         # idle 10 s: the file child's writes land, so both children hold the prefixes
                                         lambda: serve(models_dir, weighted(other, 2.0), 10.0))
    return {"cold": cold, "restart": restart, "weighted": weighted_run}


@pytest.fixture(scope="module")
def runs(prefetched):
    return prefetched(_runs)


@pytest.mark.prefetch.with_args(_runs)
def test_cpu_tier_after_reset_disk_after_restart_then_promoted_to_cpu(runs):
    _, ref, cold_again = runs["cold"]
    assert all(r.restored_tokens == 0 for r in ref), "pass 1 of a cold process restores nothing"
    # Same process, after reset_prefix_cache(): the CPU child restores.
    assert by_tier(cold_again, "cpu") == HITS and by_tier(cold_again, "fs") == [0, 0, 0]
    # New process: host memory is empty, the filesystem child restores...
    log, first, second = runs["restart"]
    assert by_tier(first, "fs") == HITS and by_tier(first, "cpu") == [0, 0, 0]
    # ...and stored it into the CPU tier on the way (promotion): next time the CPU child.
    assert by_tier(second, "cpu") == HITS and by_tier(second, "fs") == [0, 0, 0]
    assert files_written(log, "fs") == 0, "nothing stored twice on disk"
    assert files_written(log, "cpu") > 0, "promoted into host memory"
    for results in (cold_again, first, second):
        assert [r.output_ids for r in results] == [r.output_ids for r in ref]
        assert not any(r.load_failed for r in results)


@pytest.mark.prefetch.with_args(_runs)
def test_weights_favour_the_filesystem_child_on_a_tie(runs):
    _, ref, _ = runs["cold"]
    _, first, second = runs["weighted"]
    assert all(r.restored_tokens == 0 for r in first), "cold: both children empty"
    # Both children now hold the same prefixes: a tie in tokens, fs weighs 2.0.
    assert by_tier(second, "fs") == HITS and by_tier(second, "cpu") == [0, 0, 0]
    assert [r.output_ids for r in second] == [r.output_ids for r in first]


def _llama(models_dir, tmp_path):
    from offload.plan.run import plan_for_model

    llama = str(models_dir / "llama-tiny")
    cold, planner = side_by_side(lambda: run_engine(RunSpec(llama, LLAMA_PROMPTS, tiered(tmp_path), 12,
                                                            engine_args(False))),
                                 lambda: plan_for_model(llama).planner())
    warm = run_engine(RunSpec(llama, LLAMA_PROMPTS, tiered(tmp_path), 12, engine_args(False), passes=2))
    return cold, warm, planner


# `make test` stays within 12 minutes (docs/development.md): Llama restarts there in
# tests/test_e2e_partial_tail.py.
@pytest.mark.long
@pytest.mark.prefetch.with_args(_llama)
def test_llama_restart_restores_from_disk_then_from_promoted_cpu(prefetched):
    """The 768-token prompt is restored whole (vLLM computes its last token
    again over the restored KV, and counts all 768 as cached); a prompt whose
    last whole block lies past its last whole chunk is restored to that block."""
    cold, warm, planner = prefetched(_llama)
    LLAMA_HITS = [planner.repeat_hit(len(p)) for p in LLAMA_PROMPTS]
    assert any(h > planner.max_hit_chunks(len(p)) * planner.chunk_size for h, p in zip(LLAMA_HITS, LLAMA_PROMPTS))
    assert cold.restored_tokens == 0
    n = len(LLAMA_PROMPTS)
    first, second = warm.results[:n], warm.results[n:]
    assert by_tier(first, "fs") == LLAMA_HITS and by_tier(second, "cpu") == LLAMA_HITS
    assert [r.cached_tokens for r in first] == LLAMA_HITS
    assert [r.output_ids for r in first] == cold.outputs() == [r.output_ids for r in second]


def _too_small(models_dir, tmp_path):
    spec = RunSpec(str(models_dir / "qwen3-next-tiny"), PROMPTS, tiered(tmp_path, cpu_bytes=4 << 20), 12,
                   engine_args(True), order=[[0, 1, 2], [2, 1, 0]])
    return run_engine(spec)


@pytest.mark.prefetch.with_args(_too_small)
def test_host_memory_too_small_files_serve_the_rest(prefetched):
    """4 MiB of host memory holds 14 of the 20 chunks: after a reset the hit
    comes from both tiers, and every prompt restores its whole prefix. The
    second pass runs newest first, once the files of the last prompt have
    landed (RunSpec.land_stores; until then host memory holds their only copy,
    which it never evicts, so it has no room for more). In the first order,
    each promotion would evict the next prompt's chain: LRU under a cyclic
    working set larger than the cache."""
    run = prefetched(_too_small)
    ref, again = run.results[:3], run.results[3:][::-1]
    assert all(r.restored_tokens == 0 for r in ref), "pass 1 of a cold process restores nothing"
    assert [r.restored_tokens for r in again] == HITS
    cpu, fs = by_tier(again, "cpu"), by_tier(again, "fs")
    assert [c + f for c, f in zip(cpu, fs)] == HITS
    assert sum(cpu) > 0 and sum(fs) > 0, (cpu, fs)
    assert [r.output_ids for r in again] == [r.output_ids for r in ref]
    assert not any(r.load_failed for r in again)
