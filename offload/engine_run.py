"""Serve a prompt set through a fresh vLLM engine process and report per prompt.

A restart is a new process, so every run happens in a subprocess
(`python -m offload.engine_run SPEC OUT [PROGRESS]`): the demo, the end-to-end
tests and the warm-up CLI (its progress bar from `progress`) all use this one
runner and measure what an operator's restarted server would see.
Prompts are served one at a time so that batch composition cannot change a
near-tie greedy token between runs (random-weight bf16 models have many).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any, TextIO


@dataclass(frozen=True)
class PromptResult:
    prompt_tokens: int
    cached_tokens: int  # vLLM's num_cached_tokens: local prefix cache + connector
    restored_tokens: int  # loaded by OffloadConnector tiers (0 without them)
    load_failed: bool
    ttft_s: float
    output_ids: list[int]
    restored_by_tier: dict[str, int] = field(default_factory=dict)


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
    # Or: the prompt indices each pass serves, in order (overrides `passes`).
    order: list[list[int]] | None = None
    # Idle seconds before each pass after the first (a server's quiet time:
    # the stores still in flight land).
    pause_s: float = 0.0


@dataclass
class RunResult:
    results: list[PromptResult]
    log: str  # the engine's stdout+stderr, for checks on what it logged
    # kvoffload_* Prometheus samples (name, labels, value) as the engine's own
    # stat logger exported them after the last pass (offload/metrics.py).
    metrics: list[tuple[str, dict[str, str], float]] = field(default_factory=list)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return sum(v for n, lab, v in self.metrics
                   if n == name and all(lab.get(k) == want for k, want in labels.items()))

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


def run_engine(spec: RunSpec, env: dict[str, str] | None = None, timeout_s: float = 900,
               progress: Callable[[int, int], None] | None = None) -> RunResult:
    """Run `spec` in a new Python process; raise with the engine log on
    failure (or after `timeout_s`). `progress(done, total)` is called as the
    child finishes prompts (the CLI draws its bar from it)."""
    total = sum(map(len, spec.order)) if spec.order else len(spec.prompts) * spec.passes
    with tempfile.TemporaryDirectory(prefix="kvoffload-run-") as tmp:
        spec_path, out_path, prog, log_path = (Path(tmp, n) for n in ("spec.json", "out.json", "progress", "log"))
        spec_path.write_text(json.dumps(asdict(spec)))
        prog.touch()
        full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                    **(env or {})}
        with open(log_path, "w") as lf:
            proc = subprocess.Popen([sys.executable, "-m", "offload.engine_run", str(spec_path), str(out_path),
                                     str(prog)], env=full_env, stdout=lf, stderr=subprocess.STDOUT)
        deadline, seen = time.monotonic() + timeout_s, 0
        while True:
            finished = proc.poll() is not None
            done = len(prog.read_text()) // 2
            if progress is not None and done > seen:
                progress(done, total)
                seen = done
            if finished:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(proc.args, timeout_s, output=log_path.read_text(errors="replace"))
            time.sleep(0.2)
        log = log_path.read_text(errors="replace")
        if proc.returncode != 0 or not out_path.exists():
            raise RuntimeError(f"engine run failed (exit {proc.returncode}):\n{log[-6000:]}")
        results = [PromptResult(**r) for r in json.loads(out_path.read_text())]
        return RunResult(results, log, read_metrics(out_path))


def read_metrics(out_path: Path) -> list[tuple[str, dict[str, str], float]]:
    """The samples a child wrote next to its results file (OUT.metrics)."""
    p = Path(f"{out_path}.metrics")
    return [tuple(m) for m in json.loads(p.read_text())] if p.exists() else []


def _metrics() -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client import REGISTRY

    return [(s.name, dict(s.labels), s.value) for m in REGISTRY.collect() if m.name.startswith("kvoffload")
            for s in m.samples]


def _serve(spec: RunSpec, progress: TextIO | None = None) -> tuple[list[PromptResult],
                                                                    list[tuple[str, dict[str, str], float]]]:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = dict(spec.engine_args)
    if spec.kv_transfer_config is not None:
        kw["kv_transfer_config"] = KVTransferConfig(**spec.kv_transfer_config)
        # vLLM's default (0) kills the engine core 5 s after SIGTERM: stores
        # still queued on a busy machine would be lost when the run ends (the
        # connector warns about it; docs/operations.md). Let them land.
        kw.setdefault("shutdown_timeout", 60)
    llm = LLM(model=spec.model, disable_log_stats=False, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    out: list[PromptResult] = []
    order = spec.order or [list(range(len(spec.prompts)))] * spec.passes
    for p, indices in enumerate(order):
        if p:
            time.sleep(spec.pause_s)
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        out.extend(_serve_pass(llm, [spec.prompts[i] for i in indices], params, progress))
    metrics = _metrics()
    del llm  # clean shutdown: the connector finishes its stores in flight
    return out, metrics


def _serve_pass(llm: Any, prompts: list[list[int]], params: Any, progress: TextIO | None = None) -> list[PromptResult]:
    out: list[PromptResult] = []
    for ids in prompts:
        t0 = time.monotonic()
        o = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        wall = time.monotonic() - t0
        m = o.metrics
        ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
        tiers = {k.split(":", 1)[1]: v for k, v in (o.kv_transfer_params or {}).items()
                 if k.startswith("kvoffload:")}
        out.append(PromptResult(
            prompt_tokens=len(ids), cached_tokens=o.num_cached_tokens or 0,
            restored_tokens=sum(int(v["restored_tokens"]) for v in tiers.values()),
            load_failed=any(v["load_failed"] for v in tiers.values()),
            restored_by_tier={t: int(v["restored_tokens"]) for t, v in tiers.items()},
            ttft_s=ttft if ttft > 0 else wall, output_ids=list(o.outputs[0].token_ids),
        ))
        if progress is not None:
            progress.write(".\n")  # a line per prompt: the parent counts them
            progress.flush()
    return out


def main(argv: list[str]) -> int:
    spec = RunSpec(**json.loads(Path(argv[0]).read_text()))
    with open(argv[2] if len(argv) > 2 else os.devnull, "a") as progress:
        results, metrics = _serve(spec, progress)
    Path(argv[1]).write_text(json.dumps([asdict(r) for r in results]))
    Path(argv[1] + ".metrics").write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
