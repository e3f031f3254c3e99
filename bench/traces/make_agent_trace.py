"""Write a deterministic agent-shaped trace in the Mooncake format (bench/traces/agent_trace.jsonl).

    python bench/traces/make_agent_trace.py [--out PATH] [--seed 7] [--sessions 450]

The shape, unlike a chat service's: a few agent applications, each with a long system prompt
and long tool definitions that every one of its prompts starts with; sessions that append a
tool call's output (and the model's previous output) turn by turn, so each request repeats the
whole growing context; and sub-agents spawned from a session, whose prompts take the parent's
context up to a point *inside* a prompt the parent already sent (its context before the latest
tool output), add a task of their own and run a few turns; the parent's next turn reads the
sub-agent's result as a tool output. Sessions arrive over about an hour; turns follow after a
tool's latency, so sessions interleave.

Format (as `mooncake_conversation_trace.jsonl`): one JSON object a line with `timestamp`
(ms), `input_length`, `output_length`, `hash_ids`: one id per 512-token block of the input,
prefix-chained. A block's id is fixed by the id before it and the content it covers (which
segment, which span of it), so prompts share exactly the blocks of their common prefix; a
partial last block has an id of its own (as in the Mooncake release, where a partial block's
hash covers only its tokens).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

BLOCK = 512
HERE = Path(__file__).resolve().parent
MAX_PROMPT = 131_072

Segment = tuple[str, int]  # (content id, tokens)
Event = tuple[float, int, list[Segment], int]  # (time s, order, segments, output tokens)


class Ids:
    """Block ids of a segment list: id = trie[(previous id, what the block covers)]."""

    def __init__(self) -> None:
        self.trie: dict[tuple, int] = {}

    def __call__(self, segments: list[Segment]) -> tuple[int, list[int]]:
        pieces: list[tuple[str, int, int]] = []  # (segment, start, end) covering the prompt in order
        for name, n in segments:
            pieces.append((name, 0, n))
        total = sum(n for _, n in segments)
        ids, prev, pos = [], -1, 0
        it = iter(pieces)
        cur = next(it, None)
        off = 0  # tokens of `cur` used
        while pos < total:
            sig, need = [], min(BLOCK, total - pos)
            while need:
                assert cur is not None
                take = min(need, cur[2] - off)
                sig.append((cur[0], off, off + take))
                off += take
                need -= take
                if off == cur[2]:
                    cur, off = next(it, None), 0
            key = (prev, tuple(sig))
            bid = self.trie.get(key)
            if bid is None:
                bid = self.trie[key] = len(self.trie)
            ids.append(bid)
            prev = bid
            pos += sum(e - s for _, s, e in sig)
        return total, ids


def generate(seed: int = 7, sessions: int = 450, apps: int = 6, hour_s: float = 3600.0) -> list[dict]:
    rng = random.Random(seed)
    app_prefix = []
    for a in range(apps):
        system = rng.randint(2_000, 6_000)
        tools = rng.randint(3_000, 15_000)
        app_prefix.append([(f"app{a}/system", system), (f"app{a}/tools", tools)])
    app_weight = [1 / (a + 1) for a in range(apps)]  # a few popular applications, a tail of others
    events: list[Event] = []
    order = 0

    def emit(t: float, segs: list[Segment], out: int) -> None:
        nonlocal order
        events.append((t, order, list(segs), out))
        order += 1

    def run_agent(name: str, t: float, context: list[Segment], turns: int, depth: int) -> tuple[float, int]:
        """Turns of one agent from `context`; returns (when it is done, its result's tokens)."""
        segs = list(context)
        out = 0
        for turn in range(turns):
            if sum(n for _, n in segs) > MAX_PROMPT - 8_000:
                break
            out = rng.randint(40, 600)
            emit(t, segs, out)
            t += rng.uniform(5.0, 150.0)  # the model's answer, then the tool runs (or a person answers)
            segs.append((f"{name}/out{turn}", out))
            if depth == 0 and turn >= 1 and rng.random() < 0.22:
                # A sub-agent: the context before the latest tool output (a boundary inside the
                # prompt just sent), plus a task of its own.
                cut = max(len(context), len(segs) - 3)
                sub = f"{name}/sub{turn}"
                sub_ctx = [*segs[:cut], (f"{sub}/task", rng.randint(150, 900))]
                t_sub, result = run_agent(sub, t, sub_ctx, rng.randint(2, 6), depth + 1)
                t = max(t, t_sub) + rng.uniform(0.5, 3.0)
                segs.append((f"{sub}/result", max(100, result)))
            else:
                segs.append((f"{name}/tool{turn}", int(rng.lognormvariate(7.0, 1.0)) + 50))
        return t, out

    for s in range(sessions):
        app = rng.choices(range(apps), app_weight)[0]
        start = rng.uniform(0, hour_s)
        ctx = app_prefix[app] + [(f"s{s}/user", rng.randint(30, 1_500))]
        run_agent(f"s{s}", start, ctx, rng.randint(3, 12), 0)

    return rows_of(events)


def rows_of(events: list[Event]) -> list[dict]:
    """The trace's rows, in time order (then in the order the events were made)."""
    events = sorted(events, key=lambda e: (e[0], e[1]))
    ids = Ids()
    t0 = events[0][0] if events else 0.0
    rows = []
    for t, _, segs, out in events:
        n, hids = ids(segs)
        rows.append({"timestamp": round((t - t0) * 1000), "input_length": n, "output_length": out,
                     "hash_ids": hids})
    return rows


def write_trace(generate_rows, doc: str, out: Path, seed: int, sessions: int, argv: list[str] | None) -> int:
    """A trace generator's command line: `--out`, `--seed`, `--sessions`, then the JSONL file."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--seed", type=int, default=seed)
    ap.add_argument("--sessions", type=int, default=sessions)
    args = ap.parse_args(argv)
    rows = generate_rows(args.seed, args.sessions)
    with args.out.open("w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tokens = sum(r["input_length"] for r in rows)
    print(f"wrote {args.out}: {len(rows)} requests, {tokens} input tokens ({tokens / max(1, len(rows)):.0f} mean)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return write_trace(generate, __doc__, HERE / "agent_trace.jsonl", 7, 450, argv)


if __name__ == "__main__":
    raise SystemExit(main())
