"""`plan_for_model`: vLLM's start-up, replayed in fresh child processes.

The probe (`offload.plan.probe`) leaves global state behind (the distributed
groups, the layers registered by name), so it runs in a fresh
`python -m offload.plan.probe` child process; the caller's process imports
nothing from vLLM.

Tensor parallelism: `tensor_parallel_size=N` starts N such processes, ranks 0
to N-1 of one gloo group, each building its shard of the model on the meta
device (heads divided by N, KV heads replicated where N exceeds them); rank 0
gathers every rank's layer specs and builds the groups as the engine core
does. The CPU platform runs TP with gloo, so this is the platform's own path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from offload.plan.model import ModelPlan
from offload.planner import ChunkSizeError

PLAN_TIMEOUT_S = 600.0


class PlanError(RuntimeError):
    """vLLM cannot build a KV cache configuration for this model here."""


class FlagsError(PlanError):
    """vLLM refuses the flags `serve_flags` planned for this model."""


def _checked_request(model_path: str | os.PathLike, max_model_len: int | None,
                     hybrid_chunk_size: int | None) -> dict[str, Any]:
    path = Path(model_path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(f"model directory {str(path)!r} {what}; pass a local Hugging Face model "
                                "directory (config.json and weights)")
    for name, v in (("max_model_len", max_model_len), ("hybrid_chunk_size", hybrid_chunk_size)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise ValueError(f"{name}={v!r}: must be a positive integer")
    return {"model": str(path.resolve()), "max_model_len": max_model_len, "hybrid_chunk_size": hybrid_chunk_size}


def plan_for_model(model_path: str | os.PathLike, tensor_parallel_size: int = 1, max_model_len: int | None = None,
                   hybrid_chunk_size: int | None = None, timeout_s: float = PLAN_TIMEOUT_S) -> ModelPlan:
    """The plan for a model directory, from vLLM's config code on this platform.

    Runs `tensor_parallel_size` child processes (see the module docstring);
    takes about as long as importing vLLM. Raises `FileNotFoundError` for a
    missing model directory, `ValueError` for bad arguments, `ChunkSizeError`
    for a chunk size that does not fit the groups, and `PlanError` when vLLM
    cannot build a configuration for the model here (the message carries
    vLLM's own error).
    """
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) \
            or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size!r}: must be a positive integer")
    request = _checked_request(model_path, max_model_len, hybrid_chunk_size)
    [result] = _run_children([request], tensor_parallel_size, timeout_s)
    if isinstance(result, Exception):
        raise result
    return result


def plan_for_models(model_paths: Sequence[str | os.PathLike], max_model_len: int | None = None,
                    hybrid_chunk_size: int | None = None,
                    timeout_s: float = PLAN_TIMEOUT_S) -> list[ModelPlan | Exception]:
    """`plan_for_model` for several models at tensor parallel 1, in one child
    process that imports vLLM once and tears its distributed state down
    between models. Per model, the plan or the exception `plan_for_model`
    would raise."""
    out: list[ModelPlan | Exception | None] = []
    requests = []
    for m in model_paths:
        try:
            requests.append(_checked_request(m, max_model_len, hybrid_chunk_size))
            out.append(None)
        except (FileNotFoundError, ValueError) as e:
            out.append(e)
    results = iter(_run_children(requests, 1, timeout_s) if requests else [])
    return [next(results) if r is None else r for r in out]


def _run_children(requests: list[dict[str, Any]], tp: int, timeout_s: float) -> list[ModelPlan | Exception]:
    if tp > 1 and len(requests) != 1:
        raise ValueError("tensor parallel planning takes one model per call")
    with tempfile.TemporaryDirectory(prefix="kvoffload-plan-") as tmp:
        out = Path(tmp) / "plan.json"
        # The rendezvous file's name is the plan's own (mkdtemp's), so that the shared-memory
        # groups named after it (`_dist_ident`) are unique on the machine.
        job = {"models": requests, "tp": tp, "init": f"file://{tmp}/{Path(tmp).name}", "out": str(out)}
        env = dict(os.environ)
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                          env.get("PYTHONPATH")]))
        procs: list[subprocess.Popen] = []
        logs = []
        try:
            for rank in range(tp):
                log = open(Path(tmp) / f"rank{rank}.log", "w+b")  # noqa: SIM115 - closed in the finally below
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "offload.plan.probe", json.dumps({**job, "rank": rank})],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env))
            deadline = time.monotonic() + timeout_s
            # A rank that fails leaves the others waiting in a collective: stop at the first failure,
            # after giving rank 0 a moment to report the error it most likely hit as well.
            while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
                if time.monotonic() > deadline:
                    raise PlanError(f"planning {requests[0]['model']!r} took over {timeout_s:.0f} s")
                time.sleep(0.1)
            grace = min(deadline, time.monotonic() + 15)
            while procs[0].poll() is None and not out.exists() and time.monotonic() < grace:
                time.sleep(0.1)
            rcs = [p.poll() for p in procs]
            tail = ""
            for rank, log in enumerate(logs):
                if rcs[rank]:
                    log.seek(0)
                    text = log.read().decode(errors="replace").strip().splitlines()
                    tail += f"\n--- rank {rank} (exit {rcs[rank]}), last lines:\n" + "\n".join(text[-15:])
            if not out.exists():
                raise PlanError(f"the planning process for {requests[0]['model']!r} failed without a result "
                                f"(tensor_parallel_size={tp}):{tail}")
            results = json.loads(out.read_text())
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()
    plans: list[ModelPlan | Exception] = []
    for req, res in zip(requests, results):
        err = res.get("error")
        if err is None:
            plans.append(ModelPlan.from_json(res))
        elif err["type"] == "ChunkSizeError":
            plans.append(ChunkSizeError(err["message"]))
        elif err["type"] == "FlagsError":
            plans.append(FlagsError(f"{req['model']}: {err['message']}"))
        else:
            plans.append(PlanError(
                f"vLLM cannot build a KV cache configuration for {req['model']!r} "
                f"(tensor_parallel_size={tp}) on this platform: {err['type']}: {err['message']}"))
    return plans
