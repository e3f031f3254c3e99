"""bench/charts.py draws the committed results (bench/results/*.json) as PNGs.

Renders into a temporary directory from the committed JSON and checks: each file is a
well-formed PNG (chunk CRCs, image data of the size its header states, not one flat colour),
the series and their point counts are what the JSON holds, each chart names the JSON it
was drawn from, and the PNGs committed beside the JSON are the same charts, shown in
docs/performance.md. Nothing is timed.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest

from bench import charts
from conftest import REPO

RESULTS = REPO / "bench" / "results"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) of a PNG whose chunks and image data all check out."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    pos, kinds, idat, header = 8, [], b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind!r}"
        kinds.append(kind)
        if kind == b"IHDR":
            header = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND" and header is not None
    width, height, depth, colour = header
    channels = {0: 1, 2: 3, 4: 2, 6: 4}[colour]
    pixels = zlib.decompress(idat)
    assert len(pixels) == height * (1 + width * channels * depth // 8)
    assert len(set(pixels[::97])) > 8, f"{path}: a flat image"
    return width, height


def expected_race() -> tuple[dict[str, int], set[str]]:
    """Series -> points, and the files drawn from, from the JSON (the newer run wins a tie)."""
    newest: dict[tuple[str, str, int], tuple[str, str]] = {}
    for f in RESULTS.glob("peer_race_*.json"):
        doc = json.loads(f.read_text())
        for m in doc["models"]:
            for length, per in m["summary"]["per_length"].items():
                for cfg in ("ours", "vllm", "none"):
                    key = (m["label"], cfg, int(length))
                    if cfg in per and (key not in newest or newest[key][0] < doc["machine"]["time_utc"]):
                        newest[key] = (doc["machine"]["time_utc"], f.name)
    series: dict[str, int] = {}
    for label, cfg, _ in newest:
        series[f"{label}/{cfg}"] = series.get(f"{label}/{cfg}", 0) + 1
    return series, {src for _, src in newest.values()}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    return charts.render(RESULTS, tmp_path_factory.mktemp("charts"))


def test_peer_race_chart(rendered):
    race = next(c for c in rendered.charts if c.path.name == "peer_race_ttft.png")
    series, sources = expected_race()
    assert race.series == series
    assert {f"qwen3-next-80b-geometry/{c}" for c in ("ours", "vllm", "none")} <= set(race.series)
    assert set(race.sources) == sources
    w, h = png_size(race.path)
    assert w > 1000 and h > 400


def test_fs_tier_charts(rendered):
    files = sorted(RESULTS.glob("fs_tier*.json"))
    assert files
    for f in files:
        chart = next(c for c in rendered.charts if c.path.name == f"{f.stem}_gbs.png")
        rows = json.loads(f.read_text())["results"]
        stores = [k for k in rows if "store" in k or "write" in k]
        assert chart.sources == [f.name]
        assert chart.series == {"store": len(stores), "load": len(rows) - len(stores)}
        assert chart.series["store"] > 0 and chart.series["load"] > 0
        png_size(chart.path)


def test_missing_results_are_skipped_with_a_note(rendered):
    multi_turn = [f for f in RESULTS.glob("multi_turn*.json") if not f.name.endswith(".partial.json")]
    assert any(n.startswith("multi-turn race:") for n in rendered.notes) == (not multi_turn)
    replay = list(RESULTS.glob("trace_replay_*.json"))
    assert any(n.startswith("trace replay:") for n in rendered.notes) == (not replay)
    assert len(rendered.charts) == 1 + len(list(RESULTS.glob("fs_tier*.json"))) + bool(multi_turn) + bool(replay)


def test_committed_pngs_are_these_charts_and_shown_in_the_docs(rendered):
    doc = (REPO / "docs" / "performance.md").read_text()
    for c in rendered.charts:
        committed = RESULTS / c.path.name
        assert committed.exists(), f"{committed} not committed: run `make charts`"
        assert png_size(committed) == png_size(c.path)
        assert f"bench/results/{c.path.name}" in doc, f"docs/performance.md does not show {c.path.name}"
        for src in c.sources:
            assert f"bench/results/{src}" in doc
