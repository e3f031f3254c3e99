"""Warm start on real vLLM engines: the tiny hybrid with host memory over files
(configs/hybrid-tiered.json). A process stores three prompts and exits; a new
process on the same directory serves a short prompt (its first step makes the
plan), then the three prompts: with warm start (the default) every restored
token comes from host memory, without it from the files. Tokens are identical
to the first process's cold pass (the same engine, the connector loaded,
nothing restored: see test_e2e_cpu.py for why that is the reference).
"""

from __future__ import annotations

import random

import pytest

from conftest import CHUNK, engine_args, random_prompt, shipped_config, side_by_side
from harness.engine import RunSpec, run_engine

pytestmark = pytest.mark.e2e

rng = random.Random(44)
PROMPTS = [random_prompt(rng, n) for n in (700, 900, 1100)]
KICK = random_prompt(rng, CHUNK // 2)  # shorter than a chunk: nothing to look up, nothing stored
HITS = [(len(p) - 1) // CHUNK * CHUNK for p in PROMPTS]


def tiered(path, warm: bool) -> dict:
    kv = shipped_config("hybrid-tiered.json", path)
    kv["kv_connector_extra_config"]["warm_start"] = warm
    return kv


def serve(models_dir, kv, order, pause_s: float = 0.0):
    return run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), [*PROMPTS, KICK], kv, 12, engine_args(True),
                              order=order, pause_s=pause_s))


def _runs(models_dir, tmp_path):
    cache = tmp_path / "warm"
    cache.mkdir()
    cold = serve(models_dir, tiered(cache, True), [[0, 1, 2]])
    # The restart, warm start on and off, side by side on the same directory (neither stores: the
    # short prompt is under a chunk, and the three prompts are restored whole).
    on, off = side_by_side(lambda: serve(models_dir, tiered(cache, True), [[3], [0, 1, 2]], 2.0),
                           lambda: serve(models_dir, tiered(cache, False), [[3], [0, 1, 2]], 2.0))
    return {"cold": cold, "on": on, "off": off}


@pytest.fixture(scope="module")
def runs(prefetched):
    return prefetched(_runs)


def restored(run, tier: str) -> list[int]:
    after = run.by_pass(1)
    return [after[i].restored_by_tier.get(tier, 0) for i in range(len(PROMPTS))]


@pytest.mark.prefetch.with_args(_runs)
def test_after_a_restart_host_memory_serves_what_the_files_held(runs):
    ref = runs["cold"].results
    assert all(r.restored_tokens == 0 for r in ref), "the first process restores nothing"
    on, off = runs["on"], runs["off"]
    assert restored(on, "cpu") == HITS and restored(on, "fs") == [0, 0, 0]
    assert restored(off, "fs") == HITS and restored(off, "cpu") == [0, 0, 0]
    for run in (on, off):
        after = run.by_pass(1)
        assert [after[i].output_ids for i in range(len(PROMPTS))] == [r.output_ids for r in ref]
        assert not any(r.load_failed for r in run.results)
    # Its figures: everything planned was copied and verified, nothing failed, and the loads read it.
    planned = on.metric("kvoffload_warm_planned_entries", tier="cpu")
    assert planned > 0 and on.metric("kvoffload_warm_entries_total", tier="cpu") == planned
    assert on.metric("kvoffload_warm_done", tier="cpu") == 1
    assert on.metric("kvoffload_warm_failures_total", tier="cpu") == 0
    assert on.metric("kvoffload_warm_hits_total", tier="cpu") > 0
    assert on.metric("kvoffload_warm_bytes_total", tier="cpu") > 0
    assert off.metric("kvoffload_warm_planned_entries", tier="cpu") == 0
