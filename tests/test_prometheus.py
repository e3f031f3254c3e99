"""Metrics on a real vLLM server, scraped by a real Prometheus, queried panel by panel.

One vLLM OpenAI server runs the tiered config (CPU child + filesystem child)
under a short prefix-heavy load: groups of prompts sharing a prefix, with
vLLM's own prefix cache reset between rounds so that repeats are served by
the offload tiers. Prometheus scrapes it with configs/prometheus/prometheus.yml
(only the target and intervals changed; the rule files load from configs/prometheus/),
and every PromQL expression of the Grafana dashboard is run through Prometheus's
HTTP API, with the dashboard's variables at "All" (`.+`) and `$__rate_interval` at 1m.
The same Prometheus evaluates the alert rules on the real series: every rule
evaluates without error and none fires on the healthy load.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import CHUNK, REPO, random_prompt, shipped_config
from offload.config import tier_dicts
from serving import api_server, complete, metric_sum, parse_metrics, post, prometheus, wait_until

DASHBOARD = REPO / "configs" / "grafana" / "dashboards" / "kvoffload.json"


def tiered_config(cache: Path) -> dict:
    cfg = shipped_config("hybrid-tiered.json", cache)
    cpu, fs = tier_dicts(cfg)
    cpu["cpu_bytes"] = 64 << 20
    fs["max_bytes"] = 1 << 30  # a budget, so that its gauge has a series for the panel and the alert
    return cfg


# The dashboard's variables as Grafana expands them with every value selected ("All" is `.+`),
# and its rate window over this test's 1 s scrapes and short load.
VARIABLES = {"$model_name": ".+", "$tier": ".+", "$__rate_interval": "1m"}


def expand(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"a dashboard variable this test does not expand: {expr}"
    return expr


def panel_queries() -> list[tuple[str, str]]:
    """("row / panel title", query with the variables expanded) for every query of every panel."""
    out, row = [], ""
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        if p["type"] == "row":
            row = p["title"]
            continue
        out += [(f"{row} / {p['title']}", expand(t["expr"])) for t in p["targets"]]
    assert len(out) == len(set(out)), "two panel queries of one name"
    return out


def variable_queries() -> dict[str, str]:
    """The template variables' `label_values(metric{sel}, label)` as PromQL: `group by (label) (metric{sel})`."""
    out = {}
    for v in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"])
        assert m, v["query"]
        out[v["name"]] = expand(f"group by ({m[2]}) ({m[1]})")
    return out


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    out = json.loads(urllib.request.urlopen(url, timeout=30).read())
    assert out["status"] == "success", out
    return out["data"]["result"]


def scraped_after(prom: str, t: float, timeout_s: float = 60) -> None:
    """Until Prometheus has scraped the server at or after wall-clock time `t` (its `up` sample's
    timestamp is the scrape's start)."""

    def last_scrape() -> float:
        res = query(prom, 'timestamp(up{job="vllm"})')
        return max((float(r["value"][1]) for r in res), default=0.0)

    wait_until(lambda: last_scrape() >= t, timeout_s + max(0.0, t - time.time()), "a Prometheus scrape",
               interval_s=0.2)


def _scraped(models_dir, tmp):
    """The server, Prometheus and the load, on the session's background lane (tests/conftest.py)."""
    if shutil.which("prometheus") is None:
        pytest.fail("the Debian package 'prometheus' is not installed; run `make setup`")
    rng = random.Random(4)
    prefixes = [random_prompt(rng, n * CHUNK) for n in (2, 3)]
    # Dev mode enables POST /reset_prefix_cache (vLLM's own cache only; our tiers keep theirs).
    with api_server(models_dir / "qwen3-next-tiny", tiered_config(tmp / "cache"), tmp / "server.log",
                    extra_env={"VLLM_SERVER_DEV_MODE": "1"}) as base:
        port = base.rsplit(":", 1)[1]
        prom_cfg = yaml.safe_load((REPO / "configs" / "prometheus" / "prometheus.yml").read_text())
        prom_cfg["global"]["scrape_interval"] = "1s"
        prom_cfg["global"]["evaluation_interval"] = "1s"
        prom_cfg["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
        prom_cfg["rule_files"] = [str(REPO / "configs" / "prometheus" / f) for f in prom_cfg["rule_files"]]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
        with prometheus(tmp / "prometheus.yml", tmp) as prom:
            # A first request makes the series exist; rates need scrapes from
            # before the load, so wait for them, and spread the load over scrapes.
            complete(base, random_prompt(rng, 300))
            wait_until(lambda: query(prom, "count_over_time(kvoffload_lookups_total[1m]) >= 2"), 60,
                       "Prometheus scraping the kvoffload series", interval_s=0.5)
            usage = []
            for rnd in range(3):  # the same prefixes each round: rounds 2 and 3 restore from the CPU tier
                for p in prefixes:
                    usage.append(complete(base, p + random_prompt(rng, 60 + 40 * rnd))["usage"])
                    scraped_after(prom, time.time())  # one request per scrape interval
                post(base, "/reset_prefix_cache")
            # A few scrapes after the last request: the rates' windows see the whole load.
            scraped_after(prom, time.time() + 3)
            exported = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
            (tmp / "metrics.txt").write_text(exported)  # kept for a failure's diagnosis
            results = {(title, expr): query(prom, expr) for title, expr in panel_queries()}
            variables = {name: query(prom, expr) for name, expr in variable_queries().items()}
            up = query(prom, 'up{job="vllm"}')
            rules = json.loads(urllib.request.urlopen(f"{prom}/api/v1/rules", timeout=30).read())["data"]["groups"]
            firing = query(prom, 'ALERTS{alertname=~"Kvoffload.*"}')
    return {"results": results, "variables": variables, "exported": exported, "up": up, "usage": usage,
            "rules": rules, "firing": firing, "tmp": tmp}


pytestmark = [pytest.mark.e2e, pytest.mark.prefetch.with_args(_scraped)]


@pytest.fixture(scope="module")
def scraped(prefetched):
    return prefetched(_scraped)


def test_prometheus_scrapes_the_vllm_server(scraped):
    assert [r["value"][1] for r in scraped["up"]] == ["1"]


def test_every_dashboard_panel_returns_data(scraped):
    """Every query returns data; the report lists each one with its series (run with -s to see it)."""
    results = scraped["results"]
    report = [f"{len(res):3d} series  {title}: {expr}" for (title, expr), res in results.items()]
    (scraped["tmp"] / "panel_queries.txt").write_text("\n".join(report) + "\n")
    empty = [f"{title}: {expr}" for (title, expr), res in results.items() if not res]
    print(f"\n{len(results)} panel queries, {len(results) - len(empty)} returned data, {len(empty)} empty:\n"
          + "\n".join(report))
    assert not empty, "panel queries without data:\n" + "\n".join(empty)


def test_dashboard_variables_list_the_tiers(scraped):
    """The tier variable (and so the repeated per-tier row) offers the config's two tiers."""
    tiers = {r["metric"]["tier"] for r in scraped["variables"]["tier"]}
    assert tiers == {t.get("name", t["store"]) for t in tier_dicts(tiered_config(Path("/unused")))}
    served = {lab["model_name"] for n, lab, _ in parse_metrics(scraped["exported"]) if n == "kvoffload_lookups_total"}
    assert len(served) == 1
    assert [r["metric"]["model_name"] for r in scraped["variables"]["model_name"]] == sorted(served)


def test_alert_rules_evaluate_on_the_real_series_and_stay_silent(scraped):
    rules = [r for g in scraped["rules"] for r in g["rules"]]
    alerts = {r["name"] for r in rules if r["type"] == "alerting"}
    groups = yaml.safe_load((REPO / "configs" / "prometheus" / "alerts.yml").read_text())["groups"]
    shipped = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}
    assert alerts == shipped
    broken = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not broken, broken
    # A healthy load: nothing failed, nothing dropped, the disk has room.
    assert [r["metric"]["alertname"] for r in scraped["firing"]] == []


def test_no_panel_queries_a_metric_the_server_does_not_export(scraped):
    exported = {n for n, _, _ in parse_metrics(scraped["exported"])}
    missing = set()
    for _, expr in panel_queries():
        for name in re.findall(r"\b((?:kvoffload|vllm:)[\w:]*)", expr):
            if name not in exported:
                missing.add(name)
    assert not missing, f"dashboard metrics not on /metrics: {sorted(missing)}"


def _value(results, title_part: str, tier: str | None = None) -> float:
    vals = [float(r["value"][1]) for (title, _), res in results.items() if title_part in title
            for r in res if tier is None or r["metric"].get("tier") == tier]
    return max(vals)


def test_tiers_report_real_figures(scraped):
    """Not just series at zero: the load restored from the CPU tier and both tiers stored."""
    exported = parse_metrics(scraped["exported"])

    def total(name: str, tier: str) -> float:
        return metric_sum(exported, name, tier=tier)

    # Rounds 2 and 3 restore both prefixes' whole chunks from host memory.
    expected = 2 * sum(n * CHUNK for n in (2, 3))
    assert total("kvoffload_restored_tokens_total", "cpu") == expected
    assert total("kvoffload_stored_bytes_total", "cpu") > 0
    assert total("kvoffload_stored_bytes_total", "fs") > 0
    assert total("kvoffload_failed_loads_total", "cpu") == 0
    assert total("kvoffload_stores_dropped_total", "fs") == 0
    assert 0 < _value(scraped["results"], "Hit rate", "cpu") <= 1
    assert _value(scraped["results"], "Load latency", "cpu") > 0
