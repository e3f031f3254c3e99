"""Partial tails under load: the tiny hybrid served with vLLM's `--prefix-match-unit`, concurrent
clients, preemptions and aborts, then a restart on the same directory.

One vLLM OpenAI server runs qwen3-next-tiny with `kvoffload plan`'s flags and its
`--prefix-match-unit` (offload.plan, at run time), configs/hybrid-tiered.json (host memory, then
files; only the filesystem `path` changed) and a KV cache cut to a few blocks more than one request
of --max-model-len needs (`--num-gpu-blocks-override`, from the plan's block size): with CLIENTS
requests in flight vLLM evicts its own prefix cache all the time and preempts. On top of that,
tests/test_concurrent_serving.py's `Preemptor` has vLLM preempt every running request every
PREEMPT_EVERY_S (its dev-mode `reset_prefix_cache?reset_running_requests=true`), so requests are
preempted mid-prefill and mid-decode while loads and stores are in flight.

The clients (tests/loadgen.py `run_clients`, each one request at a time, for LOAD_S seconds) send:
- conversation turns: a first prompt, then each turn the previous prompt, the answer the client
  received and a new message (an answer is one token, or the tokens streamed until the client hung
  up);
- repeats of prompts any client completed, and prompts sharing only a prefix of one (cut anywhere);
- fresh prompts; every length is random, so most prompts end off the unit;
- hang-ups: streamed requests abandoned after a few tokens (mid-decode) or after a random delay
  (queued, loading or mid-prefill).

Compared with a reference: greedy tokens from an engine with our connector configured on an empty
directory and every request reading no prefix cache (neither vLLM's nor ours), one prompt at a time
(`harness.engine`, the same flags): merely configuring a connector changes vLLM-CPU's bf16 near-ties
(docs/cpu-platform.md), so the reference has one too. Under preemption only the first
token of a request is reproducible (tests/test_concurrent_serving.py's module docstring: vLLM
recomputes a preempted request's generated tokens as a prefill, which on vLLM-CPU is not bitwise a
decode), so requests that complete generate one token and hung-up ones are compared on their first;
full-length outputs are compared after the restart, where nothing preempts. Requests that vLLM's
own prefix cache started or resumed inside a block (our connector flags them, `vllm_sub_block_hit`)
are counted, not compared: vLLM-CPU 0.32 copies that block by an incomplete copy-on-write on a hybrid,
so their KV is not their prompt's (measured: 2 of 1,148 first tokens differed, both such requests).
A client that hung up, or streamed, never receives that flag (vLLM sends `kv_transfer_params` in a
non-streamed response only), so the load's server runs our connector as shipped through
tests/recording_connector.py, which writes down what it reports for every request vLLM finishes,
and those requests are judged by that.

Asserted on the load, from the server's /metrics and the responses: vLLM preempted
(`vllm:num_preemptions_total`); the client hung up before the first token and after some; the
engine aborted requests it had taken in (our scheduler's `kvoffload_lookups_total`, once per request,
minus the requests vLLM finished: its `vllm:request_success_total` has no series for client aborts)
and decoded tokens for them; our tiers restored tokens, partial tails among them; no load failed;
/health answers and no request is left running or waiting.

Then a restart: a new server (new PYTHONHASHSEED) on the same directory. For a sample of the
prompts the load stored (every entry a repeat restores is on disk), each alone with vLLM's own cache
emptied first: restored tokens == `repeat_hit` of the planner the plan implies (what vLLM's own
cache hits in one process: the prompt's unit-aligned tail, or its whole chunks), measured too (the
same prompt again hits vLLM's own cache, nothing of ours) and tokens == the reference. Last, `kvoffload
fsck` finds the directory clean.

Every figure is printed and written to loadtail_figures.json in the test's directory.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from conftest import in_background, layouts, shipped_config
from harness.cli import run_cli
from harness.engine import RunSpec, run_engine
from loadgen import Client, Request, Result, run_clients
from recording_connector import finished, params_of, recording
from serving import api_server, metric_by_label, metric_sum, scrape, wait_until
from test_concurrent_serving import Preemptor

pytestmark = [pytest.mark.e2e, pytest.mark.long]

MODEL = "qwen3-next-tiny"
MAX_MODEL_LEN = 1536
# KV cache: two requests' worth of attention blocks for MAX_MODEL_LEN and SPARE_BLOCKS more (vLLM
# refuses a cache that cannot hold one; it reports 1.86 requests, the GDN states taking blocks too).
# Tight on purpose: vLLM 0.32 reserves one block short for an async load that ends inside a Mamba
# block, and before the connector checked for room (connector/room.py) this cache stalled vLLM for
# good within a minute (see Watchdog): every block held by requests whose loads had landed, each
# waiting for one more, none running, so nothing to preempt.
SPARE_BLOCKS = 2
CLIENTS = 8
LOAD_S = 120
REQUEST_TIMEOUT_S = 180  # a request takes seconds here; one that takes this long is stuck
STALL_S = 45
PREEMPT_EVERY_S = 1.0  # vLLM preempts every running request (and empties its prefix cache) this often
HANG_UP_TOKENS = 96  # what a request the client abandons may decode until it does
OUTPUT_TOKENS = 16  # full-length outputs after the restart
SAMPLE = 24  # prompts served again after the restart
DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


# ---- the clients ---------------------------------------------------------------------------------


@dataclass
class Pool:
    """Prompts any client completed: what repeats and shared prefixes draw from."""

    prompts: list[list[int]] = field(default_factory=list)


def client(seed: int, pool: Pool, deadline: float) -> Client:
    """One client's requests (see the module docstring), until `deadline`."""
    rng = random.Random(seed)
    conv: list[int] | None = None  # the conversation so far (prompt + answer), None: start one
    limit = MAX_MODEL_LEN - HANG_UP_TOKENS - 200

    def nxt(mine: list[Result]) -> Request | None:
        req = _next(mine)
        if req is not None and len(req.prompt) > limit + 150:  # room for its output in MAX_MODEL_LEN
            req = replace(req, prompt=req.prompt[:limit + 150])
        return req

    def _next(mine: list[Result]) -> Request | None:
        nonlocal conv
        if mine:
            last = mine[-1]
            if last.request.tag.startswith("turn"):
                conv = last.request.prompt + last.token_ids if last.token_ids else None
            if last.complete:
                pool.prompts.append(last.request.prompt)
        if time.monotonic() > deadline:
            return None
        kind = rng.choices(["turn", "repeat", "shared", "fresh", "abort"], [35, 20, 15, 15, 15])[0]
        if kind in ("repeat", "shared") and not pool.prompts:
            kind = "fresh"
        if kind == "turn":
            if conv is not None and len(conv) < limit:
                prompt, tag = conv + tokens(rng, rng.randrange(8, 150)), "turn-next"
            else:
                prompt, tag = tokens(rng, rng.randrange(150, 700)), "turn-first"
            if rng.random() < 0.5:
                return Request(prompt, HANG_UP_TOKENS, stream=True, cancel_after_tokens=rng.randrange(2, 10),
                               tag=f"{tag}-hang-up")
            return Request(prompt, 1, tag=tag)
        if kind == "repeat":
            return Request(list(rng.choice(pool.prompts)), 1, tag="repeat")
        if kind == "shared":
            base = rng.choice(pool.prompts)
            cut = rng.randrange(min(64, len(base) - 1), len(base))
            return Request(base[:cut] + tokens(rng, rng.randrange(20, 300)), 1, tag="shared")
        if kind == "fresh":
            return Request(tokens(rng, rng.randrange(100, 1300)), 1, tag="fresh")
        # Abandoned after a delay: while queued, loading, in its prefill or decoding.
        base = rng.choice(pool.prompts) if pool.prompts and rng.random() < 0.5 else []
        prompt = base[:limit] + tokens(rng, rng.randrange(300, max(301, limit - len(base[:limit]))))
        return Request(prompt[:limit], HANG_UP_TOKENS, stream=True, cancel_after_s=rng.uniform(0.05, 0.8),
                       tag="hang-up-delay")

    return nxt


# ---- servers and metrics ---------------------------------------------------------------------------


def delta(after, before, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def deltas_by(after, before, name: str, label: str) -> dict[str, float]:
    a, b = metric_by_label(after, name, label), metric_by_label(before, name, label)
    return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}


def reset_prefix_cache(base: str) -> None:
    req = urllib.request.Request(f"{base}/reset_prefix_cache", method="POST")
    assert json.loads(urllib.request.urlopen(req, timeout=60).read()).get("success"), "vLLM refused the reset"


def healthy(base: str) -> bool:
    with urllib.request.urlopen(f"{base}/health", timeout=30) as r:
        return r.status == 200


class Watchdog:
    """Polls the server during the load: `stalled` is vLLM's state if it sat for STALL_S seconds with
    requests waiting, none running and no token computed (a scheduler that can never move again:
    stuck requests then time out on the client, REQUEST_TIMEOUT_S)."""

    def __init__(self, base: str) -> None:
        self.base, self.stalled = base, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        since, last = time.monotonic(), None
        while not self._stop.wait(2.0) and self.stalled is None:
            m = scrape(self.base)
            done = metric_sum(m, "vllm:prompt_tokens_total") + metric_sum(m, "vllm:generation_tokens_total")
            waiting, running = metric_sum(m, "vllm:num_requests_waiting"), metric_sum(m, "vllm:num_requests_running")
            if done != last or running or not waiting:
                since, last = time.monotonic(), done
            elif time.monotonic() - since > STALL_S:
                self.stalled = {"waiting": waiting, "running": running,
                                "kv_cache_usage": metric_sum(m, "vllm:kv_cache_usage_perc"),
                                **{f"{label}s": metric_by_label(m, name, label) for name, label in (
                                    ("vllm:num_requests_waiting_by_reason", "reason"),
                                    ("vllm:num_requests_kv_fetch_by_stage", "stage"))},
                                "loads_in_flight": metric_sum(m, "kvoffload_loads_in_flight")}

    def __enter__(self) -> Watchdog:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _idle(samples):
    """The samples, once vLLM reports no request running or waiting (else None)."""
    busy = metric_sum(samples, "vllm:num_requests_running") + metric_sum(samples, "vllm:num_requests_waiting")
    return samples if busy == 0 else None


def restored(res: Result) -> int:
    return res.restored_tokens()


def cached(res: Result) -> int:
    return int(((res.usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


# ---- what the directory holds ------------------------------------------------------------------------


def repeat_entries(planner, prompt: list[int], root: bytes) -> list[tuple[int, bytes]]:
    """(group, key) of every entry a repeat of `prompt` restores (planner.repeat_hit tokens)."""
    from offload.keys import chunk_keys, tail_key
    from offload.planner import GroupIndex

    c, n = planner.chunk_size, planner.max_hit_chunks(len(prompt))
    tail_end = planner.tail_boundary(len(prompt))
    keys = chunk_keys(root, prompt, c)
    if tail_end > n * c:
        k, tail = tail_end // c, tail_end - tail_end // c * c
        n, tk = k, tail_key(keys[k - 1] if k else root, prompt[k * c:tail_end])
    else:
        tail, tk = 0, None
    out = []
    for g in range(len(planner.groups)):
        for gc in planner.needed(GroupIndex(g), n, 0, tail):
            out.append((g, tk if gc.tail_end is not None else keys[gc.chunk]))
    return out


def missing(cache: Path, planner, prompt: list[int]) -> list[int]:
    """Indices (in `repeat_entries` order) of the entries a repeat of `prompt` restores that are not on disk."""
    from offload.keys import request_root
    from offload.store.cachedir.paths import LAYOUT_DIR

    [(d, lay)] = list(layouts(cache).items())
    root = request_root(bytes.fromhex(lay["base_fingerprint"]))
    base = cache / LAYOUT_DIR / d
    return [i for i, (g, k) in enumerate(repeat_entries(planner, prompt, root))
            if not (base / f"g{g}" / k.hex()[:2] / f"{k.hex()}.kv").exists()]


# ---- the test ---------------------------------------------------------------------------------------


def test_partial_tails_under_concurrent_load_preemption_aborts_and_a_restart(models_dir, tmp_path):
    from offload.cli.cache import scan
    from offload.plan.run import plan_for_model
    from offload.planner import HybridOffloadPlanner

    t_start = time.monotonic()
    model = models_dir / MODEL
    plan = plan_for_model(model, max_model_len=MAX_MODEL_LEN)
    unit = plan.prefix_match_unit
    assert unit is not None, plan.prefix_match
    planner = HybridOffloadPlanner(plan.specs, plan.hybrid_chunk_size, tail_unit=unit)
    assert planner.tail_unit == unit
    block = max(plan.block_sizes)
    blocks = 2 * -(-MAX_MODEL_LEN // block) + SPARE_BLOCKS
    serve_args = [*plan.serve_args, "--prefix-match-unit", str(unit)]
    extra = ("--max-model-len", str(MAX_MODEL_LEN), "--num-gpu-blocks-override", str(blocks),
             "--enable-prompt-tokens-details")
    cache = tmp_path / "cache"
    figures: dict = {"unit": unit, "chunk": planner.chunk_size, "block": block, "gpu_blocks": blocks,
                     "serve_args": serve_args, "plan_s": round(time.monotonic() - t_start, 1)}

    # ---- the load -------------------------------------------------------------------------------
    # Our connector as shipped, writing down what it reports per finished request: a client that hung
    # up never receives that (tests/recording_connector.py).
    load_kv, record_env = recording(shipped_config("hybrid-tiered.json", cache), tmp_path / "finished.jsonl")
    with api_server(model, load_kv, tmp_path / "load.log", extra_env={**DEV, **record_env},
                    serve_args=serve_args, extra_args=extra) as base:
        figures["server_start_s"] = round(time.monotonic() - t_start - figures["plan_s"], 1)
        before = scrape(base)
        pool = Pool()
        deadline = time.monotonic() + LOAD_S
        with Watchdog(base) as watchdog, Preemptor(base, PREEMPT_EVERY_S) as preemptor:
            rep = run_clients(base, [client(100 + i, pool, deadline) for i in range(CLIENTS)], REQUEST_TIMEOUT_S)
        assert watchdog.stalled is None, f"vLLM stalled with requests waiting and none running: {watchdog.stalled}"
        # Healthy at the end: /health answers, and every request vLLM took in has left it (the aborted
        # ones too: none left running or waiting).
        assert healthy(base)
        after = wait_until(lambda: _idle(scrape(base)), 60, "no request left running or waiting in vLLM")
    # The server is stopped (SIGTERM; the connector lets its stores land first).
    results = rep.results
    completed = [r for r in results if r.complete]
    hung_up = [r for r in results if r.aborted]
    # What our connector reported for each request vLLM finished: what a completed request received
    # (non-streamed; vLLM streams no kv_transfer_params), and the only copy for the others.
    records = finished(tmp_path / "finished.jsonl")
    recorded = {r.index: params_of(records, r.request_id) for r in results}
    differs = [(r.request_id, recorded[r.index], r.kv_transfer_params) for r in completed
               if not recorded[r.index][0] or (not r.request.stream and recorded[r.index][1] != r.kv_transfer_params)]
    assert not differs, differs[:3]
    unrecorded = [r.request_id for r in hung_up if r.token_ids and not recorded[r.index][0]]
    assert not unrecorded, f"hung up after tokens, yet no report of vLLM finishing them: {unrecorded[:5]}"
    results = [replace(r, kv_transfer_params=recorded[r.index][1]) if r.aborted or r.request.stream else r
               for r in results]
    completed = [r for r in results if r.complete]
    hung_up = [r for r in results if r.aborted]
    figures["load"] = {
        "requests": len(results), "completed": len(completed), "failed": len(rep.failed),
        "peak_in_flight": rep.peak_in_flight, "wall_s": round(rep.wall_s, 1),
        "by_tag": dict(Counter(r.request.tag for r in results)),
        "hung_up_before_first_token": sum(1 for r in hung_up if not r.token_ids),
        "hung_up_after_tokens": sum(1 for r in hung_up if r.token_ids),
        "preemptions": delta(after, before, "vllm:num_preemptions_total"),
        "forced_preemption_calls": dict(preemptor.outcomes),
        # Requests the engine took in (our scheduler looks each up once) and did not finish: aborted there.
        "engine_aborted": delta(after, before, "kvoffload_lookups_total") - len(completed),
        # Tokens the engine generated for requests the client hung up on (vLLM counts every step's).
        "tokens_decoded_for_hung_up": delta(after, before, "vllm:generation_tokens_total")
        - sum(len(r.token_ids) for r in completed),
        "vllm_own_sub_block_hits_at_admission": sum(1 for r in completed if (cached(r) - restored(r)) % block),
        "vllm_finished": deltas_by(after, before, "vllm:request_success_total", "finished_reason"),
        "restored_tokens": delta(after, before, "kvoffload_restored_tokens_total"),
        "restored_by_tier": deltas_by(after, before, "kvoffload_restored_tokens_total", "tier"),
        "vllm_external_hits": delta(after, before, "vllm:external_prefix_cache_hits_total"),
        "failed_loads": deltas_by(after, before, "kvoffload_failed_loads_total", "reason"),
        "stores_dropped": deltas_by(after, before, "kvoffload_stores_dropped_total", "reason"),
        "stored_tokens": delta(after, before, "kvoffload_stored_tokens_total"),
        "tail_restores": sum(1 for r in completed if restored(r) % planner.chunk_size),
        "prompt_tokens_not_unit_aligned": sum(1 for r in results if len(r.request.prompt) % unit),
    }

    # ---- the sample the restart serves: prompts the load completed whose repeat entries are all on disk
    distinct = list({tuple(r.request.prompt): r.request.tag for r in completed}.items())
    rng = random.Random(7)
    rng.shuffle(distinct)
    gaps = {p: missing(cache, planner, list(p)) for p, _ in distinct}
    on_disk = [(list(p), tag) for p, tag in distinct if not gaps[p]]
    with_tail = [x for x in on_disk if planner.repeat_hit(len(x[0])) % planner.chunk_size]
    sample = (with_tail[:SAMPLE // 2] + [x for x in on_disk if x not in with_tail[:SAMPLE // 2]])[:SAMPLE]
    figures["stored"] = {"distinct_completed_prompts": len(distinct), "fully_on_disk": len(on_disk),
                         "with_a_tail_on_disk": len(with_tail), "sample": len(sample),
                         # (tag, prompt tokens, repeat hit, entries it needs, the missing ones) of the rest
                         "not_on_disk": [(tag, len(p), planner.repeat_hit(len(p)),
                                          len(repeat_entries(planner, list(p), b"")), gaps[p])
                                         for p, tag in distinct if gaps[p]]}

    # ---- the reference (one engine, one prompt at a time, no prefix cache read) and the restart, side by side
    compared = {tuple(r.request.prompt) for r in completed} | {tuple(r.request.prompt) for r in hung_up if r.token_ids}
    ref_prompts = [list(p) for p in compared | {tuple(p) for p, _ in sample}]
    sample_set = {tuple(p) for p, _ in sample}
    ref_spec = RunSpec(str(model), ref_prompts, shipped_config("hybrid-tiered.json", tmp_path / "ref-cache"),
                       engine_args={**plan.engine_kwargs, "prefix_match_unit": unit, "max_model_len": MAX_MODEL_LEN,
                                    "enforce_eager": True},
                       skip_prefix_cache=True,
                       prompt_max_tokens=[OUTPUT_TOKENS if tuple(p) in sample_set else 1 for p in ref_prompts])
    ref_job = in_background(lambda: (run_engine(ref_spec, None, 1800), time.monotonic()))
    t_restart = time.monotonic()
    ours, theirs = [], []
    with api_server(model, shipped_config("hybrid-tiered.json", cache), tmp_path / "restart.log",
                    extra_env={**DEV, "PYTHONHASHSEED": "4242"}, serve_args=serve_args, extra_args=extra) as base:
        figures["restart_start_s"] = round(time.monotonic() - t_restart, 1)
        r0 = scrape(base)
        for p, _ in sample:
            reset_prefix_cache(base)  # our tiers only
            ours.append(run_clients(base, [_once(Request(p, OUTPUT_TOKENS, tag="restart"))]).results[0])
            theirs.append(run_clients(base, [_once(Request(p, 1, tag="vllm-own"))]).results[0])
        assert healthy(base)
        r1 = scrape(base)
    ref, ref_done = ref_job.result()
    figures["reference_s"] = round(ref_done - t_restart, 1)
    ref_tokens = {tuple(p): r.output_ids for p, r in zip(ref_prompts, ref.results)}

    # ---- fsck
    fsck = run_cli("fsck", str(cache))
    scanned = scan(cache, verify_payloads=True)
    problems = [(str(f.path), f.problem) for fp in scanned.dirs for f in fp.files if f.problem]

    # ---- tokens
    # Every request that got a token: its first (a completed request of one token: its whole output).
    # Not those that vLLM's own prefix cache started or resumed inside a block (our connector reports
    # them: `vllm_sub_block_hit`): vLLM-CPU 0.32 copies that block incompletely on a hybrid
    # (docs/limits.md), so their KV is not the prompt's whatever we do; we store
    # nothing of them from that chunk on (tests/test_connector_units.py).
    answered = [r for r in results if r.token_ids and not r.vllm_sub_block_hit()]
    by_vllm = [r for r in results if r.token_ids and r.vllm_sub_block_hit()]
    wrong = [r for r in answered if r.token_ids[:1] != ref_tokens[tuple(r.request.prompt)][:1]]
    wrong_restart = [i for i, (p, _) in enumerate(sample) if ours[i].token_ids != ref_tokens[tuple(p)]]
    expect = [planner.repeat_hit(len(p)) for p, _ in sample]
    figures["tokens"] = {
        "first_tokens_compared": len(answered), "first_tokens_identical": len(answered) - len(wrong),
        "of_them_completed_one_token_requests": sum(1 for r in answered if r.complete and r.request.max_tokens == 1),
        "started_by_vllms_own_sub_block_hit": len(by_vllm),
        "of_them_hung_up": sum(1 for r in by_vllm if r.aborted),
        "of_them_first_token_as_the_reference": sum(
            1 for r in by_vllm if r.token_ids[:1] == ref_tokens[tuple(r.request.prompt)][:1]),
        "wrong": [_describe(r, planner) for r in wrong][:20],
    }
    figures["restart"] = {
        "restored": [restored(r) for r in ours], "expected_repeat_hit": expect,
        "vllm_own_hit": [cached(r) for r in theirs], "vllm_own_restored": [restored(r) for r in theirs],
        "cached": [cached(r) for r in ours], "tags": [t for _, t in sample],
        "identical_outputs": len(sample) - len(wrong_restart),
        "external_hits": delta(r1, r0, "vllm:external_prefix_cache_hits_total"),
        "failed_loads": deltas_by(r1, r0, "kvoffload_failed_loads_total", "reason"),
    }
    figures["fsck"] = {"rc": fsck.returncode, "problems": problems[:10], "last_lines": fsck.stdout.splitlines()[-3:]}
    figures["reference_prompts"] = len(ref_prompts)
    figures["total_s"] = round(time.monotonic() - t_start, 1)
    out = tmp_path / "loadtail_figures.json"
    out.write_text(json.dumps(figures, indent=2))
    print(f"\npartial tails under load: {json.dumps(figures)}\nfigures written to {out}")

    load = figures["load"]
    # The load: every request answered or hung up on, preempted, aborted, restored (tails too), no failed load.
    assert not rep.failed, [r.error for r in rep.failed][:3]
    assert len(completed) + len(hung_up) == len(results)
    assert rep.peak_in_flight == CLIENTS
    assert load["preemptions"] > 0, "no request was preempted"
    assert set(preemptor.outcomes) <= {"reset", "refused", "http_500"}, preemptor.outcomes
    assert load["hung_up_before_first_token"] > 0 and load["hung_up_after_tokens"] > 0, load
    # vLLM finished every completed request once; the engine aborted requests (some mid-decode) it
    # had taken in; vLLM's request_success_total has no series for client aborts.
    assert load["vllm_finished"] == {"length": len(completed)}, load["vllm_finished"]
    assert 0 < load["engine_aborted"] <= len(hung_up), load
    assert load["tokens_decoded_for_hung_up"] >= sum(len(r.token_ids) for r in hung_up) > 0, load
    assert load["restored_tokens"] > 0 and load["tail_restores"] > 0, load
    assert not load["failed_loads"], load["failed_loads"]
    assert sum(restored(r) for r in completed) <= load["restored_tokens"]
    # Greedy tokens: every completed request's (one token), every other answered request's first.
    assert all(len(r.token_ids) == 1 for r in completed if r.request.max_tokens == 1)
    assert not wrong, figures["tokens"]
    # The restart restores what vLLM's own cache hits in one process, at the unit, with the reference's tokens.
    assert len(sample) >= SAMPLE // 2 and len(with_tail) > 0, figures["stored"]
    rs = figures["restart"]
    assert rs["restored"] == expect == rs["vllm_own_hit"], rs
    assert rs["cached"] == rs["restored"] and rs["vllm_own_restored"] == [0] * len(sample), rs
    assert rs["external_hits"] == sum(rs["restored"]), rs
    assert not rs["failed_loads"] and not wrong_restart, rs
    # fsck: every file verifies (payload CRCs too), no chain hole.
    assert fsck.returncode == 0 and not problems, figures["fsck"]


def _once(req: Request):
    """A client that sends `req` once."""
    return lambda mine: None if mine else req


def _describe(r: Result, planner) -> str:
    return (f"request {r.index} ({r.request.tag}, {len(r.request.prompt)} prompt tokens, tail "
            f"{planner.tail_boundary(len(r.request.prompt))}, cached {cached(r)}, restored {restored(r)}, "
            f"{len(r.token_ids)} tokens, kv_transfer_params {r.kv_transfer_params})")
