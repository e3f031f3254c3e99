"""The connector inside vLLM's real OpenAI server, and start-up errors of a real engine."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from conftest import CHUNK, engine_args, fs_kv_config, layouts, random_prompt
from serving import api_server, complete
from offload.engine_run import RunSpec, run_engine
from offload.keys import chunk_keys, request_root

pytestmark = pytest.mark.e2e


def test_invalid_chunk_size_fails_engine_start_naming_sizes_and_a_valid_value(models_dir, tmp_path):
    kv = fs_kv_config(tmp_path, hybrid_chunk_size=300)
    with pytest.raises(RuntimeError) as e:
        run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), [[1, 2, 3]], kv, engine_args=engine_args(True)))
    log = str(e.value)
    assert "kv_connector_extra_config.hybrid_chunk_size=300" in log
    assert "mamba: 128" in log and "full_attention: 128" in log and "e.g. 128" in log


def test_sigterm_of_api_server_finishes_stores(models_dir, tmp_path):
    prompt = random_prompt(random.Random(9), 4 * CHUNK + 50)
    log_path = tmp_path / "server.log"
    # Leaving the block sends SIGTERM at once: stores may still be in flight.
    with api_server(models_dir / "qwen3-next-tiny", fs_kv_config(tmp_path / "cache"), log_path) as base:
        out = complete(base, prompt)
        assert out["choices"][0]["text"] is not None
    log = log_path.read_text()
    assert "kvoffload worker counters" in log, "the worker's shutdown ran"
    assert "'shutdown'" not in log.split("kvoffload worker counters")[-1].splitlines()[0], "no store dropped"
    [(d, lay)] = list(layouts(tmp_path / "cache").items())
    keys = chunk_keys(request_root(bytes.fromhex(lay["base_fingerprint"])), prompt, CHUNK)
    root = Path(tmp_path / "cache" / "kvoffload-v1" / d)
    for g, n in ((1, len(prompt) // CHUNK), (0, (len(prompt) - 1) // CHUNK)):
        missing = [k.hex() for k in keys[:n] if not (root / f"g{g}" / k.hex()[:2] / f"{k.hex()}.kv").exists()]
        assert not missing, f"group {g}: chunks not stored before exit: {missing}"
