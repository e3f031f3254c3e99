"""Write a deterministic trace of prompts that resend a shared context with different endings, in the
Mooncake format (bench/traces/branching_trace.jsonl).

    python -m bench.traces.make_branching_trace [--out PATH] [--seed 11] [--sessions 1500]

The shape, unlike a chat service's (where a prompt extends the one before it) and an agent's (where
a session's context grows turn by turn): the common prefix of two prompts ends a few hundred tokens
before either prompt does, so what a later prompt reads is the state where its siblings branch, not
the state at the end of the earlier prompt. Sessions of four kinds, over about an hour:

- **Questions on a document** (55% of sessions): an application's system prompt, one document
  (log-normal, median about 9k tokens, 1.5k-64k; 3,000 documents, popularity 1/rank^0.6, so a
  few are read by many sessions), then one question (20-300 tokens). A session asks 2-10 questions, each
  a new prompt of system + document + question: the siblings share everything but the question.
- **A conversation about a document** (15%): the same start, but each turn appends the model's
  answer and the next question, as a chat does.
- **Few-shot prompts** (30%): an application's few-shot block (2-8k tokens, one per application,
  shared by all its sessions) and one final example or query (100-600 tokens); 2-8 requests.
- **Edits and regenerations**, in every kind: 8% of requests are sent again unchanged 2-20 s later
  (a regenerated answer), and 10% are sent again 10-60 s later with the last user message
  replaced by another of about the same length (an edited message).

Four applications, each with its own system prompt (0.5-3k tokens). Requests of a session are
30-600 s apart; outputs 50-600 tokens. Block ids as in `make_agent_trace.py` (`Ids`): a block's id is fixed
by the id before it and the content it covers, so prompts share exactly the blocks of their common
prefix, and a partial last block has an id of its own.
"""

from __future__ import annotations

import random
from pathlib import Path

from bench.traces.make_agent_trace import MAX_PROMPT, Event, Segment, rows_of, write_trace

HERE = Path(__file__).resolve().parent


def generate(seed: int = 11, sessions: int = 1500, apps: int = 4, documents: int = 3000,
             hour_s: float = 3600.0) -> list[dict]:
    rng = random.Random(seed)
    system = [(f"app{a}/system", rng.randint(500, 3_000)) for a in range(apps)]
    fewshot = [(f"app{a}/fewshot", rng.randint(2_000, 8_000)) for a in range(apps)]
    doc_len = [min(64_000, max(1_500, int(rng.lognormvariate(9.1, 0.8)))) for _ in range(documents)]
    doc_weight = [1 / (d + 1) ** 0.6 for d in range(documents)]
    app_weight = [1 / (a + 1) for a in range(apps)]
    events: list[Event] = []
    order = 0

    def emit(t: float, segs: list[Segment]) -> None:
        """A request, and the regeneration or edit of it that may follow."""
        nonlocal order
        if sum(n for _, n in segs) > MAX_PROMPT:
            return
        events.append((t, order, list(segs), rng.randint(50, 600)))
        order += 1
        r = rng.random()
        if r < 0.08:
            events.append((t + rng.uniform(2.0, 20.0), order, list(segs), rng.randint(50, 600)))
            order += 1
        elif r < 0.18:
            name, n = segs[-1]
            edited = [*segs[:-1], (f"{name}/edit", max(10, n + rng.randint(-n // 4, n // 4)))]
            events.append((t + rng.uniform(10.0, 60.0), order, edited, rng.randint(50, 600)))
            order += 1

    for s in range(sessions):
        app = rng.choices(range(apps), app_weight)[0]
        t = rng.uniform(0, hour_s)
        kind = rng.random()
        if kind < 0.70:  # questions on a document, or a conversation about one
            doc = rng.choices(range(documents), doc_weight)[0]
            ctx: list[Segment] = [system[app], (f"doc{doc}", doc_len[doc])]
            chat = kind >= 0.55
            for q in range(rng.randint(2, 10)):
                question = (f"s{s}/q{q}", rng.randint(20, 300))
                emit(t, [*ctx, question])
                if chat:
                    ctx += [question, (f"s{s}/a{q}", rng.randint(50, 600))]
                t += rng.uniform(30.0, 600.0)  # reading the answer, then the next question
        else:  # few-shot prompts: the application's examples, then one example or query of this request
            for q in range(rng.randint(2, 8)):
                emit(t, [system[app], fewshot[app], (f"s{s}/x{q}", rng.randint(100, 600))])
                t += rng.uniform(30.0, 600.0)  # reading the answer, then the next question

    return rows_of(events)


def main(argv: list[str] | None = None) -> int:
    return write_trace(generate, __doc__, HERE / "branching_trace.jsonl", 11, 1500, argv)


if __name__ == "__main__":
    raise SystemExit(main())
