"""What `kvoffload plan`'s flags cost in prefill throughput: the Mamba checkpoint flags, and its
`--prefix-match-unit`.

On a hybrid model the plan asks vLLM for a prefill step per chunk
(`--max-num-batched-tokens` = chunk) and a retained state per chunk
(`--prefix-cache-retention-interval` = chunk); vLLM's defaults take one step
for a whole prompt (up to its token budget) and keep one state per prompt.
The plan's `--prefix-match-unit` makes vLLM (align mode) also stop each
prompt's prefill at its unit-aligned tail, so the state exists there: one
more step where that boundary falls inside a block.

This serves the same long prompts, one at a time, greedy, one output token,
without any connector (the flags are vLLM's cost, not ours), twice per engine
(the prefix cache emptied in between: the first pass warms the engine up, the
second is measured and hits nothing), with engines of
three configurations per rep in rotated order: vLLM's defaults, the plan's
flags, the plan's flags plus its unit (skipped, saying why, where the plan
prints no unit). It reports prefill tokens per second (prompt tokens / time to
first token) per run, the medians, the ratios plan / defaults and
(plan + unit) / plan with their per-rep spread, each configuration's first
tokens, and the prefill steps per prompt each configuration takes.

The steps come from vLLM's own `Scheduler`, run in this process on the plan's
KV cache groups (block sizes, kinds, the 'align' Mamba mode) and each
configuration's engine arguments, without a model: vLLM's metrics have no
per-step counter that sees a partial prefill (`vllm:iteration_tokens_total`
observes only steps that emit a token).

The default prompt length is 3000 tokens (the issue's), or 3000 plus the
fewest whole units that put its unit-aligned tail inside a block, so that the
unit's split happens.

    python -m bench.prefill_flags --model .models/qwen3-next-80b-geometry --tokens 3000 --prompts 1 --reps 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from harness.engine import RunSpec, run_engine
from offload.plan.model import ModelPlan
from offload.plan.run import plan_for_model

REPO = Path(__file__).resolve().parents[1]
DEFAULTS, PLAN, UNIT = "vLLM defaults", "plan flags", "plan flags + unit"
STEPS_SOURCE = ("vLLM's Scheduler in the benchmark's process, on the plan's KV cache groups and each "
                "configuration's engine arguments, no model (vLLM's metrics count no partial-prefill step)")


def split_length(plan: ModelPlan, near: int) -> int:
    """The first of `near`, `near` + unit, `near` + 2 units, ... whose prefix-match-unit tail is
    not a block boundary (vLLM's `get_mamba_prefill_checkpoint_position`: the last unit boundary
    before the prompt's last token), so that the unit's extra prefill split happens and the last
    step is as long as `near`'s; `near` where the plan has no unit."""
    unit = plan.prefix_match_unit
    if not unit:
        return near
    block = max(plan.block_sizes)
    return next(n for n in range(near, near + block + unit, unit) if (n - 1) // unit * unit % block)


def configs(plan: ModelPlan, tokens: int) -> dict[str, dict[str, Any]]:
    """Engine arguments per configuration (the unit's only where the plan prints one)."""
    base = {"enforce_eager": True, "max_model_len": tokens + 64}
    # The plan's flags carry its unit where it has one: PLAN is them without it, so the unit's cost shows.
    flags = {k: v for k, v in plan.engine_kwargs.items() if k != "prefix_match_unit"}
    out = {DEFAULTS: {**base, "enable_prefix_caching": True}, PLAN: {**base, **flags}}
    if plan.prefix_match_unit:
        out[UNIT] = {**base, **flags, "prefix_match_unit": plan.prefix_match_unit}
    return out


def prefill_steps(plan: ModelPlan, engine_args: dict[str, Any], tokens: int) -> list[int]:
    """Tokens vLLM's scheduler schedules per step for one `tokens`-long prompt, alone, one output
    token, under `engine_args`, on the plan's groups. The KV cache specs carry the plan's kinds
    and block sizes and small stand-in pages (the scheduler reads no page bytes); the Mamba
    groups export no checkpoint from inside the forward pass (as GDN and Mamba-1 layers do not)."""
    import torch
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    # The LLM class's defaults (harness/engine.py serves through it): on CPU a larger token budget.
    vc = EngineArgs(model=plan.model, **engine_args).create_engine_config(usage_context=UsageContext.LLM_CLASS)
    cc = vc.cache_config
    # What the platform's block-size rule settled on at plan time (`update_block_size_for_backend`).
    cc.block_size = max(plan.block_sizes)
    if any(g.kind == "mamba" for g in plan.groups):
        cc.mamba_block_size = cc.block_size
    groups = []
    for i, g in enumerate(plan.groups):
        if g.kind not in ("full_attention", "mamba"):
            raise ValueError(f"group {i}: kind {g.kind!r}: the step count covers attention and Mamba groups only")
        attn = FullAttentionSpec(block_size=g.block_size, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
        spec = attn if g.kind == "full_attention" else MambaSpec(
            block_size=g.block_size, shapes=((1, 64),), dtypes=(torch.float32,),
            mamba_cache_mode=cc.mamba_cache_mode, page_size_padded=attn.page_size_bytes)
        groups.append(KVCacheGroupSpec([f"layer.{i}"], spec))
    kcc = KVCacheConfig(num_blocks=len(groups) * (tokens // min(plan.block_sizes) + 8), kv_cache_tensors=[],
                        kv_cache_groups=groups)
    cc.num_gpu_blocks = kcc.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kcc, vc)
    kcc.hash_block_size = hash_block_size
    kcc.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kcc, vc, block_size, hash_block_size)
    sched = vc.scheduler_config.get_scheduler_cls()(
        vllm_config=vc, kv_cache_config=kcc, structured_output_manager=StructuredOutputManager(vc),
        block_size=block_size, hash_block_size=hash_block_size, log_stats=False)
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    params.update_from_generation_config({}, None)
    rng = random.Random(tokens)
    req = Request(request_id="r", prompt_token_ids=[rng.randrange(2, 1000) for _ in range(tokens)],
                  sampling_params=params, pooling_params=None,
                  block_hasher=get_request_block_hasher(hash_block_size, sha256))
    sched.add_request(req)
    steps: list[int] = []
    while "r" in sched.requests:
        if len(steps) > tokens:
            raise RuntimeError(f"vLLM's scheduler did not finish a {tokens}-token prompt in {tokens} steps")
        so = sched.schedule()
        n = so.num_scheduled_tokens.get("r", 0)
        steps.append(n)
        done = req.num_computed_tokens >= tokens  # schedule() advanced it by n
        sched.update_from_output(so, ModelRunnerOutput(
            req_ids=["r"], req_id_to_index={"r": 0}, sampled_token_ids=[[7] if done else []], logprobs=None,
            prompt_logprobs_dict={}, pooler_output=None))
    return [n for n in steps if n]


def run(model: str, tokens: int, prompts: int, reps: int, plan: ModelPlan | None = None,
        warmup: bool = True) -> dict:
    """`warmup`: each engine serves the prompts twice, its prefix cache emptied in between, and
    the second pass is measured (vLLM's first steps of each new shape pay one-time costs)."""
    plan = plan or plan_for_model(model)
    passes = 2 if warmup else 1
    rng = random.Random(5)
    ps = [[rng.randrange(2, 1000) for _ in range(tokens)] for _ in range(prompts)]
    engines = configs(plan, tokens)
    if UNIT not in engines:
        print(f"skipping {UNIT!r}: {plan.prefix_match}", flush=True)
    steps = {name: prefill_steps(plan, eng, tokens) for name, eng in engines.items()}
    for name, s in steps.items():
        print(f"{name:<18} {len(s)} prefill steps per {tokens}-token prompt (tokens per step: {s})", flush=True)
    names = list(engines)
    rows: dict[str, list[float]] = {k: [] for k in names}
    first: dict[str, list[list[int | None]]] = {k: [] for k in names}
    cached: dict[str, list[list[int]]] = {k: [] for k in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]  # rotated, so drift hits all alike
        for name in order:
            t = time.monotonic()
            res = run_engine(RunSpec(model, ps, None, max_tokens=1, engine_args=engines[name], passes=passes),
                             timeout_s=7200)
            r = [res.by_pass(passes - 1)[i] for i in range(len(ps))]
            cached[name].append([x.cached_tokens for x in r])
            tps = sum(x.prompt_tokens for x in r) / sum(x.ttft_s for x in r)
            rows[name].append(tps)
            first[name].append([x.output_ids[0] if x.output_ids else None for x in r])
            print(f"rep {rep + 1} {name:<18} {tps:8.1f} prompt tok/s  ({time.monotonic() - t:.0f} s with start-up)",
                  flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    doc: dict[str, Any] = {
        "model": model, "chunk": plan.hybrid_chunk_size, "block_sizes": plan.block_sizes, "cpu_isa": plan.cpu_isa,
        "plan_flags": plan.serve_args, "prefix_match_unit": plan.prefix_match_unit,
        "prefix_match": plan.prefix_match, "configs": engines, "tokens": tokens, "prompts": prompts, "reps": reps,
        "warmup_pass": warmup, "runs_tok_s": rows, "cached_tokens": cached, "median_tok_s": med, "first_tokens": first,
        "prefill_steps_per_prompt": {k: len(v) for k, v in steps.items()},
        "prefill_step_tokens": steps, "prefill_steps_source": STEPS_SOURCE,
        "ratio_plan_over_default": med[PLAN] / med[DEFAULTS],
        "ratio_plan_over_default_per_rep": [p / d for p, d in zip(rows[PLAN], rows[DEFAULTS])],
        "ratio_unit_over_plan": None, "ratio_unit_over_plan_per_rep": [], "unit_first_tokens_equal_plan": None,
    }
    if UNIT in rows:
        doc["ratio_unit_over_plan"] = med[UNIT] / med[PLAN]
        doc["ratio_unit_over_plan_per_rep"] = [u / p for u, p in zip(rows[UNIT], rows[PLAN])]
        doc["unit_first_tokens_equal_plan"] = first[UNIT] == first[PLAN]
    return doc


def machine_isa() -> dict[str, Any]:
    """The CPU's model name and the ISA flags that pick vLLM-CPU's kernels here."""
    from bench.common import machine

    flags: set[str] = set()
    for ln in Path("/proc/cpuinfo").read_text().splitlines():
        if ln.startswith("flags"):
            flags = set(ln.split(":", 1)[1].split())
            break
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return {**machine(), "isa_flags": {f: f in flags for f in wanted}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(REPO / ".models" / "qwen3-next-tiny"))
    ap.add_argument("--tokens", type=int, help="prompt length (default: 3000, plus whole units until its "
                    "unit-aligned tail is inside a block)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-warmup", action="store_true", help="measure each engine's first pass (no warm-up pass)")
    ap.add_argument("--out", type=Path, help="write the result JSON here")
    args = ap.parse_args(argv)
    plan = plan_for_model(args.model)
    tokens = args.tokens or split_length(plan, 3000)
    doc = {"machine": machine_isa(),
           **run(args.model, tokens, args.prompts, args.reps, plan, warmup=not args.no_warmup)}
    print(json.dumps({k: doc[k] for k in ("chunk", "prefix_match_unit", "tokens", "median_tok_s",
                                          "prefill_steps_per_prompt", "ratio_plan_over_default",
                                          "ratio_unit_over_plan", "ratio_unit_over_plan_per_rep",
                                          "unit_first_tokens_equal_plan")}))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
