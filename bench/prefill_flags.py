"""What `kvoffload plan`'s Mamba checkpoint flags cost in prefill throughput.

On a hybrid model the plan asks vLLM for a prefill step per chunk
(`--max-num-batched-tokens` = chunk) and a retained state per chunk
(`--prefix-cache-retention-interval` = chunk); vLLM's defaults take one step
for a whole prompt (up to its token budget) and keep one state per prompt.
This serves the same long prompts, one at a time, greedy, one output token,
without any connector (the flags are vLLM's cost, not ours), alternating
engines with vLLM's default flags and with the plan's, and reports prefill
tokens per second (prompt tokens / time to first token) per run, the median
and the ratio plan / default.

    python -m bench.prefill_flags --model .models/qwen3-next-80b-geometry --tokens 1920 --prompts 2 --reps 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from offload.engine_run import RunSpec, run_engine
from offload.plan import plan_for_model

REPO = Path(__file__).resolve().parents[1]


def run(model: str, tokens: int, prompts: int, reps: int) -> dict:
    plan = plan_for_model(model)
    rng = random.Random(5)
    ps = [[rng.randrange(2, 1000) for _ in range(tokens)] for _ in range(prompts)]
    base = {"enforce_eager": True, "max_model_len": tokens + 64}
    configs = {"vLLM defaults": {**base, "enable_prefix_caching": True},
               "plan flags": {**base, **plan.engine_kwargs}}
    rows: dict[str, list[float]] = {k: [] for k in configs}
    for rep in range(reps):
        for name, eng in configs.items():  # alternating, so drift hits both alike
            t = time.monotonic()
            r = run_engine(RunSpec(model, ps, None, max_tokens=1, engine_args=eng), timeout_s=7200)
            tps = sum(x.prompt_tokens for x in r.results) / sum(x.ttft_s for x in r.results)
            rows[name].append(tps)
            print(f"rep {rep + 1} {name:<14} {tps:8.1f} prompt tok/s  ({time.monotonic() - t:.0f} s with start-up)",
                  flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"model": model, "chunk": plan.hybrid_chunk_size, "plan_flags": plan.serve_args, "tokens": tokens,
            "prompts": prompts, "reps": reps, "runs_tok_s": rows, "median_tok_s": med,
            "ratio_plan_over_default": med["plan flags"] / med["vLLM defaults"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / ".models" / "qwen3-next-tiny"))
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, help="write the result JSON here")
    args = ap.parse_args(argv)
    doc = run(args.model, args.tokens, args.prompts, args.reps)
    print(json.dumps({k: doc[k] for k in ("chunk", "plan_flags", "median_tok_s", "ratio_plan_over_default")}))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
