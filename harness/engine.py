"""offload/engine_run.py's engine runner with the hooks of tests and benches.

The product's runner (what `kvoffload warmup` needs) serves a prompt set `passes` times. This one
runs the same engine process (`python -m harness.engine DIR`, built from engine_run's blocks) with:
* `order`: the prompt indices each pass serves; `pause_s`: idle seconds before each later pass;
  `land_stores=False`: the next pass races the stores still in flight;
* `gated`: each pass after the first starts when the parent releases it (`EngineRun.release`, a
  file `go.<pass>` in the run's directory, which the engine polls): a test changes the cache
  between passes, or two engines take turns;
* `hold`: after its last pass the engine stays up until it is killed, as a server killed in service;
* `skip_prefix_cache`, `prompt_max_tokens`: a cold reference in one engine, per-prompt lengths;
* `pass_metrics`: the metrics are also written at the end of each pass (before it reports itself
  done), so that a parent watching a gated run sees them between passes.
Its RunResult says which pass and prompt each result belongs to.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.client import metric_sum, wait_until
from offload import engine_run
from offload.engine_run import PromptResult, land_stores, make_llm, serve_one, write_row

__all__ = ["EngineRun", "PromptResult", "RunResult", "RunSpec", "land_stores", "run_engine", "start_engine"]

REPO = Path(__file__).resolve().parents[1]


@dataclass
class RunSpec(engine_run.RunSpec):
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
    # Write the metrics (metrics.json) at the end of every pass, before its `pass_done` line.
    pass_metrics: bool = False

    def __post_init__(self) -> None:
        if self.prompt_max_tokens is not None and len(self.prompt_max_tokens) != len(self.prompts):
            raise ValueError(f"RunSpec.prompt_max_tokens: {len(self.prompt_max_tokens)} values for "
                             f"{len(self.prompts)} prompts; give one per prompt, or None")

    def pass_orders(self) -> list[list[int]]:
        return self.order if self.order is not None else super().pass_orders()


@dataclass
class RunResult(engine_run.RunResult):
    # The pass each result belongs to, and its prompt's index in RunSpec.prompts.
    pass_of: list[int] = field(default_factory=list)
    index_of: list[int] = field(default_factory=list)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return metric_sum(self.metrics, name, **labels)

    def by_pass(self, p: int) -> dict[int, PromptResult]:
        """Pass `p`'s results by prompt index."""
        return {i: r for r, q, i in zip(self.results, self.pass_of, self.index_of) if q == p}


class EngineRun(engine_run.EngineRun):
    """A running engine process (`start_engine`); `wait()` gives its RunResult."""

    CHILD = "harness.engine"
    spec: RunSpec

    def __init__(self, spec: RunSpec, env: dict[str, str] | None, workdir: Path | None) -> None:
        self._between: Callable[[int], None] | None = None
        self._released = 0
        # The engine process imports this package: the repository on its path, wherever it starts.
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        super().__init__(spec, {"PYTHONPATH": path, **(env or {})}, workdir)

    def served(self) -> list[tuple[int, int, PromptResult]]:
        """(pass, prompt index, result) of every prompt served so far."""
        return [(r["pass"], r["index"], PromptResult(**r["result"])) for r in self.rows() if "result" in r]

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

    def result(self) -> RunResult:
        served = self.served()
        return RunResult([r for _, _, r in served], self.log, self.metrics(), [p for p, _, _ in served],
                         [i for _, i, _ in served])

    def _poll(self, done: int, ended: int) -> None:
        while self.spec.gated and self._released < min(ended, len(self.spec.pass_orders()) - 1):
            if self._between is not None:
                self._between(self._released)
            self._released += 1
            self.release(self._released)

    def wait(self, timeout_s: float = 900, progress: Callable[[int, int], None] | None = None,
             between: Callable[[int], None] | None = None) -> RunResult:
        """Until the engine exits; raise with its log on failure (or after
        `timeout_s`, killing it). `progress(done, total)` as prompts finish;
        `between(p)` runs when pass `p` has ended, before a gated run's next."""
        self._between = between
        r = super().wait(timeout_s, progress)
        assert isinstance(r, RunResult)
        return r


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


# ---- the engine process ---------------------------------------------------------------------


def _serve(spec: RunSpec, workdir: Path) -> None:
    from vllm import SamplingParams

    llm = make_llm(spec)
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
                r = serve_one(llm, spec.prompts[i], params[sizes[i]])
                write_row(out, {"pass": p, "index": i, "result": asdict(r)})
            if spec.gated and spec.land_stores:
                # The parent acts between gated passes (fills or frees a disk, damages files, starts
                # a peer): the pass's stores must have landed, not wait on idle threads of a busy host.
                land_stores()
            if spec.pass_metrics:
                engine_run.write_metrics(workdir, engine_run.kvoffload_metrics())
            write_row(out, {"pass_done": p})
    engine_run.write_metrics(workdir, engine_run.kvoffload_metrics())
    while spec.hold:
        time.sleep(3600)
    del llm  # clean shutdown: the connector finishes its stores in flight


def main(argv: list[str]) -> int:
    workdir = Path(argv[0])
    _serve(RunSpec(**json.loads((workdir / "spec.json").read_text())), workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
