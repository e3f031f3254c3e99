"""`make demo`: a cross-restart warm-up run on the embedded tiny hybrid model.

Three engine processes serve the same prompt set (groups of prompts sharing a
prefix), by default through the tiered config (CPU child + filesystem child):
a reference without the connector, run 1 (cold cache: it stores), and run 2
after a restart (a new process, empty vLLM prefix cache and host memory,
another PYTHONHASHSEED: it restores from disk). Run 2 then serves the set
again after `reset_prefix_cache()`: the prefixes it loaded from disk were
promoted to host memory. Prints prompt tokens, tokens restored per tier, hit
rate against the expected chunk-aligned shared-prefix fraction, median TTFT,
and whether outputs are token-identical.

The gate is run 2 against run 1: the same engine with the connector loaded,
run 1 restoring nothing from disk. Merely loading a KV connector (even one
that does nothing) can flip a near-tie bf16 greedy token of a random-weight
model in vLLM (../shared/notes/cpu-platform.md), so the comparison with the
no-connector run is printed for information. Exits non-zero if run 2 misses
its expected hit rate or differs from run 1 in any token.

    python -m offload.demo [--model PATH] [--config configs/fs.json] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

from offload.engine_run import RunResult, RunSpec, run_engine

REPO = Path(__file__).resolve().parents[1]
HYBRID_TYPES = {"qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "falcon_h1", "jamba",
                "granitemoehybrid", "zamba2", "bamba", "mamba2"}


def is_hybrid(model: str) -> bool:
    cfg = json.loads((Path(model) / "config.json").read_text()) if Path(model, "config.json").exists() else {}
    layer_types = set(cfg.get("layer_types") or [])
    return cfg.get("model_type") in HYBRID_TYPES or bool(layer_types & {"linear_attention", "mamba"})


def prompt_set(chunk: int, vocab: int, seed: int = 7) -> tuple[list[list[int]], list[int]]:
    """Four groups of three prompts; each group shares a prefix of 1-4 chunks
    (a multiple of the chunk size, so vLLM's own block-aligned reuse within a
    run never exceeds what the disk tier restores after a restart)."""
    rng = random.Random(seed)
    hi = min(vocab, 30000) - 1
    prompts, shared = [], []
    for g in range(4):
        prefix = [rng.randrange(2, hi) for _ in range((g + 1) * chunk)]
        for k in range(3):
            prompts.append(prefix + [rng.randrange(2, hi) for _ in range(rng.randrange(100, chunk + 150))])
            shared.append(len(prefix) if k else 0)  # what a later prompt shares with an earlier one
    return prompts, shared


def _row(label: str, r: RunResult, names: list[str], expected: float | None, identical: str) -> str:
    exp = f"{expected:8.1%}" if expected is not None else f"{'-':>8}"
    per_tier = "".join(f"{sum(x.restored_by_tier.get(t, 0) for x in r.results):>10}" for t in names)
    return (f"{label:<19}{r.prompt_tokens:>11}{per_tier}{r.cached_tokens:>9}"
            f"{r.hit_rate:>10.1%}{exp:>10}{r.median_ttft_s * 1000:>12.1f} ms  {identical}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="cross-restart warm-up demo")
    ap.add_argument("--model", default=str(REPO / ".models" / "qwen3-next-tiny"))
    ap.add_argument("--config", default=str(REPO / "configs" / "hybrid-tiered.json"), help="kv-transfer-config JSON")
    ap.add_argument("--cache-dir", default=str(REPO / ".cache" / "demo"), help="replaces the fs tier's path")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args(argv)

    kv = json.loads(Path(args.config).read_text())
    cache = Path(args.cache_dir).resolve()
    shutil.rmtree(cache, ignore_errors=True)  # run 1 must start cold
    tiers = [c.get("kv_connector_extra_config", {}) for c in kv["kv_connector_extra_config"].get("children", [kv])]
    for t in tiers:
        if t.get("store") == "fs":
            t["path"] = str(cache)
    chunk = int(next((t["hybrid_chunk_size"] for t in tiers if t.get("hybrid_chunk_size")), 256))
    names = [t.get("name") or t.get("store", "?") for t in tiers]
    model_cfg = json.loads((Path(args.model) / "config.json").read_text())
    prompts, shared = prompt_set(chunk, int(model_cfg.get("vocab_size", 1024)))
    hybrid = is_hybrid(args.model)
    max_len = min(int(model_cfg.get("max_position_embeddings", 4096)), 8192)
    engine = {"enable_prefix_caching": True, "max_model_len": max_len, "max_num_batched_tokens": chunk,
              "enforce_eager": True}
    if hybrid:  # a Mamba state at every chunk boundary (docs/architecture.md)
        engine["prefix_cache_retention_interval"] = chunk

    total = sum(map(len, prompts))
    exp1 = sum(shared) / total
    exp2 = sum((len(p) - 1) // chunk * chunk for p in prompts) / total
    print(f"kvoffload demo: {Path(args.model).name} ({'hybrid' if hybrid else 'attention'}), "
          f"{len(prompts)} prompts in 4 shared-prefix groups, hybrid_chunk_size={chunk}, cache {cache}")

    def serve(label: str, with_cache: bool, seed: str, passes: int = 1) -> list[RunResult]:
        print(f"  {label} ...", flush=True)
        spec = RunSpec(args.model, prompts, kv if with_cache else None, args.max_tokens, engine, passes=passes)
        run = run_engine(spec, env={"PYTHONHASHSEED": seed})
        n = len(prompts)
        return [RunResult(run.results[i * n:(i + 1) * n], run.log) for i in range(passes)]

    [ref] = serve("reference (no connector)", False, "0")
    [run1] = serve("run 1 (cold cache)", True, "1")
    run2, run2b = serve("run 2 (after restart), then again after reset_prefix_cache()", True, "2", passes=2)

    def same(r: RunResult, base: RunResult) -> tuple[bool, str]:
        n = sum(a == b for a, b in zip(r.outputs(), base.outputs()))
        return n == len(prompts), f"{'yes' if n == len(prompts) else 'NO'} ({n}/{len(prompts)})"

    tier_cols = "".join(f"{'from ' + t:>10}" for t in names)
    print(f"\n{'run':<19}{'prompt tok':>11}{tier_cols}{'cached':>9}{'hit rate':>10}{'expected':>10}"
          f"{'median TTFT':>15}  identical to run 1 | to no-connector run")
    ok2, s2 = same(run2, run1)
    ok2b, s2b = same(run2b, run1)
    print(_row("no connector", ref, names, None, "-"))
    print(_row("1 cold", run1, names, exp1, f"-      | {same(run1, ref)[1]}"))
    print(_row("2 after restart", run2, names, exp2, f"{s2} | {same(run2, ref)[1]}"))
    print(_row("2 again (reset)", run2b, names, exp2, f"{s2b} | {same(run2b, ref)[1]}"))
    files = sorted(cache.rglob("*.kv"))
    print(f"\ncache: {len(files)} chunk files, {sum(f.stat().st_size for f in files) / 2**20:.1f} MiB; "
          f"run 2 restored {run2.restored_tokens} of {run2.prompt_tokens} prompt tokens from its tiers; "
          f"TTFT {run1.median_ttft_s / max(run2.median_ttft_s, 1e-9):.2f}x faster than run 1 (median)")
    hit_ok = abs(run2.hit_rate - exp2) < 1e-9 and abs(run2b.hit_rate - exp2) < 1e-9
    ok2 = ok2 and ok2b
    if not same(run1, ref)[0]:
        print("note: run 1 restored nothing, so its difference from the no-connector run is vLLM's own "
              "(loading any KV connector can flip a near-tie bf16 token); run 2 is compared with run 1")
    if not (ok2 and hit_ok):
        print("demo FAILED: " + ("run 2 hit rate differs from the chunk-aligned fraction; " if not hit_ok else "")
              + ("run 2 outputs differ from run 1" if not ok2 else ""))
        return 1
    print("demo OK: run 2 hit rate equals the chunk-aligned shared-prefix fraction; outputs identical to run 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
