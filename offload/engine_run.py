"""Serve a prompt set through a fresh vLLM engine process and report per prompt.

A restart is a new process, so every run happens in a subprocess
(`python -m offload.engine_run SPEC DIR`): the demo, the end-to-end tests and
the warm-up CLI (its progress bar from `progress`) all use this one runner and
measure what an operator's restarted server would see.
Prompts are served one at a time so that batch composition cannot change a
near-tie greedy token between runs (random-weight bf16 models have many).

The child writes one JSON line per served prompt to DIR/results.jsonl as it
goes (a run killed with SIGKILL still reports what it served), a line per
finished pass, and its metrics to DIR/metrics.json after the last pass. With
`RunSpec.gated` each pass after the first waits until the parent releases it
(`EngineRun.release`): a test changes the cache between passes, or two
engines take turns. With `RunSpec.hold` the engine stays up after its last
pass until it is killed, as a server killed in service would.

The end of the module is the one client harness that tests/ and bench/ share
for servers they start: a free port, a completion, /metrics read through
prometheus_client's parser, sums of samples, medians and polling with a
deadline.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

# Prometheus samples: (name, labels, value), names as exported (`_total`, `_sum`, `_bucket` kept).
Samples = list[tuple[str, dict[str, str], float]]
T = TypeVar("T")


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
    # Or: the prompt indices each pass serves, in order (overrides `passes`).
    order: list[list[int]] | None = None
    # Idle seconds before each pass after the first (a server's quiet time:
    # the stores still in flight land).
    pause_s: float = 0.0
    # Before each pass after the first, wait (up to 60 s) for the connector's
    # queued stores to land, where its worker runs in this process
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0); False: the next pass races them.
    land_stores: bool = True
    # Each pass after the first starts when the parent releases it (EngineRun.release);
    # with land_stores, a gated pass's stores land before it reports itself done.
    gated: bool = False
    # After the last pass, stay up until killed (stores may still be in flight).
    hold: bool = False
    # Requests read no prefix cache (vLLM's own nor a connector's): a cold
    # reference for prompts that share prefixes, in one engine.
    skip_prefix_cache: bool = False
    # Each prompt's own max_tokens, in the order of `prompts` (instead of `max_tokens`).
    prompt_max_tokens: list[int] | None = None

    def __post_init__(self) -> None:
        if self.prompt_max_tokens is not None and len(self.prompt_max_tokens) != len(self.prompts):
            raise ValueError(f"RunSpec.prompt_max_tokens: {len(self.prompt_max_tokens)} values for "
                             f"{len(self.prompts)} prompts; give one per prompt, or None")

    def pass_orders(self) -> list[list[int]]:
        return self.order if self.order is not None else [list(range(len(self.prompts)))] * self.passes


@dataclass
class RunResult:
    results: list[PromptResult]
    log: str  # the engine's stdout+stderr, for checks on what it logged
    # kvoffload_* Prometheus samples (name, labels, value) as the engine's own
    # stat logger exported them after the last pass (offload/metrics.py).
    metrics: Samples = field(default_factory=list)
    # The pass each result belongs to, and its prompt's index in RunSpec.prompts.
    pass_of: list[int] = field(default_factory=list)
    index_of: list[int] = field(default_factory=list)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return metric_sum(self.metrics, name, **labels)

    def by_pass(self, p: int) -> dict[int, PromptResult]:
        """Pass `p`'s results by prompt index."""
        return {i: r for r, q, i in zip(self.results, self.pass_of, self.index_of) if q == p}

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
        return median(r.ttft_s for r in self.results) if self.results else 0.0

    def outputs(self) -> list[list[int]]:
        return [r.output_ids for r in self.results]


class EngineRun:
    """A running engine process (`start_engine`); `wait()` gives its RunResult."""

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
            self.proc = subprocess.Popen([sys.executable, "-m", "offload.engine_run", str(self.dir)], env=full_env,
                                         stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rows(self) -> list[dict]:
        """What the child has reported so far: {"pass", "index", "result"} per prompt, {"pass_done"} per pass."""
        text = self.results_path.read_text()
        return [json.loads(ln) for ln in text.splitlines()[: text.count("\n")] if ln]

    def served(self) -> list[tuple[int, int, PromptResult]]:
        """(pass, prompt index, result) of every prompt served so far."""
        return [(r["pass"], r["index"], PromptResult(**r["result"])) for r in self.rows() if "result" in r]

    def passes_done(self) -> int:
        return sum(1 for r in self.rows() if "pass_done" in r)

    def wait_pass(self, p: int, timeout_s: float = 900) -> None:
        """Until pass `p` has finished; raises if the engine exits first."""

        def ended() -> bool:
            if self.passes_done() > p:
                return True
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine exited (code {self.proc.returncode}) before pass {p} ended:\n"
                                   f"{self.log[-6000:]}")
            return False

        wait_until(ended, timeout_s, f"pass {p} to end", interval_s=0.1)

    def release(self, p: int) -> None:
        """Let a gated run start pass `p`."""
        (self.dir / f"go.{p}").touch()

    def metrics(self) -> Samples:
        p = self.dir / "metrics.json"
        return [tuple(m) for m in json.loads(p.read_text())] if p.exists() else []

    def result(self) -> RunResult:
        served = self.served()
        return RunResult([r for _, _, r in served], self.log, self.metrics(), [p for p, _, _ in served],
                         [i for _, i, _ in served])

    def kill(self) -> None:
        """SIGKILL to the engine's whole process group."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def wait(self, timeout_s: float = 900, progress: Callable[[int, int], None] | None = None,
             between: Callable[[int], None] | None = None) -> RunResult:
        """Until the engine exits; raise with its log on failure (or after
        `timeout_s`, killing it). `progress(done, total)` as prompts finish;
        `between(p)` runs when pass `p` has ended, before a gated run's next."""
        orders = self.spec.pass_orders()
        total = sum(map(len, orders))
        deadline, seen, released = time.monotonic() + timeout_s, 0, 0
        try:
            while True:
                finished = self.proc.poll() is not None
                rows = self.rows()
                done = sum(1 for r in rows if "result" in r)
                if progress is not None and done > seen:
                    progress(done, total)
                    seen = done
                ended = sum(1 for r in rows if "pass_done" in r)
                while self.spec.gated and released < min(ended, len(orders) - 1):
                    if between is not None:
                        between(released)
                    released += 1
                    self.release(released)
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


def start_engine(spec: RunSpec, env: dict[str, str] | None = None, workdir: Path | None = None) -> EngineRun:
    """Start `spec` in a new Python process (its files under `workdir`, else a temporary directory)."""
    return EngineRun(spec, env, workdir)


def run_engine(spec: RunSpec, env: dict[str, str] | None = None, timeout_s: float = 900,
               progress: Callable[[int, int], None] | None = None,
               between: Callable[[int], None] | None = None) -> RunResult:
    """Run `spec` in a new Python process to its end (see EngineRun.wait)."""
    if between is not None:
        spec.gated = True
    return start_engine(spec, env).wait(timeout_s, progress, between)


def _metrics() -> Samples:
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


def _write_line(out: Any, row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()


def _serve(spec: RunSpec, workdir: Path) -> None:
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
    sizes = spec.prompt_max_tokens if spec.prompt_max_tokens is not None else [spec.max_tokens] * len(spec.prompts)
    params = {n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                skip_reading_prefix_cache=spec.skip_prefix_cache or None) for n in set(sizes)}
    with open(workdir / "results.jsonl", "a") as out:
        for p, indices in enumerate(spec.pass_orders()):
            if p:
                while spec.gated and not (workdir / f"go.{p}").exists():
                    time.sleep(0.05)
                time.sleep(spec.pause_s)
                if spec.land_stores:
                    land_stores()
                assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
            for i in indices:
                _write_line(out, {"pass": p, "index": i,
                                  "result": asdict(_serve_one(llm, spec.prompts[i], params[sizes[i]]))})
            if spec.gated and spec.land_stores:
                # The parent acts between gated passes (fills or frees a disk, damages files, starts
                # a peer): the pass's stores must have landed, not wait on idle threads of a busy host.
                land_stores()
            _write_line(out, {"pass_done": p})
    (workdir / "metrics.json").write_text(json.dumps(_metrics()))
    while spec.hold:
        time.sleep(3600)
    del llm  # clean shutdown: the connector finishes its stores in flight


def _serve_one(llm: Any, ids: list[int], params: Any) -> PromptResult:
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


# ---- the client harness of tests/ and bench/ ---------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the caller's server binds it next)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Poll `pred` until it returns a truthy value, which is returned; TimeoutError naming `what`
    after `timeout_s`. An exception from `pred` propagates (a server that died is not waited for)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(interval_s)


def parse_metrics(text: str) -> Samples:
    """Every sample of a Prometheus text exposition, through prometheus_client's parser."""
    return [(s.name, dict(s.labels), float(s.value)) for fam in text_string_to_metric_families(text)
            for s in fam.samples]


def scrape(base: str, timeout_s: float = 60) -> Samples:
    """Every sample of the server's /metrics."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=timeout_s) as r:
        return parse_metrics(r.read().decode())


def metric_sum(samples: Samples, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == want for k, want in labels.items()))


def metric_by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """`name`'s samples summed per value of `label` ("" where a sample lacks it)."""
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name:
            out[lab.get(label, "")] = out.get(lab.get(label, ""), 0.0) + v
    return out


def complete(base: str, prompt: list[int], max_tokens: int = 4, *, model: str = "tiny", timeout_s: float = 300,
             **body: Any) -> dict:
    """One greedy `/v1/completions` request of token ids; `body` adds fields (e.g. ignore_eos,
    return_token_ids, logprobs). Returns the response's JSON."""
    data = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       **body}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def median(xs: Iterable[float | None]) -> float:
    """The median of the values that are not None; NaN when there are none."""
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else math.nan


def main(argv: list[str]) -> int:
    workdir = Path(argv[0])
    _serve(RunSpec(**json.loads((workdir / "spec.json").read_text())), workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
