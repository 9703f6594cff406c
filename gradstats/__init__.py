"""gradstats: statistics of neural gradients, and what follows from them.

Data flows one way, one module per stage::

    models  ->  tracer (trace)  ->  run (open_run)  ->  fitting (fit)
            ->  pruning / fpanalysis (analyse)  ->  plan (Plan, recommend)  ->  enforce (apply)

Low-precision formats live in :mod:`gradstats.formats` (``FPFormat``) and
:mod:`gradstats.quant` (``quantize``). Public names are imported lazily, so
``import gradstats`` is cheap and each stage loads only what it needs.

Example:
    >>> import gradstats
    >>> gradstats.FPFormat.parse("e4m3fn").max
    448.0
"""
from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__

# public name -> module that defines it (one home per idea)
_EXPORTS: dict[str, str] = {
    # formats and quantisation
    "FPFormat": "gradstats.formats",
    "quantize": "gradstats.quant",
    "block_scales": "gradstats.quant",
    "mx_shared_exponent": "gradstats.quant",
    # built-in models, data and training loop
    "build_model": "gradstats.models",
    "list_models": "gradstats.models",
    "load_fashion_mnist": "gradstats.data",
    "load_shakespeare": "gradstats.data",
    "train": "gradstats.training",
    "evaluate": "gradstats.training",
    "prepare": "gradstats.training",
    # capture
    "trace": "gradstats.tracer",
    "Tracer": "gradstats.tracer",
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
    "recommend": "gradstats.recommendation",
    "what_if": "gradstats.fpanalysis.what_if",
    "apply": "gradstats.enforce",
    "Applied": "gradstats.enforce",
    "prune_quantize": "gradstats.compress",
}
# stage modules exposed as attributes (``gradstats.pruning.threshold(...)``)
_SUBMODULES = {"pruning", "fpanalysis", "models", "data", "training", "plots", "formats", "quant", "stats",
               "run", "tracer", "plan", "report", "compress", "enforce", "fitting", "wrappers"}

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
