"""The connector inside vLLM's real OpenAI server, and start-up errors of a real engine."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import CHUNK, engine_args, fs_kv_config, layouts, random_prompt
from offload.engine_run import RunSpec, run_engine
from offload.keys import chunk_keys, request_root

pytestmark = pytest.mark.e2e


def test_invalid_chunk_size_fails_engine_start_naming_sizes_and_a_valid_value(models_dir, tmp_path):
    kv = fs_kv_config(tmp_path, hybrid_chunk_size=300)
    with pytest.raises(RuntimeError) as e:
        run_engine(RunSpec(str(models_dir / "qwen3-next-tiny"), [[1, 2, 3]], kv, engine_args=engine_args(True)))
    log = str(e.value)
    assert "kv_connector_extra_config.hybrid_chunk_size=300" in log
    assert "mamba: 128" in log and "full_attention: 128" in log and "e.g. 256" in log


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_of_api_server_finishes_stores(models_dir, tmp_path):
    model = str(models_dir / "qwen3-next-tiny")
    port = _free_port()
    args = engine_args(True)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--enable-prefix-caching",
           "--max-model-len", str(args["max_model_len"]),
           "--max-num-batched-tokens", str(args["max_num_batched_tokens"]),
           "--prefix-cache-retention-interval", str(args["prefix_cache_retention_interval"]),
           "--enforce-eager", "--shutdown-timeout", "60", "--kv-transfer-config", json.dumps(fs_kv_config(tmp_path / "cache"))]
    log_path = tmp_path / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log_path.read_text()[-4000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not become healthy"
                time.sleep(1)
        prompt = random_prompt(random.Random(9), 4 * CHUNK + 50)
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        out = json.loads(urllib.request.urlopen(req, timeout=120).read())
        assert out["choices"][0]["text"] is not None
        server.send_signal(signal.SIGTERM)  # immediately: stores may still be in flight
        server.wait(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    log = log_path.read_text()
    assert "kvoffload worker counters" in log, "the worker's shutdown ran"
    assert "'shutdown'" not in log.split("kvoffload worker counters")[-1].splitlines()[0], "no store dropped"
    [(d, lay)] = list(layouts(tmp_path / "cache").items())
    keys = chunk_keys(request_root(bytes.fromhex(lay["base_fingerprint"])), prompt, CHUNK)
    root = Path(tmp_path / "cache" / "kvoffload-v1" / d)
    for g, n in ((1, len(prompt) // CHUNK), (0, (len(prompt) - 1) // CHUNK)):
        missing = [k.hex() for k in keys[:n] if not (root / f"g{g}" / k.hex()[:2] / f"{k.hex()}.kv").exists()]
        assert not missing, f"group {g}: chunks not stored before exit: {missing}"
