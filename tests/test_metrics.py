"""Metrics payloads and their Prometheus objects, with the real prometheus-client.

The end-to-end path (engine processes -> API server /metrics -> Prometheus) is
tests/test_prometheus.py; here: aggregation, labels, monotonic counters under
concurrency, and the dashboard's own consistency.
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from conftest import REPO
from offload.metrics import METRICS, OffloadPromMetrics, Recorder

TYPES = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}


def prom(registry=None) -> tuple[OffloadPromMetrics, CollectorRegistry]:
    registry = registry or CollectorRegistry()
    return OffloadPromMetrics(SimpleNamespace(kv_transfer_config=None), TYPES, ["model_name", "engine"],
                              {0: ["m", "0"], 1: ["m", "1"]}, registry=registry), registry


def sample(registry: CollectorRegistry, name: str, **labels) -> float | None:
    return registry.get_sample_value(name, {"model_name": "m", "engine": "0", "connector": "OffloadConnector",
                                            **labels})


def test_payload_round_trips_through_json_and_keeps_tiers_apart():
    cpu, fs = Recorder("cpu"), Recorder("fs")
    cpu.inc("kvoffload_restored_tokens", 512)
    fs.inc("kvoffload_restored_tokens", 256)
    fs.inc("kvoffload_stored_bytes", 1000, group_kind="mamba")
    fs.observe("kvoffload_load_seconds", 0.5)
    # vLLM's MultiConnector merges children of one class; the engine core
    # aggregates workers with the scheduler; payloads cross processes encoded.
    merged = cpu.take().aggregate(fs.take())
    data = json.loads(json.dumps(merged.to_dict()))
    p, reg = prom()
    p.observe(data)
    assert sample(reg, "kvoffload_restored_tokens_total", tier="cpu") == 512
    assert sample(reg, "kvoffload_restored_tokens_total", tier="fs") == 256
    assert sample(reg, "kvoffload_stored_bytes_total", tier="fs", group_kind="mamba") == 1000
    assert sample(reg, "kvoffload_load_seconds_count", tier="fs") == 1
    assert sample(reg, "kvoffload_load_seconds_count", tier="cpu") is None


def test_take_drains_and_empty_recorder_reports_nothing():
    r = Recorder("cpu")
    assert r.take() is None
    r.inc("kvoffload_lookups")
    assert r.take().data["c"]["kvoffload_lookups"] == {"OffloadConnector|cpu": 1}
    assert r.take() is None


def test_running_totals_survive_take_and_match_what_prometheus_adds_up():
    """The totals a process logs and its tests read are the Recorder's own: what the payloads it
    drains add up to in Prometheus, whatever `take` drained meanwhile."""
    rec = Recorder("fs")
    rec.declare("kvoffload_stores_dropped", reason="backpressure")
    rec.inc("kvoffload_stores_dropped", 2, reason="error")
    rec.inc("kvoffload_stored_bytes", 1000, group_kind="mamba")
    rec.observe("kvoffload_store_seconds", 0.1, group_kind="mamba")
    metrics, registry = prom()
    metrics.observe(rec.take().data)
    rec.inc("kvoffload_stores_dropped", reason="error")
    rec.inc("kvoffload_stored_bytes", 24, group_kind="full_attention")
    rec.observe("kvoffload_store_seconds", 0.2, group_kind="full_attention")
    metrics.observe(rec.take().data)
    assert rec.by("kvoffload_stores_dropped", "reason") == {"error": 3}  # zero series left out
    assert rec.total("kvoffload_stores_dropped", reason="error") == \
        sample(registry, "kvoffload_stores_dropped_total", tier="fs", reason="error") == 3
    assert rec.total("kvoffload_stored_bytes") == 1024
    assert rec.total("kvoffload_stored_bytes", group_kind="mamba") == \
        sample(registry, "kvoffload_stored_bytes_total", tier="fs", group_kind="mamba") == 1000
    assert rec.count("kvoffload_store_seconds") == 2
    assert rec.count("kvoffload_store_seconds", group_kind="mamba") == \
        sample(registry, "kvoffload_store_seconds_count", tier="fs", group_kind="mamba") == 1
    assert rec.total("kvoffload_lookups") == 0 and rec.by("kvoffload_failed_loads", "reason") == {}
    with pytest.raises(ValueError):
        rec.total("kvoffload_store_seconds")  # a histogram: its count, not a total


def test_workers_add_up_and_histograms_concatenate():
    a, b = Recorder("fs"), Recorder("fs")
    for r in (a, b):
        r.inc("kvoffload_stored_bytes", 10, group_kind="full_attention")
        r.set("kvoffload_store_queue_bytes", 7)
        r.observe("kvoffload_store_seconds", 0.1, group_kind="full_attention")
    s = a.take().aggregate(b.take())
    assert s.data["c"]["kvoffload_stored_bytes"] == {"OffloadConnector|fs|full_attention": 20}
    assert s.data["g"]["kvoffload_store_queue_bytes"] == {"OffloadConnector|fs": 14}
    assert s.data["h"]["kvoffload_store_seconds"] == {"OffloadConnector|fs|full_attention": [0.1, 0.1]}
    assert s.reduce()["stored_bytes"] == 20


def test_negative_increment_is_refused_and_never_reaches_a_counter():
    r = Recorder("fs")
    with pytest.raises(ValueError):
        r.inc("kvoffload_stored_bytes", -1, group_kind="mamba")
    p, reg = prom()
    p.observe({"c": {"kvoffload_lookups": {"OffloadConnector|fs": 5}}})
    p.observe({"c": {"kvoffload_lookups": {"OffloadConnector|fs": -3}}})  # a corrupted payload
    assert sample(reg, "kvoffload_lookups_total", tier="fs") == 5


def test_counters_lose_nothing_and_never_go_back_under_concurrency():
    """8 threads increment while another drains and observes: the exported
    counter only grows and ends at the exact total."""
    r = Recorder("fs")
    p, reg = prom()
    n_threads, n = 8, 2000
    done = threading.Event()
    seen: list[float] = []

    def work():
        for _ in range(n):
            r.inc("kvoffload_stored_bytes", 3, group_kind="mamba")

    def drain():
        while True:
            last = done.is_set()
            s = r.take()
            if s is not None:
                p.observe(json.loads(json.dumps(s.to_dict())))
            seen.append(sample(reg, "kvoffload_stored_bytes_total", tier="fs", group_kind="mamba") or 0)
            if last:
                return

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    d = threading.Thread(target=drain)
    d.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    d.join()
    assert seen == sorted(seen), "the counter went backwards"
    assert seen[-1] == 3 * n * n_threads


def test_hit_rate_since_start_and_throughput_gauges():
    p, reg = prom()
    r = Recorder("cpu")
    r.inc("kvoffload_lookup_hit_tokens", 300)
    r.inc("kvoffload_lookup_miss_tokens", 100)
    r.inc("kvoffload_restored_bytes", 4e9, group_kind="full_attention")
    r.inc("kvoffload_restored_bytes", 1e9, group_kind="mamba")
    r.observe("kvoffload_load_seconds", 1.0)
    r.observe("kvoffload_load_seconds", 1.5)
    p.observe(r.take().to_dict())
    assert sample(reg, "kvoffload_hit_rate", tier="cpu") == pytest.approx(0.75)
    assert sample(reg, "kvoffload_load_throughput_bytes_per_second", tier="cpu") == pytest.approx(2e9)
    r.inc("kvoffload_lookup_miss_tokens", 200)
    p.observe(r.take().to_dict())
    assert sample(reg, "kvoffload_hit_rate", tier="cpu") == pytest.approx(0.5)


def test_state_metrics_carry_class_and_reason_through_the_exposition():
    """`kvoffload_state_hits_total` by class and `kvoffload_state_evictions_total` by class and reason,
    as a scrape reads them (prometheus_client's parser): the series the scheduler declares exist at 0,
    the counted ones hold their counts, and a cold eviction exists only for a class a policy admits
    cold."""
    from harness.client import parse_metrics
    from offload.planner.worth import EvictionReason, StateClass, cold_classes

    rec = Recorder("cpu")
    for cls in StateClass:  # as the scheduler declares them
        rec.declare("kvoffload_state_hits", state_class=cls.value)
        rec.declare("kvoffload_state_evictions", state_class=cls.value, reason=EvictionReason.LRU.value)
    for cls in cold_classes():
        rec.declare("kvoffload_state_evictions", state_class=cls.value, reason=EvictionReason.COLD.value)
    rec.inc("kvoffload_state_hits", 3, state_class="branch")
    rec.inc("kvoffload_state_evictions", 6, state_class="internal", reason="cold")
    rec.inc("kvoffload_state_evictions", 3, state_class="tail", reason="lru")
    metrics, registry = prom()
    metrics.observe(json.loads(json.dumps(rec.take().to_dict())))
    samples = parse_metrics(generate_latest(registry).decode())

    def series(name: str, *labels: str) -> dict[tuple[str, ...], float]:
        return {tuple(lab[x] for x in labels): v for n, lab, v in samples
                if n == name and lab.get("tier") == "cpu" and lab.get("engine") == "0"}

    assert series("kvoffload_state_hits_total", "state_class") == {
        (c.value,): 3.0 if c is StateClass.BRANCH else 0.0 for c in StateClass}
    evictions = series("kvoffload_state_evictions_total", "state_class", "reason")
    assert {k: v for k, v in evictions.items() if v} == {("internal", "cold"): 6.0, ("tail", "lru"): 3.0}
    assert set(evictions) == {(c.value, "lru") for c in StateClass} | {(c.value, "cold") for c in cold_classes()}
    assert ("tail", "cold") not in evictions and ("branch", "cold") not in evictions


def test_engines_are_labelled_apart():
    p, reg = prom()
    r = Recorder("fs")
    r.inc("kvoffload_lookups", 2)
    p.observe(r.take().to_dict(), engine_idx=1)
    assert sample(reg, "kvoffload_lookups_total", tier="fs") is None
    assert reg.get_sample_value("kvoffload_lookups_total", {"model_name": "m", "engine": "1",
                                                            "connector": "OffloadConnector", "tier": "fs"}) == 2


def test_rebuilding_in_one_process_replaces_the_collectors():
    """vLLM rebuilds its stat loggers in one process; duplicate names must not crash."""
    _, reg = prom()
    p2, _ = prom(reg)
    p2.observe({"c": {"kvoffload_lookups": {"OffloadConnector|fs": 1}}})
    assert b"kvoffload_lookups_total" in generate_latest(reg)


def test_every_defined_metric_is_documented_and_the_dashboard_uses_only_defined_metrics():
    docs = (REPO / "docs" / "metrics.md").read_text()
    undocumented = [n for n in METRICS if n not in docs]
    assert not undocumented, f"not in docs/metrics.md: {undocumented}"
    dash = json.loads((REPO / "configs" / "grafana" / "dashboards" / "kvoffload.json").read_text())
    import re

    exposed = {n + ("_total" if d.kind == "counter" else "") for n, d in METRICS.items()}
    exposed |= {f"{n}_{s}" for n, d in METRICS.items() if d.kind == "histogram" for s in ("bucket", "sum", "count")}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    panels = [p for p in dash["panels"] if p["type"] != "row"]  # rows only group panels
    assert panels
    for p in panels:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "kvoffload-prometheus"
            for name in re.findall(r"\b(kvoffload_\w+)", t["expr"]):
                assert name in exposed, f"{p['title']}: {name} is not a metric we export"
