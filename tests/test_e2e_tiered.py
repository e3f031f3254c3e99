"""The tiered service (CPU child + filesystem child under our MultiConnector)
on real vLLM engines: which tier restores, promotion, weights.

Reference outputs are pass 1 of the cold process: the same engine with the
connector loaded and nothing restored (asserted); see test_e2e_cpu.py for why.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from conftest import CHUNK, REPO, engine_args, random_prompt, side_by_side
from offload.engine_run import RunSpec, run_engine

pytestmark = pytest.mark.e2e

rng = random.Random(5)
PROMPTS = [random_prompt(rng, n) for n in (700, 900, 1100)]
HITS = [(len(p) - 1) // CHUNK * CHUNK for p in PROMPTS]
LLAMA_HITS = [(len(p) - 1) // 256 * 256 for p in PROMPTS]  # attention only: 256-token chunks by default


def tiered(path, fs_weight: float = 1.0) -> dict:
    kv = json.loads((REPO / "configs" / "hybrid-tiered.json").read_text())
    cpu, fs = kv["kv_connector_extra_config"]["children"]
    fs["kv_connector_extra_config"]["path"] = str(path)
    fs["load_weight"] = fs_weight
    return kv


def serve(models_dir, kv):
    run = run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), PROMPTS, kv, 12, engine_args(True), passes=2))
    n = len(PROMPTS)
    return run, run.results[:n], run.results[n:]


def by_tier(results, tier):
    return [r.restored_by_tier.get(tier, 0) for r in results]


def files_written(log: str, tier: str) -> int:
    return int(re.search(rf"counters \[{tier}\]: .*?files_written=(\d+)", log).group(1))


@pytest.fixture(scope="module")
def runs(models_dir, tmp_path_factory):
    cache = tmp_path_factory.mktemp("tiered")
    cold = serve(models_dir, tiered(cache))
    # Two restarts reading the same files, side by side (each its own CPU tier; neither writes to disk).
    restart, weighted = side_by_side(lambda: serve(models_dir, tiered(cache)),
                                     lambda: serve(models_dir, tiered(cache, fs_weight=2.0)))
    return {"cold": cold, "restart": restart, "weighted": weighted}


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
    assert files_written(log.log, "fs") == 0, "nothing stored twice on disk"
    for results in (cold_again, first, second):
        assert [r.output_ids for r in results] == [r.output_ids for r in ref]
        assert not any(r.load_failed for r in results)


def test_weights_favour_the_filesystem_child_on_a_tie(runs):
    _, ref, _ = runs["cold"]
    _, first, second = runs["weighted"]
    assert by_tier(first, "fs") == HITS  # CPU empty after the restart
    # Both tiers now hold the same prefixes: a tie in tokens, fs weighs 2.0.
    assert by_tier(second, "fs") == HITS and by_tier(second, "cpu") == [0, 0, 0]
    assert [r.output_ids for r in second] == [r.output_ids for r in ref]


def test_llama_restart_restores_from_disk_then_from_promoted_cpu(models_dir, tmp_path):
    llama = str(models_dir / "llama-tiny")
    cold = run_engine(RunSpec(llama, PROMPTS, tiered(tmp_path), 12, engine_args(False)))
    assert cold.restored_tokens == 0
    warm = run_engine(RunSpec(llama, PROMPTS, tiered(tmp_path), 12, engine_args(False), passes=2))
    first, second = warm.results[:3], warm.results[3:]
    assert by_tier(first, "fs") == LLAMA_HITS and by_tier(second, "cpu") == LLAMA_HITS
    assert [r.output_ids for r in first] == cold.outputs() == [r.output_ids for r in second]
