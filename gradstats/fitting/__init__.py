"""Distribution fitting and model comparison of neural gradients.

Three families are compared fairly, on the same data with the same support: the non-zero
finite magnitudes ``|g|`` under a lognormal, a half-normal (the magnitude of a zero-mean
normal) and an exponential (the magnitude of a zero-mean Laplace). Exact zeros are a point
mass reported as ``zero_fraction``; inf/NaN are counted and excluded.

- :func:`fit` on raw values: MLE parameters, log-likelihoods, AIC/BIC, exact KS (equal to
  ``scipy.stats.kstest``), Anderson-Darling of ``ln|g|``, Vuong's test, skewness and
  kurtosis of ``ln|g|``, signed normal and Laplace fits;
- :func:`fit_stats` from streamed sufficient statistics alone (KS with a proven bound);
- :func:`fit_run` on a whole run: one row per layer, step, kind and family; groups that
  cannot be fitted (all zeros, damaged sample files) are rows with a ``status`` saying why
  (:func:`failed_groups`), never an error.

Formulas, error bounds and where families cannot be told apart: ``docs/fitting.md``.

Example:
    >>> import torch, gradstats
    >>> g = torch.randn(50_000).mul(1.5).exp()
    >>> gradstats.fit(g).best
    'lognormal'
"""
from __future__ import annotations

from gradstats.families import FAMILIES, MAGNITUDE_MODEL
from gradstats.fitting._compare import MIN_NONZERO, VUONG_ALPHA
from gradstats.fitting._exact import SUBSAMPLE_CONFIDENCE, fit
from gradstats.fitting._result import FitResult
from gradstats.fitting._run import failed_groups, failure_lines, fit_run, layer_verdicts
from gradstats.fitting._stats import fit_many_stats, fit_stats, hist_ks_bounds

__all__ = ["fit", "fit_stats", "fit_run", "layer_verdicts", "failed_groups", "failure_lines", "FitResult", "FAMILIES",
           "MAGNITUDE_MODEL", "MIN_NONZERO", "VUONG_ALPHA", "SUBSAMPLE_CONFIDENCE", "fit_many_stats",
           "hist_ks_bounds"]
