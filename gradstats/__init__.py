"""gradstats: statistics of neural gradients, and what follows from them.

Data flows one way, one stage per module, and no stage imports a later one (``docs/architecture.md``)::

    zoo (models, data)  ->  tracer (trace)  ->  run (open_run)  ->  fitting (fit)
        ->  pruning / fpanalysis (analyse)  ->  plan (Plan, recommend)  ->  apply (apply)

beneath them the values and operators every stage uses: :mod:`gradstats.formats` (``FPFormat``),
:mod:`gradstats.ops` (``quantize``, ``prune_quantize``, stochastic pruning, on the CPU and GPU engines)
and :mod:`gradstats.stats` (the statistics row of a gradient tensor); :mod:`gradstats.plots` draws
results. Public names are imported lazily, so ``import gradstats`` is cheap and each stage loads only
what it needs.

Example:
    >>> import gradstats
    >>> gradstats.FPFormat.parse("e4m3fn").max
    448.0
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from gradstats._version import __version__ as __version__

# public name -> module that defines it (one home per idea); imported on attribute access, so
# tools/imports.py (which counts literal-name imports only) sees no edge from this table
_EXPORTS: dict[str, str] = {
    # formats and quantisation
    "FPFormat": "gradstats.formats",
    "Scheme": "gradstats.scheme",
    "quantize": "gradstats.ops.quantization",
    "block_scales": "gradstats.ops.quantization",
    "mx_shared_exponent": "gradstats.ops.quantization",
    # capture
    "trace": "gradstats.tracer",
    "Tracer": "gradstats.tracer",
    "TraceConfig": "gradstats.tracer",
    "tensor_stats": "gradstats.stats",
    # runs on disk
    "open_run": "gradstats.run",
    "Run": "gradstats.run",
    "RunCorruptError": "gradstats.run",
    "RunDamageWarning": "gradstats.run",
    # fitting
    "fit": "gradstats.fitting",
    "fit_stats": "gradstats.fitting",
    "fit_run": "gradstats.fitting",
    "FitResult": "gradstats.fitting",
    # plans
    "Plan": "gradstats.plan",
    "PlanEntry": "gradstats.plan",
    "Rule": "gradstats.plan",
    "recommend": "gradstats.plan.recommend",
    "recommend_each": "gradstats.plan.recommend",
    "RecommendConfig": "gradstats.plan.config",
    "what_if": "gradstats.fpanalysis.what_if",
    "apply": "gradstats.apply",
    "Applied": "gradstats.apply",
    "ApplyConfig": "gradstats.apply",
    "prune_quantize": "gradstats.ops.fused",
    # what a plan costs
    "predicted_noise": "gradstats.plan.noise_prediction",
    "noise_probe": "gradstats.apply.noise_probe",
}
# stage modules exposed as attributes (``gradstats.pruning.threshold(...)``)
_SUBMODULES = {"formats", "ops", "stats", "layers", "tracer", "alarms", "run", "fitting", "pruning", "fpanalysis",
               "plan", "noise", "study", "figures", "report", "plots", "zoo", "wrappers", "integrations", "families"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"gradstats.{name}")
    raise AttributeError(f"module 'gradstats' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


class _Package(types.ModuleType):
    """Keeps a verb a verb: importing the module :mod:`gradstats.apply` must not replace the function
    ``gradstats.apply`` (Python binds a loaded submodule as an attribute of its package)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType) and value.__name__ == f"gradstats.{name}":
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
