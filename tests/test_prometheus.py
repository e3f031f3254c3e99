"""Metrics on a real vLLM server, scraped by a real Prometheus, queried panel by panel.

One vLLM OpenAI server runs the tiered config (CPU child + filesystem child)
under a short prefix-heavy load: groups of prompts sharing a prefix, with
vLLM's own prefix cache reset between rounds so that repeats are served by
the offload tiers. Prometheus scrapes it with configs/prometheus/prometheus.yml
(only the target and interval changed), and every PromQL expression of the
Grafana dashboard is run through Prometheus's HTTP API.
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
from serving import api_server, complete, post, prometheus

DASHBOARD = REPO / "configs" / "grafana" / "dashboards" / "kvoffload.json"


def tiered_config(cache: Path) -> dict:
    cfg = shipped_config("hybrid-tiered.json", cache)
    cpu, _ = tier_dicts(cfg)
    cpu["cpu_bytes"] = 64 << 20
    return cfg


def panel_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def query(prom: str, expr: str) -> list[dict]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    out = json.loads(urllib.request.urlopen(url, timeout=30).read())
    assert out["status"] == "success", out
    return out["data"]["result"]


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
        prom_cfg["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{port}"]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_cfg))
        with prometheus(tmp / "prometheus.yml", tmp) as prom:
            # A first request makes the series exist; rates need scrapes from
            # before the load, so wait for them, and spread the load over scrapes.
            complete(base, random_prompt(rng, 300))
            deadline = time.monotonic() + 60
            while not query(prom, "count_over_time(kvoffload_lookups_total[1m]) >= 2"):
                assert time.monotonic() < deadline, "Prometheus did not scrape the kvoffload series"
                time.sleep(1)
            usage = []
            for rnd in range(3):  # the same prefixes each round: rounds 2 and 3 restore from the CPU tier
                for p in prefixes:
                    usage.append(complete(base, p + random_prompt(rng, 60 + 40 * rnd))["usage"])
                    time.sleep(1.5)
                post(base, "/reset_prefix_cache")
            time.sleep(4)  # a few scrapes after the last request
            exported = urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode()
            (tmp / "metrics.txt").write_text(exported)  # kept for a failure's diagnosis
            results = {(title, expr): query(prom, expr) for title, expr in panel_queries()}
            up = query(prom, 'up{job="vllm"}')
    return {"results": results, "exported": exported, "up": up, "usage": usage, "tmp": tmp}


pytestmark = [pytest.mark.e2e, pytest.mark.prefetch.with_args(_scraped)]


@pytest.fixture(scope="module")
def scraped(prefetched):
    return prefetched(_scraped)


def test_prometheus_scrapes_the_vllm_server(scraped):
    assert [r["value"][1] for r in scraped["up"]] == ["1"]


def test_every_dashboard_panel_returns_data(scraped):
    empty = [f"{title}: {expr}" for (title, expr), res in scraped["results"].items() if not res]
    print(f"\n{len(scraped['results'])} panel queries, {len(empty)} empty")
    assert not empty, "panel queries without data:\n" + "\n".join(empty)


def test_no_panel_queries_a_metric_the_server_does_not_export(scraped):
    exported = set(re.findall(r"^([a-zA-Z_:][\w:]*?)(?:\{| )", scraped["exported"], re.M))
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
    exported = scraped["exported"]

    def total(name: str, tier: str) -> float:
        return sum(float(m) for m in re.findall(rf'^{name}\{{[^}}]*tier="{tier}"[^}}]*\}} (\S+)$', exported, re.M))

    # Rounds 2 and 3 restore both prefixes' whole chunks from host memory.
    expected = 2 * sum(n * CHUNK for n in (2, 3))
    assert total("kvoffload_restored_tokens_total", "cpu") == expected
    assert total("kvoffload_stored_bytes_total", "cpu") > 0
    assert total("kvoffload_stored_bytes_total", "fs") > 0
    assert total("kvoffload_failed_loads_total", "cpu") == 0
    assert total("kvoffload_stores_dropped_total", "fs") == 0
    assert 0 < _value(scraped["results"], "Hit rate", "cpu") <= 1
    assert _value(scraped["results"], "Load latency", "cpu") > 0
