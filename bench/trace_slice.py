"""The trace slices of the engine runs on a production-shaped trace: tests/test_e2e_state_policy.py
(state policies across a restart) and bench/warm_start.py --trace (warm start after a restart). Its
docstring gives how a slice is taken (by conversation, or by context) and how a trace block id
becomes token ids; both take their prompts from here, so that they serve the same requests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "bench" / "traces" / "mooncake_conversation_trace.jsonl"
RESULTS = REPO / "bench" / "results" / "state_policy_engine.json"
TRACE_BLOCK = 512  # tokens per trace block id
SESSION_SAMPLE = 40
CONTEXT_SAMPLE = 8
PER_CONTEXT = 6
REQUESTS = 120
MAX_CHUNKS = 8
BRANCHING_MAX_CHUNKS = 12


def conversations(rows: list[dict]) -> list[int]:
    """Per request (in order), its conversation: that of the earlier request it shares the longest
    prefix of at least two block ids with, else a new one."""
    owner: dict[tuple[int, ...], int] = {}
    out, n = [], 0
    for r in rows:
        ids = tuple(r["hash_ids"])
        conv = next((owner[ids[:k]] for k in range(len(ids), 1, -1) if ids[:k] in owner), None)
        if conv is None:
            conv, n = n, n + 1
        out.append(conv)
        for k in range(1, len(ids) + 1):
            owner.setdefault(ids[:k], conv)
    return out


def contexts(rows: list[dict]) -> list[int]:
    """Per request (in order), its context: the longest prefix of block ids it shares with any other
    request of the trace (a document behind its application's system prompt, or an application's
    few-shot block), numbered in order of first use."""
    uses: dict[tuple[int, ...], int] = {}
    for r in rows:
        ids = tuple(r["hash_ids"])
        for k in range(1, len(ids) + 1):
            uses[ids[:k]] = uses.get(ids[:k], 0) + 1
    number: dict[tuple[int, ...], int] = {}
    out = []
    for i, r in enumerate(rows):
        ids = tuple(r["hash_ids"])
        k = next((k for k in range(len(ids), 0, -1) if uses[ids[:k]] > 1), 0)
        out.append(number.setdefault(ids[:k] if k else (-1 - i,), len(number)))
    return out


@dataclass(frozen=True)
class TraceCase:
    """A trace and how the test takes its slice: `group` gives each request (in trace order) its
    group, the slice is every `sample`-th group's requests (at most `per_group` of each) in trace
    order, the first REQUESTS; `keep_end`: a prompt over MAX_CHUNKS blocks keeps its first
    MAX_CHUNKS - 1 and its last (its own ending), else its first MAX_CHUNKS."""

    name: str
    trace: Path
    results: Path
    unit: str  # what a group is, in the JSON: "conversation", "context"
    group: Callable[[list[dict]], list[int]]
    sample: int
    per_group: int | None = None
    keep_end: bool = False
    max_chunks: int = MAX_CHUNKS


CASES = {
    "conversation": TraceCase("conversation", TRACE, RESULTS, "conversation", conversations, SESSION_SAMPLE),
    "branching": TraceCase("branching", REPO / "bench" / "traces" / "branching_trace.jsonl",
                           REPO / "bench" / "results" / "state_policy_engine_branching.json", "context", contexts,
                           CONTEXT_SAMPLE, PER_CONTEXT, keep_end=True, max_chunks=BRANCHING_MAX_CHUNKS),
}


def trace_slice(chunk: int, case: TraceCase = CASES["conversation"], requests: int = REQUESTS,
                max_chunks: int | None = None) -> list[dict]:
    """Every `case.sample`-th group's requests (the first `case.per_group` of each), in trace order, the
    first `requests`; each a dict of its group, block ids (at most `max_chunks`, default the case's)
    and prompt length in tokens (a trace block is one chunk; a partial last block is cut in
    proportion)."""
    max_chunks = max_chunks or case.max_chunks
    rows = [json.loads(ln) for ln in case.trace.read_text().splitlines() if ln.strip()]
    rows.sort(key=lambda r: r["timestamp"])  # stable: ties keep file order
    out: list[dict] = []
    taken: dict[int, int] = {}
    for r, group in zip(rows, case.group(rows)):
        if group % case.sample or (case.per_group is not None and taken.get(group, 0) >= case.per_group):
            continue
        taken[group] = taken.get(group, 0) + 1
        ids = [int(h) for h in r["hash_ids"]]
        rest = int(r["input_length"]) - TRACE_BLOCK * (len(ids) - 1)
        last = max(1, -(-rest * chunk // TRACE_BLOCK))  # the last block's tokens, cut in proportion
        if len(ids) > max_chunks and case.keep_end:
            ids, n = ids[:max_chunks - 1] + ids[-1:], (max_chunks - 1) * chunk + last
        elif len(ids) > max_chunks:
            ids, n = ids[:max_chunks], max_chunks * chunk
        else:
            n = (len(ids) - 1) * chunk + last
        out.append({case.unit: group, "ids": ids, "tokens": n, "timestamp_ms": r["timestamp"]})
        if len(out) == requests:
            break
    return out


def prompt_of(item: dict, chunk: int, cache: dict[int, list[int]]) -> list[int]:
    """Token ids: block id b's chunk is `chunk` ids drawn from random.Random(b)."""
    toks: list[int] = []
    for b in item["ids"]:
        if b not in cache:
            rng = random.Random(b)
            cache[b] = [rng.randrange(2, 1000) for _ in range(chunk)]
        toks += cache[b]
    return toks[:item["tokens"]]
