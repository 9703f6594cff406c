"""Heterogeneous mode: per-layer sparsity targets under one global, element-weighted budget.

Problem. Layers ``i`` with ``n_i`` elements, zero fraction ``p0_i`` and a magnitude model
(lognormal ``mu_i, sigma_i`` by default). Choose thresholds ``a_i`` to

    minimise   sum_i w_i * D_i(a_i)          D_i = E[(T(g) - g)^2] / E[g^2] = 1/cos_i^2 - 1
    subject to sum_i n_i S_i(a_i) = budget * sum_i n_i      and  cos_i >= floor_i,

i.e. spend the sparsity where it adds the least relative noise (``w_i`` defaults to ``n_i``:
every element's noise counts the same). Per element, ``dVar/da = E[|g| 1{|g|<a}]`` and
``dS/da = E[|g| 1{|g|<a}] / a^2``, so the marginal cost of sparsity is
``dD_i/dS_i = a_i^2 / E_i[g^2]``: it grows with ``a_i``, the problem is convex, and its
KKT conditions give ``a_i = min(c * sqrt(n_i E_i[g^2] / w_i), a_max_i)`` with one scalar
``c`` set by the budget and ``a_max_i`` the largest threshold the cosine floor allows. With the
default weights the thresholds are a common multiple of each layer's RMS gradient.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..stats import HIST_BINS, merge_stats
from ._models import solve_ratio
from .thresholds import (MODELS, _row_params, _subset, added_variance, expected_sparsity,
                         predicted_cosine, resolve, threshold)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Allocation:
    """Result of :func:`allocate`: per-layer targets, thresholds and their predicted cost.

    Attributes: ``layers`` (names), ``n`` (element counts), ``targets`` (expected sparsity of
    each layer, zeros included), ``thresholds``, ``cosine`` (predicted cosine similarity),
    ``added_variance`` (relative, ``1/cos^2 - 1``), ``floors`` (NaN where none), ``budget``,
    ``achieved`` (element-weighted mean of ``targets``), ``objective`` (``sum w_i D_i``),
    ``uniform_objective`` (the same with every layer at the budget, ignoring floors), ``model``.
    """

    layers: list[str]
    n: np.ndarray
    targets: np.ndarray
    thresholds: np.ndarray
    cosine: np.ndarray
    added_variance: np.ndarray
    floors: np.ndarray
    budget: float
    achieved: float
    objective: float
    uniform_objective: float
    model: str = "lognormal"
    weights: np.ndarray = field(default_factory=lambda: np.zeros(0))

    def to_dataframe(self):
        """One row per layer.

        Example:
            >>> a = allocate({"l1": {"mu": -9.0, "sigma": 2.0, "n": 1000},
            ...               "l2": {"mu": -12.0, "sigma": 1.0, "n": 3000}}, 0.8)
            >>> list(a.to_dataframe().columns)[:3]
            ['layer', 'n', 'target']
        """
        import pandas as pd

        return pd.DataFrame({"layer": self.layers, "n": self.n, "target": self.targets,
                             "threshold": self.thresholds, "cosine": self.cosine,
                             "added_variance": self.added_variance, "cosine_floor": self.floors})

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form (lists and floats), e.g. for JSON."""
        return {"layers": list(self.layers), "n": [int(v) for v in self.n],
                "targets": self.targets.tolist(), "thresholds": self.thresholds.tolist(),
                "cosine": self.cosine.tolist(), "added_variance": self.added_variance.tolist(),
                "floors": [None if math.isnan(v) else float(v) for v in self.floors],
                "budget": self.budget, "achieved": self.achieved, "objective": self.objective,
                "uniform_objective": self.uniform_objective, "model": self.model}

    def plot(self, path: str | None = None):
        """Bar chart of per-layer targets and cosines (see :mod:`gradstats.plots.pruning`)."""
        from ..plots.pruning import plot_allocation

        return plot_allocation(self, path)


def _layers(layers: Any, sizes: Any) -> tuple[list[str], list[Any], np.ndarray]:
    import pandas as pd

    if isinstance(layers, pd.DataFrame):
        df = layers
        if "kind" in df.columns:  # a run's statistics: the neural gradients only
            df = df[df["kind"] == "grad"]
        if "layer" in df.columns:
            names, rows = [], []
            for name, grp in df.groupby("layer", sort=False):
                recs = grp.to_dict("records")
                if len(recs) > 1 and "sum_ln_abs" in grp.columns:
                    for r in recs:
                        r.setdefault("hist", np.zeros(HIST_BINS, dtype=np.int64))
                    recs = [merge_stats(recs)]
                rows.append(recs[0])
                names.append(str(name))
        else:
            names = [str(i) for i in df.index]
            rows = df.to_dict("records")
    elif isinstance(layers, Mapping):
        names, rows = [str(k) for k in layers], list(layers.values())
    else:
        raise ValueError("layers must be a DataFrame (one statistics row per layer, or a 'layer' "
                         f"column) or a mapping name -> statistics row / fit result; got "
                         f"{type(layers).__name__}")
    if not rows:
        raise ValueError("allocate needs at least one layer")
    if sizes is not None:
        if isinstance(sizes, Mapping):
            try:
                n = np.array([float(sizes[k]) for k in names])
            except KeyError as e:
                raise ValueError(f"sizes has no entry for layer {e.args[0]!r}") from None
        else:
            n = np.asarray(sizes, dtype=np.float64).reshape(-1)
    else:
        try:
            n = np.array([float(r["n"]) if isinstance(r, Mapping) else float(getattr(r, "n"))
                          for r in rows])
        except (KeyError, AttributeError):
            raise ValueError("element counts are missing: give rows with a field 'n' or pass "
                             "sizes=") from None
    if n.shape != (len(rows),) or not (np.isfinite(n) & (n > 0)).all():
        raise ValueError(f"sizes must be one positive count per layer ({len(rows)}), got {n}")
    return names, rows, n


def allocate(layers: Any, budget: float, *, cosine_floor: Any = None, weights: Any = None,
             sizes: Any = None, model: str = "lognormal") -> Allocation:
    """Per-layer sparsity targets meeting a global ``budget`` (fraction of all elements) at the
    least weighted relative added noise, with optional per-layer cosine-similarity floors.

    ``layers``: a DataFrame of statistics rows (one per layer, or a ``layer`` column whose rows
    are merged, e.g. ``run.stats()``: only rows of kind ``"grad"`` are used), or a mapping
    name -> statistics row / fit result / ``{"mu", "sigma", "p0", "n"}``. ``cosine_floor``: one number, a mapping name -> floor, or an array (NaN: none).
    ``weights``: importance per layer (default: element counts). ``sizes``: element counts
    when the rows lack ``n``. A budget below the zeros already present gives threshold 0
    everywhere (and ``achieved`` above the budget); a budget the floors cannot allow raises
    ``ValueError``.

    Example:
        >>> layers = {"conv1": {"mu": -9.0, "sigma": 2.5, "p0": 0.4, "n": 20000},
        ...           "fc": {"mu": -12.0, "sigma": 1.2, "n": 5000}}
        >>> a = allocate(layers, 0.85)
        >>> round(a.achieved, 9), bool(a.objective < a.uniform_objective)
        (0.85, True)
        >>> b = allocate(layers, 0.85, cosine_floor={"conv1": 0.9})
        >>> bool(b.cosine[0] >= 0.9 - 1e-12)
        True
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    try:
        B = float(budget)
    except (TypeError, ValueError):
        raise ValueError(f"budget must be a number in [0, 1), got {budget!r}") from None
    if not 0.0 <= B < 1.0:
        raise ValueError(f"budget must lie in [0, 1) (a fraction of all elements), got {B}")
    names, rows, n = _layers(layers, sizes)
    params = [_row_params(r) for r in rows]
    keyset = {"mu": "mu", "sigma": "sigma", "p0": "p0"}
    arr = {k: np.array([p.get(v, np.nan if k != "p0" else 0.0) for p in params], dtype=np.float64)
           for k, v in keyset.items()}
    scale_key = "scale_normal" if model == "normal" else "scale_laplace"
    scale = np.array([p.get(scale_key, np.nan) for p in params], dtype=np.float64)
    m, p0, _ = resolve(None, model=model, mu=arr["mu"] if model == "lognormal" else None,
                       sigma=arr["sigma"] if model == "lognormal" else None, p0=arr["p0"],
                       scale=scale if model != "lognormal" else None)
    L = len(names)
    w = n.copy() if weights is None else _per_layer(weights, names, "weights")
    if not (np.isfinite(w) & (w > 0)).all():
        raise ValueError(f"weights must be positive and finite, got {w}")
    floors = np.full(L, np.nan) if cosine_floor is None else _per_layer(cosine_floor, names,
                                                                        "cosine_floor")
    bad = ~np.isnan(floors) & ~((floors > 0) & (floors <= 1))
    if bad.any():
        raise ValueError(f"cosine floors must lie in (0, 1], got {floors[bad]}")
    # largest threshold each floor allows (E T^2 / E g^2 <= 1 / floor^2)
    a_max = np.full(L, np.inf)
    has = ~np.isnan(floors)
    a_max[has & (floors >= 1)] = 0.0
    sel = has & (floors < 1)
    if sel.any():
        sub = _subset(m, sel)
        a_max[sel] = sub.from_x(solve_ratio(sub, 1.0 / floors[sel] ** 2))
    eg2 = (1.0 - p0) * m.m2()
    r = np.sqrt(n * eg2 / w)
    N = n.sum()

    def thresholds(lnc: float) -> np.ndarray:
        return np.minimum(math.exp(lnc) * r if lnc < 700 else np.full(L, np.inf), a_max)

    def total(a: np.ndarray) -> float:
        s = np.where(np.isinf(a), 1.0, 0.0)
        fin = np.isfinite(a)
        if fin.any():
            s[fin] = np.asarray(expected_sparsity(a[fin], model=model, p0=p0[fin],
                                                  **_kw(m, fin)))
        return float((n * s).sum() / N)

    floor_total = float((n * p0).sum() / N)
    if B <= floor_total:
        log.info("budget %.4f is met by the exact zeros alone (%.4f): nothing to prune", B,
                 floor_total)
        a = np.zeros(L)
    else:
        most = total(a_max)
        if most < B - 1e-12:
            raise ValueError(f"budget {B} cannot be met under the cosine floors: they allow at "
                             f"most {most:.6f}")
        lo, hi = 0.0, 0.0
        while total(thresholds(lo)) > B:
            lo -= 4.0
        while total(thresholds(hi)) < B and hi < 700:
            hi += 4.0
        for _ in range(200):
            mid = 0.5 * (lo + hi)
            if total(thresholds(mid)) < B:
                lo = mid
            else:
                hi = mid
            if hi - lo < 1e-15 * max(1.0, abs(mid)):
                break
        a = thresholds(hi)
    kw = _kw(m, np.ones(L, dtype=bool))
    targets = np.asarray(expected_sparsity(a, model=model, p0=p0, **kw), dtype=np.float64)
    cos = np.asarray(predicted_cosine(a, model=model, **kw), dtype=np.float64)
    dvar = np.asarray(added_variance(a, model=model, relative=True, **kw), dtype=np.float64)
    ua = np.asarray(threshold(np.maximum(B, p0), model=model, p0=p0, **kw), dtype=np.float64)
    udvar = np.asarray(added_variance(ua, model=model, relative=True, **kw), dtype=np.float64)
    return Allocation(layers=names, n=n, targets=targets, thresholds=a, cosine=cos,
                      added_variance=dvar, floors=floors, budget=B,
                      achieved=float((n * targets).sum() / N), objective=float((w * dvar).sum()),
                      uniform_objective=float((w * udvar).sum()), model=model, weights=w)


def _kw(m: Any, mask: np.ndarray) -> dict[str, np.ndarray]:
    if hasattr(m, "mu"):
        return {"mu": m.mu[mask], "sigma": m.sigma[mask]}
    return {"scale": m.scale[mask]}


def _per_layer(v: Any, names: list[str], what: str) -> np.ndarray:
    if isinstance(v, Mapping):
        unknown = set(map(str, v)) - set(names)
        if unknown:
            raise ValueError(f"{what} names unknown layers: {sorted(unknown)}")
        return np.array([float(v.get(k, np.nan)) for k in names], dtype=np.float64)
    arr = np.asarray(v, dtype=np.float64)
    if arr.ndim == 0:
        return np.full(len(names), float(arr))
    if arr.shape != (len(names),):
        raise ValueError(f"{what} must be one number, a mapping, or one value per layer "
                         f"({len(names)}); got shape {arr.shape}")
    return arr
