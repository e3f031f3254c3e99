"""The alert rules of configs/prometheus/, checked and unit-tested by Prometheus's own `promtool`.

`promtool test rules tests/promtool/alerts_test.yml` evaluates every rule of alerts.yml over
synthetic series and compares the alerts, labels and
annotations with the expected ones at each evaluation time. These tests run it, check that
every alert has a case where it fires and one where it stays silent, that a firing case really
depends on the rule (drop its expectation and promtool fails, naming the alert), and that the
rules, Prometheus config and runbook agree with each other and with the code (every metric a
rule reads is one the code exports).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO

PROM = REPO / "configs" / "prometheus"
ALERTS = PROM / "alerts.yml"
UNIT = REPO / "tests" / "promtool" / "alerts_test.yml"
RUNBOOK = REPO / "docs" / "operations.md"


def promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.fail("promtool is not installed: it comes with the Debian package 'prometheus' (`make setup`)")
    return subprocess.run([exe, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def alert_names() -> list[str]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [r["alert"] for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_rules_and_config_pass_promtool_check():
    r = promtool("check", "rules", str(ALERTS))
    assert r.returncode == 0, r.stdout + r.stderr
    r = promtool("check", "config", str(PROM / "prometheus.yml"))
    assert r.returncode == 0, r.stdout + r.stderr
    rule_files = yaml.safe_load((PROM / "prometheus.yml").read_text())["rule_files"]
    assert rule_files == ["alerts.yml"]


def test_promtool_unit_tests_pass():
    r = promtool("test", "rules", str(UNIT))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_every_alert_has_a_firing_and_a_silent_case():
    names = alert_names()
    assert len(names) == len(set(names)) >= 9
    firing: dict[str, int] = {n: 0 for n in names}
    silent: dict[str, int] = {n: 0 for n in names}
    for case in yaml.safe_load(UNIT.read_text())["tests"]:
        for t in case.get("alert_rule_test", []):
            assert t["alertname"] in firing, f"{case['name']}: no alert {t['alertname']} in alerts.yml"
            (firing if t.get("exp_alerts") else silent)[t["alertname"]] += 1
    assert not [n for n, c in firing.items() if c == 0], f"alerts without a firing case: {firing}"
    assert not [n for n, c in silent.items() if c == 0], f"alerts without a silent case: {silent}"


def test_a_firing_case_without_its_expectation_fails(tmp_path):
    """Drop every firing expectation: promtool must then report each alert as unexpected."""
    doc = yaml.safe_load(UNIT.read_text())
    doc["rule_files"] = [str((UNIT.parent / f).resolve()) for f in doc["rule_files"]]
    for case in doc["tests"]:
        for t in case.get("alert_rule_test", []):
            t["exp_alerts"] = []
    mutated = tmp_path / "alerts_test.yml"
    mutated.write_text(yaml.safe_dump(doc, sort_keys=False))
    r = promtool("test", "rules", str(mutated))
    assert r.returncode != 0
    failed = set(re.findall(r"alertname: (\w+)", r.stdout + r.stderr))
    assert failed == set(alert_names())


def test_rules_read_only_metrics_the_code_exports():
    """The limits the rules compare with are exported by the tiers themselves
    (kvoffload_store_queue_limit_bytes, kvoffload_budget_bytes), not recorded by hand."""
    from offload.metrics import METRICS

    exprs = " ".join(r["expr"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"])
    used = set(re.findall(r"\b(kvoffload_[a-z_]+)", exprs))
    exported = set(METRICS) | {f"{m}_total" for m, d in METRICS.items() if d.kind == "counter"} \
        | {f"{m}_{s}" for m, d in METRICS.items() if d.kind == "histogram" for s in ("bucket", "sum", "count")}
    assert used and used <= exported, used - exported
    assert {"kvoffload_store_queue_limit_bytes", "kvoffload_budget_bytes"} <= used


def test_every_alert_has_a_runbook_line():
    text = RUNBOOK.read_text()
    section = text.split("\n## Alerts", 1)[1].split("\n## ", 1)[0]
    missing = [n for n in alert_names() if not re.search(rf"^\| `{n}` \|", section, re.M)]
    assert not missing, f"alerts without a runbook line in docs/operations.md#alerts: {missing}"
