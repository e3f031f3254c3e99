"""The host-memory tier ("store": "cpu") on real vLLM engines.

Repeats are served after `reset_prefix_cache()`, so a hit can only come from
the CPU tier. The reference is pass 1 of the same engine (connector loaded,
nothing restored, asserted): loading any connector can flip a near-tie bf16
token against a connector-less run (docs/cpu-platform.md).
"""

from __future__ import annotations

import random

import pytest

from conftest import CHUNK, engine_args, random_prompt, side_by_side
from harness.engine import RunSpec, run_engine

rng = random.Random(11)
PROMPTS = [random_prompt(rng, n) for n in (700, 900, 1100, 600)]
# One chunk of the tiny Qwen3-Next: 2 attention pages + 1 GDN state, natural sizes.
CHUNK_BYTES = CHUNK // 128 * 262_144 + 35_072  # attention blocks of a chunk + one GDN state


def cpu_config(cpu_bytes: int) -> dict:
    return {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
            "kv_role": "kv_both", "kv_connector_extra_config": {"store": "cpu", "cpu_bytes": cpu_bytes}}


def aligned_hit(p: list[int]) -> int:
    return (len(p) - 1) // CHUNK * CHUNK


# Pass order of the budget test (below).
BUDGET_ORDER = [[0, 1, 2, 3], [3, 2, 1, 0]]


def serve(models_dir, cpu_bytes: int, passes: int = 3):
    run = run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), PROMPTS, cpu_config(cpu_bytes), 12,
                             engine_args(True), passes=passes))
    n = len(PROMPTS)
    return run, [run.results[i * n:(i + 1) * n] for i in range(passes)]


def _runs(models_dir, _tmp):
    """The two tests' engines, started together (independent processes, one CPU tier each), on the
    session's background lane (tests/conftest.py)."""
    ample, budget = side_by_side(
        lambda: serve(models_dir, 256 << 20),
        lambda: run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), PROMPTS, cpu_config(5 * CHUNK_BYTES), 12,
                                   engine_args(True), order=BUDGET_ORDER)))
    return {"ample": ample, "budget": budget}


pytestmark = [pytest.mark.e2e, pytest.mark.prefetch.with_args(_runs)]


@pytest.fixture(scope="module")
def runs(prefetched):
    return prefetched(_runs)


def test_repeat_after_prefix_cache_reset_is_restored_from_cpu(runs):
    run, (first, second, third) = runs["ample"]
    assert all(r.restored_tokens == 0 for r in first)
    for again in (second, third):
        assert [r.restored_tokens for r in again] == [aligned_hit(p) for p in PROMPTS]
        assert [r.cached_tokens for r in again] == [aligned_hit(p) for p in PROMPTS]
        assert [r.output_ids for r in again] == [r.output_ids for r in first]
    # The tier reports its capacity: the budget in whole chunk slots.
    capacity = run.metric("kvoffload_capacity_bytes", tier="cpu")
    assert (256 << 20) - CHUNK_BYTES < capacity <= 256 << 20, capacity


def test_budget_smaller_than_working_set_evicts_and_never_reports_an_unrestorable_hit(runs):
    # Room for 5 chunks; the four prompts store 2 + 3 + 4 + 2 attention chunks.
    # LRU with prefix-closed eviction leaves only the last prompt after pass 1;
    # pass 2 runs in reverse, so the last prompt hits and the rest were evicted.
    order = BUDGET_ORDER
    run = runs["budget"]
    first, second = run.results[:4], dict(zip(order[1], run.results[4:]))
    assert not any(r.load_failed for r in run.results), "a hit that could not be restored"
    assert second[3].restored_tokens == aligned_hit(PROMPTS[3]), "the most recent prompt survived"
    assert [second[i].restored_tokens for i in (2, 1, 0)] == [0, 0, 0], "evicted prompts miss cleanly"
    for i in range(4):
        assert second[i].output_ids == first[i].output_ids, f"prompt {i} differs"
