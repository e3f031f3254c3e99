"""Warm start, measured on engines: what a restart costs with it on and off.

    python -m bench.warm_start [--model PATH] [--prompts 24] [--reps 3] [--dir DIR]

A first engine (configs/hybrid-tiered.json: host memory over files, the plan's flags) serves a set
of prompts that share prefixes in groups of three (it stores them), then serves them again after
vLLM's own prefix cache is emptied: the steady state, restored from host memory. Then a new engine
on the same directory (a restart) serves one short prompt (under a chunk: it looks nothing up and
stores nothing; its first step is when warm start plans), waits a few seconds (a quiet server), and
serves the first 20 prompts. Once with warm start on (the default), once off, one after the other
on an otherwise idle machine. Reported: the share of the 20 requests' restored tokens that came
from host memory, their median TTFT against the steady state's (the same 20 prompts), warm start's
own figures (entries, bytes, seconds to done, hits), and whether the tokens equal the first
engine's first pass. Then start-up to the first served token: an engine that serves only the short
prompt, from launch to exit, `--reps` times each, on and off interleaved (median).

Writes bench/results/warm_start.json (or --out-dir).

`--trace conversation|branching`: a restart in the middle of a trace-derived workload instead. The
requests are the slice tests/test_e2e_state_policy.py serves (bench/trace_slice.py: the Mooncake
conversation trace sampled by conversation, or the branching trace by context; each trace block id
one chunk of deterministic token ids), one at a time, in trace order, with vLLM's own KV cache held
to a few requests (`num_gpu_blocks_override`: its prefix cache keeps little, as on a busy server) and
host memory at `--cpu-bytes` (default 64 MiB: under the first part's files, so warm start chooses
what it reads). A first engine serves the first `--restart-after` requests (default: half) and
stops; its directory is copied; a new engine on each copy (warm start on, then off; `--order` swaps
them between runs) serves the short prompt, waits PAUSE_S, and serves the rest of the slice.
Reported for the first 20 requests after the restart: the share of their restored tokens that came
from host memory, their median TTFT against the median of the last 20 before the restart (the
steady state), warm start's figures, and how many of them (and of the whole rest) gave the tokens
of a reference engine with the do-nothing connector (tests/noop_connector.py) that reads no prefix
cache. Writes bench/results/warm_start_trace.json (or --out-dir, --name).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.common import table, write_results
from harness.engine import RunSpec, run_engine

REPO = Path(__file__).resolve().parents[1]
FIRST = 20  # requests after the restart that are measured
PAUSE_S = 3.0  # the quiet time after the short prompt
MAX_TOKENS = 4


def prompt_set(chunk: int, n: int, vocab: int, seed: int = 11) -> list[list[int]]:
    """`n` prompts in groups of three sharing a prefix of 2-5 chunks, each with an own part of about a chunk."""
    rng = random.Random(seed)
    hi = min(vocab, 30000) - 1
    out: list[list[int]] = []
    while len(out) < n:
        prefix = [rng.randrange(2, hi) for _ in range(rng.randrange(2, 6) * chunk)]
        for _ in range(3):
            out.append(prefix + [rng.randrange(2, hi) for _ in range(rng.randrange(chunk // 2, chunk + chunk // 2))])
    return out[:n]


def kv_config(path: Path, warm: bool, cpu_bytes: int | None = None) -> dict:
    kv = json.loads((REPO / "configs" / "hybrid-tiered.json").read_text())
    extra = kv["kv_connector_extra_config"]
    extra["tiers"][1]["path"] = str(path)
    if cpu_bytes is not None:
        extra["tiers"][0]["cpu_bytes"] = cpu_bytes
    extra["warm_start"] = warm
    return kv


def from_tier(results, tier: str) -> int:
    return sum(r.restored_by_tier.get(tier, 0) for r in results)


def run(model: str, n: int, reps: int, work: Path) -> dict:
    from offload.plan.run import plan_for_model

    plan = plan_for_model(model)
    chunk = plan.hybrid_chunk_size
    cfg = json.loads((Path(model) / "config.json").read_text())
    args = {"enable_prefix_caching": True, "enforce_eager": True,
            "max_model_len": min(8192, int(cfg.get("max_position_embeddings", 8192))), **plan.engine_kwargs}
    vocab = int(cfg.get("vocab_size", 1024))
    prompts = prompt_set(chunk, n, vocab)
    kick = prompts[0][: chunk // 2]
    every, kick_i = list(range(n)), n
    cache = work / "cache"
    first = run_engine(RunSpec(model, [*prompts, kick], kv_config(cache, True), MAX_TOKENS, args,
                               order=[every, every]))
    ref = first.by_pass(0)
    steady = first.by_pass(1)
    doc: dict = {"model": Path(model).name, "chunk": chunk,
                 "prompts": n, "measured": FIRST, "pause_s": PAUSE_S, "engine_args": args,
                 "steady": {"median_ttft_s": statistics.median(steady[i].ttft_s for i in range(FIRST)),
                            "from_cpu": from_tier([steady[i] for i in range(FIRST)], "cpu"),
                            "from_fs": from_tier([steady[i] for i in range(FIRST)], "fs")}}
    for warm in (True, False):
        r = run_engine(RunSpec(model, [*prompts, kick], kv_config(cache, warm), MAX_TOKENS, args,
                               order=[[kick_i], every[:FIRST]], pause_s=PAUSE_S))
        after = r.by_pass(1)
        rows = [after[i] for i in range(FIRST)]
        cpu, fs = from_tier(rows, "cpu"), from_tier(rows, "fs")
        doc["on" if warm else "off"] = {
            "from_cpu": cpu, "from_fs": fs, "share_from_cpu": round(cpu / max(1, cpu + fs), 4),
            "median_ttft_s": statistics.median(x.ttft_s for x in rows),
            "ttft_vs_steady": round(statistics.median(x.ttft_s for x in rows) / doc["steady"]["median_ttft_s"], 3),
            "identical_to_first_pass": sum(after[i].output_ids == ref[i].output_ids for i in range(FIRST)),
            "load_failed": sum(x.load_failed for x in rows),
            "warm_planned_entries": r.metric("kvoffload_warm_planned_entries", tier="cpu"),
            "warm_entries": r.metric("kvoffload_warm_entries_total", tier="cpu"),
            "warm_bytes": r.metric("kvoffload_warm_bytes_total", tier="cpu"),
            "warm_failures": r.metric("kvoffload_warm_failures_total", tier="cpu"),
            "warm_seconds": r.metric("kvoffload_warm_seconds", tier="cpu"),
            "warm_hits": r.metric("kvoffload_warm_hits_total", tier="cpu"),
        }
    # Start-up to the first served token: launch to exit of an engine serving the short prompt only.
    startup: dict[str, list[float]] = {"on": [], "off": []}
    for _ in range(reps):
        for warm in (True, False):
            t0 = time.perf_counter()
            run_engine(RunSpec(model, [kick], kv_config(cache, warm), 1, args))
            startup["on" if warm else "off"].append(round(time.perf_counter() - t0, 2))
    doc["startup_to_first_token_s"] = {k: {"runs": v, "median": statistics.median(v)} for k, v in startup.items()}
    return doc


TRACE_CPU_BYTES = 64 << 20
GPU_REQUESTS = 2  # requests' worth of vLLM's own KV cache in the trace mode


def warm_figures(r) -> dict:
    return {k: r.metric(f"kvoffload_warm_{m}", tier="cpu") for k, m in (
        ("warm_planned_entries", "planned_entries"), ("warm_entries", "entries_total"),
        ("warm_bytes", "bytes_total"), ("warm_failures", "failures_total"), ("warm_seconds", "seconds"),
        ("warm_hits", "hits_total"))}


def run_trace(model: str, trace: str, requests: int, restart_after: int | None, cpu_bytes: int, work: Path,
              order: str = "on-off") -> dict:
    """The trace mode (module doc)."""
    from bench.trace_slice import CASES, prompt_of, trace_slice
    from offload.plan.run import plan_for_model

    sys.path.insert(0, str(REPO / "tests"))
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath

    plan = plan_for_model(model)
    chunk = plan.hybrid_chunk_size
    case = CASES[trace]
    items = trace_slice(chunk, case, requests)
    blocks: dict[int, list[int]] = {}
    prompts = [prompt_of(it, chunk, blocks) for it in items]
    cut = restart_after if restart_after is not None else len(prompts) // 2
    if not FIRST <= cut <= len(prompts) - FIRST:
        raise ValueError(f"--restart-after {cut}: needs {FIRST} requests before the restart and {FIRST} after it "
                         f"(the slice has {len(prompts)}); give a value in [{FIRST}, {len(prompts) - FIRST}]")
    # As the state-policy test sizes them: the longest prompt, and vLLM's KV cache for a few requests.
    max_len = case.max_chunks * chunk + (plan.prefix_match_unit or chunk)
    mamba_groups = sum(1 for g in plan.groups if g.kind == "mamba")
    gpu_blocks = GPU_REQUESTS * (-(-max_len // max(plan.block_sizes)) + 2 * mamba_groups) + 8
    args = {**plan.engine_kwargs, "enable_prefix_caching": True, "enforce_eager": True, "max_model_len": max_len,
            "num_gpu_blocks_override": gpu_blocks}
    kick = prompts[0][: chunk // 2]
    kick_i = len(prompts)
    before, rest = list(range(cut)), list(range(cut, len(prompts)))
    cache = work / "cache"
    first = run_engine(RunSpec(model, [*prompts, kick], kv_config(cache, True, cpu_bytes), MAX_TOKENS, args,
                               order=[before]), timeout_s=1800)
    steady = [first.by_pass(0)[i] for i in before[-FIRST:]]
    files = [f for f in cache.rglob("*.kv") if f.is_file()]
    doc: dict = {
        "model": Path(model).name, "chunk": chunk, "bytes_per_chunk": plan.bytes_per_chunk,
        "trace": {"name": trace, "file": case.trace.name, "requests": len(prompts), "restart_after": cut,
                  "prompt_tokens": sum(map(len, prompts)),
                  "minutes_at_restart": round(items[cut]["timestamp_ms"] / 60000, 1),
                  "max_chunks": case.max_chunks},
        "measured": FIRST, "pause_s": PAUSE_S, "max_tokens": MAX_TOKENS, "order": order,
        "engine_args": args, "cpu_bytes": cpu_bytes,
        "files_at_restart": {"count": len(files), "bytes": sum(f.stat().st_size for f in files)},
        "steady": {"median_ttft_s": statistics.median(r.ttft_s for r in steady),
                   "from_cpu": from_tier(steady, "cpu"), "from_fs": from_tier(steady, "fs")},
    }
    dirs = {"on": cache, "off": work / "cache-off"}
    shutil.copytree(cache, dirs["off"])  # the same files for both: each run stores into its own copy
    runs = {}
    for k in order.split("-"):
        runs[k] = run_engine(RunSpec(model, [*prompts, kick], kv_config(dirs[k], k == "on", cpu_bytes), MAX_TOKENS,
                                     args, order=[[kick_i], rest], pause_s=PAUSE_S), timeout_s=1800)
    distinct = list({tuple(prompts[i]): None for i in rest})
    ref = run_engine(RunSpec(model, [list(p) for p in distinct], NOOP, MAX_TOKENS, args, skip_prefix_cache=True),
                     env={"PYTHONPATH": pythonpath()}, timeout_s=1800)
    want = {p: r.output_ids for p, r in zip(distinct, ref.results)}
    for k, r in runs.items():
        after = r.by_pass(1)
        rows = [after[i] for i in rest[:FIRST]]
        cpu, fs = from_tier(rows, "cpu"), from_tier(rows, "fs")
        whole = [after[i] for i in rest]
        rest_cpu, rest_fs = from_tier(whole, "cpu"), from_tier(whole, "fs")
        doc[k] = {
            "from_cpu": cpu, "from_fs": fs, "share_from_cpu": round(cpu / max(1, cpu + fs), 4),
            "median_ttft_s": statistics.median(x.ttft_s for x in rows),
            "ttft_vs_steady": round(statistics.median(x.ttft_s for x in rows) / doc["steady"]["median_ttft_s"], 3),
            "identical_to_reference": sum(x.output_ids == want[tuple(prompts[i])] for i, x in zip(rest, rows)),
            "rest": {"requests": len(rest), "from_cpu": rest_cpu, "from_fs": rest_fs,
                     "share_from_cpu": round(rest_cpu / max(1, rest_cpu + rest_fs), 4),
                     "median_ttft_s": statistics.median(x.ttft_s for x in whole),
                     "identical_to_reference": sum(after[i].output_ids == want[tuple(prompts[i])] for i in rest)},
            "load_failed": sum(x.load_failed for x in whole),
            **warm_figures(r),
        }
    return doc


def _first_rows(doc: dict, steady: str, after: str, same: str) -> list[list]:
    """The steady state's row, then the first requests' after the restart, warm start on and off
    (`same`: the key of their count of outputs equal to the reference)."""
    s = doc["steady"]
    rows = [[steady, s["from_cpu"], s["from_fs"], "-", f"{s['median_ttft_s'] * 1e3:.1f}", "1.00", "-"]]
    for k in ("on", "off"):
        d = doc[k]
        rows.append([f"{after}, warm start {k}", d["from_cpu"], d["from_fs"], f"{d['share_from_cpu']:.0%}",
                     f"{d['median_ttft_s'] * 1e3:.1f}", f"{d['ttft_vs_steady']:.2f}", f"{d[same]}/{FIRST}"])
    return rows


def print_trace(doc: dict) -> None:
    rows = _first_rows(doc, "steady state (the 20 before the restart)", "after the restart", "identical_to_reference")
    print(table(["first 20 requests", "from cpu", "from fs", "share cpu", "median TTFT ms", "vs steady",
                 "= reference"], rows))
    for k in ("on", "off"):
        d = doc[k]
        print(f"warm start {k}: {d['warm_entries']:.0f} of {d['warm_planned_entries']:.0f} entries, "
              f"{d['warm_bytes'] / 2**20:.1f} MiB in {d['warm_seconds']:.2f} s, {d['warm_hits']:.0f} hits; "
              f"the whole rest ({d['rest']['requests']}): {d['rest']['share_from_cpu']:.0%} from host memory, "
              f"{d['rest']['identical_to_reference']} identical to the reference, {d['load_failed']} failed loads")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / ".models" / "qwen3-next-80b-state-ratio"))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the cache directory goes (default: $TMPDIR)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--trace", choices=("conversation", "branching"), default=None,
                    help="a restart in the middle of this trace's slice instead (module doc)")
    ap.add_argument("--requests", type=int, default=120, help="--trace: requests of the slice")
    ap.add_argument("--restart-after", type=int, default=None, help="--trace: requests before the restart")
    ap.add_argument("--cpu-bytes", type=int, default=TRACE_CPU_BYTES, help="--trace: host memory")
    ap.add_argument("--order", choices=("on-off", "off-on"), default="on-off",
                    help="--trace: which restart runs first")
    ap.add_argument("--name", default=None, help="the results file's name (default warm_start, warm_start_trace)")
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvoffload-warm-", dir=a.dir))
    if a.trace is not None:
        try:
            doc = run_trace(a.model, a.trace, a.requests, a.restart_after, a.cpu_bytes, work, a.order)
        except ValueError as e:
            ap.error(str(e))
        print_trace(doc)
        print(f"wrote {write_results(a.name or 'warm_start_trace', doc, a.out_dir)}")
        return 0
    if a.prompts < FIRST:
        ap.error(f"--prompts must be at least {FIRST} (the requests measured after the restart)")
    doc = run(a.model, a.prompts, a.reps, work)
    rows = _first_rows(doc, "steady state (before the restart)", "after a restart", "identical_to_first_pass")
    print(table(["first 20 requests", "from cpu", "from fs", "share cpu", "median TTFT ms", "vs steady",
                 "identical"], rows))
    on = doc["on"]
    print(f"warm start: {on['warm_entries']:.0f} of {on['warm_planned_entries']:.0f} entries, "
          f"{on['warm_bytes'] / 2**20:.1f} MiB in {on['warm_seconds']:.2f} s, {on['warm_hits']:.0f} hits, "
          f"{on['warm_failures']:.0f} failures")
    st = doc["startup_to_first_token_s"]
    print(f"start-up to the first served token (launch to exit, median of {a.reps}): on {st['on']['median']:.2f} s, "
          f"off {st['off']['median']:.2f} s")
    print(f"wrote {write_results(a.name or 'warm_start', doc, a.out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
