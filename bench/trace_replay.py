"""Replay a Mooncake-format request trace through the connector's scheduler-side code, no engine.

    python -m bench.trace_replay --trace bench/traces/mooncake_conversation_trace.jsonl \
        --budget-gb 100,200,400,unlimited --json bench/results/trace_replay_conversation.json

What runs is the project's own code, not a model of it: `HybridOffloadPlanner` (lookup, what a
hit needs, what a chunk or tail entry holds, a state's class), `offload.keys` (chained chunk keys
and tail keys of deterministic token ids), `offload.planner.worth.admission`, and the host-memory
tier's scheduler-side index and evictor (`CpuLayout.plan` + `CpuIndex`: one arena of frames,
prefix-closed leaf LRU, cold admission). Per request it does what `offload.connector.scheduler`
(and its store planning, `offload.connector.store_plan`) does, in its order:

1. lookup (`get_num_new_matched_tokens`): `planner.lookup` with the index's `contains` for chunk
   and partial-tail keys; the branch point is `max(full_prefix, computed // chunk) * chunk`;
2. load (`update_state_after_alloc`): pin every entry `planner.needed` names for the hit (group
   order), then unpin them (the load finished);
3. prefill from the hit to the prompt's end in steps of one chunk, split once more at the
   prompt's partial-tail boundary (the plan's flags: `--max-num-batched-tokens` = the block =
   the chunk, `--prefix-match-unit`); per step, as `build_connector_meta`: the attention chunks
   completed (`_plan_chunk_stores`, from the stored prefix on, each chained to the chunk before),
   the attention half of the partial tail in the step that computed up to it
   (`_plan_tail_store`), then the states vLLM hands over for the boundaries the step computed
   (`_plan_state_stores`: a state at each chunk boundary, the tail state), each reserved with
   `admission(policy, planner.entry_class(entry, prompt, branch_at))` (the partial tail's
   attention half is admitted as its state is).

Requests run one after another in trace order (no concurrency, so a pin never blocks an
eviction), vLLM's own GPU prefix cache is left out (every lookup starts at 0 computed tokens:
the offload tier is the only cache), and only prompt tokens are stored (as the connector does).
Token ids are deterministic per trace block id (`block_id * block_tokens + i`), so prompts that
share leading block ids share exactly those tokens; the last block of a prompt may be partial.

Model (default): Qwen3-Next-80B-A3B at TP 1 on CUDA, grouped as vLLM groups it: 48 layers = 12
full attention (2 KV heads x head_dim 256, bf16: 2048 B per token per layer) + 36 Gated DeltaNet
(1,097,728 B of state per layer in bf16: conv 8192 x 3 x 2 B + recurrent 32 x 128 x 128 x 2 B),
in 4 KV cache groups of 12 layers (3 Mamba, 1 full attention), block size 544 (vLLM raises the
attention block until its page holds a state), chunk = block = 544 tokens, prefix-match unit 34
(`offload.plan.policy.prefix_match_unit`: the partial-tail unit the plan serves it with).

Policies: `all`, `by_use` (also reported as `default`, the value of `DEFAULT_STATE_POLICY`),
`tails`, and `attention_only`: the attention group alone (same block, chunk and bytes, no states;
its planner takes no 34-token tail unit, as an attention-only model hits at whole blocks). What-ifs,
not policies: `oracle` and `pre_tail` (see their constants below).
Token hit rate = restored tokens / input tokens. Budgets are in GB (10^9 bytes) of host memory;
`unlimited` holds every entry the trace stores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from offload.keys import ChunkKey, chunk_keys, fingerprint, request_root, tail_key
from offload.plan.policy import prefix_match_unit
from offload.planner import ChunkIndex, GroupIndex, GroupKind, GroupSpec, HybridOffloadPlanner
from offload.planner.worth import DEFAULT_STATE_POLICY, Admission, StateClass, StatePolicy, admission
from offload.store.arena import CpuLayout
from offload.store.cpu import CpuIndex

GB = 10**9
POLICIES = ("all", "by_use", "tails", "attention_only")  # the default set
ATTENTION_ONLY = "attention_only"
# A what-if, not a state_policy: states are admitted hot where a later request of the trace reads them
# with every entry kept (an unlimited replay of `all` tells which), and not stored elsewhere. What
# admission alone could reach with foresight of the trace (the eviction order stays LRU).
ORACLE = "oracle"
# A what-if, not a state_policy: `by_use` with the pre-tail rule (`offload.planner.worth.pre_tail`):
# where the tail lies within `--pre-tail-within` tokens of the prompt's end (default: the plan's
# partial-tail unit), the state one chunk before it is the prompt's hot state and the tail is cold.
PRE_TAIL = "pre_tail"
CHOICES = (*POLICIES, ORACLE, PRE_TAIL)


# ---- model geometry -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Geometry:
    """A hybrid model's KV cache as vLLM groups it (one group per `layers_per_group` layers)."""

    name: str
    attn_layers: int
    attn_bytes_per_token_layer: int  # K and V, all KV heads of one layer, one token
    mamba_layers: int
    state_bytes_per_layer: int
    layers_per_group: int
    block_size: int
    notes: str = ""

    def specs(self) -> list[GroupSpec]:
        """Mamba groups first, then full attention (vLLM's order for Qwen3-Next)."""
        per = self.layers_per_group
        mamba = [GroupSpec(GroupKind.MAMBA, self.block_size, per * self.state_bytes_per_layer, per)
                 for _ in range(self.mamba_layers // per)]
        attn = [GroupSpec(GroupKind.FULL_ATTENTION, self.block_size,
                          per * self.block_size * self.attn_bytes_per_token_layer, per)
                for _ in range(self.attn_layers // per)]
        return mamba + attn


QWEN3_NEXT_80B = Geometry(
    name="Qwen3-Next-80B-A3B (TP 1, CUDA, bf16)",
    attn_layers=12, attn_bytes_per_token_layer=2 * 2 * 256 * 2,  # K,V x 2 KV heads x 256 x bf16
    mamba_layers=36, state_bytes_per_layer=8192 * 3 * 2 + 32 * 128 * 128 * 2,  # conv + recurrent, bf16
    layers_per_group=12, block_size=544,
    notes="48 layers = 12 full attention (2 KV heads x head_dim 256) + 36 Gated DeltaNet "
          "(conv 8192x3, recurrent 32 heads x 128 x 128); 4 KV cache groups of 12 layers "
          "(3 Mamba, 1 full attention); CUDA block size 544 at TP 1",
)


@dataclass
class Model:
    """The planners the replay runs: the hybrid's, and the attention-only reference's."""

    geometry: Geometry
    chunk: int
    tail_unit: int | None
    hybrid: HybridOffloadPlanner
    attention: HybridOffloadPlanner

    @classmethod
    def build(cls, geometry: Geometry = QWEN3_NEXT_80B, chunk: int | None = None,
              tail_unit: int | None = -1) -> Model:
        specs = geometry.specs()
        if tail_unit == -1:  # the plan's prefix-match unit
            tail_unit, _ = prefix_match_unit(specs)
        hybrid = HybridOffloadPlanner(specs, chunk, tail_unit=tail_unit or None)
        attn_specs = [s for s in specs if s.kind is GroupKind.FULL_ATTENTION]
        attention = HybridOffloadPlanner(attn_specs, hybrid.chunk_size, tail_unit=tail_unit or None)
        return cls(geometry, hybrid.chunk_size, hybrid.tail_unit, hybrid, attention)

    def planner(self, policy: str) -> HybridOffloadPlanner:
        return self.attention if policy == ATTENTION_ONLY else self.hybrid

    def describe(self) -> dict[str, Any]:
        g, p = self.geometry, self.hybrid
        chunk_bytes = {k.value: sum(len(p.stored(GroupIndex(i), ChunkIndex(0)).blocks or [0]) * s.page_bytes
                                    for i, s in enumerate(p.groups) if s.kind is k)
                       for k in (GroupKind.FULL_ATTENTION, GroupKind.MAMBA)}
        layout = CpuLayout.plan(p, GB)
        return {
            "name": g.name, "notes": g.notes,
            "attention_layers": g.attn_layers, "attention_bytes_per_token_per_layer": g.attn_bytes_per_token_layer,
            "mamba_layers": g.mamba_layers, "state_bytes_per_layer": g.state_bytes_per_layer,
            "groups": [{"kind": s.kind.value, "block_size": s.block_size, "num_layers": s.num_layers,
                        "page_bytes": s.page_bytes} for s in p.groups],
            "chunk_tokens": self.chunk, "tail_unit": self.tail_unit,
            "attention_only_tail_unit": self.attention.tail_unit,
            "bytes_per_chunk": chunk_bytes,
            "state_share_of_chunk_bytes": chunk_bytes["mamba"] / sum(chunk_bytes.values()),
            "host_frame_bytes": layout.frame_bytes,
            "default_policy": DEFAULT_STATE_POLICY.value,
        }


# ---- trace --------------------------------------------------------------------------------------

@dataclass
class Request:
    """One trace request with its chunk keys (computed once, shared by every replay)."""

    prompt: int
    hash_ids: list[int]
    keys: list[ChunkKey]
    tails: dict[int, ChunkKey] = field(default_factory=dict)


class Trace:
    def __init__(self, path: Path, chunk: int, block_tokens: int = 512, limit: int | None = None,
                 partial: str = "own") -> None:
        self.path = Path(path)
        self.partial = partial
        self.block_tokens = block_tokens
        self.chunk = chunk
        self.root = request_root(fingerprint({"bench": "trace_replay", "chunk": chunk}))
        rows = []
        with self.path.open() as f:
            for line in f:
                if line.strip():
                    rows.append(json.loads(line))
                    if limit is not None and len(rows) >= limit:
                        break
        rows.sort(key=lambda r: r["timestamp"])  # stable: ties keep file order
        # "continue": a prompt's partial last block holds the first tokens of the full block that a
        # later prompt with the same prefix has there (the next turn of a conversation continues
        # it); "own": its tokens are its own id's, so nothing past the last full block is shared.
        self.alias: dict[int, int] = {}
        if partial == "continue":
            self.alias = self._continuations(rows, block_tokens)
        elif partial != "own":
            raise ValueError(f"partial must be 'own' or 'continue', got {partial!r}")
        self.requests: list[Request] = []
        for r in rows:
            n, ids = int(r["input_length"]), [int(h) for h in r["hash_ids"]]
            if -(-n // block_tokens) != len(ids):
                raise ValueError(f"{self.path}: {n} input tokens need {-(-n // block_tokens)} block ids, "
                                 f"got {len(ids)}")
            req = Request(n, ids, [])
            req.keys = chunk_keys(self.root, self.tokens(req, 0, n), chunk)
            self.requests.append(req)
        self.input_tokens = sum(r.prompt for r in self.requests)
        self.output_tokens = sum(int(r.get("output_length", 0)) for r in rows)
        self.duration_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 if rows else 0.0

    @staticmethod
    def _continuations(rows: list[dict], block_tokens: int) -> dict[int, int]:
        """Partial last block id -> the full block id the earliest later prompt with the same
        prefix has at that position."""
        alias: dict[int, int] = {}
        first_full: dict[tuple[int, int], int] = {}  # (previous id or -1, position) -> full id
        for r in reversed(rows):
            ids = r["hash_ids"]
            full = len(ids) if r["input_length"] % block_tokens == 0 else len(ids) - 1
            if full < len(ids):
                q = first_full.get((ids[full - 1] if full else -1, full))
                if q is not None:
                    alias[ids[full]] = q
            for j in range(full):
                first_full[ids[j - 1] if j else -1, j] = ids[j]
        return alias

    def tokens(self, req: Request, start: int, end: int) -> np.ndarray:
        """Token ids [start, end) of a prompt: block id b's i-th token is b * block_tokens + i."""
        bt = self.block_tokens
        pos = np.arange(start, end, dtype=np.int64)
        ids = np.asarray([self.alias.get(h, h) for h in req.hash_ids] if self.alias else req.hash_ids,
                         dtype=np.int64)[pos // bt]
        return (ids * bt + pos % bt).astype("<u4")

    def tail_key(self, req: Request, end: int) -> ChunkKey:
        key = req.tails.get(end)
        if key is None:
            c = end // self.chunk
            parent = req.keys[c - 1] if c else self.root
            key = req.tails[end] = tail_key(parent, self.tokens(req, c * self.chunk, end).tolist())
        return key

    def describe(self) -> dict[str, Any]:
        unique = len({h for r in self.requests for h in r.hash_ids})
        return {"name": self.path.name, "requests": len(self.requests), "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "duration_s": self.duration_s,
                "block_tokens": self.block_tokens, "unique_blocks": unique,
                "mean_input_tokens": self.input_tokens / max(1, len(self.requests))}


# ---- replay -------------------------------------------------------------------------------------

@dataclass
class Result:
    policy: str
    restored: int = 0
    input_tokens: int = 0
    hits: int = 0  # requests with a hit
    usage: Any = None
    seconds: float = 0.0
    states_stored: Counter = field(default_factory=Counter)  # state entries reserved, by class

    @property
    def hit_rate(self) -> float:
        return self.restored / self.input_tokens if self.input_tokens else 0.0


def unlimited_bytes(trace: Trace, planner: HybridOffloadPlanner) -> int:
    """A budget that holds every entry the trace can store (one frame per entry)."""
    layout = CpuLayout.plan(planner, 1 << 62)
    entries = sum(r.prompt // planner.chunk_size + 1 for r in trace.requests) * len(planner.groups)
    return (entries + 1) * layout.frame_bytes


def replay(trace: Trace, planner: HybridOffloadPlanner, policy: str, cpu_bytes: int,
           reads: set[ChunkKey] | None = None, oracle: set[ChunkKey] | None = None,
           pre_tail_within: int = 0) -> Result:
    """Run every request of `trace` through the connector's scheduler-side steps on a `CpuIndex`.
    `reads`: filled with the keys of the states loads read. `oracle`: admit a state hot where its key
    is in it, else not at all (the `oracle` what-if). `pre_tail_within`: the pre-tail rule's reach
    (0: off)."""
    t0 = time.perf_counter()
    pol = StatePolicy.ALL if policy in (ATTENTION_ONLY, ORACLE) else \
        StatePolicy.BY_USE if policy == PRE_TAIL else StatePolicy(policy)
    within = pre_tail_within if policy == PRE_TAIL else 0

    def admit_state(cls: StateClass, key: ChunkKey) -> Admission:
        if oracle is None:
            return admission(pol, cls)
        return Admission.HOT if key in oracle else Admission.SKIP
    index = CpuIndex(planner, CpuLayout.plan(planner, cpu_bytes))
    contains, reserve = index.contains, index.reserve
    C = planner.chunk_size
    storable = [g for g, s in enumerate(planner.groups) if s.kind is not GroupKind.MAMBA]
    mamba = [g for g, s in enumerate(planner.groups) if s.kind is GroupKind.MAMBA]
    unit = planner.tail_unit
    res = Result(policy, input_tokens=trace.input_tokens)
    for req in trace.requests:
        P, keys = req.prompt, req.keys
        tail_end = planner.tail_boundary(P)
        # -- get_num_new_matched_tokens (num_computed_tokens = 0, a fresh request: num_tokens = P)
        max_n = planner.max_hit_chunks(P, P)
        stored_chunks = tail_stored_to = branch_at = 0
        n = tail = 0
        if max_n or (unit is not None and unit <= P - 1):
            found = planner.lookup(
                P, lambda g, ch, keys=keys: ch < len(keys) and contains(g, keys[ch]), 0, P,
                present_tail=(lambda g, end, req=req: contains(g, trace.tail_key(req, end))) if unit else None)
            stored_chunks = found.full_prefix
            branch_at = found.full_prefix * C
            n, tail = found.chunks, found.tail
        hit = n * C + tail
        # -- update_state_after_alloc: pin what the hit needs, then the load finishes: unpin
        if hit:
            res.hits += 1
            res.restored += hit
            pinned = []
            for g in range(len(planner.groups)):
                for gc in planner.needed(GroupIndex(g), n, 0, tail):
                    key = trace.tail_key(req, gc.tail_end) if gc.tail_end is not None else keys[gc.chunk]
                    if index.pin(g, key) is None:
                        raise AssertionError(f"group {g} chunk {gc.chunk} left the index between lookup and load")
                    pinned.append((g, key))
                    if reads is not None and g in mamba:
                        reads.add(key)
            for g, key in pinned:
                index.unpin(g, key)
            stored_chunks = max(stored_chunks, n)
            if tail and hit == tail_end:
                tail_stored_to = hit
        # -- the prefill, step by step: build_connector_meta's stores
        stops = sorted({b for b in range(hit // C * C + C, P, C)} | ({tail_end} if tail_end > hit else set()) | {P})
        before = hit
        for after in stops:
            # _plan_chunk_stores
            end = min(after, P) // C
            for chunk in range(stored_chunks, end):
                parent = keys[chunk - 1] if chunk else None
                for g in storable:
                    reserve(g, keys[chunk], parent)
            stored_chunks = max(stored_chunks, end)
            # _plan_tail_store (hybrid: only in the step that computed up to the tail)
            if not (tail_stored_to >= tail_end or not tail_end or after < tail_end or before >= tail_end):
                tail_stored_to = tail_end
                c = tail_end // C
                parent = keys[c - 1] if c else None
                tkey = trace.tail_key(req, tail_end)
                for g in storable:
                    cls = planner.entry_class(planner.stored_tail(GroupIndex(g), ChunkIndex(c), tail_end), P, branch_at,
                                              within)
                    reserve(g, tkey, parent, admit_state(cls, tkey) if cls is not None else Admission.HOT)
            # _plan_state_stores: the states at the boundaries this step computed
            if mamba:
                for b in range(before // C * C + C, after + 1, C):
                    chunk = b // C - 1
                    state = planner.state_class(b, P, branch_at, within)
                    admit = admit_state(state, keys[chunk])
                    res.states_stored[state.value, admit.value] += len(mamba)
                    for g in mamba:
                        reserve(g, keys[chunk], keys[chunk - 1] if chunk else None, admit, state)
                if tail_end and before < tail_end <= after:
                    c = tail_end // C
                    state = planner.state_class(tail_end, P, branch_at, within)
                    tkey = trace.tail_key(req, tail_end)
                    admit = admit_state(state, tkey)
                    res.states_stored[state.value, admit.value] += len(mamba)
                    for g in mamba:
                        reserve(g, tkey, keys[c - 1] if c else None, admit, state)
            before = after
    res.usage = index.usage()
    res.seconds = time.perf_counter() - t0
    return res


def _bytes_by_kind(planner: HybridOffloadPlanner, values: tuple[int, ...]) -> dict[str, int]:
    out = {GroupKind.FULL_ATTENTION.value: 0, GroupKind.MAMBA.value: 0}
    for s, v in zip(planner.groups, values):
        out[s.kind.value] = out.get(s.kind.value, 0) + int(v)
    return out


def summarize(model: Model, r: Result) -> dict[str, Any]:
    u = model.planner(r.policy), r.usage
    planner, usage = u
    return {
        "hit_rate": r.hit_rate, "restored_tokens": r.restored, "requests_hit": r.hits,
        "bytes_by_kind": _bytes_by_kind(planner, usage.bytes),
        "entries_by_kind": _bytes_by_kind(planner, usage.entries),
        "states_by_class": {c: {"entries": k, "bytes": b} for c, k, b in usage.states},
        "states_stored": {f"{c}/{a}": k for (c, a), k in sorted(r.states_stored.items())},
        "state_hits": dict(usage.state_hits),
        "evictions": {"by_kind": _bytes_by_kind(planner, usage.evictions),
                      "states": {f"{c}/{why}": k for c, why, k in usage.state_evictions},
                      "no_room": usage.no_room, "skipped": usage.skipped},
        "capacity_bytes": usage.capacity_bytes, "seconds": round(r.seconds, 2),
    }


def parse_budgets(text: str) -> list[float | None]:
    out: list[float | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part:
            out.append(None if part in ("unlimited", "inf", "none") else float(part))
    return out


def run(trace_path: Path, budgets: list[float | None], block_tokens: int = 512, chunk: int | None = None,
        tail_unit: int | None = -1, limit: int | None = None, policies: tuple[str, ...] = POLICIES,
        partial: str = "own", log=print, pre_tail_within: int | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    model = Model.build(QWEN3_NEXT_80B, chunk, tail_unit)
    trace = Trace(trace_path, model.chunk, block_tokens, limit, partial)
    desc = model.describe()
    log(f"model: {desc['name']}: {desc['notes']}")
    log("  groups: " + ", ".join(f"{g['kind']} x{g['num_layers']} layers, block {g['block_size']}, "
                                  f"{g['page_bytes']} B/page" for g in desc["groups"]))
    log(f"  chunk {model.chunk} tokens, partial-tail unit {model.tail_unit} (attention-only reference: "
        f"{model.attention.tail_unit}); per chunk {desc['bytes_per_chunk']} B, states "
        f"{desc['state_share_of_chunk_bytes']:.1%} of it; host frame {desc['host_frame_bytes']} B")
    td = trace.describe()
    log(f"trace: {td['name']}: {td['requests']} requests, {td['input_tokens']} input tokens "
        f"({td['mean_input_tokens']:.0f} mean), {td['unique_blocks']} distinct {block_tokens}-token blocks "
        f"(keys in {time.perf_counter() - t0:.1f} s)")
    oracle: set[ChunkKey] | None = None
    if ORACLE in policies:  # the states a replay that keeps everything reads
        oracle = set()
        planner = model.planner("all")
        replay(trace, planner, "all", unlimited_bytes(trace, planner), reads=oracle)
        log(f"  oracle: {len(oracle)} distinct states read with every entry kept")
    within = (model.tail_unit or 0) if pre_tail_within is None else pre_tail_within
    if PRE_TAIL in policies:
        log(f"  pre_tail: the state one chunk before the tail hot where the tail is within {within} tokens of the end")
    rows = []
    for b in budgets:
        entry: dict[str, Any] = {"budget_gb": "unlimited" if b is None else b, "hit_rate": {}, "bytes_by_kind": {},
                                 "states_by_class": {}, "evictions": {}, "policies": {}}
        for policy in policies:
            planner = model.planner(policy)
            cpu_bytes = unlimited_bytes(trace, planner) if b is None else int(b * GB)
            r = replay(trace, planner, policy, cpu_bytes, oracle=oracle if policy == ORACLE else None,
                       pre_tail_within=within)
            s = summarize(model, r)
            entry["policies"][policy] = s
            entry["hit_rate"][policy] = s["hit_rate"]
            entry["bytes_by_kind"][policy] = s["bytes_by_kind"]
            entry["states_by_class"][policy] = s["states_by_class"]
            entry["evictions"][policy] = s["evictions"]
            log(f"  budget {entry['budget_gb']} GB, {policy}: hit rate {s['hit_rate']:.4f} ({r.seconds:.1f} s)")
        default = DEFAULT_STATE_POLICY.value
        if default in entry["hit_rate"]:
            for k in ("hit_rate", "bytes_by_kind", "states_by_class", "evictions"):
                entry[k]["default"] = entry[k][default]
        rows.append(entry)
    doc = {"model": desc, "trace": td, "policies": list(policies), "default_policy": DEFAULT_STATE_POLICY.value,
           "budget_unit": "GB = 1e9 bytes of host memory (CpuLayout.plan)", "budgets": rows,
           "replay": {"computed_tokens": 0, "pre_tail_within": within if PRE_TAIL in policies else None,
                      "order": "trace timestamp, one request at a time",
                      "token_ids": f"block_id * {block_tokens} + position in block",
                      "partial_blocks": partial, "partial_blocks_continued": len(trace.alias)},
           "code": _code_state(),
           "wall_s": round(time.perf_counter() - t0, 1)}
    return doc


def _code_state() -> dict[str, Any]:
    """The commit the replay ran on, and whether offload/ differed from it (others edit it)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "offload"], cwd=repo, capture_output=True,
                               text=True).stdout.split("\n")
        return {"commit": rev, "offload_uncommitted": sorted(ln[3:] for ln in dirty if ln.strip())}
    except OSError:
        return {"commit": "", "offload_uncommitted": []}


def table(doc: dict[str, Any]) -> str:
    cols = [p for p in ("all", "default", "tails", "attention_only") if p in doc["budgets"][0]["hit_rate"]]
    head = ["budget", *cols, "default/all", "default/attn"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for b in doc["budgets"]:
        h = b["hit_rate"]
        budget = "unlimited" if b["budget_gb"] == "unlimited" else f"{b['budget_gb']:g} GB"
        cells = [budget] + [f"{100 * h[c]:.1f}%" for c in cols]
        cells.append(f"{h['default'] / h['all']:.2f}x" if "default" in h and h.get("all") else "-")
        cells.append(f"{h['default'] / h['attention_only']:.2f}" if "default" in h and h.get("attention_only")
                     else "-")
        lines.append(" | ".join(cells))
    return "\n".join("| " + ln + " |" for ln in lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    ap.add_argument("--budget-gb", default="100,200,400,unlimited",
                    help="comma-separated host-memory budgets in GB (1e9 B), or 'unlimited'")
    ap.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash id (default 512)")
    ap.add_argument("--chunk", type=int, default=None, help="chunk tokens (default: the model's, 544)")
    ap.add_argument("--tail-unit", type=int, default=-1,
                    help="partial-tail unit in tokens (default: the plan's prefix-match unit; 0: none)")
    ap.add_argument("--partial-blocks", choices=("own", "continue"), default="own",
                    help="a prompt's partial last block: 'own' tokens (as the trace's ids say) or the first "
                         "tokens of the block a later prompt with the same prefix has there")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(CHOICES))
    ap.add_argument("--pre-tail-within", type=int, default=None,
                    help="the pre_tail what-if's reach in tokens (default: the plan's partial-tail unit)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    bad = [p for p in policies if p not in CHOICES]
    if bad:
        ap.error(f"unknown policies {bad}; choose from {CHOICES}")
    doc = run(args.trace, parse_budgets(args.budget_gb), args.block_tokens, args.chunk, args.tail_unit,
              args.limit, policies, args.partial_blocks, pre_tail_within=args.pre_tail_within)
    print()
    print(table(doc))
    print(f"\n{doc['trace']['requests']} requests replayed at {len(doc['budgets'])} budgets x "
          f"{len(policies)} policies in {doc['wall_s']} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
