"""Shared fixtures: the tiny local models and engine settings for real vLLM runs."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Every engine the tests start gets the same OpenMP core layout, with or without a connector: vLLM-CPU
# reserves a core more when a connector is set, and a different thread count changes the order of
# floating-point sums, so greedy tokens of a random tiny model differ (measured: 4 of 12 prompts). Token
# identity must compare like with like. 0: all cores for OpenMP, what a connector engine gets on 2 cores.
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

# The connector's default chunk on the tiny hybrid: its block size (vLLM-CPU gives it 128-token blocks).
CHUNK = 128


def engine_args(hybrid: bool) -> dict:
    """vLLM settings under which a hybrid model has a Mamba state at every
    chunk boundary of a prefill: what `kvoffload plan` prints for dense
    checkpoints (docs/operations.md#plan). vLLM refuses a retention interval
    on models without Mamba/window groups."""
    args = {"enable_prefix_caching": True, "max_model_len": 4096, "max_num_batched_tokens": CHUNK,
            "enforce_eager": True}
    if hybrid:
        args["prefix_cache_retention_interval"] = CHUNK
    return args


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """`make setup` builds the models into .models; build them if missing."""
    d = REPO / ".models"
    if not (d / "qwen3-next-tiny" / "config.json").exists() or not (d / "llama-tiny" / "config.json").exists():
        d = tmp_path_factory.mktemp("models")
        subprocess.run([sys.executable, str(REPO / "tools" / "tiny_models.py"), str(d)], check=True)
    return d


def fs_kv_config(path: Path, **extra) -> dict:
    return {
        "kv_connector": "OffloadConnector",
        "kv_connector_module_path": "offload.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"store": "fs", "path": str(path), **extra},
    }


def shipped_config(name: str, path: Path) -> dict:
    """configs/<name> with every filesystem tier's `path` set to `path` (nothing else changed)."""
    from offload.config import tier_dicts

    kv = json.loads((REPO / "configs" / name).read_text())
    fs = [t for t in tier_dicts(kv) if t.get("store") == "fs"]
    assert fs, f"configs/{name} has no filesystem tier"
    for t in fs:
        t["path"] = str(path)
    return kv


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


def layouts(cache: Path) -> dict[str, dict]:
    """layout.json of every fingerprint directory, by directory name."""
    return {p.parent.name: json.loads(p.read_text()) for p in cache.glob("kvoffload-v1/*/layout.json")}
