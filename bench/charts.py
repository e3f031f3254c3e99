"""PNG charts of the committed benchmark results (bench/results/*.json).

    python -m bench.charts                       # bench/results/*.json -> bench/results/*.png
    python -m bench.charts --out /tmp/charts     # elsewhere (the JSON is only read)

Contract: `render(results_dir, out_dir)` reads only JSON that `make bench` wrote and draws:

- `peer_race_ttft.png`: time to first token against prompt length for ours, vLLM's own
  tiering and recompute (no connector), one panel per model geometry, from every
  `peer_race_*.json`. Points are the median of the rounds with a bar from the fastest to
  the slowest. Where two files measured the same (model, prompt length, configuration),
  the newer run (`machine.time_utc`) is drawn: a rerun supersedes the run before it.
- `<fs_tier*>_gbs.png`: GB/s of each store and load variant of one `fs_tier*.json`, against
  the device limit of the same run (its fastest pure write and read, `raw_write_gb_s` and
  `raw_read_gb_s`), one chart per file.
- `multi_turn_ttft.png`: the multi-turn race (`python -m bench.peer_race --multi-turn`), from
  every `multi_turn*.json`: time to first token of each turn after the first, each after a
  restart of the server, for the same three configurations, one panel per model. Points are the
  median of the rounds with a bar from the fastest to the slowest; the newer run wins a tie as
  above. Skipped with a note when no such file exists.

Every chart names the JSON files it was drawn from in its footer. It returns one `Chart`
per PNG (path, sources, and the points of each series) and the notes of what it skipped.
Matplotlib draws off-screen (Agg); it is a `bench` extra, never imported by offload/.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

from bench.common import median

matplotlib.use("Agg")  # off-screen: no display on CI or benchmark machines
import matplotlib.pyplot as plt

RESULTS = Path(__file__).resolve().parent / "results"
CONFIGS = {  # peer_race configuration -> legend, colour, marker
    "ours": ("ours (kvoffload)", "tab:blue", "o"),
    "vllm": ("vLLM's tiering (OffloadingConnector)", "tab:orange", "s"),
    "none": ("recompute (no connector)", "tab:gray", "^"),
}


@dataclass
class Chart:
    """One PNG: where it is, the JSON it was drawn from, and the points of each series."""

    path: Path
    sources: list[str]
    series: dict[str, int] = field(default_factory=dict)


@dataclass
class Rendered:
    charts: list[Chart]
    notes: list[str]


def _footer(fig, sources: list[str]) -> None:
    fig.text(0.01, 0.01, "Drawn from bench/results/" + ", bench/results/".join(sources),
             fontsize=8, color="dimgray", ha="left", va="bottom")


@dataclass(frozen=True)
class RacePoint:
    ttft_s: list[float]
    time_utc: str
    source: str


def race_points(results: Path) -> dict[str, dict[str, dict[int, RacePoint]]]:
    """{model label: {configuration: {prompt tokens: point}}}, the newer run winning a tie."""
    out: dict[str, dict[str, dict[int, RacePoint]]] = {}
    for f in sorted(results.glob("peer_race_*.json")):
        doc = json.loads(f.read_text())
        when = doc["machine"]["time_utc"]
        for m in doc["models"]:
            for length, per in m["summary"]["per_length"].items():
                for cfg in CONFIGS:
                    if cfg not in per:
                        continue
                    pts = out.setdefault(m["label"], {}).setdefault(cfg, {})
                    old = pts.get(int(length))
                    if old is None or old.time_utc < when:
                        pts[int(length)] = RacePoint(per[cfg]["ttft_s"], when, f.name)
    return out


def render_peer_race(results: Path, out_dir: Path) -> Chart | None:
    data = race_points(results)
    if not data:
        return None
    labels = sorted(data, key=lambda lb: -max(max(p.ttft_s) for c in data[lb].values() for p in c.values()))
    fig, axes = plt.subplots(1, len(labels), figsize=(4.6 * len(labels), 5.0), squeeze=False)
    chart = Chart(out_dir / "peer_race_ttft.png", [])
    for ax, label in zip(axes[0], labels):
        _ttft_series(ax, chart, label, data[label])
        if "ours" in data[label] and "none" in data[label]:
            for x, p in data[label]["ours"].items():
                if x in data[label]["none"]:
                    speedup = median(data[label]["none"][x].ttft_s) / median(p.ttft_s)
                    ax.annotate(f"{speedup:.0f}x", (x, median(p.ttft_s)), textcoords="offset points",
                                xytext=(0, -15), ha="center", fontsize=8, color="tab:blue")
        xs_all = sorted({x for c in data[label].values() for x in c})
        if xs_all[-1] >= 2 * xs_all[0]:  # lengths over an octave or more: a log axis
            ax.set_xscale("log")
            ax.set_xlim(xs_all[0] / 1.25, xs_all[-1] * 1.25)
        else:  # close lengths (3840 and 3900) would sit on one spot of a log axis
            pad = max(0.3 * (xs_all[-1] - xs_all[0]), 50)
            ax.set_xlim(xs_all[0] - pad, xs_all[-1] + pad)
        ax.set_xticks(xs_all, [str(x) for x in xs_all], fontsize=8)
        ax.minorticks_off()
        ax.set_yscale("log")
        lo_y = min(min(p.ttft_s) for c in data[label].values() for p in c.values())
        ax.set_ylim(bottom=lo_y / 2.5)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (s)")
        ax.grid(True, which="major", alpha=0.3)
    _finish(fig, chart, "Peer race: time to first token with a restored prefix, median and range of the rounds "
            "(blue: recompute / ours)", title_size=11, legend_size=9, legend_y=0.045, rect=(0, 0.11, 1, 0.95))
    return chart


def _ttft_series(ax: Any, chart: Chart, label: str, by_cfg: dict[str, dict[int, Any]]) -> dict[str, tuple]:
    """Each configuration's TTFT points (median, and the range of the rounds as error bars) on `ax`,
    recorded in `chart`; returns {configuration: (xs, medians)} of those drawn."""
    drawn = {}
    for cfg, (legend, colour, marker) in CONFIGS.items():
        pts = by_cfg.get(cfg)
        if not pts:
            continue
        xs = sorted(pts)
        med = [median(pts[x].ttft_s) for x in xs]
        lo = [m - min(pts[x].ttft_s) for x, m in zip(xs, med)]
        hi = [max(pts[x].ttft_s) - m for x, m in zip(xs, med)]
        ax.errorbar(xs, med, yerr=[lo, hi], label=legend, color=colour, marker=marker, capsize=3, lw=1.5)
        chart.series[f"{label}/{cfg}"] = len(xs)
        chart.sources = sorted(set(chart.sources) | {pts[x].source for x in xs})
        drawn[cfg] = (xs, med)
    return drawn


def _finish(fig: Any, chart: Chart, title: str, title_size: float, legend_size: float, legend_y: float,
            rect: tuple[float, float, float, float]) -> None:
    """Title, the configurations' legend, the sources' footer; written to `chart.path` and closed."""
    fig.suptitle(title, fontsize=title_size)
    handles = [plt.Line2D([], [], color=c, marker=m, label=lg) for lg, c, m in CONFIGS.values()]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=legend_size, bbox_to_anchor=(0.5, legend_y))
    _footer(fig, chart.sources)
    fig.tight_layout(rect=rect)
    fig.savefig(chart.path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class TurnPoint:
    ttft_s: list[float]
    restored_tokens: list[int]
    prompt_tokens: int
    time_utc: str
    source: str


def multi_turn_points(results: Path) -> dict[str, dict[str, dict[int, TurnPoint]]]:
    """{model label: {configuration: {turn: point}}} for every turn after the first, the newer
    run winning a tie."""
    out: dict[str, dict[str, dict[int, TurnPoint]]] = {}
    for f in sorted(results.glob("multi_turn*.json")):
        if f.name.endswith(".partial.json"):  # a run still going (or one that died): its rounds are incomplete
            continue
        doc = json.loads(f.read_text())
        if doc.get("mode", "multi_turn") != "multi_turn":
            continue  # another benchmark's JSON under a matching name
        when = doc["machine"]["time_utc"]
        for m in doc["models"]:
            for turn, per in m["summary"]["per_turn"].items():
                for cfg in CONFIGS:
                    if cfg not in per:
                        continue
                    pts = out.setdefault(m["label"], {}).setdefault(cfg, {})
                    old = pts.get(int(turn))
                    if old is None or old.time_utc < when:
                        pts[int(turn)] = TurnPoint(per[cfg]["ttft_s"], per[cfg]["restored_tokens"],
                                                   int(median(per[cfg]["prompt_tokens"])), when, f.name)
    return out


def render_multi_turn(results: Path, out_dir: Path) -> Chart | None:
    data = multi_turn_points(results)
    if not data:
        return None
    labels = sorted(data)
    fig, axes = plt.subplots(1, len(labels), figsize=(max(6.5, 5.2 * len(labels)), 5.2), squeeze=False)
    chart = Chart(out_dir / "multi_turn_ttft.png", [])
    for ax, label in zip(axes[0], labels):
        for cfg, (xs, med) in _ttft_series(ax, chart, label, data[label]).items():
            if cfg != "none":  # what the restore brought back, under each point
                pts, colour = data[label][cfg], CONFIGS[cfg][1]
                for x, m in zip(xs, med):
                    ax.annotate(f"{median(pts[x].restored_tokens):.0f}", (x, m), textcoords="offset points",
                                xytext=(0, -13 if cfg == "ours" else 7), ha="center", fontsize=7, color=colour)
        turns = sorted({x for c in data[label].values() for x in c})
        prompt = {x: next(c[x].prompt_tokens for c in data[label].values() if x in c) for x in turns}
        ax.set_xticks(turns, [f"{x}\n({prompt[x]} tok)" for x in turns], fontsize=8)
        ax.set_xlim(turns[0] - 0.5, turns[-1] + 0.5)
        ax.set_yscale("log")
        ax.margins(y=0.12)  # room for the restored-token labels above and below the extreme points
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("turn (prompt tokens)")
        ax.set_ylabel("time to first token after a restart (s)")
        ax.grid(True, which="major", alpha=0.3)
    _finish(fig, chart, "Multi-turn race: TTFT of each turn after a restart, median and range of the rounds\n"
            "(small numbers: tokens restored, ours below its points, vLLM's tiering above)", title_size=10,
            legend_size=8, legend_y=0.05, rect=(0, 0.12, 1, 0.93))
    return chart


def _bar_colour(name: str) -> str:
    return "tab:blue" if name.startswith("ours") else "tab:orange" if name.startswith("vLLM") else "tab:gray"


def _side(row: str) -> str:
    """'store' for a write variant ('ours store', 'raw write x4'), 'load' for a read one."""
    return "store" if "store" in row or "write" in row else "load"


def render_fs_tier(src: Path, out_dir: Path) -> Chart:
    doc = json.loads(src.read_text())
    res = doc["results"]
    chart = Chart(out_dir / f"{src.stem}_gbs.png", [src.name])
    fig, axes = plt.subplots(1, 2, figsize=(13, 6.8))
    for ax, (op, raw_word, limit_key) in zip(axes, (("store", "write", "raw_write_gb_s"),
                                                     ("load", "read", "raw_read_gb_s"))):
        names = sorted((k for k in res if _side(k) == op), key=lambda k: res[k]["gb_s"])
        limit = doc[limit_key]
        gb = [res[k]["gb_s"] for k in names]
        lo = [g - min(res[k]["runs_gb_s"]) for k, g in zip(names, gb)]
        hi = [max(res[k]["runs_gb_s"]) - g for k, g in zip(names, gb)]
        ax.barh(names, gb, xerr=[lo, hi], color=[_bar_colour(k) for k in names], capsize=3)
        fastest = doc.get("baseline_rows", {}).get(f"device_{raw_word}", f"raw {raw_word}")
        ax.axvline(limit, color="black", ls="--", lw=1.2,
                   label=f"device limit {limit:.2f} GB/s\n(fastest {raw_word} of the run: {fastest})")
        for y, (_k, g) in enumerate(zip(names, gb)):
            ax.text(g + max(hi[y], 0) + limit * 0.05, y, f"{g:.2f} ({g / limit:.0%})", va="center",
                    fontsize=8)
        ax.set_xlim(0, max(max(g + h for g, h in zip(gb, hi)), limit) * 1.3)
        ax.set_title(f"{op} ({raw_word}): GB/s, median and range of {doc['reps']} runs", fontsize=10)
        ax.set_xlabel("GB/s (percentage: of the device limit)")
        ax.tick_params(axis="y", labelsize=8)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)
        chart.series[op] = len(names)
    fig.suptitle(f"Filesystem tier against the device limit: {doc['bytes'] / 1e9:.2f} GB in {doc['files']} files, "
                 f"{doc['filesystem']}, {doc['machine']['cpu']} ({doc['machine']['cores']} cores), "
                 f"{doc['machine']['time_utc']}", fontsize=11)
    _footer(fig, chart.sources)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(chart.path, dpi=100)
    plt.close(fig)
    return chart


def render(results: Path = RESULTS, out_dir: Path = RESULTS) -> Rendered:
    out_dir.mkdir(parents=True, exist_ok=True)
    charts: list[Chart] = []
    notes: list[str] = []
    race = render_peer_race(results, out_dir)
    if race is None:
        notes.append("peer race: no peer_race_*.json; no TTFT chart")
    else:
        charts.append(race)
    fs = sorted(results.glob("fs_tier*.json"))
    if not fs:
        notes.append("fs_tier: no fs_tier*.json; no GB/s chart")
    charts += [render_fs_tier(f, out_dir) for f in fs]
    mt = render_multi_turn(results, out_dir)
    if mt is None:
        notes.append(f"multi-turn race: no multi_turn*.json in {results}; its chart is skipped")
    else:
        charts.append(mt)
    replay = render_trace_replay(results, out_dir)
    if replay is None:
        notes.append(f"trace replay: no trace_replay_*.json in {results}; its chart is skipped")
    else:
        charts.append(replay)
    return Rendered(charts, notes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="PNG charts of bench/results/*.json")
    ap.add_argument("--results", type=Path, default=RESULTS, help="directory of the JSON results")
    ap.add_argument("--out", type=Path, default=None, help="where the PNGs go (default: --results)")
    args = ap.parse_args(argv)
    r = render(args.results, args.out or args.results)
    for c in r.charts:
        series = ", ".join(f"{k} {n} points" for k, n in c.series.items())
        print(f"wrote {c.path} from {', '.join(c.sources)}: {series}")
    for n in r.notes:
        print(f"note: {n}")
    return 0




REPLAY_POLICIES = {  # trace_replay policy -> legend, colour, marker
    "all": ('"all": every state stored hot', "tab:red", "s"),
    "default": ("default (state_policy={default})", "tab:blue", "o"),
    "tails": ('"tails": no internal states', "tab:green", "v"),
    "attention_only": ("attention-only reference (same attention bytes)", "tab:gray", "^"),
    "oracle": ("what-if: only the states a later prompt reads (foresight)", "tab:purple", "D"),
}


def render_trace_replay(results: Path, out_dir: Path) -> Chart | None:
    """`trace_replay.png`: token hit rate against the host-memory budget for each state policy
    and the attention-only reference, one panel per `trace_replay_*.json` (a trace); the
    unlimited budget is drawn as a dashed level. None when no such file exists."""
    files = sorted(results.glob("trace_replay_*.json"))
    if not files:
        return None
    docs = [json.loads(f.read_text()) for f in files]
    chart = Chart(out_dir / "trace_replay.png", [f.name for f in files])
    fig, axes = plt.subplots(1, len(docs), figsize=(max(6.5, 5.6 * len(docs)), 5.4), squeeze=False)
    for ax, doc in zip(axes[0], docs):
        rows = [b for b in doc["budgets"] if b["budget_gb"] != "unlimited"]
        unlimited = next((b for b in doc["budgets"] if b["budget_gb"] == "unlimited"), None)
        xs = [float(b["budget_gb"]) for b in rows]
        for policy, (label, colour, marker) in REPLAY_POLICIES.items():
            if not rows or policy not in rows[0]["hit_rate"]:
                continue
            ys = [100 * b["hit_rate"][policy] for b in rows]
            ax.plot(xs, ys, color=colour, marker=marker, label=label.format(default=doc.get("default_policy")))
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.1f}", (x, y), textcoords="offset points", xytext=(4, -10), fontsize=7,
                            color=colour)
            chart.series[policy] = len(ys)
        if unlimited is not None:
            level = 100 * unlimited["hit_rate"].get("all", 0.0)
            ax.axhline(level, color="black", ls="--", lw=1, label=f"unlimited budget ({level:.1f}%)")
        t = doc["trace"]
        mode = doc.get("replay", {}).get("partial_blocks", "own")
        ax.set_title(f"{t['name']}: {t['requests']} requests, {t['input_tokens'] / 1e6:.0f}M input tokens\n"
                     f"partial last blocks: {mode}", fontsize=9)
        ax.set_xlabel("host-memory budget (GB)")
        ax.set_ylabel("token hit rate (%)")
        ax.set_xticks(xs)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    model = docs[0]["model"]
    fig.suptitle(f"Trace replay through the host-memory index: {model['name']}, chunk {model['chunk_tokens']} "
                 f"tokens, states {model['state_share_of_chunk_bytes']:.0%} of a chunk's bytes", fontsize=10)
    _footer(fig, chart.sources)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(chart.path, dpi=100)
    plt.close(fig)
    return chart


if __name__ == "__main__":
    raise SystemExit(main())
