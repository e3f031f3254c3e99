"""Prometheus metrics of the offload tiers, on vLLM's own `/metrics`.

vLLM runs the scheduler and the workers in engine processes and serves
`/metrics` from the API server process, so metrics travel its way:

    worker / scheduler half        engine core                 API server
    Recorder.inc/set/observe  ──►  OffloadStats per step  ──►  OffloadPromMetrics.observe
    (get_kv_connector_stats)       (aggregated over ranks)     (prometheus-client objects)

A payload carries deltas since the last one (counters, histogram samples)
and the latest gauge values, all keyed by label values, so that several tiers
of one MultiConnector (all of class OffloadConnector, which vLLM merges into
one stats object) stay apart. Counters only ever receive non-negative deltas
and are incremented by prometheus-client in one process: they cannot go
backwards, whatever the concurrency in the engine (prometheus-client raises
ValueError on a negative increment, inside the engine's stats path).

Every metric and its labels are defined in METRICS; docs/operations.md lists them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from offload.planner import GroupKind, StateClass
from offload.store.base import MissReason

CONNECTOR = "OffloadConnector"
# Label values are joined with this into one payload key (payloads are
# msgpack-encoded between vLLM processes, whose map keys must be strings).
_SEP = "|"

# Latency buckets from 100 us to 60 s: a CPU-tier page copy to an NFS read of a long prefix.
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


@dataclass(frozen=True)
class MetricDef:
    kind: str  # "counter" | "gauge" | "histogram"
    labels: tuple[str, ...]
    doc: str


_T = ("connector", "tier")
_TG = ("connector", "tier", "group_kind")
_TR = ("connector", "tier", "reason")
_TS = ("connector", "tier", "state_class")
_TSR = ("connector", "tier", "state_class", "reason")

METRICS: dict[str, MetricDef] = {
    "kvoffload_lookups": MetricDef(
        "counter", _T, "Prefix lookups (one per request, however often vLLM asks while it waits for room)."),
    "kvoffload_lookup_hit_tokens": MetricDef("counter", _T, "Prompt tokens a lookup found restorable in the tier."),
    "kvoffload_hits_deferred": MetricDef(
        "counter", _T, "Hits answered 'not yet': vLLM's free blocks could not hold the loads in flight and this "
        "one to the end of their prompts (vLLM asks again next step)."),
    "kvoffload_lookup_miss_tokens": MetricDef(
        "counter", _T, "Prompt tokens beyond vLLM's own prefix cache that a lookup did not find."),
    "kvoffload_restored_tokens": MetricDef("counter", _T, "Prompt tokens restored from the tier (completed loads)."),
    "kvoffload_restored_bytes": MetricDef("counter", _TG, "Bytes restored into the KV cache."),
    "kvoffload_load_read_seconds": MetricDef(
        "counter", _TG, "Seconds loads spent reading entries from the tier (checksum included), per group."),
    "kvoffload_load_scatter_seconds": MetricDef(
        "counter", _TG, "Seconds loads spent copying entries into the KV cache, per group."),
    "kvoffload_stored_tokens": MetricDef("counter", _TG, "Prompt tokens stored, per group (a chunk per file)."),
    "kvoffload_stored_bytes": MetricDef("counter", _TG, "Bytes stored in the tier."),
    "kvoffload_stores_deduplicated": MetricDef(
        "counter", _TG, "Stores skipped because the tier already held the entry (e.g. another instance wrote it)."),
    "kvoffload_stores_dropped": MetricDef(
        "counter", _TR, "Stores dropped: backpressure, no_space, error, shutdown, no_room (host-memory tier full), "
        "parent_dropped (the entry it chains from was dropped)."),
    "kvoffload_failed_loads": MetricDef(
        "counter", _TR, "Loads that failed and became a recompute: missing, corrupt, unauthenticated, io_error, "
        "unsafe, error, allocation mismatch."),
    "kvoffload_chunk_misses": MetricDef(
        "counter", _TR, "Entries (files, objects) a load could not use, by reason: missing, corrupt, "
        "unauthenticated, io_error, unsafe (one load may meet several; kvoffload_failed_loads counts the requests)."),
    "kvoffload_checksum_failures": MetricDef(
        "counter", _TG, "Files that failed verification (header, size or CRC) and were quarantined."),
    "kvoffload_evictions": MetricDef("counter", _TG, "Entries evicted from the tier to make room."),
    "kvoffload_load_seconds": MetricDef("histogram", _T, "Time to restore one request's hit, read to scatter."),
    "kvoffload_store_seconds": MetricDef(
        "histogram", _TG, "Time to store one (chunk, group) entry, gather to durable."),
    "kvoffload_load_throughput_bytes_per_second": MetricDef(
        "gauge", _T, "Bytes per second of the loads completed in the last report (bytes / load time)."),
    "kvoffload_store_throughput_bytes_per_second": MetricDef(
        "gauge", _T, "Bytes per second of the stores completed in the last report (bytes / store time)."),
    "kvoffload_store_queue_bytes": MetricDef("gauge", _T, "Gathered bytes waiting to be written (the store queue)."),
    "kvoffload_store_queue_limit_bytes": MetricDef(
        "gauge", _T,
        "max_pending_store_bytes: past it stores are dropped (backpressure); on the tier the queue is on."),
    "kvoffload_loads_in_flight": MetricDef("gauge", _T, "Loads submitted and not yet finished."),
    "kvoffload_bytes_in_use": MetricDef("gauge", _TG, "Bytes held by the tier (files: the whole cache directory)."),
    "kvoffload_files_in_use": MetricDef("gauge", _TG, "Entries held by the tier (files, or host-memory slots)."),
    "kvoffload_capacity_bytes": MetricDef(
        "gauge", _T, "Capacity of the tier: cpu_bytes, or the size of the cache directory's filesystem."),
    "kvoffload_budget_bytes": MetricDef(
        "gauge", _T, "The byte budget the tier enforces by eviction (a file tier's max_bytes); absent without one."),
    "kvoffload_state_entries": MetricDef(
        "gauge", _TS, "Recurrent (Mamba/GDN) states held by the tier, by the class they were stored under: tail, "
        "partial, branch, internal (host memory)."),
    "kvoffload_state_bytes": MetricDef("gauge", _TS, "Bytes of the recurrent states held by the tier, by class."),
    "kvoffload_state_hits": MetricDef(
        "counter", _TS, "Stored states a planned load reads (one per Mamba group at the boundary), by the class "
        "they were stored under (host memory)."),
    "kvoffload_state_evictions": MetricDef(
        "counter", _TSR, "States evicted to make room, by class and reason: cold (admitted cold and never read) "
        "or lru (the least recent entry in use)."),
    "kvoffload_states_not_admitted": MetricDef(
        "counter", _T, "Stores the tier declined under state_policy (tails: internal states; by_use: an entry admitted "
        "cold, an internal state or either half of a partial tail, with no free or colder slot; LMCache: every "
        "entry admitted cold)."),
    "kvoffload_warm_hits": MetricDef(
        "counter", _T, "Loads planned from an entry warm start put in the tier (host memory), one per entry."),
    "kvoffload_warm_entries": MetricDef(
        "counter", _T, "Entries warm start copied into the tier (host memory) from a tier below, verified."),
    "kvoffload_warm_bytes": MetricDef("counter", _T, "Bytes warm start copied into the tier (host memory)."),
    "kvoffload_warm_failures": MetricDef(
        "counter", _TR, "Entries warm start could not copy up, by reason: missing, corrupt, unauthenticated, "
        "io_error, unsafe, error, no_room (each is left to a later load; nothing is offered in its place)."),
    "kvoffload_warm_planned_entries": MetricDef(
        "gauge", _T, "Entries warm start planned to copy into the tier (host memory); 0 before it starts."),
    "kvoffload_warm_done": MetricDef(
        "gauge", _T, "1 once every entry warm start planned for the tier is settled (copied or failed)."),
    "kvoffload_warm_seconds": MetricDef(
        "gauge", _T, "Seconds warm start took from its first read to its last, once done."),
    "kvoffload_hit_rate": MetricDef(
        "gauge", _T, "Hit tokens / looked-up tokens since the server started (computed in the API server)."),
}

GROUP_KINDS = tuple(k.value for k in GroupKind)
STATE_CLASSES = tuple(c.value for c in StateClass)
DROP_REASONS = ("backpressure", "no_space", "error", "shutdown", "no_room", "parent_dropped")
LOAD_FAILURE_REASONS = tuple(r.value for r in MissReason)


class Recorder:
    """Thread-safe accumulator of one tier's metrics in one process (the
    scheduler half or a worker half); `take()` drains it into a payload.

    It also keeps this process's running totals, which `take()` leaves alone:
    a counter's `total` and a histogram's `count` (its Prometheus `_count`),
    what the process's own logs and tests read instead of counting twice."""

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self._lock = threading.Lock()
        self._c: dict[str, dict[str, float]] = {}
        self._g: dict[str, dict[str, float]] = {}
        self._h: dict[str, dict[str, list[float]]] = {}
        self._totals: dict[str, dict[str, float]] = {}  # counters: sums; histograms: observations

    def _key(self, name: str, labels: dict[str, str]) -> str:
        d = METRICS[name]
        values = {"connector": CONNECTOR, "tier": self.tier, **labels}
        return _SEP.join(str(values[n]) for n in d.labels)

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        if value < 0:
            raise ValueError(f"{name}: counter increment {value} < 0")
        k = self._key(name, labels)
        with self._lock:
            m = self._c.setdefault(name, {})
            m[k] = m.get(k, 0) + value
            t = self._totals.setdefault(name, {})
            t[k] = t.get(k, 0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        k = self._key(name, labels)
        with self._lock:
            self._g.setdefault(name, {})[k] = value

    def observe(self, name: str, value: float, **labels: str) -> None:
        k = self._key(name, labels)
        with self._lock:
            self._h.setdefault(name, {}).setdefault(k, []).append(value)
            t = self._totals.setdefault(name, {})
            t[k] = t.get(k, 0) + 1

    def declare(self, name: str, **labels: str) -> None:
        """Make a counter series exist at zero, so that dashboards show 0
        rather than no data before the first event."""
        self.inc(name, 0, **labels)

    def _series(self, name: str, kind: str) -> list[tuple[dict[str, str], float]]:
        """(labels, running total) of every series of `name`, a metric of `kind`."""
        d = METRICS[name]
        if d.kind != kind:
            raise ValueError(f"{name} is a {d.kind}, not a {kind}")
        with self._lock:
            items = list(self._totals.get(name, {}).items())
        return [(dict(zip(d.labels, k.split(_SEP))), v) for k, v in items]

    def total(self, name: str, **labels: str) -> float:
        """Counter `name`'s total in this process so far, over its series
        with `labels` (all of them where none are given)."""
        return sum(v for have, v in self._series(name, "counter")
                   if all(have.get(n) == x for n, x in labels.items()))

    def count(self, name: str, **labels: str) -> int:
        """How many values histogram `name` observed in this process so far, over its series with `labels`."""
        return int(sum(v for have, v in self._series(name, "histogram")
                       if all(have.get(n) == x for n, x in labels.items())))

    def by(self, name: str, label: str) -> dict[str, float]:
        """Counter `name`'s non-zero totals in this process so far, per value of `label`."""
        out: dict[str, float] = {}
        for have, v in self._series(name, "counter"):
            out[have[label]] = out.get(have[label], 0) + v
        return {k: v for k, v in out.items() if v}

    def take(self) -> OffloadStats | None:
        with self._lock:
            if not (self._c or self._g or self._h):
                return None
            data = {"c": self._c, "g": self._g, "h": self._h}
            self._c, self._g, self._h = {}, {}, {}
        return OffloadStats(data=data)


def _tier_key(key: str) -> str:
    """The (connector, tier) part of a payload key."""
    return _SEP.join(key.split(_SEP)[:2])


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Counters and histogram samples add up; gauges of different processes
    add up too (a worker per TP rank holds its own queue and bytes)."""
    out: dict[str, Any] = {"c": {}, "g": {}, "h": {}}
    for part in ("c", "g", "h"):
        for src in (a.get(part, {}), b.get(part, {})):
            for name, series in src.items():
                dst = out[part].setdefault(name, {})
                for k, v in series.items():
                    if part == "h":
                        dst[k] = dst.get(k, []) + list(v)
                    else:
                        dst[k] = dst.get(k, 0) + v
    return out


try:  # the stats base class comes from vLLM; the planner-free parts above do not need it
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
except ImportError:  # pragma: no cover - vLLM is a dependency; this keeps `kvoffload` tools importable
    KVConnectorStats = object  # type: ignore[misc,assignment]
    KVConnectorPromMetrics = object  # type: ignore[misc,assignment]


@dataclass
class OffloadStats(KVConnectorStats):  # type: ignore[misc]
    """One payload: {"c"|"g"|"h": {metric: {"label|values": value}}}."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> OffloadStats:
        self.data = _merge(self.data, other.data)
        return self

    def is_empty(self) -> bool:
        return not any(self.data.get(p) for p in ("c", "g", "h"))

    def reduce(self) -> dict[str, int | float]:
        """Totals per metric for vLLM's periodic 'KV Transfer metrics' log line."""
        out: dict[str, int | float] = {}
        for name, series in self.data.get("c", {}).items():
            if total := sum(series.values()):
                out[name.removeprefix("kvoffload_")] = total
        for name, series in self.data.get("h", {}).items():
            samples = [x for v in series.values() for x in v]
            if samples:
                out[name.removeprefix("kvoffload_") + "_avg"] = round(sum(samples) / len(samples), 6)
        return out


class OffloadPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """Prometheus objects for METRICS, fed from payloads in the API server."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]], registry: Any = None) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        registry = REGISTRY if registry is None else registry
        self._metrics: dict[str, Any] = {}
        for name, d in METRICS.items():
            old = registry._names_to_collectors.get(name if d.kind != "counter" else name + "_total")
            if old is not None:  # vLLM rebuilds its loggers in one process (tests, restarts)
                registry.unregister(old)
            cls = metric_types[{"counter": Counter, "gauge": Gauge, "histogram": Histogram}[d.kind]]
            kw: dict[str, Any] = {"registry": registry} if registry is not REGISTRY else {}
            if d.kind == "histogram":
                kw["buckets"] = _LATENCY_BUCKETS
            if d.kind == "gauge":
                kw["multiprocess_mode"] = "mostrecent"
            self._metrics[name] = cls(name=name, documentation=d.doc, labelnames=[*labelnames, *d.labels], **kw)
        self._totals: dict[tuple[int, str], list[float]] = {}  # (engine, key) -> [hit, miss]

    def _throughput(self, data: dict[str, Any], engine_idx: int) -> None:
        """Bytes / busy seconds of the transfers in this payload, per tier."""
        for gauge, nbytes, seconds in (
            ("kvoffload_load_throughput_bytes_per_second", "kvoffload_restored_bytes", "kvoffload_load_seconds"),
            ("kvoffload_store_throughput_bytes_per_second", "kvoffload_stored_bytes", "kvoffload_store_seconds"),
        ):
            per_tier: dict[str, list[float]] = {}
            for key, v in data.get("c", {}).get(nbytes, {}).items():
                per_tier.setdefault(_tier_key(key), [0.0, 0.0])[0] += v
            for key, samples in data.get("h", {}).get(seconds, {}).items():
                per_tier.setdefault(_tier_key(key), [0.0, 0.0])[1] += sum(samples)
            for key, (b, t) in per_tier.items():
                if b > 0 and t > 0:
                    self._series(gauge, engine_idx, key).set(b / t)

    def _series(self, name: str, engine_idx: int, key: str) -> Any:
        values = [*self.per_engine_labelvalues[engine_idx], *key.split(_SEP)]
        return self._metrics[name].labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, series in transfer_stats_data.get("c", {}).items():
            if name not in self._metrics:
                continue
            for key, v in series.items():
                if v >= 0:  # a negative delta would be a bug upstream; never let it break /metrics
                    self._series(name, engine_idx, key).inc(v)
                if name in ("kvoffload_lookup_hit_tokens", "kvoffload_lookup_miss_tokens"):
                    t = self._totals.setdefault((engine_idx, key), [0.0, 0.0])
                    t[name.endswith("miss_tokens")] += max(0.0, v)
        for name, series in transfer_stats_data.get("g", {}).items():
            if name in self._metrics:
                for key, v in series.items():
                    self._series(name, engine_idx, key).set(v)
        for name, series in transfer_stats_data.get("h", {}).items():
            if name in self._metrics:
                for key, samples in series.items():
                    s = self._series(name, engine_idx, key)
                    for x in samples:
                        s.observe(x)
        self._throughput(transfer_stats_data, engine_idx)
        for (e, key), (hit, miss) in self._totals.items():
            if e == engine_idx and hit + miss > 0:
                self._series("kvoffload_hit_rate", e, key).set(hit / (hit + miss))
