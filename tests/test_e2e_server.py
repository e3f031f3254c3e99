"""The connector inside vLLM's real OpenAI server, and start-up errors of a real engine.

The start-up error is checked on the connector as the engine core builds it (in-process, real
VllmConfig: tests/conftest.py `start_connector`); `-m long` also starts a real engine with it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from conftest import CHUNK, engine_args, fs_kv_config, layouts, random_prompt, start_connector
from harness.engine import RunSpec, run_engine
from offload.config import ConfigError
from offload.connector.worker import SHUTDOWN_LINE
from offload.keys import chunk_keys, request_root
from offload.store.cachedir.paths import LAYOUT_DIR
from serving import complete


def _check_chunk_size_message(log: str) -> None:
    assert "kv_connector_extra_config.hybrid_chunk_size=300" in log
    assert "mamba: 128" in log and "full_attention: 128" in log and "e.g. 128" in log


def test_invalid_chunk_size_fails_connector_start_naming_sizes_and_a_valid_value(vllm_setup, tmp_path):
    with pytest.raises(ConfigError) as e:
        start_connector(vllm_setup, fs_kv_config(tmp_path, hybrid_chunk_size=300))
    _check_chunk_size_message(str(e.value))


@pytest.mark.e2e
@pytest.mark.long  # the test above, through a whole engine start (about a minute)
def test_invalid_chunk_size_fails_engine_start_naming_sizes_and_a_valid_value(models_dir, tmp_path):
    kv = fs_kv_config(tmp_path, hybrid_chunk_size=300)
    with pytest.raises(RuntimeError) as e:
        run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), [[1, 2, 3]], kv, engine_args=engine_args(True)))
    _check_chunk_size_message(str(e.value))


@pytest.mark.e2e
@pytest.mark.long  # a three-process server start: `make test` stays within 12 minutes (docs/development.md)
@pytest.mark.stops_fs_server  # runs right after the other tests of the session's server
def test_sigterm_of_api_server_finishes_stores(fs_server):
    prompt = random_prompt(random.Random(9), 4 * CHUNK + 50)
    out = complete(fs_server.url(), prompt)
    assert out["choices"][0]["text"] is not None
    # SIGTERM right after the response: stores may still be in flight.
    fs_server.stop()
    log, cache = fs_server.log.read_text(), fs_server.cache
    # The worker's shutdown logs its tiers' totals (its metrics Recorders'; the engine sends no metrics
    # after it stops stepping, so /metrics cannot show drops at shutdown): the file tier's comes last.
    lines = [ln for ln in log.splitlines() if SHUTDOWN_LINE in ln]
    assert lines, "the worker's shutdown ran"
    figures = json.loads(lines[-1].split(SHUTDOWN_LINE, 1)[1].split(": ", 1)[1])
    assert "shutdown" not in figures["stores_dropped"], f"no store dropped: {figures}"
    [(d, lay)] = list(layouts(cache).items())
    keys = chunk_keys(request_root(bytes.fromhex(lay["base_fingerprint"])), prompt, CHUNK)
    root = Path(cache / LAYOUT_DIR / d)
    for g, n in ((1, len(prompt) // CHUNK), (0, (len(prompt) - 1) // CHUNK)):
        missing = [k.hex() for k in keys[:n] if not (root / f"g{g}" / k.hex()[:2] / f"{k.hex()}.kv").exists()]
        assert not missing, f"group {g}: chunks not stored before exit: {missing}"
