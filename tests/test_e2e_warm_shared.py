"""Two instances on one cache directory, on real vLLM engines (the tiny hybrid with host memory over
files, configs/hybrid-tiered.json): instance A serves three prompts and stores them; while A is
still up (its pass's stores landed, the engine holding), instance B, a separate engine process on
the same directory, starts, serves a short prompt (its first step makes warm start's plan from the
directory's ledger, which A's records are in), then A's three prompts. B starts hot: its warm start
copied A's entries into host memory, and every token B restores for A's prompts comes from host
memory. B's tokens are identical to a reference engine's with the do-nothing connector
(tests/noop_connector.py, every prompt computed).

Engine starts: 3 (A beside the reference, then B). A restart of one instance is
tests/test_e2e_warm_start.py.
"""

from __future__ import annotations

import random

import pytest

from conftest import CHUNK, engine_args, in_background, random_prompt, shipped_config
from harness.engine import RunSpec, run_engine, start_engine
from offload.store.cachedir.paths import LAYOUT_DIR

pytestmark = pytest.mark.e2e

rng = random.Random(4545)
PROMPTS = [random_prompt(rng, n) for n in (650, 820, 1000)]
KICK = random_prompt(rng, CHUNK // 2)  # shorter than a chunk: nothing to look up, nothing stored
HITS = [(len(p) - 1) // CHUNK * CHUNK for p in PROMPTS]
MAX_TOKENS = 12


def spec(models_dir, kv: dict, order: list[list[int]], **kw) -> RunSpec:
    return RunSpec(str(models_dir / "qwen3-next-tiny"), [*PROMPTS, KICK], kv, MAX_TOKENS, engine_args(True),
                   order=order, **kw)


def _instances(models_dir, tmp_path):
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath

    cache = tmp_path / "shared"
    cache.mkdir()
    kv = shipped_config("hybrid-tiered.json", cache)  # warm start on: the default
    # A: one gated pass (its stores land before it reports the pass done), then it holds until killed.
    a = start_engine(spec(models_dir, kv, [[0, 1, 2]], gated=True, hold=True), workdir=tmp_path / "a")
    ref = in_background(run_engine, spec(models_dir, NOOP, [[0, 1, 2]], skip_prefix_cache=True),
                        env={"PYTHONPATH": pythonpath()})
    try:
        a.wait_pass(0)
        assert a.proc.poll() is None, "instance A exited after its pass"
        # What A stored (its metrics are exported at its steps: stores that land after its last step
        # are not in them while it holds, so the files are counted here).
        a_files = len(list(cache.glob(f"{LAYOUT_DIR}/*/g*/*/*.kv")))
        b = run_engine(spec(models_dir, kv, [[3], [0, 1, 2]], pause_s=2.0))
        a_up = a.proc.poll() is None  # A held the directory the whole time B ran
        a_result = a.result()
    finally:
        a.kill()
    return {"a": a_result, "a_up": a_up, "a_files": a_files, "b": b, "ref": ref.result()}


@pytest.fixture(scope="module")
def runs(prefetched):
    return prefetched(_instances)


@pytest.mark.prefetch.with_args(_instances)
def test_a_second_instance_on_a_shared_directory_starts_hot(runs):
    a, b, ref = runs["a"], runs["b"], runs["ref"]
    assert runs["a_up"], "instance A was not up while B ran"
    assert all(r.restored_tokens == 0 and r.cached_tokens == 0 for r in ref.results), "the reference computes all"
    want = [r.output_ids for r in ref.results]
    assert [r.output_ids for r in a.results] == want, "A (cold, storing) differs from the reference"
    assert all(r.restored_tokens == 0 for r in a.results), "A started on an empty directory"
    assert runs["a_files"] > 0, "A stored nothing into the files"

    after = b.by_pass(1)
    served = [after[i] for i in range(len(PROMPTS))]
    # B's warm start read A's entries: planned from the ledger A wrote, every one copied and verified.
    planned = b.metric("kvoffload_warm_planned_entries", tier="cpu")
    assert planned > 0, "B planned nothing: A's entries were not in the directory's ledger"
    assert b.metric("kvoffload_warm_entries_total", tier="cpu") == planned
    assert b.metric("kvoffload_warm_bytes_total", tier="cpu") > 0
    assert b.metric("kvoffload_warm_done", tier="cpu") == 1
    assert b.metric("kvoffload_warm_failures_total", tier="cpu") == 0
    assert b.metric("kvoffload_warm_hits_total", tier="cpu") > 0
    # B's first requests for A's prompts: every restorable token from host memory, none from the files.
    assert [r.restored_by_tier.get("cpu", 0) for r in served] == HITS
    assert [r.restored_by_tier.get("fs", 0) for r in served] == [0] * len(PROMPTS)
    assert not any(r.load_failed for r in b.results)
    assert [r.output_ids for r in served] == want, "B's tokens differ from the reference's"
