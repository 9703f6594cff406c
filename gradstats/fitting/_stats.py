"""``fit_stats``: fits from the tracer's streamed sufficient statistics alone.

Parameters and log-likelihoods are closed forms of the sums (see ``_families``). KS comes
from the binade histogram with a proven bound:

At a knot ``t`` where the number ``c`` of magnitudes below ``t`` is known exactly (every
binade edge ``2^k``; ``min_abs``, below which there are none; the float just above
``max_abs``, below which there are all ``m``), the left limit of the empirical CDF is
``c/m``, and ``D >= |c/m - F(t)|`` because ``D`` is a supremum and ``F`` is continuous.
Between consecutive knots ``t_k < t_k+1`` both CDFs are non-decreasing, the empirical one
within ``[c_k/m, c_k+1/m]`` and the model's within ``[F(t_k), F(t_k+1)]``, so there
``|F_m - F| <= max(c_k+1/m - F(t_k), F(t_k+1) - c_k/m)``. Hence

    ``L = max_k |c_k/m - F(t_k)|  <=  KS  <=  U = max_k max(c_k+1/m - F(t_k), F(t_k+1) - c_k/m)``

and ``U <= L + max_k (c_k+1 - c_k)/m``: the bound is never wider than the largest bin mass.
``fit_stats`` reports ``ks = (L + U)/2`` and ``ks_error = (U - L)/2``.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch

from gradstats.families import FAMILIES, cdf64
from gradstats.fitting._compare import MIN_NONZERO, check_families, too_few_message
from gradstats.fitting._result import FitResult, assemble
from gradstats.stats import COUNT_FIELDS, HIST_BINS, HIST_MIN_EXP, SUM_FIELDS, lognormal_moments, merge_stats

_REQUIRED = (*COUNT_FIELDS, *SUM_FIELDS, "min_abs", "max_abs", "hist")


def hist_ks_bounds(hist: np.ndarray, m: np.ndarray, amin: np.ndarray, amax: np.ndarray,
                   params: Mapping[str, Mapping[str, Any]]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Lower and upper bounds ``(L, U)`` of the KS distance of each of ``G`` histograms
    against each family (see the module docstring).

    Args:
        hist: ``(G, HIST_BINS)`` binade counts of the non-zero finite magnitudes.
        m: ``(G,)`` number of those magnitudes (the row sums of ``hist``).
        amin, amax: ``(G,)`` smallest and largest of them.
        params: family -> parameters (scalars or ``(G,)`` arrays): lognormal ``mu``,
            ``sigma``; normal and laplace ``scale`` (half-normal, exponential).

    Returns ``({family: L}, {family: U})`` as float64 arrays of shape ``(G,)``.
    """
    h = torch.as_tensor(np.asarray(hist, dtype=np.float64))
    g = h.shape[0]
    mm = torch.as_tensor(np.asarray(m, dtype=np.float64)).reshape(g, 1)
    edges = torch.exp2(torch.arange(HIST_MIN_EXP, HIST_MIN_EXP + HIST_BINS + 1, dtype=torch.float64))
    c_edges = torch.cat([torch.zeros(g, 1, dtype=torch.float64), torch.cumsum(h, 1)], 1)
    lo_k = torch.as_tensor(np.asarray(amin, dtype=np.float64)).reshape(g, 1)
    hi_k = torch.as_tensor(np.nextafter(np.asarray(amax, dtype=np.float64), np.inf)).reshape(g, 1)
    zero = torch.zeros(g, 1, dtype=torch.float64)
    knots = torch.cat([zero, edges.expand(g, -1), lo_k, hi_k, torch.full((g, 1), math.inf, dtype=torch.float64)], 1)
    counts = torch.cat([zero, c_edges, zero, mm, mm], 1)
    knots, order = torch.sort(knots, dim=1, stable=True)
    counts = torch.cummax(torch.gather(counts, 1, order), 1).values / mm
    lower: dict[str, np.ndarray] = {}
    upper: dict[str, np.ndarray] = {}
    for fam, p in params.items():
        pp = {k: torch.as_tensor(np.asarray(v, dtype=np.float64)).reshape(-1, 1) for k, v in p.items()}
        F = cdf64(fam, knots, pp)
        lower[fam] = (counts - F).abs().amax(1).numpy()
        seg = torch.maximum(counts[:, 1:] - F[:, :-1], F[:, 1:] - counts[:, :-1])
        upper[fam] = seg.amax(1).numpy()
    return lower, upper


def _rows(row_or_rows: Any) -> list[Mapping[str, Any]]:
    import pandas as pd

    if isinstance(row_or_rows, pd.DataFrame):
        return row_or_rows.to_dict("records")
    if isinstance(row_or_rows, pd.Series):
        return [row_or_rows.to_dict()]
    if isinstance(row_or_rows, Mapping):
        return [row_or_rows]
    if isinstance(row_or_rows, Iterable) and not isinstance(row_or_rows, (str, bytes)):
        out: list[Mapping[str, Any]] = []
        for r in row_or_rows:
            out.extend(_rows(r))
        return out
    raise ValueError("fit_stats expects a statistics dict (gradstats.stats.tensor_stats), a row of "
                     f"Run.stats(), a DataFrame of such rows or a list of them; got {type(row_or_rows).__name__}")


def _merged(row_or_rows: Any) -> dict[str, Any]:
    rows = _rows(row_or_rows)
    if not rows:
        raise ValueError("fit_stats got no statistics rows")
    for r in rows:
        missing = [k for k in _REQUIRED if k not in r]
        if missing:
            raise ValueError(f"statistics row lacks {missing}; expected the fields of gradstats.stats "
                             f"({', '.join(_REQUIRED)})")
    return merge_stats(rows) if len(rows) > 1 else dict(rows[0])


def _check(st: Mapping[str, Any]) -> tuple[int, np.ndarray]:
    n, nz, nnf = int(st["n"]), int(st["n_zero"]), int(st["n_nonfinite"])
    m = n - nz - nnf
    hist = np.asarray(st["hist"], dtype=np.int64)
    if n == 0:
        raise ValueError("statistics of an empty tensor (n = 0): nothing to fit")
    if m < MIN_NONZERO:
        raise ValueError(too_few_message(m, n, nz, nnf))
    if hist.shape != (HIST_BINS,) or int(hist.sum()) != m:
        raise ValueError(f"statistics histogram must have {HIST_BINS} bins summing to n - n_zero - "
                         f"n_nonfinite = {m}; got shape {hist.shape}, sum {int(hist.sum())}")
    if float(st["min_abs"]) == float(st["max_abs"]):
        raise ValueError(f"all {m} non-zero magnitudes equal {float(st['min_abs']):g}: sigma = 0, so no "
                         "continuous family fits and the comparison is undefined")
    return m, hist


def fit_many_stats(stats: Sequence[Mapping[str, Any]], families: Sequence[str] = FAMILIES
                   ) -> list[FitResult | ValueError]:
    """:func:`fit_stats` of many merged statistics dicts at once (the KS bounds vectorised);
    an entry that cannot be fitted gives its ValueError in place of a result."""
    fams = check_families(families)
    out: list[FitResult | ValueError | None] = [None] * len(stats)
    good: list[tuple[int, dict[str, Any], int, np.ndarray]] = []
    for i, st in enumerate(stats):
        try:
            m, hist = _check(st)
            mu, sigma = lognormal_moments(st)
            if not sigma > 0:
                raise ValueError(f"the sums of the {m} non-zero magnitudes give sigma(ln|g|) = 0 to working "
                                 "precision; no continuous family fits")
            nf = int(st["n"]) - int(st["n_nonfinite"])
            loc = float(st["sum"]) / nf
            p = {"mu": mu, "sigma": sigma, "s": math.sqrt(float(st["sum_sq"]) / m),
                 "b": float(st["sum_abs"]) / m,
                 "signed": {"normal_loc": loc,
                            "normal_std": math.sqrt(max(float(st["sum_sq"]) / nf - loc * loc, 0.0))}}
            good.append((i, p, m, hist))
        except ValueError as exc:
            out[i] = exc
    if good:
        H = np.stack([g[3] for g in good])
        M = np.array([g[2] for g in good], dtype=np.float64)
        amin = np.array([float(stats[g[0]]["min_abs"]) for g in good])
        amax = np.array([float(stats[g[0]]["max_abs"]) for g in good])
        par = {"lognormal": {"mu": [g[1]["mu"] for g in good], "sigma": [g[1]["sigma"] for g in good]},
               "normal": {"scale": [g[1]["s"] for g in good]}, "laplace": {"scale": [g[1]["b"] for g in good]}}
        lo, hi = hist_ks_bounds(H, M, amin, amax, {f: par[f] for f in fams})
        for j, (i, p, m, hist) in enumerate(good):
            st = stats[i]
            nz = np.nonzero(hist)[0]
            k0, k1 = int(nz[0]), int(nz[-1]) + 1
            cum = np.cumsum(hist[k0:k1])[:-1] / m
            qe = np.arange(k0 + 1, k1) + HIST_MIN_EXP
            out[i] = assemble(
                fams, source="stats", n=int(st["n"]), n_zero=int(st["n_zero"]),
                n_nonfinite=int(st["n_nonfinite"]), m=m, p=p, signed=p["signed"], vuong_sq=None, s3=None,
                s4=None, ks={f: float(0.5 * (lo[f][j] + hi[f][j])) for f in fams},
                ks_error={f: float(0.5 * (hi[f][j] - lo[f][j])) for f in fams}, ks_method="hist", ks_n=m, ad=None,
                ks_confidence=1.0, log2_edges=np.arange(k0, k1 + 1, dtype=np.float64) + HIST_MIN_EXP,
                log2_counts=hist[k0:k1].copy(), qq=(cum, qe * math.log(2.0)))
    return out  # type: ignore[return-value]


def fit_stats(row_or_rows: Any, *, families: Sequence[str] = FAMILIES) -> FitResult:
    """Fit from streamed sufficient statistics alone (no raw values).

    Takes a statistics dict of :func:`gradstats.stats.tensor_stats`, a row of
    ``Run.stats()``, or several of either (a DataFrame or a list), which are merged with
    :func:`gradstats.stats.merge_stats`. Returns a :class:`FitResult` with the lognormal
    ``mu``, ``sigma``; the half-normal and exponential scales (all on the non-zero finite
    magnitudes, as :func:`fit`); the signed normal ``loc``, ``std`` (over the finite values);
    log-likelihoods, AIC, BIC; and KS from the binade histogram: the true KS distance lies
    within ``ks +- ks_error`` (proven; see ``docs/fitting.md``). Vuong's test, skewness,
    kurtosis, Anderson-Darling and the signed Laplace fit need raw values and are absent.

    Example:
        >>> import torch, gradstats
        >>> from gradstats.stats import tensor_stats
        >>> g = torch.randn(100_000).exp()
        >>> r = gradstats.fit_stats(tensor_stats(g))
        >>> r.best, round(r.params["lognormal"]["sigma"], 2), r.ks_error["lognormal"] < 0.2
        ('lognormal', 1.0, True)
    """
    res = fit_many_stats([_merged(row_or_rows)], families)[0]
    if isinstance(res, ValueError):
        raise res
    return res
