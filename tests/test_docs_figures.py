"""The README's "How fast" figures equal their JSON under bench/results/, and every relative link in
README.md and docs/*.md resolves inside the repository (files, and #anchors to Markdown headings).

Fast: no engine, no benchmark; it reads committed files only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from conftest import REPO

RESULTS = REPO / "bench" / "results"


def _race(length: str, key: str) -> Callable[[dict], float]:
    return lambda d: d["models"][0]["summary"]["per_length"][length][key]["median"]


def _turn(turn: str, key: str) -> Callable[[dict], float]:
    return lambda d: d["models"][0]["summary"]["per_turn"][turn][key]["median"]


def _hit(budget: float, policy: str) -> Callable[[dict], float]:
    return lambda d: 100 * next(b for b in d["budgets"] if b["budget_gb"] == budget)["hit_rate"][policy]


def _gluster(fs: str, op: str) -> Callable[[dict], float]:
    return lambda d: next(r for r in d["rows"] if r["fs"] == fs and r["op"] == op)["gb_s"]


def _copier(d: dict) -> float:
    r = d["results"]
    return 100 * r["gather, kernel (GPU pages -> pinned slots)"]["gb_s"] / r["device -> host, one call"]["gb_s"]


# README row label -> the value its JSON holds, in the unit the README prints.
FIGURES: dict[str, Callable[[dict], float]] = {
    "4096-token prompt: ours / vLLM's tiering, TTFT": _race("4096", "ttft_ours_over_vllm"),
    "4096-token prompt: recompute / ours, TTFT": _race("4096", "speedup_ours_vs_recompute"),
    "8192-token prompt: ours / vLLM's tiering, TTFT": _race("8192", "ttft_ours_over_vllm"),
    "8192-token prompt: recompute / ours, TTFT": _race("8192", "speedup_ours_vs_recompute"),
    "conversation turn 4, one restart per turn: ours / vLLM's tiering, TTFT": _turn("4", "ttft_ours_over_vllm"),
    "file tier store, of the device's write limit": lambda d: 100 * d["ratio_store_to_raw"],
    "file tier load of one request, cold page cache, of the device's read limit":
        lambda d: 100 * d["loads"]["ours load"]["of_device"],
    "CUDA copier gather on an H100, of one plain copy": _copier,
    "host-memory hit rate at 200 GB, default `state_policy` (production chat trace)": _hit(200.0, "by_use"),
    "the same, every state kept like attention KV (`all`)": _hit(200.0, "all"),
    "file tier load on GlusterFS (replica 2, FUSE), GB/s": _gluster("gluster", "ours load"),
}

ROW = re.compile(r"^\| (?P<label>[^|]+?) \| (?P<value>[0-9.,]+)(?P<unit>×|%|) \| "
                 r"\[[^\]]*\]\((?P<json>bench/results/[^)]+\.json)\) \|$")


def how_fast_rows(readme: str) -> list[dict[str, str]]:
    """The figure rows of the README's "How fast" section."""
    section = readme.split("\n## How fast\n", 1)[1].split("\n## ", 1)[0]
    return [m.groupdict() for line in section.splitlines() if (m := ROW.match(line))]


def mismatches(readme: str, results: Path = RESULTS) -> list[str]:
    """Every way the README's figures differ from their JSON: a value off by more than its printed
    rounding, a row whose JSON or label is unknown, a known figure without a row."""
    problems = []
    rows = how_fast_rows(readme)
    for row in rows:
        label, printed = row["label"], row["value"].replace(",", "")
        if label not in FIGURES:
            problems.append(f"README row {label!r}: no extractor in FIGURES")
            continue
        path = results.parent.parent / row["json"]
        if not path.is_file():
            problems.append(f"README row {label!r}: {row['json']} does not exist")
            continue
        value = FIGURES[label](json.loads(path.read_text()))
        decimals = len(printed.split(".")[1]) if "." in printed else 0
        if abs(value - float(printed)) > 0.5 * 10 ** -decimals + 1e-9:
            problems.append(f"README row {label!r}: prints {printed}, {row['json']} gives {value:.{decimals + 3}f}")
    missing = FIGURES.keys() - {r["label"] for r in rows}
    problems += [f"no README row for {label!r}" for label in sorted(missing)]
    return problems


def test_readme_how_fast_figures_equal_their_json():
    readme = (REPO / "README.md").read_text()
    assert len(how_fast_rows(readme)) == len(FIGURES)
    assert mismatches(readme) == []


def test_a_changed_figure_is_found():
    readme = (REPO / "README.md").read_text()
    altered = readme.replace("| 0.10× |", "| 0.19× |", 1)
    assert altered != readme
    found = mismatches(altered)
    assert len(found) == 1 and "prints 0.19" in found[0]
    dropped = "\n".join(line for line in readme.splitlines() if "| 82× |" not in line)
    assert any(m.startswith("no README row") for m in mismatches(dropped))


def test_performance_doc_leads_with_the_readme_figures():
    """performance.md's opening tables hold the README's race figures and link the same JSON."""
    doc = (REPO / "docs" / "performance.md").read_text()
    lead = doc.split("\n## How close to the device\n", 1)[0]
    for fig in ("**0.10×**", "**52×**", "**0.49×**", "**82×**", "**0.26×**"):
        assert fig in lead, fig
    for row in how_fast_rows((REPO / "README.md").read_text()):
        assert f"../{row['json']}" in doc, row["json"]


# --- the capacity table: every cell from its trace replay JSON -----------------------------------

CAPACITY_JSON = {"conversation": ("trace_replay_conversation_continue.json", "trace_replay_conversation.json"),
                 "agent": ("trace_replay_agent_continue.json", "trace_replay_agent.json"),
                 "branching": ("trace_replay_branching_continue.json", "trace_replay_branching_own.json")}
CAPACITY_COLUMNS = ("by_use", "all", "tails", "oracle", "attention_only")
CAPACITY_ROW = re.compile(r"^\| (?P<trace>conversation|agent|branching) \| (?P<budget>\d+ GB|unlimited) \|"
                          r"(?P<cells>(?: \**[0-9.]+ / [0-9.]+%\** \|)+)$")


def capacity_mismatches(doc: str, results: Path = RESULTS) -> list[str]:
    """Every cell of performance.md's capacity table ("continue / own" hit rates) that differs from
    its JSON by more than its rounding, and every (trace, budget) of the JSON without a row."""
    section = doc.split("\n## What a byte of cache holds\n", 1)[1].split("\n## ", 1)[0]
    problems, seen = [], set()
    docs = {t: [json.loads((results / f).read_text()) for f in files] for t, files in CAPACITY_JSON.items()}
    for line in section.splitlines():
        m = CAPACITY_ROW.match(line)
        if not m:
            continue
        trace, budget = m["trace"], m["budget"]
        key = "unlimited" if budget == "unlimited" else float(budget.split()[0])
        seen.add((trace, key))
        cells = re.findall(r"([0-9.]+) / ([0-9.]+)%", m["cells"])
        if len(cells) != len(CAPACITY_COLUMNS):
            problems.append(f"{trace} {budget}: {len(cells)} cells")
            continue
        for policy, printed in zip(CAPACITY_COLUMNS, cells):
            for d, value in zip(docs[trace], printed):
                row = next((b for b in d["budgets"] if b["budget_gb"] == key), None)
                got = None if row is None else 100 * row["hit_rate"][policy]
                if got is None or abs(got - float(value)) > 0.05 + 1e-9:
                    problems.append(f"{trace} {budget} {policy} ({d['replay']['partial_blocks']}): prints {value}, "
                                    f"JSON {got}")
    for trace, (d, _) in docs.items():
        problems += [f"no row for {trace} {b['budget_gb']}" for b in d["budgets"]
                     if (trace, b["budget_gb"]) not in seen]
    return problems


def test_the_capacity_table_equals_its_json():
    doc = (REPO / "docs" / "performance.md").read_text()
    assert capacity_mismatches(doc) == []
    altered = doc.replace("| branching | 200 GB | **77.3 / 75.1%**", "| branching | 200 GB | **77.3 / 75.6%**", 1)
    assert altered != doc and len(capacity_mismatches(altered)) == 1


# --- warm start after a restart in the middle of a trace: every run's figures from its JSON --------------

WARM_TRACE_ROW = "| after a restart in the middle of a trace"
WARM_TRACE_RUN = re.compile(r"\[(?P<name>[^\]]+)\]\(\.\./(?P<json>bench/results/warm_start_trace[\w-]*\.json)\): "
                            r"(?P<on>\d+)% / (?P<off>\d+)% from host memory, median TTFT "
                            r"(?P<ttft_on>[0-9.]+)× / (?P<ttft_off>[0-9.]+)×, tokens identical "
                            r"(?P<same_on>\d+)/20 / (?P<same_off>\d+)/20")


def warm_trace_mismatches(doc: str, results: Path = RESULTS) -> list[str]:
    """Every figure of performance.md's warm-start trace row (per run: the share of restored tokens
    from host memory, on / off; median TTFT against the steady state, on / off; tokens identical to
    the reference, on / off) that differs from its JSON by more than its rounding, and every
    warm_start_trace JSON under bench/results/ the row does not quote."""
    rows = [ln for ln in doc.splitlines() if ln.startswith(WARM_TRACE_ROW)]
    if len(rows) != 1:
        return [f"{len(rows)} rows start with {WARM_TRACE_ROW!r}"]
    problems, seen = [], set()
    for m in WARM_TRACE_RUN.finditer(rows[0]):
        seen.add(Path(m["json"]).name)
        d = json.loads((results.parent.parent / m["json"]).read_text())
        want = {"on": 100 * d["on"]["share_from_cpu"], "off": 100 * d["off"]["share_from_cpu"],
                "ttft_on": d["on"]["ttft_vs_steady"], "ttft_off": d["off"]["ttft_vs_steady"],
                "same_on": d["on"]["identical_to_reference"], "same_off": d["off"]["identical_to_reference"]}
        for k, value in want.items():
            printed = m[k]
            decimals = len(printed.split(".")[1]) if "." in printed else 0
            if abs(value - float(printed)) > 0.5 * 10 ** -decimals + 1e-9:
                problems.append(f"{m['json']} {k}: prints {printed}, JSON {value}")
    problems += [f"{p.name}: not quoted" for p in sorted(results.glob("warm_start_trace*.json")) if p.name not in seen]
    return problems


def test_the_warm_start_trace_figures_equal_their_json():
    doc = (REPO / "docs" / "performance.md").read_text()
    assert warm_trace_mismatches(doc) == []
    row = next(ln for ln in doc.splitlines() if ln.startswith(WARM_TRACE_ROW))
    m = WARM_TRACE_RUN.search(row)
    assert m is not None
    altered = doc.replace(m.group(0), m.group(0).replace(f"{m['on']}% /", f"{int(m['on']) + 7}% /", 1), 1)
    assert altered != doc and len(warm_trace_mismatches(altered)) == 1


# --- links -------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _strip_code(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"^(    |\t).*$", "", text, flags=re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-` and `_` dropped, spaces to `-`,
    repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M).splitlines():
        m = re.match(r"^#{1,6} (.+?)\s*#*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(files: list[Path], repo: Path = REPO) -> list[str]:
    problems = []
    for f in files:
        for target in LINK.findall(_strip_code(f.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f.resolve()
            where = f"{f.relative_to(repo)}: ({target})"
            if repo.resolve() not in dest.parents and dest != repo.resolve():
                problems.append(f"{where} leaves the repository")
            elif not dest.exists():
                problems.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                problems.append(f"{where}: no heading with anchor #{anchor}")
    return problems


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    assert broken_links(doc_files()) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Some section\n\nok [x](#some-section), [y](a.md#title)\n"
                                            "bad [z](missing.md), [w](a.md#nowhere), `[code](ignored.md)`\n")
    found = broken_links([tmp_path / "docs" / "a.md"], tmp_path)
    assert len(found) == 2
    assert "missing.md" in found[0] and "#nowhere" in found[1]


def test_anchor_slugs_follow_github():
    md = "# A\n## Configuration (`kv_connector_extra_config`)\n## 3b. The CUDA copier on a GPU (H100)\n## A\n"
    assert anchors(md) == {"a", "configuration-kv_connector_extra_config", "3b-the-cuda-copier-on-a-gpu-h100", "a-1"}


def test_no_citation_of_notes_outside_the_repository():
    """Facts the tests cite live in docs/ (docs/cpu-platform.md), not in notes outside the repository."""
    offenders = [str(p.relative_to(REPO)) for d in ("tests", "docs", "bench", "offload", "tools")
                 for p in (REPO / d).rglob("*") if p.suffix in (".py", ".md") and p.name != Path(__file__).name
                 and "../shared/" in p.read_text(errors="replace")]
    assert offenders == []


NAMED_LINK = re.compile(r"\[([^\]]+)\]\(([^)#\s]+)(?:#[^)]*)?\)")
FILE_NAME = re.compile(r"[\w./-]+\.(?:md|json|py|png)")
# A checkout's place on the machine an example ran on: docs show a stand-in instead.
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|root|home)/[\w.-]+")


def misnamed_links(files: list[Path]) -> list[str]:
    """Links whose text names a file other than the one they lead to."""
    out = []
    for f in files:
        text = f.read_text()
        for m in NAMED_LINK.finditer(text):
            names, target = FILE_NAME.findall(m.group(1)), m.group(2)
            if names and not target.startswith("http") and Path(target).name not in {Path(n).name for n in names}:
                out.append(f"{f.name}:{text[:m.start()].count(chr(10)) + 1}: [{m.group(1)}]({target})")
    return out


def test_every_link_text_that_names_a_file_names_its_target():
    assert misnamed_links(doc_files()) == []


def test_a_misnamed_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("see [operations.md](cli-reference.md) and [cli-reference.md](cli-reference.md)\n")
    assert misnamed_links([tmp_path / "a.md"]) == ["a.md:1: [operations.md](cli-reference.md)"]


def test_no_doc_prints_the_path_of_the_machine_it_ran_on():
    found = [f"{f.name}:{f.read_text()[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
             for f in doc_files() for m in MACHINE_PATH.finditer(f.read_text())]
    assert found == []


# A page named in prose or in a comment (not only in a link) must exist, and an anchor named with
# it must be one of its headings: a section moved to a page of its own leaves no stale pointer.
NAMED_PAGE = re.compile(r"(?<![\w/.-])(docs/)?([\w-]+\.md)(?:#([\w-]+))?")


def stale_page_names(files: list[Path], repo: Path = REPO) -> list[str]:
    """Mentions of `docs/<page>.md` (anywhere) or `<page>.md` (in docs/ and the README) naming no
    page of docs/ or the repository's top, or an anchor that page lacks."""
    out = []
    for f in files:
        text = f.read_text(errors="replace")
        in_docs = f.suffix == ".md" and (f.parent == repo / "docs" or f.parent == repo)
        for m in NAMED_PAGE.finditer(text):
            prefix, name, anchor = m.groups()
            if not prefix and not in_docs:
                continue
            page = repo / "docs" / name if prefix or (repo / "docs" / name).exists() else repo / name
            where = f"{f.relative_to(repo)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
            if not page.exists():
                out.append(f"{where}: no such page")
            elif anchor and anchor not in anchors(page.read_text()):
                out.append(f"{where}: no heading with that anchor")
    return out


def source_files() -> list[Path]:
    out = [*doc_files(), REPO / "pyproject.toml", REPO / "Makefile"]
    for d in ("offload", "tests", "bench", "tools", "harness", "scripts"):
        out += [p for p in sorted((REPO / d).rglob("*")) if p.suffix in (".py", ".sh") and "results" not in p.parts
                and p != Path(__file__)]  # this file's own cases name pages that do not exist
    return out


def test_every_page_named_in_prose_or_code_exists():
    assert stale_page_names(source_files()) == []


def test_a_stale_page_name_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Known limits\n\nsee b.md and a.md#known-limits, a.md#gone\n")
    (tmp_path / "x.py").write_text("# docs/a.md#known-limits says why; docs/c.md too; a.md is not a docs/ path here\n")
    assert stale_page_names([tmp_path / "docs" / "a.md", tmp_path / "x.py"], tmp_path) == [
        "docs/a.md:5: b.md: no such page",
        "docs/a.md:5: a.md#gone: no heading with that anchor",
        "x.py:1: docs/c.md: no such page",
    ]


# A page other than history.md says what holds now: the day a figure was taken and the commit it
# ran at belong to history.md (each JSON under bench/results/ records its own day and machine).
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
THIS_MACHINE = re.compile(r"\bthis \d+-core machine\b")


def dated_statements(files: list[Path]) -> list[str]:
    """Dates, commit-like hashes and "this N-core machine" in prose (code and link targets
    aside) of pages other than history.md."""
    out = []
    for f in files:
        if f.name == "history.md":
            continue
        text = re.sub(r"\]\([^)]*\)", "]()", _strip_code(f.read_text()))
        for rx in (DATE, COMMIT, THIS_MACHINE):
            out += [f"{f.name}: {m.group(0)}" for m in rx.finditer(text)]
    return out


def test_only_the_history_page_dates_its_figures():
    assert dated_statements(doc_files()) == []


def test_a_dated_statement_is_found(tmp_path):
    (tmp_path / "a.md").write_text("Measured on 2026-11-22 at 71f80e0 on this 2-core machine; 1000000 files, "
                                   "`516f7d7c` and [h](history.md#runs-2026-11-28) are not dates.\n")
    (tmp_path / "history.md").write_text("2026-11-22 at 71f80e0\n")
    assert dated_statements([tmp_path / "a.md", tmp_path / "history.md"]) == [
        "a.md: 2026-11-22", "a.md: 71f80e0", "a.md: this 2-core machine"]
