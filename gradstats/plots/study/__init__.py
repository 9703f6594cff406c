"""Drawing the study's figures: where each layer's gradients lie, how well each family follows
them, how they move over training, and what the analysis recommends for them, checked against
the run.

The functions draw the tables, fits and plans they are given and compute nothing of the analysis:
:mod:`.distributions` (histograms, Q-Q plots, goodness of fit, moments over training, KS per
model) and :mod:`.recommended` (format map, format ranges, error against exponent bits, pruning
checks). :mod:`gradstats.figures` computes their inputs from a run and writes every figure
(:func:`gradstats.figures.write_figures`, ``gradstats figures RUN -o DIR``); the tables are those of
:mod:`gradstats.study`. What each figure shows and how to read it: ``docs/figures.md``.

The old names of this package (``write_figures``, ``FIGURES``, the ``plot_*`` functions of a run,
the tables) still work for one release, with a ``DeprecationWarning`` naming their new home.

Example:
    >>> import pandas as pd
    >>> from gradstats.plots.study.distributions import plot_moments_over_steps
    >>> t = pd.DataFrame({"layer": ["a"], "step": [0], "mean_log2": [-9.0], "std_log2": [2.0],
    ...                   "zero_fraction": [0.1]})
    >>> len(plot_moments_over_steps(t).axes)
    3
"""
from __future__ import annotations

import importlib
from typing import Any

from gradstats.plots.study.distributions import plot_ks_by_model
from gradstats.plots.style import KIND_LABELS

__all__ = ["plot_ks_by_model", "KIND_LABELS"]

# old names of this package, kept for one release: name -> the module where it lives now
_FIGURES_NAMES = ("write_figures", "FIGURES", "plot_layer_histograms", "plot_qq", "plot_goodness_of_fit",
                  "plot_moments_over_steps", "plot_format_map", "plot_layer_format_ranges",
                  "plot_error_vs_bits_for_layers", "plot_sparsity_check", "plot_cosine_check")
_STUDY_NAMES = ("sampled_steps", "layer_values", "layer_fit", "layer_fits", "goodness_of_fit", "moments_over_steps",
                "sparsity_check", "error_check", "MAX_GRID_LAYERS", "SPARSITY_RULES", "SPARSITY_TARGETS")
_MOVED = {**{n: "gradstats.figures" for n in _FIGURES_NAMES}, **{n: "gradstats.study" for n in _STUDY_NAMES}}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        import warnings

        home = _MOVED[name]
        warnings.warn(f"gradstats.plots.study.{name} moved to {home}.{name}; the old name goes in the next release",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_MOVED])
