"""`kvoffload warmup`: replay a prompt file to fill the cache; --verify checks a restart.

    kvoffload warmup --config CONFIG --prompts FILE --model M  [--verify]
    kvoffload warmup --prompts FILE --url http://host:8000 [--config CONFIG]

With --model, each run is a fresh engine process (`offload.engine_run`) with
the kv-transfer-config CONFIG and the chunk size and vLLM flags `kvoffload
plan` gives for the model (on a hybrid: a Mamba state kept at every chunk
boundary). Prompts are served one at a time, greedy, and only their
prompt tokens are stored. The report gives, per run: prompt tokens, tokens
restored from each offload tier, tokens vLLM's own prefix cache had, tokens
computed, the hit rate and load failures.

--verify serves the set twice, in two engine processes (a restart: empty
vLLM prefix cache and host memory, another PYTHONHASHSEED), and reports the
cross-restart hit rate of run 2 and, under the table, run 2's warm start (where host memory
sits over files: entries and bytes copied into host memory, seconds to done, loads served from
warmed entries, read from the engine's metrics at the end of the run). It passes (exit 0) only if, in run 2, every
prompt had at least its chunk-aligned prefix cached (what run 1 stored:
len // chunk * chunk tokens when every group is full attention, one less
when that is the whole prompt, else (len - 1) // chunk * chunk), no load
failed, and every output is token-identical to run 1; otherwise it exits 1.

With --url, prompts go to a running OpenAI-compatible server's
/v1/completions (text as text, token ids as a list). Cached tokens come from
`usage.prompt_tokens_details.cached_tokens` (the server needs
--enable-prompt-tokens-details) and restored tokens per tier from the
response's `kv_transfer_params`, where present. --verify cannot restart a
server, so with --url it is refused: run warmup, restart the server, and run
warmup again; the second report is the cross-restart hit rate.

--json prints the report as one JSON document on stdout instead of tables
(`run_report` and `url_report` say its fields); progress and errors stay on stderr.

Exit codes: 0 done (and, with --verify, passed); 1 verify failed; 2 usage
error (bad prompt file, config or arguments); 3 the engine or server failed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from offload.cli.prompts import Prompt, PromptFileError, load, token_ids
from offload.config import connector_extras, tier_dicts
from offload.engine_run import RunResult, RunSpec, run_engine
from offload.plan.model import ModelPlan
from offload.plan.run import PlanError, plan_for_model
from offload.planner import HybridOffloadPlanner


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("warmup", help="replay a prompt file through an engine or a server to fill the cache",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="kv-transfer-config JSON file (required with --model)")
    p.add_argument("--prompts", required=True, help="JSONL ({\"prompt\": ...} or {\"prompt_token_ids\": [...]}) "
                   "or text (one prompt per line)")
    p.add_argument("--format", choices=("auto", "jsonl", "text"), default="auto",
                   help="prompt file format (default: jsonl for .jsonl/.ndjson/.json, else text)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="model path or name: serve through a fresh engine process")
    src.add_argument("--url", help="base URL of a running OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    p.add_argument("--served-model-name", help="with --url: the model name (default: the server's first)")
    p.add_argument("--verify", action="store_true", help="run twice, restarting the engine in between, and "
                   "check the cross-restart hit rate and output identity")
    p.add_argument("--max-tokens", type=int, help="tokens generated per prompt (default 1; 16 with --verify)")
    p.add_argument("--max-num-batched-tokens", type=int,
                   help="vLLM prefill step size, a multiple of the chunk size (default: `kvoffload plan`'s)")
    p.add_argument("--max-model-len", type=int, help="default: the model's, at most 8192")
    p.add_argument("--again-after-reset", action="store_true",
                   help="with --verify: run 2 serves the set a second time after reset_prefix_cache(), "
                   "showing what the first pass promoted to faster tiers")
    p.add_argument("--reference", action="store_true",
                   help="with --verify: also run once without the connector, for comparison only")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.set_defaults(func=run)


# ---- engine settings -----------------------------------------------------------------


def tier_names(kv: dict | None) -> list[str]:
    return [t.get("name") or t.get("store", "?") for t in tier_dicts(kv)] if kv else []


def explicit_chunk_size(kv: dict) -> int | None:
    return next((int(e["hybrid_chunk_size"]) for e in connector_extras(kv) if e.get("hybrid_chunk_size")), None)


def engine_args(plan: ModelPlan, batched: int | None = None, max_len: int | None = None) -> dict:
    """The plan's flags (offload/plan/policy.py::serve_flags), eager, and a model length for small machines."""
    args: dict[str, Any] = {**plan.engine_kwargs, "enforce_eager": True,
                            "max_model_len": max_len or min(plan.max_model_len or 4096, 8192)}
    if batched:
        args["max_num_batched_tokens"] = batched
    return args


# ---- one engine run, with a progress bar -----------------------------------------------


def run_engine_with_progress(spec: RunSpec, label: str, seed: str, timeout_s: float = 3600) -> RunResult:
    """`offload.engine_run.run_engine`, with a progress bar."""
    from tqdm import tqdm

    total = sum(map(len, spec.pass_orders()))
    with tqdm(total=total, desc=label, unit="prompt", file=sys.stderr, mininterval=1.0) as bar:
        return run_engine(spec, env={"PYTHONHASHSEED": seed}, timeout_s=timeout_s,
                          progress=lambda done, _: bar.update(done - bar.n))


# ---- report --------------------------------------------------------------------------


def expected(prompt_len: int, planner: HybridOffloadPlanner) -> int:
    """Fewest cached tokens vLLM may report after a restart for a prompt stored
    whole: its restorable prefix (whole chunks, or its tail where the planner
    has one). A prefix that is the whole prompt counts one token less: vLLM
    computes that token again (0.32 still reports it cached)."""
    return min(prompt_len - 1, planner.repeat_hit(prompt_len))


def width(tier: str) -> int:
    """A tier's column: at least 10, and a space before 'from <tier>' however long the name."""
    return max(10, len(tier) + 6)


def header(names: list[str], verify: bool = True) -> str:
    cols = "".join(f"{'from ' + t:>{width(t)}}" for t in names)
    return (f"{'run':<18}{'prompts':>8}{'prompt tok':>11}{cols}{'prefix$':>9}{'computed':>9}{'hit rate':>9}"
            f"{'expected':>9}{'failed':>7}{'med TTFT':>11}" + ("  identical to run 1" if verify else ""))


def row(label: str, r: RunResult, names: list[str], exp: float | None, identical: str = "-") -> str:
    per_tier = "".join(f"{sum(x.restored_by_tier.get(t, 0) for x in r.results):>{width(t)}}" for t in names)
    own = r.cached_tokens - r.restored_tokens
    exp_s = f"{exp:.1%}" if exp is not None else "-"
    return (f"{label:<18}{len(r.results):>8}{r.prompt_tokens:>11}{per_tier}{own:>9}"
            f"{r.prompt_tokens - r.cached_tokens:>9}{r.hit_rate:>9.1%}{exp_s:>9}"
            f"{sum(x.load_failed for x in r.results):>7}{r.median_ttft_s * 1000:>8.1f} ms  {identical}")


def same(a: RunResult, b: RunResult) -> tuple[bool, str]:
    n = sum(x == y for x, y in zip(a.outputs(), b.outputs()))
    ok = n == len(a.results) == len(b.results)
    return ok, f"{'yes' if ok else 'NO'} ({n}/{len(a.results)})"


def run_report(label: str, r: RunResult, names: list[str], exp: float | None, like: RunResult | None = None,
               warm: bool = False) -> dict:
    """One run of the table as data: its prompts and prompt tokens, tokens restored per tier,
    tokens vLLM's own prefix cache had (`prefix_cache_tokens`), computed tokens, hit rate, the
    expected hit rate (None where nothing is expected), failed loads, median TTFT, with `like`,
    how many outputs are token-identical to that run's (`identical`: [same, of]) and, with `warm`
    (the first pass of an engine started on a filled cache), its engine's warm start figures
    (`warm_start`: `warm_start()`, or None)."""
    doc = {"label": label, "prompts": len(r.results), "prompt_tokens": r.prompt_tokens,
           "restored_by_tier": {t: sum(x.restored_by_tier.get(t, 0) for x in r.results) for t in names},
           "prefix_cache_tokens": r.cached_tokens - r.restored_tokens,
           "computed_tokens": r.prompt_tokens - r.cached_tokens, "hit_rate": r.hit_rate, "expected_hit_rate": exp,
           "failed_loads": sum(x.load_failed for x in r.results), "median_ttft_s": r.median_ttft_s}
    if like is not None:
        doc["identical"] = [sum(x == y for x, y in zip(r.outputs(), like.outputs())), len(r.results)]
    if warm:
        doc["warm_start"] = warm_start(r)
    return doc


WARM_FIGURES = {  # warm_start's fields: the engine's kvoffload_warm_* samples, summed over tiers
    "planned_entries": "kvoffload_warm_planned_entries", "entries": "kvoffload_warm_entries_total",
    "bytes": "kvoffload_warm_bytes_total", "failures": "kvoffload_warm_failures_total",
    "done": "kvoffload_warm_done", "seconds": "kvoffload_warm_seconds", "hits": "kvoffload_warm_hits_total"}


def warm_start(r: RunResult) -> dict | None:
    """Warm start's figures in the engine of `r`, read from its metrics at the end of the run:
    entries planned, copied into host memory (`entries`) and their bytes, entries that failed, whether
    it was done (every planned entry settled) and the seconds it took (0 until done), and the loads
    planned from warmed entries (`hits`, over the engine's life); None where the engine had no warm
    start (no host memory over files, or `warm_start` off: nothing planned)."""
    got = {k: sum(v for n, _, v in r.metrics if n == name) for k, name in WARM_FIGURES.items()}
    if not any(n == WARM_FIGURES["planned_entries"] for n, _, _ in r.metrics) or not got["planned_entries"]:
        return None
    return {k: (float(v) if k == "seconds" else int(v)) for k, v in got.items()}


def warm_line(label: str, w: dict | None) -> str:
    if w is None:
        return f"warm start ({label}): none (no host memory over files, warm_start off, or nothing to read)"
    state = f"done in {w['seconds']:.2f} s" if w["done"] else "not done when the run ended"
    return (f"warm start ({label}): {w['entries']} of {w['planned_entries']} planned entries copied into host "
            f"memory, {w['bytes'] / 2**20:.1f} MiB, {state}; {w['hits']} loads served from warmed entries; "
            f"{w['failures']} failed")


def verdict(run1: RunResult, run2: list[RunResult], planner: HybridOffloadPlanner) -> list[str]:
    """Why run 2 (each of its passes) fails --verify; empty if it passes."""
    problems = []
    for label, r in zip(("2 after restart", "2 again (reset)"), run2):
        ok, s = same(r, run1)
        short = sum(x.cached_tokens < expected(x.prompt_tokens, planner) for x in r.results)
        failed = sum(x.load_failed for x in r.results)
        problems += [f"{label}: {short} prompts below their chunk-aligned prefix"] if short else []
        problems += [f"{label}: {failed} loads failed"] if failed else []
        problems += [f"{label}: outputs differ from run 1 ({s})"] if not ok else []
    return problems


# ---- the command ---------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    try:
        prompts = load(args.prompts, args.format)
    except PromptFileError as e:
        print(f"kvoffload warmup: {e}", file=sys.stderr)
        return 2
    if args.url:
        if args.verify:
            print("kvoffload warmup: --verify needs a restart between the two runs, and a running server "
                  "cannot be restarted from here. Run `kvoffload warmup --url ...`, restart the server, then "
                  "run it again: the second report is the cross-restart hit rate. Or use --model.",
                  file=sys.stderr)
            return 2
        return warm_url(args, prompts)
    if not args.config:
        print("kvoffload warmup: --config is required with --model", file=sys.stderr)
        return 2
    try:
        kv = json.loads(Path(args.config).read_text())
        ids = token_ids(prompts, args.model)
    except (OSError, ValueError) as e:
        print(f"kvoffload warmup: {e}", file=sys.stderr)
        return 2
    return warm_engine(args, kv, ids)


def warm_engine(args: argparse.Namespace, kv: dict, ids: list[list[int]]) -> int:
    try:
        plan = plan_for_model(args.model, max_model_len=args.max_model_len, hybrid_chunk_size=explicit_chunk_size(kv))
    except (OSError, ValueError, PlanError) as e:
        print(f"kvoffload warmup: {e}", file=sys.stderr)
        return 2
    chunk = plan.hybrid_chunk_size
    if args.max_num_batched_tokens and args.max_num_batched_tokens % chunk:
        print(f"kvoffload warmup: --max-num-batched-tokens={args.max_num_batched_tokens} must be a multiple of "
              f"the chunk size {chunk}", file=sys.stderr)
        return 2
    names = tier_names(kv)
    max_tokens = args.max_tokens or (16 if args.verify else 1)
    eng = engine_args(plan, args.max_num_batched_tokens, args.max_model_len)
    total = sum(map(len, ids))
    planner = plan.planner()
    exp = sum(expected(len(p), planner) for p in ids) / max(1, total)
    print(f"kvoffload warmup: {len(ids)} prompts, {total} tokens, model {args.model}, "
          f"hybrid_chunk_size {chunk}, tiers {', '.join(names) or '-'}", flush=True,
          file=sys.stderr if args.json else sys.stdout)

    def serve(label: str, with_kv: bool, seed: str, passes: int = 1) -> list[RunResult]:
        spec = RunSpec(args.model, ids, kv if with_kv else None, max_tokens, eng, passes=passes)
        r = run_engine_with_progress(spec, label, seed)
        n = len(ids)
        return [RunResult(r.results[i * n:(i + 1) * n], r.log, r.metrics) for i in range(passes)]

    try:
        ref = serve("no connector", False, "0")[0] if args.verify and args.reference else None
        run1 = serve("run 1" if args.verify else "warmup", True, "1")[0]
        run2 = serve("run 2 (restart)", True, "2", 2 if args.again_after_reset else 1) if args.verify else []
    except RuntimeError as e:
        print(f"kvoffload warmup: {e}", file=sys.stderr)
        return 3
    if args.json:
        runs = [run_report("no connector", ref, names, None)] if ref is not None else []
        runs.append(run_report("1" if args.verify else "warmup", run1, names, None, ref))
        runs += [run_report(label, r, names, exp, run1, warm=not k)
                 for k, (label, r) in enumerate(zip(("2 after restart", "2 again (reset)"), run2))]
        problems = verdict(run1, run2, planner) if args.verify else []
        doc: dict[str, Any] = {"prompts": len(ids), "prompt_tokens": total, "model": args.model,
                               "hybrid_chunk_size": chunk, "prefix_match_unit": plan.prefix_match_unit, "tiers": names,
                               "runs": runs}
        if args.verify:
            doc.update(cross_restart_hit_rate=run2[0].hit_rate, expected_hit_rate=exp,
                       verify={"ok": not problems, "problems": problems})
        print(json.dumps(doc, indent=2))
        return 1 if problems else 0
    print("\n" + header(names, args.verify))
    if ref is not None:
        print(row("no connector", ref, names, None))
    print(row("1" if args.verify else "warmup", run1, names, None,
              f"-  | to no-connector run: {same(run1, ref)[1]}" if ref is not None else "-" if args.verify else ""))
    if not args.verify:
        print(f"\nrestored {run1.restored_tokens} and computed {run1.prompt_tokens - run1.cached_tokens} of "
              f"{run1.prompt_tokens} prompt tokens; {sum(r.load_failed for r in run1.results)} loads failed")
        return 0
    for label, r in zip(("2 after restart", "2 again (reset)"), run2):
        print(row(label, r, names, exp, same(r, run1)[1]))
    problems = verdict(run1, run2, planner)
    r2 = run2[0]
    print("\n" + warm_line("run 2, its engine's figures", warm_start(r2)))
    print(f"cross-restart hit rate {r2.hit_rate:.1%} (expected at least {exp:.1%}); run 2 restored "
          f"{r2.restored_tokens} of {r2.prompt_tokens} prompt tokens from its tiers; median TTFT "
          f"{run1.median_ttft_s / max(r2.median_ttft_s, 1e-9):.2f}x run 1's")
    if problems:
        print("verify FAILED: " + "; ".join(problems))
        return 1
    print("verify OK: every prompt restored its chunk-aligned prefix after the restart; outputs identical to run 1")
    return 0


# ---- a running server ----------------------------------------------------------------


def _post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def warm_url(args: argparse.Namespace, prompts: list[Prompt]) -> int:
    from tqdm import tqdm

    base = args.url.rstrip("/")
    try:
        model = args.served_model_name or json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=30)
                                                     .read())["data"][0]["id"]
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"kvoffload warmup: {base}/v1/models: {e}", file=sys.stderr)
        return 3
    max_tokens = args.max_tokens or 1
    results, cached_known, tiers_seen = [], True, set()
    latencies = []
    for p in tqdm(prompts, desc="warmup", unit="prompt", file=sys.stderr):
        body = {"model": model, "prompt": p.token_ids if p.token_ids is not None else p.text,
                "max_tokens": max_tokens, "temperature": 0}
        t0 = time.monotonic()
        try:
            out = _post(f"{base}/v1/completions", body)
        except (OSError, ValueError) as e:
            detail = e.read().decode(errors="replace")[:500] if isinstance(e, urllib.error.HTTPError) else ""
            print(f"kvoffload warmup: {base}/v1/completions: {e} {detail}", file=sys.stderr)
            return 3
        latencies.append(time.monotonic() - t0)
        usage = out.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        cached_known &= cached is not None
        ours = {k.split(":", 1)[1]: v for k, v in (out.get("kv_transfer_params") or {}).items()
                if k.startswith("kvoffload:")}
        tiers_seen |= set(ours)
        results.append((int(usage.get("prompt_tokens", 0)), int(cached or 0),
                        {t: int(v.get("restored_tokens", 0)) for t, v in ours.items()},
                        any(v.get("load_failed") for v in ours.values())))
    total = sum(r[0] for r in results)
    cached = sum(r[1] for r in results)
    restored = {t: sum(r[2].get(t, 0) for r in results) for t in sorted(tiers_seen)}
    if args.json:
        print(json.dumps(url_report(base, model, results, restored, cached if cached_known else None, latencies),
                         indent=2))
        return 0
    print(f"\n{len(results)} prompts, {total} prompt tokens, server {base} ({model})")
    if restored:
        print("restored per tier: " + ", ".join(f"{t} {n}" for t, n in restored.items())
              + f"; {sum(r[3] for r in results)} loads failed")
    else:
        print("restored per tier: not reported by the server (no kv_transfer_params in its responses)")
    if cached_known:
        print(f"cached {cached} (hit rate {cached / max(1, total):.1%}), computed {total - cached}")
    else:
        print("cached tokens: not reported; start the server with --enable-prompt-tokens-details")
    print(f"median request latency {statistics.median(latencies) * 1000:.1f} ms")
    return 0


def url_report(base: str, model: str, results: list[tuple[int, int, dict[str, int], bool]],
               restored: dict[str, int], cached: int | None, latencies: list[float]) -> dict:
    """The --url report as data: prompts, prompt tokens, the server and model, tokens restored per
    tier (empty where the server reports none), failed loads, cached tokens and hit rate (None
    where the server does not report them) and the median request latency."""
    total = sum(r[0] for r in results)
    return {"prompts": len(results), "prompt_tokens": total, "server": base, "model": model,
            "restored_by_tier": restored, "failed_loads": sum(r[3] for r in results), "cached_tokens": cached,
            "hit_rate": None if cached is None else cached / max(1, total),
            "computed_tokens": None if cached is None else total - cached,
            "median_latency_s": statistics.median(latencies) if latencies else None}
