"""The comparison arithmetic shared by every fit path (the families themselves: :mod:`gradstats.families`).

All models are compared on the same data with the same support, the non-zero finite
magnitudes ``a = |g|``:

=============  ==========================  ========================================================
family         model of ``a``              maximum-likelihood parameters (``m`` magnitudes)
=============  ==========================  ========================================================
``lognormal``  ``ln a ~ N(mu, sigma^2)``   ``mu = mean ln a``, ``sigma^2 = mean (ln a - mu)^2``
``normal``     half-normal, scale ``s``    ``s^2 = mean a^2``
``laplace``    exponential, scale ``b``    ``b = mean a``
=============  ==========================  ========================================================

At the MLE the mean log-likelihood per magnitude is a closed form of the parameters:
``-mu - ln sigma - ln(2 pi)/2 - 1/2`` (lognormal), ``ln(2/pi)/2 - ln s - 1/2`` (half-normal),
``-ln b - 1`` (exponential).
"""
from __future__ import annotations

import math
from typing import Mapping

from gradstats.families import FAMILIES, N_PARAMS

#: two-sided level at which the Vuong test is said to separate two families
VUONG_ALPHA = 0.05
#: fewest non-zero finite values a fit accepts
MIN_NONZERO = 10



def too_few_message(m: int, n: int, n_zero: int, n_nonfinite: int) -> str:
    """The error of a fit with fewer than ``MIN_NONZERO`` non-zero finite values, naming the
    counts; with none at all it says so (an all-zero or all-non-finite tensor has no magnitude
    distribution to fit)."""
    msg = (f"fit needs at least {MIN_NONZERO} non-zero finite values, got {m} "
           f"(n={n}: {n_zero} zeros, {n_nonfinite} non-finite)")
    if m == 0:
        what = "zero" if n_nonfinite == 0 else "non-finite (inf/NaN)" if n_zero == 0 else "zero or non-finite"
        msg += (f": there is no non-zero finite value, every value is {what}, so there is no magnitude "
                "distribution to fit (a layer whose gradient is identically zero, or an overflow)")
    return msg


def check_families(families: object) -> tuple[str, ...]:
    """Validate a ``families`` argument: a non-empty sequence of distinct names of FAMILIES."""
    if isinstance(families, str):
        families = (families,)
    try:
        fams = tuple(families)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"families must be a sequence of names from {FAMILIES}, got {families!r}") from None
    bad = [f for f in fams if f not in FAMILIES]
    if not fams or bad or len(set(fams)) != len(fams):
        raise ValueError(f"families must be distinct names from {FAMILIES}, got {fams!r}")
    return fams


def information_criteria(family: str, loglik: float, m: int) -> tuple[float, float]:
    """``(AIC, BIC)`` of a family with mean log-likelihood ``loglik`` on ``m`` magnitudes."""
    k = N_PARAMS[family]
    total = loglik * m
    return 2.0 * k - 2.0 * total, k * math.log(m) - 2.0 * total


def vuong(mean_diff: float, var_diff: float, m: int) -> dict[str, float]:
    """Vuong's non-nested test from the mean and variance of the per-magnitude log-likelihood
    differences ``d_i``: ``z = sum(d_i) / (sqrt(m) std(d_i))``, effect size ``z / sqrt(m)``
    (= mean/std of ``d``), two-sided p-value. A zero variance (identical per-sample
    likelihoods up to a constant) gives ``z = +-inf`` (or 0 when the mean is 0 too)."""
    sd = math.sqrt(max(var_diff, 0.0))
    if sd > 0:
        effect = mean_diff / sd
    elif mean_diff != 0:
        effect = math.copysign(math.inf, mean_diff)
    else:
        effect = 0.0
    z = effect * math.sqrt(m)
    p = math.erfc(abs(z) / math.sqrt(2.0)) if math.isfinite(z) else 0.0
    return {"z": z, "effect": effect, "p": p, "mean": mean_diff, "std": sd}


def ranking(loglik: Mapping[str, float], vuong_tests: Mapping[tuple[str, str], Mapping[str, float]]
            ) -> tuple[str, str | None, bool | None]:
    """``(best, runner_up, separated)``: the family with the highest mean log-likelihood, the
    next one, and whether Vuong's test separates them at ``VUONG_ALPHA`` (``None`` when
    there is no runner-up or no Vuong test, as for fits from statistics alone)."""
    order = sorted(loglik, key=lambda f: -loglik[f])
    best = order[0]
    if len(order) < 2:
        return best, None, None
    runner = order[1]
    test = vuong_tests.get((best, runner)) or vuong_tests.get((runner, best))
    if test is None:
        return best, runner, None
    return best, runner, bool(test["p"] < VUONG_ALPHA)
