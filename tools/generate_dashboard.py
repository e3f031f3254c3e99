"""Generate the Grafana dashboard of the offload tiers from code.

    python tools/generate_dashboard.py           # writes configs/grafana/dashboards/kvoffload.json
    python tools/generate_dashboard.py --check   # exits 1 if the committed JSON differs from this output

Contract: the output is a pure function of this file (no clock, no environment),
serialised with keys in insertion order, two-space indent and a final
newline, so `--check` is a byte comparison. Every query names only metrics of
`offload/metrics.py` (`kvoffload_*`) or vLLM's own (`vllm:*`); tests/test_dashboard.py
checks the names and tests/test_prometheus.py runs every query against a real
Prometheus scraping a real vLLM server.

Why plain Python and not `grafana-foundation-sdk`: the dashboard needs four panel
shapes (row, time series, stat, the two template variables) and a grid layout, about
as much code as the SDK's builder calls would take; the SDK's PyPI releases are
generated per Grafana version (an epoch-prefixed version per Grafana release), so it
would pin the project to one Grafana schema and add a dependency that nothing else
imports. vLLM generates its dashboards the same way (plain Python with a `--check`
mode for CI). The JSON targets schema 39 (Grafana 10.4 and later import it).

Layout: rows stack top to bottom; inside a row panels flow left to right on Grafana's
24-column grid. The "Tier: $tier" row repeats once per value of the `tier` variable,
so a new tier (a renamed one, LMCache, a second file tier) gets its own row without a
change here. Panels that break figures down by `reason` group by the label rather
than listing values, so a reason added to the code appears without a change either.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "configs" / "grafana" / "dashboards" / "kvoffload.json"

# The provisioned datasource (configs/grafana/provisioning/datasources/prometheus.yml).
DS = {"type": "prometheus", "uid": "kvoffload-prometheus"}
# Selectors: ours carry `tier`; vLLM's only `model_name` (and `engine`).
T = 'model_name=~"$model_name",tier=~"$tier"'
M = 'model_name=~"$model_name"'
RI = "$__rate_interval"


@dataclass(frozen=True)
class Q:
    """One query of a panel: PromQL and its legend."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    queries: tuple[Q, ...]
    kind: str = "timeseries"  # "timeseries" | "stat"
    width: int = 12
    height: int = 8


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]
    repeat: str | None = None
    description: str = ""


@dataclass
class _Grid:
    """Places panels row by row on the 24-column grid."""

    y: int = 0
    next_id: int = 1
    out: list[dict] = field(default_factory=list)

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def row(self, r: Row) -> None:
        d: dict = {"id": self._id(), "type": "row", "title": r.title, "collapsed": False, "panels": [],
                   "gridPos": {"x": 0, "y": self.y, "w": 24, "h": 1}}
        if r.repeat:
            d["repeat"] = r.repeat
        self.out.append(d)
        self.y += 1
        x, line_h = 0, 0
        for p in r.panels:
            if x + p.width > 24:
                x, self.y, line_h = 0, self.y + line_h, 0
            self.out.append(_panel(self._id(), p, {"x": x, "y": self.y, "w": p.width, "h": p.height}))
            x += p.width
            line_h = max(line_h, p.height)
        self.y += line_h


def _panel(pid: int, p: Panel, grid: dict) -> dict:
    targets = [{"refId": chr(ord("A") + i), "datasource": DS, "expr": q.expr, "legendFormat": q.legend}
               for i, q in enumerate(p.queries)]
    d: dict = {"id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DS,
               "gridPos": grid, "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []}}
    if p.kind == "stat":
        d["fieldConfig"]["defaults"]["decimals"] = 2
        d["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "none", "graphMode": "area", "textMode": "value_and_name"}
    else:
        d["options"] = {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    d["targets"] = targets
    return d


def _variable(name: str, label: str, query: str) -> dict:
    """A multi-value query variable; "All" matches every value (`.+`)."""
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "definition": query, "query": {"query": query, "refId": f"{name}-values"},
            "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".+",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0}


def _ratio(num: str, den: str, by: str) -> str:
    """num / den per `by`; 0 (not NaN) while den is 0."""
    return f"sum by ({by}) ({num}) / clamp_min(sum by ({by}) ({den}), 1e-9)"


def _hit_ratio(by: str) -> str:
    hit = f"rate(kvoffload_lookup_hit_tokens_total{{{T}}}[{RI}])"
    miss = f"rate(kvoffload_lookup_miss_tokens_total{{{T}}}[{RI}])"
    return f"sum by ({by}) ({hit}) / clamp_min(sum by ({by}) ({hit}) + sum by ({by}) ({miss}), 1e-9)"


def _quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({metric}_bucket{{{T}}}[{RI}])))"


def _gbs(counter: str, by: str) -> str:
    return f"sum by ({by}) (rate({counter}{{{T}}}[{RI}])) / 1e9"


def rows() -> tuple[Row, ...]:
    overview = Row("Overview: every tier, and vLLM's own view", (
        Panel("Hit rate by tier",
              "Looked-up prompt tokens (beyond vLLM's own prefix cache) that the tier could restore: since the "
              "server started (kvoffload_hit_rate), and over the rate interval. In a stack a request is looked "
              "up once, on the top tier.",
              "percentunit", (
                  Q(f"max by (tier) (kvoffload_hit_rate{{{T}}})", "{{tier}} since start"),
                  Q(_hit_ratio("tier"), "{{tier}} recent"))),
        Panel("Restored tokens by tier",
              "Prompt tokens per second restored from each tier instead of computed (completed loads).",
              "short", (Q(f"sum by (tier) (rate(kvoffload_restored_tokens_total{{{T}}}[{RI}]))", "{{tier}}"),)),
        Panel("Cached prompt tokens: vLLM by source, ours",
              "vLLM's own count of prompt tokens served from a cache, by source (device = its prefix cache; "
              "host = our host-memory tier, or LMCache without a remote; disk = a file tier, or LMCache with a "
              "remote), beside the tokens our tiers restored. Without preemption, host + disk equals ours "
              "(docs/metrics.md).",
              "short", (
                  Q(f"sum by (source) (rate(vllm:prompt_tokens_cached_by_source_total{{{M}}}[{RI}]))",
                    "vLLM {{source}}"),
                  Q(f"sum(rate(kvoffload_restored_tokens_total{{{T}}}[{RI}]))", "ours, all tiers"))),
        Panel("Prompt tokens by source (vLLM)",
              "vLLM's split of every prompt token: computed, hit in its prefix cache, or transferred by a KV "
              "connector (ours); and the external hit rate vLLM sees from the connector.",
              "short", (
                  Q(f"sum by (source) (rate(vllm:prompt_tokens_by_source_total{{{M}}}[{RI}]))", "{{source}}"),
                  Q(f"sum(rate(vllm:external_prefix_cache_hits_total{{{M}}}[{RI}])) / "
                    f"clamp_min(sum(rate(vllm:external_prefix_cache_queries_total{{{M}}}[{RI}])), 1e-9)",
                    "external hit rate (0..1)"))),
    ))
    per_tier = Row("Tier: $tier", (
        Panel("Hit rate since start", "kvoffload_hit_rate of this tier.", "percentunit",
              (Q(f"max(kvoffload_hit_rate{{{T}}})", "hit rate"),), kind="stat", width=4, height=5),
        Panel("Restored tokens/s", "Prompt tokens per second restored from this tier.", "short",
              (Q(f"sum(rate(kvoffload_restored_tokens_total{{{T}}}[{RI}]))", "tokens/s"),), kind="stat", width=4,
              height=5),
        Panel("Load p99", "99th percentile of the time to restore one request's hit from this tier.", "s",
              (Q(_quantile(0.99, "kvoffload_load_seconds", "tier"), "p99"),), kind="stat", width=4, height=5),
        Panel("Store p99", "99th percentile of the time to store one (chunk, group) entry in this tier.", "s",
              (Q(_quantile(0.99, "kvoffload_store_seconds", "tier"), "p99"),), kind="stat", width=4, height=5),
        Panel("Load and store GB/s", "Bytes per second restored from and stored into this tier.", "decgbytes",
              (Q(_gbs("kvoffload_restored_bytes_total", "tier"), "load"),
               Q(_gbs("kvoffload_stored_bytes_total", "tier"), "store")), kind="stat", width=4, height=5),
        Panel("Capacity used", "Bytes held / capacity: the host pools' size, LMCache's local_cpu_bytes, or the "
              "size of the file tier's filesystem (its max_bytes budget is not exported).", "percentunit",
              (Q(f"sum by (tier) (kvoffload_bytes_in_use{{{T}}}) / on (tier) "
                 f"max by (tier) (kvoffload_capacity_bytes{{{T}}})", "used"),), kind="stat", width=4, height=5),
    ), repeat="tier", description="One row per tier (the `tier` variable).")
    loads = Row("Loads (restores)", (
        Panel("Load latency",
              "Time to restore one request's hit, first read to last scatter, p50 and p99 per tier.", "s", (
                  Q(_quantile(0.5, "kvoffload_load_seconds", "tier"), "{{tier}} p50"),
                  Q(_quantile(0.99, "kvoffload_load_seconds", "tier"), "{{tier}} p99"))),
        Panel("Load GB/s",
              "Bytes restored into the KV cache per second (rate), and the bytes / load time of the loads in "
              "the latest report (achieved while loading).", "decgbytes", (
                  Q(_gbs("kvoffload_restored_bytes_total", "tier"), "{{tier}} restored"),
                  Q(f"max by (tier) (kvoffload_load_throughput_bytes_per_second{{{T}}}) / 1e9",
                    "{{tier}} achieved"))),
        Panel("Where restore time goes",
              "Seconds per second that loads spent reading entries (read and checksum) and scattering them "
              "into the KV cache, per tier and group kind.", "s", (
                  Q(f"sum by (tier, group_kind) (rate(kvoffload_load_read_seconds_total{{{T}}}[{RI}]))",
                    "{{tier}} {{group_kind}} read"),
                  Q(f"sum by (tier, group_kind) (rate(kvoffload_load_scatter_seconds_total{{{T}}}[{RI}]))",
                    "{{tier}} {{group_kind}} scatter"))),
        Panel("Lookups and loads in flight",
              "Prefix lookups per second, loads submitted and not yet finished, and hits deferred per second "
              "(no KV cache room for them to finish yet: the request waits a step).", "short", (
                  Q(f"sum by (tier) (rate(kvoffload_lookups_total{{{T}}}[{RI}]))", "{{tier}} lookups/s"),
                  Q(f"sum by (tier) (kvoffload_loads_in_flight{{{T}}})", "{{tier}} loads in flight"),
                  Q(f"sum by (tier) (rate(kvoffload_hits_deferred_total{{{T}}}[{RI}]))",
                    "{{tier}} hits deferred/s"))),
    ))
    stores = Row("Stores", (
        Panel("Store latency",
              "Time to store one (chunk, group) entry, gather to durable, p50 and p99 per tier.", "s", (
                  Q(_quantile(0.5, "kvoffload_store_seconds", "tier"), "{{tier}} p50"),
                  Q(_quantile(0.99, "kvoffload_store_seconds", "tier"), "{{tier}} p99"))),
        Panel("Store GB/s",
              "Bytes stored per second (rate), and the bytes / store time of the stores in the latest report.",
              "decgbytes", (
                  Q(_gbs("kvoffload_stored_bytes_total", "tier"), "{{tier}} stored"),
                  Q(f"max by (tier) (kvoffload_store_throughput_bytes_per_second{{{T}}}) / 1e9",
                    "{{tier}} achieved"))),
        Panel("Store queue",
              "Gathered bytes waiting to be written (on the bottom tier of a stack). Stores beyond the tier's "
              "max_pending_store_bytes are dropped (reason backpressure).", "bytes",
              (Q(f"sum by (tier) (kvoffload_store_queue_bytes{{{T}}})", "{{tier}}"),
               Q(f"sum by (tier) (kvoffload_store_queue_limit_bytes{{{T}}}) > 0", "{{tier}} limit"))),
        Panel("Stored and deduplicated",
              "Prompt tokens stored per second, and stores skipped because the tier already held the entry.",
              "short", (
                  Q(f"sum by (tier, group_kind) (rate(kvoffload_stored_tokens_total{{{T}}}[{RI}]))",
                    "{{tier}} {{group_kind}} tokens"),
                  Q(f"sum by (tier, group_kind) (rate(kvoffload_stores_deduplicated_total{{{T}}}[{RI}]))",
                    "{{tier}} {{group_kind}} deduplicated"))),
    ))
    failures = Row("Failures (each one a recompute, never garbage)", (
        Panel("Failed loads by reason (last 5 min)",
              "Loads that failed and became a recompute, one per request, by reason (every value of the "
              "`reason` label: missing, corrupt, io_error, unsafe, error, allocation mismatch, and any "
              "reason added later).", "short",
              (Q(f"sum by (tier, reason) (increase(kvoffload_failed_loads_total{{{T}}}[5m]))",
                 "{{tier}} {{reason}}"),), width=8),
        Panel("Stores dropped by reason (last 5 min)",
              "backpressure: over max_pending_store_bytes; no_space: ENOSPC; error: other I/O errors; "
              "shutdown: pending at shutdown; no_room: host-memory tier full of pinned entries; "
              "parent_dropped: the entry it chains from was dropped.", "short",
              (Q(f"sum by (tier, reason) (increase(kvoffload_stores_dropped_total{{{T}}}[5m]))",
                 "{{tier}} {{reason}}"),), width=8),
        Panel("Quarantined entries (last 5 min)",
              "Entries that failed verification (size, header or CRC): files are moved to quarantine; for the "
              "host-memory tier a slot that no longer holds its chunk.", "short",
              (Q(f"sum by (tier, group_kind) (increase(kvoffload_checksum_failures_total{{{T}}}[5m]))",
                 "{{tier}} {{group_kind}}"),), width=8),
    ))
    capacity = Row("Capacity and evictions", (
        Panel("Bytes held against capacity",
              "Bytes each tier holds, its capacity (cpu_bytes, LMCache's local_cpu_bytes, or the size of the "
              "file tier's filesystem) and, for a file tier with max_bytes, the budget eviction keeps it within.",
              "bytes", (
                  Q(f"sum by (tier) (kvoffload_bytes_in_use{{{T}}})", "{{tier}} held"),
                  Q(f"max by (tier) (kvoffload_capacity_bytes{{{T}}})", "{{tier}} capacity"),
                  Q(f"max by (tier) (kvoffload_budget_bytes{{{T}}})", "{{tier}} budget"))),
        Panel("Capacity used",
              "Bytes held / capacity per tier. A cache at its budget is its steady state; a file tier near 1 "
              "fills its disk.", "percentunit",
              (Q(f"sum by (tier) (kvoffload_bytes_in_use{{{T}}}) / on (tier) "
                 f"max by (tier) (kvoffload_capacity_bytes{{{T}}})", "{{tier}}"),)),
        Panel("Entries held", "Files, or host-memory slots, per tier and group kind.", "short",
              (Q(f"sum by (tier, group_kind) (kvoffload_files_in_use{{{T}}})", "{{tier}} {{group_kind}}"),)),
        Panel("Evictions", "Entries evicted per second to make room, per tier and group kind.", "short",
              (Q(f"sum by (tier, group_kind) (rate(kvoffload_evictions_total{{{T}}}[{RI}]))",
                 "{{tier}} {{group_kind}}"),)),
    ))
    states = Row("Recurrent states (hybrid models)", (
        Panel("State bytes by class",
              "Bytes of Mamba/GDN states each tier holds, by the class they were stored under: tail (a prompt's "
              "last whole-chunk boundary, read by repeats and next turns), partial (its partial tail), branch "
              "(where another prompt's stored prefix ended), internal; under state_policy by_use partial and "
              "internal are stored cold: first to go unless read.", "bytes",
              (Q(f"sum by (tier, state_class) (kvoffload_state_bytes{{{T}}})", "{{tier}} {{state_class}}"),
               Q(f"sum by (tier) (kvoffload_state_entries{{{T}}})", "{{tier}} entries"))),
        Panel("State hits by class",
              "Loads per second planned from a stored state, by its class: internal states that are read show "
              "prompts branching inside other prompts.", "short",
              (Q(f"sum by (tier, state_class) (rate(kvoffload_state_hits_total{{{T}}}[{RI}]))",
                 "{{tier}} {{state_class}}"),)),
        Panel("State evictions by reason",
              "States evicted per second: cold (stored cold and never read) or lru (least recent in use). "
              "Many lru evictions of tail states: the tier is too small for the working set.", "short",
              (Q(f"sum by (tier, state_class, reason) (rate(kvoffload_state_evictions_total{{{T}}}[{RI}]))",
                 "{{tier}} {{state_class}} {{reason}}"),
               Q(f"sum by (tier) (rate(kvoffload_states_not_admitted_total{{{T}}}[{RI}]))",
                 "{{tier}} not admitted"))),
    ))
    warm = Row("Warm start", (
        Panel("Warm start progress",
              "Entries warm start planned to copy from the files into host memory after start-up, those copied "
              "and verified, and those that failed (each left to the files); done is 1 once every planned entry "
              "is settled.", "short",
              (Q(f"sum by (tier) (kvoffload_warm_planned_entries{{{T}}})", "{{tier}} planned"),
               Q(f"sum by (tier) (kvoffload_warm_entries_total{{{T}}})", "{{tier}} copied"),
               Q(f"sum by (tier, reason) (kvoffload_warm_failures_total{{{T}}})", "{{tier}} failed {{reason}}"),
               Q(f"max by (tier) (kvoffload_warm_done{{{T}}})", "{{tier}} done"))),
        Panel("Warm start bytes and hits",
              "Bytes warm start copied, its time to done, and loads per second planned from entries it put in "
              "host memory (what it served).", "short",
              (Q(f"sum by (tier) (kvoffload_warm_bytes_total{{{T}}})", "{{tier}} bytes"),
               Q(f"max by (tier) (kvoffload_warm_seconds{{{T}}})", "{{tier}} seconds to done"),
               Q(f"sum by (tier) (rate(kvoffload_warm_hits_total{{{T}}}[{RI}]))", "{{tier}} hits/s"))),
    ))
    return overview, per_tier, loads, stores, failures, capacity, states, warm


def dashboard() -> dict:
    grid = _Grid()
    for r in rows():
        grid.row(r)
    return {
        "uid": "kvoffload",
        "title": "kvoffload: KV cache offload tiers",
        "description": "Generated by tools/generate_dashboard.py; edit that file, not this JSON.",
        "tags": ["vllm", "kvoffload"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"},
        "editable": True,
        "templating": {"list": [
            _variable("model_name", "model", "label_values(kvoffload_lookups_total, model_name)"),
            _variable("tier", "tier", 'label_values(kvoffload_lookups_total{model_name=~"$model_name"}, tier)'),
        ]},
        "annotations": {"list": []},
        "panels": grid.out,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs from the output")
    ap.add_argument("--output", type=Path, default=OUTPUT, help=f"default: {OUTPUT.relative_to(REPO)}")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} differs from tools/generate_dashboard.py's output; "
                  "run `python tools/generate_dashboard.py` and commit the result", file=sys.stderr)
            return 1
        print(f"{args.output}: up to date")
        return 0
    args.output.write_text(text)
    print(f"wrote {args.output} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
