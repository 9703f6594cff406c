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
