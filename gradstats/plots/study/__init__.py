"""Drawing the study's figures: where each layer's gradients lie, how well each family follows
them, how they move over training, and what the analysis recommends for them, checked against
the run.

The functions draw the tables, fits and plans they are given and compute nothing of the analysis:
:mod:`.distributions` (histograms, Q-Q plots, goodness of fit, moments over training, KS per
model) and :mod:`.recommended` (format map, format ranges, error against exponent bits, pruning
checks). :mod:`gradstats.figures` computes their inputs from a run and writes every figure
(:func:`gradstats.figures.write_figures`, ``gradstats figures RUN -o DIR``); the tables are those of
:mod:`gradstats.study`. What each figure shows and how to read it: ``docs/figures.md``.

Example:
    >>> import pandas as pd
    >>> from gradstats.plots.study.distributions import plot_moments_over_steps
    >>> t = pd.DataFrame({"layer": ["a"], "step": [0], "mean_log2": [-9.0], "std_log2": [2.0],
    ...                   "zero_fraction": [0.1]})
    >>> len(plot_moments_over_steps(t).axes)
    3
"""
from __future__ import annotations

from gradstats.plots.study.distributions import plot_ks_by_model
from gradstats.plots.style import KIND_LABELS

__all__ = ["plot_ks_by_model", "KIND_LABELS"]
