"""The package's import graph: cycles, stage order, private names and private modules crossing packages.

Every ``import`` in a module counts, at module level or inside a function, and so does a dynamic import
of a literal module name (``importlib.import_module("gradstats.figures")``, ``import_module(...)``
imported from importlib, ``__import__("gradstats.figures")``), with one exception: a function named
``plot`` (or ``plot_*``) may import :mod:`gradstats.plots` lazily, the adapter that lets a result draw
itself without its stage depending on matplotlib. A dynamic import of a computed name is not an edge
the source can show: the root package's lazy ``_EXPORTS`` table maps public names to modules that are
imported on attribute access (``gradstats.fit``), and ``gradstats.cli`` imports its subcommands by
name; neither adds an edge here.

Run ``python tools/imports.py`` for a report; ``tests/test_architecture.py`` asserts on the same graph.
"""
from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "gradstats"


@dataclass
class Module:
    name: str
    path: Path
    is_package: bool
    imports: dict[str, list[tuple[int, bool, set[str]]]] = field(default_factory=dict)
    """target module -> [(line, at module level, names imported from it)]"""


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _resolve(mod: Module, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.name.split(".")
    if not mod.is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _lazy_plot_adapter(stack: list[ast.AST], target: str) -> bool:
    """A result's ``plot()`` importing :mod:`gradstats.plots`, or its ``to_<library>()`` importing that
    library's adapter in :mod:`gradstats.integrations`: the lazy adapters, allowed to point forward (even
    counting them, the package has no cycle: ``tests/test_architecture.py``)."""
    funcs = [f.name for f in stack if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    if target == "gradstats.plots" or target.startswith("gradstats.plots."):
        return any(f == "plot" or f.startswith("plot_") for f in funcs)
    if target.startswith("gradstats.integrations."):
        lib = target.rsplit(".", 1)[1]
        return any(f == f"to_{lib}" for f in funcs)
    return False


def _dynamic_import(node: ast.AST) -> str | None:
    """The module a call imports by a literal name: ``importlib.import_module("x.y")``,
    ``import_module("x.y")`` or ``__import__("x.y")`` (which loads ``x.y``); None for any other call,
    and for a name computed at run time (an f-string, a variable, a relative name)."""
    if not (isinstance(node, ast.Call) and node.args):
        return None
    f = node.func
    called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if isinstance(f, ast.Attribute) and not (isinstance(f.value, ast.Name) and f.value.id == "importlib"):
        called = None
    first = node.args[0]
    if called in ("import_module", "__import__") and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return None if first.value.startswith(".") else first.value
    return None


def scan(package: Path = PACKAGE) -> dict[str, Module]:
    """Every module of the package with the gradstats modules it imports (statements and dynamic
    imports of literal names)."""
    mods = {}
    for path in sorted(package.rglob("*.py")):
        mod = Module(module_name(path, package.parent), path, path.name == "__init__.py")
        mods[mod.name] = mod
    for mod in mods.values():
        tree = ast.parse(mod.path.read_text(), str(mod.path))

        def visit(node: ast.AST, stack: list[ast.AST]) -> None:
            top = not any(isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for f in stack)
            if isinstance(node, ast.If) and _is_type_checking(node.test):
                return                                  # typing-only imports do not run
            targets: list[tuple[str, set[str]]] = []
            if isinstance(node, ast.Import):
                targets = [(a.name, set()) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, node)
                for a in node.names:                   # ``from . import x``: x may be a module
                    sub = f"{base}.{a.name}"
                    targets.append((sub, set()) if sub in mods else (base, {a.name}))
            elif (dynamic := _dynamic_import(node)) is not None:
                targets = [(dynamic, set())]
            for target, names in targets:
                if not target.startswith("gradstats"):
                    continue
                while target not in mods and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target == mod.name or _lazy_plot_adapter(stack, target):
                    continue
                mod.imports.setdefault(target, []).append((node.lineno, top, names))
            for child in ast.iter_child_nodes(node):
                visit(child, stack + [node])

        visit(tree, [])
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def cycles(mods: dict[str, Module]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph = {m: set(mod.imports) for m, mod in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = [0]
    sys.setrecursionlimit(10000)

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(out)


def private_crossings(mods: dict[str, Module]) -> list[str]:
    """``from a.b import _name`` where a.b is in another top-level package than the importer."""
    out = []
    for mod in mods.values():
        for target, uses in mod.imports.items():
            if _top(target) == _top(mod.name):
                continue
            for line, _, names in uses:
                for n in sorted(names):
                    if n.startswith("_") and not n.startswith("__"):
                        out.append(f"{mod.name}:{line} imports {target}.{n}")
    return out


def private_module_imports(mods: dict[str, Module]) -> list[str]:
    """Imports of a private module (``a.b._c``) from outside its package ``a.b``: the package's own
    ``__init__``, its modules and its subpackages may import it; anything else goes through a public
    name (the package's ``__init__`` or a public module)."""
    out = []
    for mod in mods.values():
        for target, uses in mod.imports.items():
            parts = target.split(".")
            for i in range(1, len(parts)):
                if parts[i].startswith("_") and not parts[i].startswith("__"):
                    package = ".".join(parts[:i])
                    if mod.name != package and not mod.name.startswith(package + "."):
                        out.append(f"{mod.name}:{uses[0][0]} imports {target}")
                    break
    return sorted(out)


def _top(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2])


def module_level_plot_imports(mods: dict[str, Module]) -> list[str]:
    """Modules outside ``plots``/``cli``/``report`` importing ``gradstats.plots`` at module level."""
    out = []
    for mod in mods.values():
        if _top(mod.name) in {"gradstats.plots", "gradstats.cli", "gradstats.report"}:
            continue
        for target, uses in mod.imports.items():
            if _top(target) == "gradstats.plots" and any(top for _, top, _ in uses):
                out.append(mod.name)
    return sorted(set(out))


#: the stages, in data-flow order; a module may import its own stage and earlier ones only
STAGES: list[tuple[str, tuple[str, ...]]] = [
    ("values", ("gradstats._version", "gradstats._threads", "gradstats._roots", "gradstats._special", "gradstats._config", "gradstats._progress",
                "gradstats.formats",
                "gradstats.scheme", "gradstats.wrappers")),
    ("testbed", ("gradstats.zoo",)),
    ("ops", ("gradstats.ops",)),
    ("stats", ("gradstats.stats", "gradstats.families")),
    ("run", ("gradstats.run",)),
    ("capture", ("gradstats.layers", "gradstats.alarms", "gradstats.tracer")),
    ("fit", ("gradstats.fitting",)),
    ("analyse", ("gradstats.pruning", "gradstats.fpanalysis", "gradstats.noise")),
    ("plan", ("gradstats.plan",)),
    ("apply", ("gradstats.apply",)),
    ("adapters", ("gradstats.integrations",)),
    ("outputs", ("gradstats.plots", "gradstats.study", "gradstats.figures", "gradstats.report", "gradstats.cli",
                 "gradstats.__main__")),
]


def stage(name: str) -> int | None:
    """Index of a module's stage in :data:`STAGES` (None: the lazy root package); the longest
    matching prefix decides."""
    best, length = None, -1
    for i, (_, prefixes) in enumerate(STAGES):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    return best


def backward_imports(mods: dict[str, Module]) -> list[str]:
    """Imports of a later stage (the root package ``gradstats`` is lazy and excluded); ``plots`` may
    import the values, ops and stats only (it draws what it is given)."""
    out = []
    for mod in mods.values():
        a = stage(mod.name)
        if a is None:
            continue
        for target, uses in mod.imports.items():
            b = stage(target)
            if b is None:
                continue
            if b > a or (_top(mod.name) == "gradstats.plots" and b > stage("gradstats.stats")
                         and _top(target) != "gradstats.plots"):
                out.append(f"{mod.name}:{uses[0][0]} imports {target} ({STAGES[a][0]} -> {STAGES[b][0]})")
    return out


def main() -> int:
    mods = scan()
    cyc = cycles(mods)
    print(f"{len(mods)} modules, {sum(len(m.imports) for m in mods.values())} import edges")
    print(f"import cycles (strongly connected groups): {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    plots = module_level_plot_imports(mods)
    print(f"analysis modules importing plots at module level: {len(plots)}")
    for p in plots:
        print("  " + p)
    priv = private_crossings(mods)
    print(f"private names imported across packages: {len(priv)}")
    for p in priv:
        print("  " + p)
    priv_mods = private_module_imports(mods)
    print(f"private modules imported from another package: {len(priv_mods)}")
    for p in priv_mods:
        print("  " + p)
    back = backward_imports(mods)
    print(f"imports of a later stage: {len(back)}")
    for b in back:
        print("  " + b)
    unstaged = sorted(m for m in mods if stage(m) is None and m != "gradstats")
    if unstaged:
        print("modules in no stage: " + ", ".join(unstaged))
    return 1 if cyc or back or unstaged or priv or priv_mods else 0


if __name__ == "__main__":
    raise SystemExit(main())
