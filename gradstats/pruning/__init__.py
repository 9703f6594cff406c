"""Gradient pruning: analytic lognormal thresholds, the baselines, unbiased stochastic pruning.

Public verbs (see ``docs/pruning.md``):

- :func:`expected_sparsity`, :func:`threshold`: the sparsity at a threshold and its inverse,
  by the model-free log2-histogram rule of :class:`LogHistogram` (:data:`DEFAULT_RULE`, where a
  histogram is at hand: a statistics row or the tensor) or a model (lognormal, the study's
  closed form; naive lognormal, normal, Laplace), vectorised over layers;
- :func:`predicted_cosine`, :func:`added_variance`: what pruning at a threshold costs;
- :func:`stochastic_prune`, :func:`hard_prune`, :func:`prune`, :func:`exact_threshold`: the
  operators on tensors, and the sort/selection baseline;
- :func:`allocate`: heterogeneous mode, per-layer targets under a global element-weighted
  budget with optional per-layer cosine floors.

Example:
    >>> from gradstats import pruning
    >>> round(pruning.expected_sparsity(1.0, mu=0.0, sigma=1.0), 6)
    0.238422
"""
from __future__ import annotations

from gradstats.pruning.operator import hard_prune, prune, stochastic_prune
from gradstats.pruning.rules import THRESHOLD_RULES, exact_threshold
from gradstats.pruning.thresholds import (
                         DEFAULT_RULE,
                         FAMILIES,
                         RULES,
                         added_variance,
                         expected_sparsity,
                         predicted_cosine,
                         threshold,
)

__all__ = ["expected_sparsity", "threshold", "predicted_cosine", "added_variance",
           "stochastic_prune", "hard_prune", "prune", "exact_threshold",
           "FAMILIES", "THRESHOLD_RULES", "RULES", "DEFAULT_RULE"]
from gradstats.pruning.allocation import Allocation, allocate  # noqa: E402
from gradstats.pruning.histogram import LogHistogram  # noqa: E402

__all__ += ["allocate", "Allocation", "LogHistogram"]
