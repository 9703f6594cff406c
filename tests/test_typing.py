"""The public API is typed: every public function and method has hints on its parameters and return,
and the typed usage in tests/typecheck/public_api.py runs (mypy checks it in ``make test``)."""
from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

import gradstats

PUBLIC_MODULES = ["gradstats.formats", "gradstats.ops", "gradstats.stats", "gradstats.run", "gradstats.run.select",
                  "gradstats.tracer", "gradstats.fitting", "gradstats.pruning", "gradstats.fpanalysis", "gradstats.plan",
                  "gradstats.plan.recommend", "gradstats.apply", "gradstats.zoo"]


def _public_callables():
    seen = set()
    for modname in PUBLIC_MODULES:
        mod = importlib.import_module(modname)
        for name in getattr(mod, "__all__", [n for n in vars(mod) if not n.startswith("_")]):
            obj = getattr(mod, name, None)
            if obj is None or id(obj) in seen or not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            if not getattr(obj, "__module__", "").startswith("gradstats"):
                continue
            seen.add(id(obj))
            if inspect.isfunction(obj):
                yield f"{modname}.{name}", obj
            else:
                for meth_name, meth in vars(obj).items():
                    if inspect.isfunction(meth) and not meth_name.startswith("_"):
                        yield f"{modname}.{name}.{meth_name}", meth


def _missing_hints(fn) -> list[str]:
    fn = inspect.unwrap(fn)
    sig = inspect.signature(fn)
    missing = [p for p, v in sig.parameters.items()
               if p not in ("self", "cls") and v.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty and fn.__name__ != "__init__":
        missing.append("return")
    return missing


def test_every_public_function_has_type_hints():
    bare = {name: m for name, fn in _public_callables() if (m := _missing_hints(fn))}
    assert bare == {}, f"public callables without type hints: {bare}"


def test_the_typed_usage_runs():
    sys.path.insert(0, str(Path(__file__).resolve().parent / "typecheck"))
    try:
        import public_api
    finally:
        sys.path.pop(0)
    public_api.main()


def test_the_hint_check_can_fail():
    def untyped(x, y: int):
        return x

    assert _missing_hints(untyped) == ["x", "return"]
    with pytest.raises(AttributeError):
        gradstats.no_such_name  # noqa: B018
