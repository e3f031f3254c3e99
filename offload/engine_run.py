"""Serve a prompt set through a fresh vLLM engine process and report per prompt.

A restart is a new process, so every run happens in a subprocess
(`python -m offload.engine_run DIR`): `kvoffload warmup` (its progress bar
from `progress`) and `make demo` use this runner and measure what an
operator's restarted server would see. Prompts are served one at a time so
that batch composition cannot change a near-tie greedy token between runs
(random-weight bf16 models have many).

The child writes one JSON line per served prompt to DIR/results.jsonl as it
goes (a run killed with SIGKILL still reports what it served), a line per
finished pass, and its metrics to DIR/metrics.json after the last pass.

This module holds only what the product needs. The harness of tests/ and
bench/ (harness/engine.py) extends the spec and the serving loop with its
test hooks, from the building blocks below (`make_llm`, `serve_one`,
`land_stores`, `kvoffload_metrics`, `write_row`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Prometheus samples: (name, labels, value), names as exported (`_total`, `_sum`, `_bucket` kept).
Samples = list[tuple[str, dict[str, str], float]]


@dataclass(frozen=True)
class PromptResult:
    prompt_tokens: int
    cached_tokens: int  # vLLM's num_cached_tokens: local prefix cache + connector
    restored_tokens: int  # loaded by OffloadConnector tiers (0 without them)
    load_failed: bool
    ttft_s: float
    output_ids: list[int]
    restored_by_tier: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0  # the request's whole time (decode time = wall_s - ttft_s)


@dataclass
class RunSpec:
    model: str
    prompts: list[list[int]]
    kv_transfer_config: dict[str, Any] | None = None
    max_tokens: int = 16
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Serve the prompt set this many times in the same engine, emptying vLLM's
    # own prefix cache in between (so repeats can only hit an offload tier).
    passes: int = 1

    def pass_orders(self) -> list[list[int]]:
        return [list(range(len(self.prompts)))] * self.passes


@dataclass
class RunResult:
    results: list[PromptResult]
    log: str  # the engine's stdout+stderr, for checks on what it logged
    # kvoffload_* Prometheus samples (name, labels, value) as the engine's own
    # stat logger exported them after the last pass (offload/metrics.py).
    metrics: Samples = field(default_factory=list)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.results)

    @property
    def restored_tokens(self) -> int:
        return sum(r.restored_tokens for r in self.results)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.results)

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / max(1, self.prompt_tokens)

    @property
    def median_ttft_s(self) -> float:
        return statistics.median(r.ttft_s for r in self.results) if self.results else 0.0

    def outputs(self) -> list[list[int]]:
        return [r.output_ids for r in self.results]


class EngineRun:
    """A running engine process (`start_engine`); `wait()` gives its RunResult.
    `CHILD`: the module the engine process runs (`python -m CHILD DIR`)."""

    CHILD = "offload.engine_run"

    def __init__(self, spec: RunSpec, env: dict[str, str] | None, workdir: Path | None) -> None:
        self.spec, self._own_dir = spec, workdir is None
        self.dir = Path(tempfile.mkdtemp(prefix="kvoffload-run-")) if workdir is None else workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.results_path, self.log_path = self.dir / "results.jsonl", self.dir / "engine.log"
        (self.dir / "spec.json").write_text(json.dumps(asdict(spec)))
        self.results_path.write_text("")
        # The engine's metrics are its own: a Prometheus multiprocess directory inherited from the
        # caller would be shared with every other engine it starts.
        full_env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        full_env.update({"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **(env or {})})
        with open(self.log_path, "w") as lf:
            # A session of its own: kill() takes the engine core and workers with it.
            self.proc = subprocess.Popen([sys.executable, "-m", self.CHILD, str(self.dir)], env=full_env,
                                         stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rows(self) -> list[dict]:
        """What the child has reported so far: {"pass", "index", "result"} per prompt, {"pass_done"} per pass."""
        text = self.results_path.read_text()
        return [json.loads(ln) for ln in text.splitlines()[: text.count("\n")] if ln]

    def passes_done(self) -> int:
        return sum(1 for r in self.rows() if "pass_done" in r)

    def metrics(self) -> Samples:
        p = self.dir / "metrics.json"
        return [tuple(m) for m in json.loads(p.read_text())] if p.exists() else []

    def result(self) -> RunResult:
        return RunResult([PromptResult(**r["result"]) for r in self.rows() if "result" in r], self.log,
                         self.metrics())

    def kill(self) -> None:
        """SIGKILL to the engine's whole process group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def _poll(self, done: int, ended: int) -> None:
        """Called about every 0.1 s while the engine runs, with the prompts served and passes ended."""

    def wait(self, timeout_s: float = 900, progress: Callable[[int, int], None] | None = None) -> RunResult:
        """Until the engine exits; raise with its log on failure (or after
        `timeout_s`, killing it). `progress(done, total)` as prompts finish."""
        orders = self.spec.pass_orders()
        total = sum(map(len, orders))
        deadline, seen = time.monotonic() + timeout_s, 0
        try:
            while True:
                finished = self.proc.poll() is not None
                rows = self.rows()
                done = sum(1 for r in rows if "result" in r)
                if progress is not None and done > seen:
                    progress(done, total)
                    seen = done
                self._poll(done, sum(1 for r in rows if "pass_done" in r))
                if finished:
                    break
                if time.monotonic() > deadline:
                    self.kill()
                    raise subprocess.TimeoutExpired(self.proc.args, timeout_s, output=self.log)
                time.sleep(0.1)
            if self.proc.returncode != 0 or self.passes_done() < len(orders):
                raise RuntimeError(f"engine run failed (exit {self.proc.returncode}):\n{self.log[-6000:]}")
            return self.result()
        finally:
            if self._own_dir and self.proc.poll() is not None:
                shutil.rmtree(self.dir, ignore_errors=True)


def run_engine(spec: RunSpec, env: dict[str, str] | None = None, timeout_s: float = 900,
               progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run `spec` in a new Python process (its files in a temporary directory) to its end (see EngineRun.wait)."""
    return EngineRun(spec, env, None).wait(timeout_s, progress)


# ---- the engine process ---------------------------------------------------------------------


def write_metrics(workdir: Path, samples: Samples) -> None:
    """DIR/metrics.json, whole or not at all: a run killed while writing it leaves no half file."""
    tmp = workdir / "metrics.json.tmp"
    tmp.write_text(json.dumps(samples))
    os.replace(tmp, workdir / "metrics.json")


def kvoffload_metrics() -> Samples:
    """This process's kvoffload_* Prometheus samples."""
    from prometheus_client import REGISTRY

    return [(s.name, dict(s.labels), s.value) for m in REGISTRY.collect() if m.name.startswith("kvoffload")
            for s in m.samples]


def land_stores(timeout_s: float = 60.0) -> int | None:
    """Wait for this process's connector's queued stores (see
    `OffloadConnector.wait_for_stores`); returns how many are still pending, or
    None where no connector of ours has its worker in this process."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    return conn.wait_for_stores(timeout_s) if hasattr(conn, "wait_for_stores") else None


def write_row(out: Any, row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()


def make_llm(spec: RunSpec) -> Any:
    """vLLM's LLM for `spec`: its engine arguments and kv-transfer-config, stats logged."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = dict(spec.engine_args)
    if spec.kv_transfer_config is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**spec.kv_transfer_config)
        # vLLM's default (0) kills the engine core 5 s after SIGTERM: stores
        # still queued on a busy machine would be lost when the run ends (the
        # connector warns about it; docs/operations.md). Let them land.
        kw.setdefault("shutdown_timeout", 60)
    return LLM(model=spec.model, disable_log_stats=False, **kw)


def _serve(spec: RunSpec, workdir: Path) -> None:
    from vllm import SamplingParams

    llm = make_llm(spec)
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    with open(workdir / "results.jsonl", "a") as out:
        for p, indices in enumerate(spec.pass_orders()):
            if p:
                land_stores()
                assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
            for i in indices:
                write_row(out, {"pass": p, "index": i, "result": asdict(serve_one(llm, spec.prompts[i], params))})
            write_row(out, {"pass_done": p})
    write_metrics(workdir, kvoffload_metrics())
    del llm  # clean shutdown: the connector finishes its stores in flight


def serve_one(llm: Any, ids: list[int], params: Any) -> PromptResult:
    t0 = time.monotonic()
    o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    wall = time.monotonic() - t0
    m = o.metrics
    ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
    tiers = {k.split(":", 1)[1]: v for k, v in (o.kv_transfer_params or {}).items() if k.startswith("kvoffload:")}
    return PromptResult(
        prompt_tokens=len(ids), cached_tokens=o.num_cached_tokens or 0,
        restored_tokens=sum(int(v["restored_tokens"]) for v in tiers.values()),
        load_failed=any(v["load_failed"] for v in tiers.values()),
        restored_by_tier={t: int(v["restored_tokens"]) for t, v in tiers.items()},
        ttft_s=ttft if ttft > 0 else wall, output_ids=list(o.outputs[0].token_ids), wall_s=wall,
    )


def main(argv: list[str]) -> int:
    workdir = Path(argv[0])
    _serve(RunSpec(**json.loads((workdir / "spec.json").read_text())), workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
