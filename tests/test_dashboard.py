"""The Grafana dashboard is the generator's output, and names only metrics that exist.

tools/generate_dashboard.py writes configs/grafana/dashboards/kvoffload.json; `--check`
fails when the committed JSON differs. Every `kvoffload_*` name a query uses is a metric of
offload/metrics.py with the suffix its kind exports, and every `vllm:*` name is one vLLM's
own loggers define. tests/test_prometheus.py runs the same queries against a real server.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import yaml

from conftest import REPO

GENERATOR = REPO / "tools" / "generate_dashboard.py"
DASHBOARD = REPO / "configs" / "grafana" / "dashboards" / "kvoffload.json"
SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def run_generator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=60)


def panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def exprs() -> list[str]:
    return [t["expr"] for p in panels() for t in p.get("targets", [])]


def metric_kinds() -> dict[str, str]:
    """METRICS of offload/metrics.py (name -> kind), read from its source."""
    tree = ast.parse((REPO / "offload" / "metrics.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "METRICS":
            return {k.value: v.args[0].value for k, v in zip(node.value.keys, node.value.values)}
    raise AssertionError("no METRICS in offload/metrics.py")


def test_committed_json_is_the_generator_output():
    r = run_generator("--check")
    assert r.returncode == 0, r.stdout + r.stderr


def test_check_fails_when_the_json_differs(tmp_path):
    changed = tmp_path / "kvoffload.json"
    doc = json.loads(DASHBOARD.read_text())
    doc["panels"][1]["targets"][0]["expr"] = "up"
    changed.write_text(json.dumps(doc, indent=2) + "\n")
    r = run_generator("--check", "--output", str(changed))
    assert r.returncode == 1
    r = run_generator("--output", str(changed))
    assert r.returncode == 0 and changed.read_text() == DASHBOARD.read_text()


def test_every_kvoffload_name_is_a_metric_with_its_kinds_suffix():
    kinds = metric_kinds()
    exported = {name + s: name for name, kind in kinds.items() for s in SUFFIXES[kind]}
    used = {n for e in exprs() for n in re.findall(r"\b(kvoffload_\w+)", e)}
    assert used, "no kvoffload metric in the dashboard"
    assert not used - exported.keys(), f"not exported by offload/metrics.py: {sorted(used - exported.keys())}"
    # Every metric the code defines is on the dashboard, except the per-entry miss counter
    # (failed loads by reason show the requests; it has no series until a miss happens).
    unused = set(kinds) - {exported[n] for n in used} - {"kvoffload_chunk_misses"}
    assert not unused, f"metrics of offload/metrics.py on no panel: {sorted(unused)}"


def test_every_vllm_name_is_defined_by_vllm():
    source = (Path(importlib.util.find_spec("vllm").origin).parent / "v1" / "metrics" / "loggers.py").read_text()
    defined = set(re.findall(r'name="(vllm:[\w:]+)"', source))
    used = {n for e in exprs() for n in re.findall(r"\b(vllm:[\w:]+)", e)}
    assert used
    missing = {n for n in used if n not in defined and n.removesuffix("_total") not in defined}
    assert not missing, f"not defined in vLLM's loggers: {sorted(missing)}"


def test_layout_ids_datasource_and_rows():
    ps = panels()
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids))
    uid = yaml.safe_load((REPO / "configs" / "grafana" / "provisioning" / "datasources" /
                          "prometheus.yml").read_text())["datasources"][0]["uid"]
    boxes = []
    for p in ps:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        boxes.append((p["title"], g["x"], g["y"], g["x"] + g["w"], g["y"] + g["h"]))
        if p["type"] != "row":
            assert p["datasource"]["uid"] == uid and p["targets"]
            assert all(t["datasource"]["uid"] == uid for t in p["targets"])
    overlaps = [(a[0], b[0]) for a, b in combinations(boxes, 2)
                if a[1] < b[3] and b[1] < a[3] and a[2] < b[4] and b[2] < a[4]]
    assert not overlaps
    rows = [p["title"] for p in ps if p["type"] == "row"]
    assert rows == ["Overview: every tier, and vLLM's own view", "Tier: $tier", "Loads (restores)", "Stores",
                    "Failures (each one a recompute, never garbage)", "Capacity and evictions",
                    "Recurrent states (hybrid models)", "Warm start"]
    tier_row = next(p for p in ps if p["type"] == "row" and p.get("repeat"))
    variables = {v["name"] for v in json.loads(DASHBOARD.read_text())["templating"]["list"]}
    assert tier_row["repeat"] == "tier" and {"tier", "model_name"} <= variables


def test_reasons_are_grouped_by_label_not_listed():
    """A reason added to the code (e.g. unauthenticated) shows up without a dashboard change."""
    by_reason = [e for e in exprs() if "failed_loads" in e or "stores_dropped" in e]
    assert len(by_reason) == 2
    for e in by_reason:
        assert "by (tier, reason)" in e and "reason=" not in e and "reason!" not in e


def test_every_query_filters_by_the_variables():
    for p in panels():
        for t in p.get("targets", []):
            for name, sel in re.findall(r"\b(kvoffload_\w+|vllm:[\w:]+)(\{[^}]*\})?", t["expr"]):
                assert 'model_name=~"$model_name"' in sel, (p["title"], name)
                if name.startswith("kvoffload_"):
                    assert 'tier=~"$tier"' in sel, (p["title"], name)
