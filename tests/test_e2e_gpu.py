"""Children whose data path exists only on GPUs: LMCache, and vLLM's own
SimpleCPUOffloadConnector, each beside our filesystem tier.

On this project's CPU machines both fail inside their own code (LMCache has
no CPU data path; SimpleCPUOffloadConnector needs CUDA streams), so these run
only where CUDA is available. Config handling for them is tested on CPU in
test_multi_config.py.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import REPO, engine_args, random_prompt
from harness.engine import RunSpec, run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

rng = random.Random(21)
PROMPTS = [random_prompt(rng, n) for n in (700, 900, 1100)]


def _serve_twice(models_dir, kv: dict, model: str = "llama-tiny"):
    args = {**engine_args(False), "disable_hybrid_kv_cache_manager": True}
    run = run_engine(RunSpec(str(models_dir / model), PROMPTS, kv, 12, args, passes=2))
    return run.results[:3], run.results[3:]


def _check(first, second):
    assert [r.output_ids for r in second] == [r.output_ids for r in first]
    assert all(r.cached_tokens > 0 for r in second), "after reset_prefix_cache() a child restores"


@pytest.mark.parametrize("model", ["llama-tiny", "llama-3.1-8b-geometry"])
def test_lmcache_child_restores_attention_model(models_dir, tmp_path, model):
    """LMCache's own vLLM connector as a child where it has a data path (pure attention on a GPU),
    on the toy and on a model with Llama-3.1-8B's per-layer geometry."""
    pytest.importorskip("lmcache")
    kv = json.loads((REPO / "configs" / "attention-tiered-lmcache.json").read_text())
    kv["kv_connector_extra_config"]["children"][1]["kv_connector_extra_config"]["path"] = str(tmp_path)
    _check(*_serve_twice(models_dir, kv, model))


def test_vllm_simple_cpu_offload_child_beside_our_fs_tier(models_dir, tmp_path):
    kv = {"kv_connector": "OffloadMultiConnector", "kv_connector_module_path": "offload.multi_connector",
          "kv_role": "kv_both", "kv_connector_extra_config": {"children": [
              {"kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}},
              {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
               "kv_role": "kv_both", "kv_connector_extra_config": {"store": "fs", "path": str(tmp_path)}}]}}
    first, second = _serve_twice(models_dir, kv)
    _check(first, second)
    # Our tier stored everything on the way, whichever child loaded.
    assert any(tmp_path.rglob("*.kv"))
