"""bench/trace_replay.py replays a Mooncake-format trace through the planner, keys and the
host-memory index (no engine); a small replay of the agent trace, checked on its JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # bench/ is not installed; it runs from the checkout
    sys.path.insert(0, str(REPO))

from bench import trace_replay  # noqa: E402
from bench.traces import make_agent_trace, make_branching_trace  # noqa: E402
from offload.planner.worth import DEFAULT_STATE_POLICY  # noqa: E402

TRACES = REPO / "bench" / "traces"
POLICIES = ("all", "default", "by_use", "tails", "attention_only")


def _replay(tmp_path: Path, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    assert trace_replay.main(["--trace", str(TRACES / "agent_trace.jsonl"), "--budget-gb", "5,unlimited",
                              "--limit", "250", "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("replay")
    return _replay(tmp, "a"), _replay(tmp, "b")


def test_json_shape_and_geometry(runs) -> None:
    doc = runs[0]
    m = doc["model"]
    assert m["chunk_tokens"] == 544 and m["tail_unit"] == 34
    assert [g["kind"] for g in m["groups"]] == ["mamba"] * 3 + ["full_attention"]
    assert m["bytes_per_chunk"] == {"full_attention": 12 * 544 * 2048, "mamba": 36 * 1_097_728}
    assert doc["default_policy"] == DEFAULT_STATE_POLICY.value
    assert doc["trace"]["requests"] == 250
    assert [b["budget_gb"] for b in doc["budgets"]] == [5.0, "unlimited"]
    for b in doc["budgets"]:
        assert set(POLICIES) <= set(b["hit_rate"])
        assert all(0.0 <= b["hit_rate"][p] <= 1.0 for p in POLICIES)
        assert b["hit_rate"]["default"] == b["hit_rate"][DEFAULT_STATE_POLICY.value]
        assert set(b["bytes_by_kind"]) >= set(POLICIES)
        assert b["bytes_by_kind"]["attention_only"]["mamba"] == 0
        assert b["bytes_by_kind"]["all"]["mamba"] > 0
        if b["budget_gb"] != "unlimited":
            for p in POLICIES:
                assert sum(b["bytes_by_kind"][p].values()) <= b["budget_gb"] * 1e9


def test_budgets_order_the_policies(runs) -> None:
    tight, unlimited = runs[0]["budgets"]
    h = tight["hit_rate"]
    assert h["attention_only"] >= h["all"] and h["attention_only"] > 0
    assert h["default"] > h["all"]  # the tight budget is where admission by use matters
    u = unlimited["hit_rate"]
    for p in ("default", "by_use", "attention_only"):
        assert abs(u[p] - u["all"]) <= 0.005, (p, u)
    assert u["tails"] <= u["all"] + 1e-9  # no internal states: a branch inside another prompt misses
    assert unlimited["evictions"]["all"]["by_kind"] == {"full_attention": 0, "mamba": 0}


def test_deterministic(runs) -> None:
    a, b = runs
    for x, y in zip(a["budgets"], b["budgets"]):
        for p in trace_replay.POLICIES:  # everything but the timing
            assert {k: v for k, v in x["policies"][p].items() if k != "seconds"} == \
                {k: v for k, v in y["policies"][p].items() if k != "seconds"}
        for p in POLICIES:
            assert x["hit_rate"][p] == y["hit_rate"][p]
            assert x["bytes_by_kind"][p] == y["bytes_by_kind"][p]


def test_agent_trace_is_what_the_generator_writes(tmp_path: Path) -> None:
    rows = make_agent_trace.generate()
    committed = (TRACES / "agent_trace.jsonl").read_text().splitlines()
    assert len(rows) == len(committed)
    assert [json.loads(line) for line in committed[:200]] == rows[:200]
    for r in rows[:500]:
        assert -(-r["input_length"] // 512) == len(r["hash_ids"])


def test_branching_trace_is_what_the_generator_writes_and_siblings_branch_near_their_end() -> None:
    rows = make_branching_trace.generate()
    committed = (TRACES / "branching_trace.jsonl").read_text().splitlines()
    assert len(rows) == len(committed)
    assert [json.loads(line) for line in committed[:200]] == rows[:200]
    for r in rows[:500]:
        assert -(-r["input_length"] // 512) == len(r["hash_ids"])
    # What the trace is for: most prompts are siblings of an earlier one (another question, an edit,
    # another final example): they share its first blocks and part from it within its last two
    # blocks (the conversation trace: 27% of its prompts).
    seen: dict[tuple[int, ...], int] = {}
    near = far = 0
    for r in rows:
        ids = r["hash_ids"]
        k = 0
        while k < len(ids) and tuple(ids[:k + 1]) in seen:
            k += 1
        earlier = seen.get(tuple(ids[:k]), 0) if k else 0
        if k >= 4 and k < len(ids) and earlier > k:  # a branch off an earlier prompt, not its extension
            near += earlier - k <= 2
            far += earlier - k > 2
        for j in range(1, len(ids) + 1):
            seen[tuple(ids[:j])] = max(seen.get(tuple(ids[:j]), 0), len(ids))
    assert near > len(rows) / 2 and near > 3 * far, (near, far, len(rows))


def test_chart_of_the_committed_results(tmp_path: Path) -> None:
    from bench import charts
    chart = charts.render_trace_replay(REPO / "bench" / "results", tmp_path)
    assert chart is not None and chart.path.exists()
    assert chart.sources == sorted(f.name for f in (REPO / "bench" / "results").glob("trace_replay_*.json"))
    assert "trace_replay_conversation.json" in chart.sources
    assert chart.series == {p: 4 for p in ("all", "default", "tails", "attention_only", "oracle")}


def test_the_committed_results_hold_every_trace_budget_and_reading() -> None:
    """docs/performance.md's capacity table: the three traces, both readings of a partial last block,
    50 / 100 / 200 / 400 GB and unlimited, every policy, the oracle and the attention-only model."""
    found = {}
    for f in sorted((REPO / "bench" / "results").glob("trace_replay_*.json")):
        doc = json.loads(f.read_text())
        found[doc["trace"]["name"], doc["replay"]["partial_blocks"]] = f.name
        assert [b["budget_gb"] for b in doc["budgets"]] == [50.0, 100.0, 200.0, 400.0, "unlimited"], f.name
        assert set(doc["policies"]) == {*trace_replay.POLICIES, trace_replay.ORACLE}, f.name
    traces = ("mooncake_conversation_trace.jsonl", "agent_trace.jsonl", "branching_trace.jsonl")
    assert set(found) == {(t, m) for t in traces for m in ("own", "continue")}, found
