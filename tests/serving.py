"""A real vLLM OpenAI server (and a real Prometheus) for end-to-end tests.

The servers and the client side (a free port, a completion, /metrics through prometheus_client's
parser, sums of samples, polling with a deadline) are the harness's (harness/), which bench/ uses
too; the client side is re-exported here for the tests.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from conftest import engine_args
from harness.client import (  # noqa: F401 - re-exported: the tests' one harness
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
from harness.server import running, vllm_server


@contextmanager
def api_server(model: Path, kv_transfer_config: dict | None, log: Path, hybrid: bool = True,
               extra_env: dict[str, str] | None = None, extra_args: tuple[str, ...] = (),
               serve_args: list[str] | None = None, timeout_s: float = 900) -> Iterator[str]:
    """Yields the base URL of the harness's vLLM server (harness/server.py: a taken port retried,
    no inherited Prometheus directory); SIGTERM on exit. `timeout_s`: for its start (about a
    minute alone; more than 5 minutes measured with other engines starting beside it, load average 15+).
    `serve_args` (e.g. `kvoffload plan`'s) replace the suite's prefix-caching
    flags; `kv_transfer_config=None` serves without a connector."""
    args = engine_args(hybrid)
    if serve_args is None:
        serve_args = ["--enable-prefix-caching", "--max-num-batched-tokens", str(args["max_num_batched_tokens"])]
        if hybrid:
            serve_args += ["--prefix-cache-retention-interval", str(args["prefix_cache_retention_interval"])]
    with vllm_server(model, ["--max-model-len", str(args["max_model_len"]), *serve_args, *extra_args], log,
                     kv=kv_transfer_config, env={"VLLM_CPU_KVCACHE_SPACE": "1", **(extra_env or {})},
                     start_s=timeout_s, stop_s=90, shutdown_timeout_s=30) as s:
        yield s.base


def post(base: str, path: str) -> None:
    urllib.request.urlopen(urllib.request.Request(f"{base}{path}", method="POST"), timeout=60)


@contextmanager
def prometheus(config: Path, workdir: Path) -> Iterator[str]:
    """Debian's `prometheus` (installed by `make setup`), on 127.0.0.1."""
    port = free_port()
    log = workdir / "prometheus.log"
    base = f"http://127.0.0.1:{port}"
    cmd = ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
           f"--web.listen-address=127.0.0.1:{port}"]
    with running(cmd, log, f"{base}/-/ready", 60, 30):
        yield base
