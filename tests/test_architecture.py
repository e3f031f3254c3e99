"""docs/architecture.md's module map matches the code: every module of `offload/` has
its row, and imports only what its row allows (its own package always, a
subpackage such as offload/store/cachedir/ being a package of its own; vLLM only where the row
says yes). The planner and the stores importing nothing of vLLM or the connector's config is one
consequence."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "offload"
ROW = re.compile(r"^\| `(offload/[\w/]+\.py)` \| (.+?) \| (.+?) \| (yes|no) \|$")


def module_map() -> dict[str, tuple[set[str], bool]]:
    rows: dict[str, tuple[set[str], bool]] = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            path, _job, allowed, vllm = m.groups()
            assert path not in rows, f"{path}: two rows in the module map"
            names = set() if allowed.strip() == "—" else {a.strip().strip("`") for a in allowed.split(",")}
            rows[path] = (names, vllm == "yes")
    return rows


def dotted(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = REPO) -> set[str]:
    """Every module `path` (under `root`, the directory holding its top-level package) imports
    (at any depth, TYPE_CHECKING included), as dotted names; `from offload import x` names the
    submodule x where one exists."""
    out: set[str] = set()
    package = dotted(path, root) if path.name == "__init__.py" else dotted(path, root).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            for a in node.names:
                sub = f"{base}.{a.name}"
                rel = Path(*sub.split("."))
                is_module = (root / rel).with_suffix(".py").exists() or (root / rel / "__init__.py").exists()
                out.add(sub if is_module else base)
    return out


def allowed(own_pkg: str, names: set[str], target: str) -> bool:
    """`target` (an offload module) is in `own_pkg` (a subpackage of offload, "" for offload's
    top-level modules, which share no package) or under one of `names` (relative to offload)."""
    rel = target.removeprefix("offload").lstrip(".")
    if own_pkg and (rel == own_pkg or rel.startswith(own_pkg + ".")):
        return True
    if rel == "":
        return "offload" in names
    return any(rel == n or rel.startswith(n + ".") for n in names)


def test_every_module_has_a_row_and_every_row_a_module():
    rows = module_map()
    assert len(rows) > 40, "the module map was not found in docs/architecture.md"
    files = {str(p.relative_to(REPO)) for p in PKG.rglob("*.py")}
    assert sorted(files - rows.keys()) == [], "modules missing from docs/architecture.md's map"
    assert sorted(rows.keys() - files) == [], "rows of docs/architecture.md's map naming no module"


def test_every_module_imports_only_what_its_row_allows():
    problems = []
    for path_s, (names, vllm_ok) in sorted(module_map().items()):
        path = REPO / path_s
        if not path.exists():
            continue
        own = ".".join(path.relative_to(PKG).parts[:-1])  # its package, relative to offload ("" at the top)
        for target in sorted(imports(path)):
            top = target.split(".")[0]
            if top == "offload" and not allowed(own, names, target):
                problems.append(f"{path_s} imports {target}")
            elif top == "vllm" and not vllm_ok:
                problems.append(f"{path_s} imports {target} (its row says no vLLM)")
    assert problems == []


# ---- module sizes -------------------------------------------------------------------------------
# A module over MAX_LINES says why in its row of the module map, or is cut.

MAX_LINES = 450
SIZE_REASON = "past the size rule because"


def jobs() -> dict[str, str]:
    """Each module's job, as its row of the module map states it."""
    out = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def oversized(lines: dict[str, int], jobs: dict[str, str]) -> list[str]:
    """Modules over MAX_LINES whose row gives no reason."""
    return [f"{path}: {n} lines, and its row in docs/architecture.md says not why" for path, n in sorted(lines.items())
            if n > MAX_LINES and SIZE_REASON not in jobs.get(path, "")]


def test_no_module_is_over_the_size_rule_without_its_reason_in_the_module_map():
    lines = {str(p.relative_to(REPO)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    assert oversized(lines, jobs()) == []


def test_the_size_checker_catches_a_long_module_without_a_reason():
    rows = {"offload/a.py": "a job", "offload/b.py": f"a job; one module {SIZE_REASON} it must"}
    assert oversized({"offload/a.py": 451, "offload/b.py": 900, "offload/c.py": 450}, rows) == [
        "offload/a.py: 451 lines, and its row in docs/architecture.md says not why"]


def test_the_checker_catches_a_forbidden_import():
    # The rule itself: a planner module importing the connector or vLLM is outside its row.
    assert not allowed("planner", set(), "offload.connector.worker")
    assert allowed("planner", set(), "offload.planner.spec")
    assert allowed("store", {"keys"}, "offload.store.base")
    assert not allowed("store", {"keys"}, "offload.config")
    assert allowed("connector", {"store"}, "offload.store.cachedir")
    assert not allowed("", {"store.options"}, "offload.store.fs")
    assert not allowed("", set(), "offload")
    assert not allowed("", set(), "offload.keys")
    # A subpackage is a package of its own: the cache-directory machinery imports no tier.
    assert allowed("store.cachedir", set(), "offload.store.cachedir.ledger")
    assert allowed("store.cachedir", {"store.options"}, "offload.store.options")
    assert not allowed("store.cachedir", {"store.options"}, "offload.store.fs")
    assert allowed("store", set(), "offload.store.cachedir.owners")


# ---- the product ships alone -------------------------------------------------------------------
# harness/ (servers, engine runs with test hooks, CLI runs, scrapes), bench/ and tests/ use the
# product; the product imports none of them (setup.py ships offload/ only).
NOT_SHIPPED = {"harness", "bench", "tests", "tools", "conftest", "serving"}


def test_offload_imports_no_harness_bench_or_tests():
    problems = [f"{p.relative_to(REPO)} imports {t}" for p in sorted(PKG.rglob("*.py")) for t in sorted(imports(p))
                if t.split(".")[0] in NOT_SHIPPED]
    assert problems == []


def test_the_harness_is_outside_the_product():
    harness = REPO / "harness"
    assert (harness / "__init__.py").exists() and not (PKG / "harness").exists()
    assert {"client.py", "server.py", "engine.py", "cli.py"} <= {p.name for p in harness.glob("*.py")}


# ---- no module-level state ---------------------------------------------------------------------
# State has an owner that creates and stops it: a module may hold constants, never a lock, a thread
# or a container that its functions fill (a registry).

SYNC = re.compile(r"(^|\.)(Lock|RLock|Thread|Event|Condition|Semaphore|BoundedSemaphore|Timer|local|Queue)$")
MUTATORS = {"append", "add", "update", "setdefault", "pop", "popitem", "clear", "extend", "remove", "discard",
            "insert"}


def module_state(source: str) -> list[str]:
    """What in `source` is module-level state: a `global` statement, a module-level
    synchronisation object or thread, a module-level container whose name is not a CONSTANT,
    or a function that changes a module-level container."""
    tree = ast.parse(source)
    problems: list[str] = []
    containers: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [t.id for t in targets if isinstance(t, ast.Name)]
            v = node.value
            if isinstance(v, ast.Call) and SYNC.search(ast.unparse(v.func)):
                problems.extend(f"line {node.lineno}: {n} = {ast.unparse(v.func)}()" for n in names)
            is_container = isinstance(v, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
                isinstance(v, ast.Call) and ast.unparse(v.func) in {"dict", "list", "set", "defaultdict",
                                                                    "collections.defaultdict", "OrderedDict"})
            if is_container:
                containers.update(names)
                problems.extend(f"line {node.lineno}: {n} is a module-level container" for n in names
                                if n != "__all__" and not n.lstrip("_").isupper())
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            problems.append(f"line {node.lineno}: global {', '.join(node.names)}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(node):
                target = None
                if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in MUTATORS:
                    target = sub.func.value
                elif isinstance(sub, (ast.Assign, ast.AugAssign, ast.Delete)):
                    for t in (sub.targets if isinstance(sub, (ast.Assign, ast.Delete)) else [sub.target]):
                        if isinstance(t, ast.Subscript):
                            target = t.value
                if isinstance(target, ast.Name) and target.id in containers:
                    problems.append(f"line {sub.lineno}: {node.name} changes module-level {target.id}")
    return problems


def test_no_module_level_state_in_offload():
    problems = [f"{p.relative_to(REPO)} {msg}" for p in sorted(PKG.rglob("*.py"))
                for msg in module_state(p.read_text())]
    assert problems == []


def test_the_state_checker_catches_a_registry_a_lock_and_a_global():
    found = module_state(
        "import threading\n"
        "_LOCK = threading.Lock()\n"
        "_OWNERS = {}\n"
        "_cache = []\n"
        "def own(k, v):\n"
        "    _OWNERS[k] = v\n"
        "def forget(k):\n"
        "    _OWNERS.pop(k)\n"
        "def count():\n"
        "    global N\n")
    assert found == ["line 2: _LOCK = threading.Lock()", "line 4: _cache is a module-level container",
                     "line 6: own changes module-level _OWNERS", "line 8: forget changes module-level _OWNERS",
                     "line 10: global N"]
    assert module_state("UNITS = {'k': 1}\n__all__ = ['x']\ndef f(d):\n    d['k'] = 1\n    return UNITS['k']\n") == []


# ---- no import circle ----------------------------------------------------------------------------
# Modules import each other one way: no circle of imports between any modules of offload/, within
# a package or across packages, whether the imports are at module level, in a function or under
# TYPE_CHECKING (a circle that only a late import keeps from failing is still a circle).


def import_graph(pkg: Path, root: Path = REPO) -> dict[str, set[str]]:
    """Every module of the package `pkg` (a directory under `root`) -> the modules of that
    package it imports (`imports`: relative imports resolved, imports at any depth)."""
    mods = {dotted(p, root): p for p in sorted(pkg.rglob("*.py"))}
    return {m: {t for t in imports(p, root) if t in mods and t != m} for m, p in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import circle per strongly connected component of `graph` (Tarjan's algorithm): the
    shortest from the component's first module back to itself, that module repeated last."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for component in sorted(components, key=min):
        start = min(component)
        paths = {start: [start]}
        frontier = [start]
        while frontier and start not in graph[frontier[0]]:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & component):
                    if w not in paths:
                        paths[w] = [*paths[v], w]
                        nxt.append(w)
            frontier = nxt
            frontier.sort(key=lambda w: (start not in graph[w], w))
        out.append([*paths[frontier[0]], start])
    return out


def test_no_import_circle_in_offload():
    found = circles(import_graph(PKG))
    assert found == [], "import circles: " + "; ".join(" → ".join(c) for c in found)


def test_the_circle_checker_catches_circles_within_and_across_packages(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.sub import b\n",  # across packages: a → sub.b → sub.c → a
        "pkg/sub/__init__.py": "",
        "pkg/sub/b.py": "from . import c\n",
        "pkg/sub/c.py": "def late():\n    from ..a import VALUE  # in a function, relative\n",
        "pkg/sub/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.e import E\n",
        "pkg/sub/e.py": "import pkg.sub.d\n",  # within a package: sub.d → sub.e → sub.d
        "pkg/f.py": "from pkg import a\nfrom pkg.sub import d\n",  # imports into circles, in none
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    pkg = tmp_path / "pkg"
    assert circles(import_graph(pkg, tmp_path)) == [["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"],
                                                    ["pkg.sub.d", "pkg.sub.e", "pkg.sub.d"]]
    (pkg / "sub" / "c.py").write_text("VALUE = 1\n")
    (pkg / "sub" / "e.py").write_text("E = 1\n")
    assert circles(import_graph(pkg, tmp_path)) == []


# ---- through a package's face ------------------------------------------------------------------
# A package whose __init__.py re-exports names of its modules has a public face: another package
# imports those names from the face, never from the modules behind it, so that the package may
# move them. No module imports a private name (a leading underscore) of another package.


def import_froms(path: Path, root: Path = REPO) -> list[tuple[str, str]]:
    """(module, name) of each `from module import name` in `path` (at any depth), relative
    imports resolved to dotted names."""
    package = dotted(path, root) if path.name == "__init__.py" else dotted(path, root).rpartition(".")[0]
    return [(absolute(node, package), a.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) for a in node.names]


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The dotted module `node` imports from, in a module of `package`."""
    base = node.module or ""
    if node.level:
        up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join([*up, base] if base else up)
    return base


def package_of(module: str, root: Path = REPO) -> str:
    """The package holding `module` (itself where it is a package)."""
    return module if (root / Path(*module.split(".")) / "__init__.py").exists() else module.rpartition(".")[0]


def has_face(package: str, root: Path = REPO) -> bool:
    """Whether `package`'s __init__.py re-exports a name from one of its own modules (at its top
    level: an import under TYPE_CHECKING or in a function exports nothing)."""
    init = root / Path(*package.split(".")) / "__init__.py"
    return any(isinstance(node, ast.ImportFrom) and absolute(node, package).startswith(package + ".")
               for node in ast.parse(init.read_text()).body)


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def face_problems(pkg: Path, root: Path = REPO) -> list[str]:
    """Each import, by a module under `pkg`, of a module behind another package's face or of
    another package's private name."""
    problems = []
    top = pkg.name
    for path in sorted(pkg.rglob("*.py")):
        me = dotted(path, root)
        own = package_of(me, root)
        for target in sorted(imports(path, root)):
            if not inside(target, top):
                continue
            parts = target.split(".")
            for i in range(2, len(parts)):  # every package above the target, the target's own included
                p = ".".join(parts[:i])
                if not inside(own, p) and has_face(p, root):
                    problems.append(f"{me} imports {target}, behind {p}'s face")
                    break
        for module, name in import_froms(path, root):
            if inside(module, top) and name.startswith("_") and name != "__future__":
                home = package_of(f"{module}.{name}", root) if package_of(module, root) == module else \
                    package_of(module, root)
                if own != home:
                    problems.append(f"{me} imports {module}.{name}, private to {home}")
    return problems


def test_other_packages_import_through_a_face_and_no_private_name():
    assert face_problems(PKG) == []


def test_the_face_checker_catches_a_reach_behind_a_face_and_a_private_name(tmp_path):
    files = {
        "pkg/__init__.py": "",
        "pkg/_ext.py": "",  # a private module of the top package, for its own wrapper
        "pkg/wrap.py": "from pkg import _ext\n",
        "pkg/face/__init__.py": "from .impl import Thing\n",
        "pkg/face/impl.py": "class Thing: ...\nclass _Hidden: ...\n",
        "pkg/face/user.py": "from pkg.face.impl import _Hidden\n",  # inside the package: allowed
        "pkg/bare/__init__.py": "",  # no face: its modules are what other packages import
        "pkg/bare/mod.py": "X = 1\n_y = 2\n",
        "pkg/other/__init__.py": "",
        "pkg/other/good.py": "from pkg.face import Thing\nfrom pkg.bare.mod import X\n",
        "pkg/other/bad.py": "def late():\n    from pkg.face.impl import Thing\n    from pkg.bare.mod import _y\n",
        "pkg/other/rel.py": "from ..face import impl\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert face_problems(tmp_path / "pkg", tmp_path) == [
        "pkg.other.bad imports pkg.face.impl, behind pkg.face's face",
        "pkg.other.bad imports pkg.bare.mod._y, private to pkg.bare",
        "pkg.other.rel imports pkg.face.impl, behind pkg.face's face",
    ]


def test_no_import_circle_in_bench():
    # Benchmarks share code through one module that imports the other, never both ways.
    found = circles(import_graph(REPO / "bench"))
    assert found == [], "import circles: " + "; ".join(" → ".join(c) for c in found)


def test_the_wait_tail_spec_named_by_the_cpu_harness_is_defined_where_it_points():
    # bench/vllm_offloading_cpu.py names bench/vllm_wait_tail.py's spec by module path (vLLM loads
    # it from there) instead of importing it, so the name must be kept true by hand.
    consts = {t.id: node.value.value for node in ast.parse((REPO / "bench" / "vllm_offloading_cpu.py").read_text()).body
              if isinstance(node, ast.Assign) for t in node.targets
              if isinstance(t, ast.Name) and isinstance(node.value, ast.Constant)}
    module = REPO / Path(*consts["WAIT_TAIL_MODULE"].split(".")).with_suffix(".py")
    classes = {n.name for n in ast.parse(module.read_text()).body if isinstance(n, ast.ClassDef)}
    assert consts["WAIT_TAIL_SPEC"] in classes
# ---- one module decides worth --------------------------------------------------------------------
# offload/planner/worth.py alone says what a stored entry is worth: its class and admission, what
# cold is, where cold ranks, what a hit refreshes. Every tier, gc and the replay ask it; a second
# cold constant or class rule elsewhere is how "still cold?" came to have several answers.

WORTH = PKG / "planner" / "worth.py"
COLDISH = re.compile("cold", re.IGNORECASE)
CLASS_MEMBERS = {"StateClass": {"TAIL", "PARTIAL", "BRANCH", "INTERNAL"}, "Admission": {"COLD"}}


def _numeric(v: ast.expr) -> bool:
    """A number the module computes from literals alone: 3, 1 << 52, float(1 << 40), -2 ** 10."""
    if isinstance(v, ast.Constant):
        return isinstance(v.value, (int, float)) and not isinstance(v.value, bool)
    if isinstance(v, ast.UnaryOp):
        return _numeric(v.operand)
    if isinstance(v, ast.BinOp):
        return _numeric(v.left) and _numeric(v.right)
    if isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id in {"int", "float"}:
        return len(v.args) == 1 and not v.keywords and _numeric(v.args[0])
    return False


def _mentions_cold(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Name) and COLDISH.search(n.id)) or
               (isinstance(n, ast.Attribute) and COLDISH.search(n.attr)) for n in ast.walk(node))


def worth_rules(source: str) -> list[str]:
    """What in `source` decides worth: a module- or class-level name with "cold" in it bound
    to a number (a cold offset or constant), a rank that a cold flag shifts (`t - K if cold else
    t`), a state class or the cold admission named (`StateClass.INTERNAL`, `Admission.COLD`:
    a class rule)."""
    tree = ast.parse(source)
    problems: list[str] = []
    scopes: list[list[ast.stmt]] = [tree.body]
    while scopes:
        for node in scopes.pop():
            if isinstance(node, ast.ClassDef):
                scopes.append(node.body)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and _numeric(node.value):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                problems.extend(f"line {node.lineno}: cold constant {t.id}" for t in targets
                                if isinstance(t, ast.Name) and COLDISH.search(t.id))
    for node in ast.walk(tree):
        if isinstance(node, ast.IfExp) and _mentions_cold(node.test) and (
                isinstance(node.body, ast.BinOp) or isinstance(node.orelse, ast.BinOp)):
            problems.append(f"line {node.lineno}: cold rank {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.attr in CLASS_MEMBERS.get(node.value.id, ()):
            problems.append(f"line {node.lineno}: class rule on {node.value.id}.{node.attr}")
    return sorted(problems, key=lambda p: int(p.split()[1].rstrip(":")))


def test_only_the_worth_model_decides_worth():
    sources = sorted([*PKG.rglob("*.py"), *(REPO / "bench").rglob("*.py")])
    problems = [f"{p.relative_to(REPO)} {msg}" for p in sources if p != WORTH for msg in worth_rules(p.read_text())]
    assert problems == []
    # The check looks for what the worth model really holds.
    found = worth_rules(WORTH.read_text())
    assert any("cold constant _COLD_TICKS" in f for f in found) and any("StateClass.INTERNAL" in f for f in found)


def test_the_worth_checker_catches_a_cold_constant_a_cold_rank_and_a_class_rule():
    found = worth_rules(
        "_COLD = 1 << 52\n"
        "COLD_S = float(1 << 40)\n"
        "class Index:\n"
        "    cold_offset: int = -2 ** 40\n"
        "def rank(e):\n"
        "    return e.t - OFFSET if e.cold else e.t\n"
        "def admit(c):\n"
        "    return Admission.COLD if c is StateClass.INTERNAL else Admission.HOT\n")
    assert found == ["line 1: cold constant _COLD", "line 2: cold constant COLD_S",
                     "line 4: cold constant cold_offset", "line 6: cold rank e.t - OFFSET if e.cold else e.t",
                     "line 8: class rule on Admission.COLD", "line 8: class rule on StateClass.INTERNAL"]
    # What stays: a file format's token, a flag, a counter in a function, the worth model's answers.
    assert worth_rules("COLD_MARK = ' cold'\n"
                       "cold: bool = False\n"
                       "def f(e, admission):\n"
                       "    cold_files = 0\n"
                       "    n = 1 if enters_cold(admission) else 0\n"
                       "    return tick_rank(e.t, e.cold), cold_files + n, Admission.HOT\n") == []
