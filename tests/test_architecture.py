"""The package's shape: one-way imports along the data flow (docs/architecture.md), read from the source."""
from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import imports  # noqa: E402

MODS = imports.scan()


def test_no_import_cycle():
    """No two modules need each other, at module level or inside functions (a result's lazy ``plot()``
    and ``to_<library>()`` adapters excepted)."""
    assert imports.cycles(MODS) == []


def test_no_cycle_even_through_the_lazy_adapters(monkeypatch):
    """Counting the ``plot()`` and ``to_<library>()`` adapters' imports too."""
    monkeypatch.setattr(imports, "_lazy_plot_adapter", lambda stack, target: False)
    assert imports.cycles(imports.scan()) == []


def test_every_module_has_a_stage():
    assert sorted(m for m in MODS if imports.stage(m) is None and m != "gradstats") == []


def test_no_stage_imports_a_later_one():
    assert imports.backward_imports(MODS) == []


def test_analysis_does_not_import_plots_at_module_level():
    assert imports.module_level_plot_imports(MODS) == []


def test_no_private_name_crosses_a_package():
    assert imports.private_crossings(MODS) == []


def test_no_private_module_is_imported_from_another_package():
    """``a.b._c`` is imported by ``a.b``'s ``__init__``, its modules and subpackages only; the rest of the
    package goes through a public name."""
    assert imports.private_module_imports(MODS) == []


def _package(tmp_path, files):
    """A throwaway package named ``gradstats`` (the scanner follows that name only) from ``{path: source}``."""
    for rel, src in files.items():
        path = tmp_path / "gradstats" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
    return imports.scan(tmp_path / "gradstats")


def test_the_scanner_sees_dynamic_imports_of_literal_names(tmp_path):
    """importlib.import_module("x.y"), import_module("x.y") and __import__("x.y") are edges, inside
    functions too; a computed name is not (the source cannot show it)."""
    mods = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "def f():\n    import importlib\n    return importlib.import_module('gradstats.b')\n",
        "b.py": "from importlib import import_module\nimport_module('gradstats.c')\n",
        "c.py": "X = __import__('gradstats.a.x')\n",
        "d.py": "import importlib\nfor n in ('a', 'b'):\n    importlib.import_module(f'gradstats.{n}')\n"
                "importlib.import_module('json')\n",
    })
    assert set(mods["gradstats.a"].imports) == {"gradstats.b"}
    assert mods["gradstats.a"].imports["gradstats.b"][0][:2] == (3, False)
    assert set(mods["gradstats.b"].imports) == {"gradstats.c"}
    assert set(mods["gradstats.c"].imports) == {"gradstats.a"}       # the longest module of the name
    assert mods["gradstats.d"].imports == {}
    assert imports.cycles(mods) == [["gradstats.a", "gradstats.b", "gradstats.c"]]


def test_the_scanner_sees_a_private_module_leave_its_package(tmp_path):
    mods = _package(tmp_path, {
        "__init__.py": "", "_top.py": "",
        "p/__init__.py": "from gradstats.p._impl import f\n",
        "p/_impl.py": "def f():\n    pass\n",
        "p/public.py": "from . import _impl\n",
        "p/sub/__init__.py": "from gradstats.p._impl import f\n",
        "q.py": "import gradstats._top\ndef g():\n    from gradstats.p._impl import f\n",
        "r.py": "import importlib\nm = importlib.import_module('gradstats.p._impl')\n",
    })
    assert imports.private_module_imports(mods) == ["gradstats.q:3 imports gradstats.p._impl",
                                                    "gradstats.r:2 imports gradstats.p._impl"]


def test_the_scanner_sees_what_it_must():
    """The checks above can fail: a function-level import counts, a plot adapter does not."""
    mods = imports.scan()
    apply_imports = mods["gradstats.apply"].imports
    assert "gradstats.plan" in apply_imports or "gradstats.plan._plan" in apply_imports
    assert any(not top for uses in mods["gradstats.plan.export"].imports.values() for _, top, _ in uses)
    fake = {"a": imports.Module("gradstats.a", Path("a.py"), False, {"gradstats.b": [(1, False, set())]}),
            "b": imports.Module("gradstats.b", Path("b.py"), False, {"gradstats.a": [(1, True, set())]})}
    fake = {m.name: m for m in fake.values()}
    assert imports.cycles(fake) == [["gradstats.a", "gradstats.b"]]


@pytest.mark.parametrize("old", ["gradstats.quant", "gradstats.compress", "gradstats.enforce", "gradstats.models",
                                 "gradstats.data", "gradstats.training", "gradstats.recommendation",
                                 "gradstats.blocks"])
def test_old_homes_are_gone(old):
    """The modules' old homes (kept for one release) no longer import, and no import hook serves them."""
    import gradstats

    sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError, match=old.replace(".", r"\.")):
        importlib.import_module(old)
    assert not any(type(f).__module__ == "gradstats" for f in sys.meta_path)
    assert old.rpartition(".")[2] not in dir(gradstats)


@pytest.mark.parametrize("name", ["build_model", "list_models", "load_fashion_mnist", "load_shakespeare", "train",
                                  "evaluate", "prepare", "models", "quant"])
def test_old_top_level_names_are_gone(name):
    import gradstats

    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(gradstats, name)


def test_importing_the_apply_module_keeps_the_verb():
    import gradstats

    module = importlib.import_module("gradstats.apply")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callable(gradstats.apply) and gradstats.apply is module.apply


def test_no_module_is_over_600_lines():
    """A module that grows past 600 lines is split along a seam (docs/architecture.md)."""
    root = Path(__file__).resolve().parents[1] / "gradstats"
    long = {str(p.relative_to(root)): n for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines: {long}"
