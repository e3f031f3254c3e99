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
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
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


def kv_config(path: Path, warm: bool) -> dict:
    kv = json.loads((REPO / "configs" / "hybrid-tiered.json").read_text())
    extra = kv["kv_connector_extra_config"]
    extra["tiers"][1]["path"] = str(path)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(REPO / ".models" / "qwen3-next-80b-state-ratio"))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the cache directory goes (default: $TMPDIR)")
    ap.add_argument("--out-dir", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.prompts < FIRST:
        ap.error(f"--prompts must be at least {FIRST} (the requests measured after the restart)")
    doc = run(a.model, a.prompts, a.reps, Path(tempfile.mkdtemp(prefix="kvoffload-warm-", dir=a.dir)))
    s = doc["steady"]
    rows = [["steady state (before the restart)", s["from_cpu"], s["from_fs"], "-", f"{s['median_ttft_s'] * 1e3:.1f}",
             "1.00", "-"]]
    for k in ("on", "off"):
        d = doc[k]
        rows.append([f"after a restart, warm start {k}", d["from_cpu"], d["from_fs"], f"{d['share_from_cpu']:.0%}",
                     f"{d['median_ttft_s'] * 1e3:.1f}", f"{d['ttft_vs_steady']:.2f}",
                     f"{d['identical_to_first_pass']}/{FIRST}"])
    print(table(["first 20 requests", "from cpu", "from fs", "share cpu", "median TTFT ms", "vs steady",
                 "identical"], rows))
    on = doc["on"]
    print(f"warm start: {on['warm_entries']:.0f} of {on['warm_planned_entries']:.0f} entries, "
          f"{on['warm_bytes'] / 2**20:.1f} MiB in {on['warm_seconds']:.2f} s, {on['warm_hits']:.0f} hits, "
          f"{on['warm_failures']:.0f} failures")
    st = doc["startup_to_first_token_s"]
    print(f"start-up to the first served token (launch to exit, median of {a.reps}): on {st['on']['median']:.2f} s, "
          f"off {st['off']['median']:.2f} s")
    print(f"wrote {write_results('warm_start', doc, a.out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
