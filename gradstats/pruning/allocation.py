"""Heterogeneous mode: per-layer sparsity targets under one global, element-weighted budget.

Problem. Layers ``i`` with ``n_i`` elements and a model of their gradient magnitudes. Choose
thresholds ``a_i`` to

    minimise   sum_i w_i * D_i(a_i)          D_i = E[(T(g) - g)^2] / E[g^2] = 1/cos_i^2 - 1
    subject to sum_i n_i S_i(a_i) = budget * sum_i n_i,   cos_i >= floor_i,   S_i <= cap_i,

over the allocated layers (the output layer, and any named in ``exclude``, are left unpruned),
i.e. spend the sparsity where it adds the least relative noise (``w_i`` defaults to ``n_i``:
every element's noise counts the same). Per element, ``dVar/da = E[|g| 1{|g|<a}]`` and
``dS/da = E[|g| 1{|g|<a}] / a^2`` for *any* distribution of ``|g|``, so the marginal cost of
sparsity is ``dD_i/dS_i = a_i^2 / E_i[g^2]``: it grows with ``a_i``, the problem is convex, and
its KKT conditions give ``a_i = min(c * sqrt(n_i E_i[g^2] / w_i), a_max_i)`` with one scalar
``c`` set by the budget and ``a_max_i`` the largest threshold the cosine floor and the cap allow.
With the default weights the thresholds are a common multiple of each layer's RMS gradient.

The model of a layer (:class:`ConditionedModel`, the default for statistics rows) is its own
data: the sums ``sum_abs``, ``sum_sq`` give ``E|g|`` and ``E g^2`` exactly, the 64 largest
magnitudes (``top_abs``) are known one by one, and the binade histogram gives the cumulative
distribution exactly at every power of two. Above the largest entry nothing exists: there
every value is pruned, and ``S = 1 - E|g| / a``, ``Var = a E|g| - E g^2`` hold exactly. A
lognormal fitted to the same layer puts mass above the maximum that the data does not have:
over a calibration run of the CNN the fits of the classifier layers (sigma 4.7 and 5.9 nats)
give an RMS gradient ``e^18`` and ``e^28`` times the data's, which made pruning almost
everything there look free. The parametric families (``threshold_rule="lognormal"``, ``"normal"``,
``"laplace"``) remain for rows given by their parameters and for what-if reasoning.
"""
from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from gradstats._roots import bracketed_newton
from gradstats.families import solve_ratio
from gradstats.layers import output_layer  # noqa: F401 - its home is gradstats.layers; importable here too
from gradstats.pruning.thresholds import (
    MODELS,
    _row_params,
    _subset,
    added_variance,
    expected_sparsity,
    resolve,
    threshold,
)
from gradstats.stats import HIST_BINS, HIST_MIN_EXP, merge_stats

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

#: default largest target any one layer is given (expected sparsity, zeros included)
DEFAULT_CAP = 0.98
#: magnitude models :func:`allocate` accepts: the data-conditioned model and the families
ALLOCATION_MODELS = ("histogram",) + MODELS


# ----------------------------------------------------------------------------- the output layer
# ----------------------------------------------------------------------------- conditioned model
def _moment_antiderivative(c: np.ndarray, t: np.ndarray, k: int) -> np.ndarray:
    """``G`` with ``G' = p'(t) e^(k t)`` for the cubic ``p = c0 t^3 + c1 t^2 + c2 t + c3``:
    ``e^(kt) (q/k - q'/k^2 + q''/k^3)`` with ``q = p'``."""
    c0, c1, c2 = c[0], c[1], c[2]
    q = (3.0 * c0 * t + 2.0 * c1) * t + c2
    q1 = 6.0 * c0 * t + 2.0 * c1
    q2 = 6.0 * c0
    return np.exp(k * t) * (q / k - q1 / k ** 2 + q2 / k ** 3)


class ConditionedModel:
    """The cost of stochastic pruning on one layer, from its statistics row alone, conditioned
    on what the data determines.

    Pieces (fractions and moments are per element over all ``n`` entries, zeros included):

    - exact zeros (``n_zero``) and, one by one, the largest magnitudes (``top_abs``; with ties at
      the smallest of them);
    - the *bulk*, every other non-zero value: its count and its sums ``E[|g|]``, ``E[g^2]`` are
      exact (``sum_abs``, ``sum_sq`` less the top values'), and its cumulative distribution
      ``F`` is exact at every power of two (the binade histogram less the top values), its upper
      edge the smallest top value ``t``, its lower edge ``min_abs``. Between them ``F`` is
      interpolated in ``ln|g|`` by a monotone cubic (PCHIP, as
      :class:`gradstats.pruning.LogHistogram`), mixed with the two step functions that put each
      bin's mass at its upper or its lower edge, with the weights that give the bulk the data's
      ``E|g|`` and ``E g^2`` (where no mixture does, the one weight that gives it ``E|g|``). So
      the operator's sparsity is continuous and increasing in the threshold, and the added
      variance continuous where both sums are met (within about 1% on real gradients elsewhere).

    For a threshold ``a >= t`` everything is exact: ``S(a) = F(a) - E[|g| 1{|g|<a}] / a`` and the
    added variance ``E[(a|g| - g^2) 1{|g|<a}]``; above ``amax`` every value is pruned and these
    are ``1 - E|g| / a`` and ``a E|g| - E g^2``. Below ``t`` the partial moments come from the
    interpolated ``F`` in closed form. Inf and NaN count in ``n`` and are never pruned.

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).exp()
        >>> m = ConditionedModel.from_stats(tensor_stats(x))
        >>> a = 2 * m.amax                # above the maximum: exact on the data (float32 sums)
        >>> g = x.double()
        >>> abs(m.sparsity(a) - float(1 - g.mean() / a)) < 1e-6
        True
        >>> abs(m.added_variance(a) / float(a * g.mean() - (g * g).mean()) - 1) < 1e-6
        True
        >>> abs(m.sparsity(m.threshold(0.8)) - 0.8) < 1e-9
        True
    """

    def __init__(self, *, n: int, n_zero: int, sum_abs: float, sum_sq: float, hist: Any,
                 max_abs: float, top_abs: Any = None, n_nonfinite: int = 0,
                 min_abs: float | None = None) -> None:
        n, z, nf = int(n), int(n_zero), int(n_nonfinite)
        if n <= 0:
            raise ValueError("the statistics row describes an empty tensor (n = 0)")
        h = np.asarray(hist, dtype=np.float64).reshape(-1)
        if h.size != HIST_BINS:
            raise ValueError(f"hist must hold {HIST_BINS} binade counts, got {h.size}")
        self.n, self.n_zero, self.n_nonfinite = n, z, nf
        self.p0 = z / n
        self.mean_abs = max(float(sum_abs), 0.0) / n
        self.mean_sq = max(float(sum_sq), 0.0) / n
        self.f_inf = (n - nf) / n                      # F beyond every finite value
        m = n - z - nf
        amax = float(max_abs) if max_abs is not None else math.nan
        top = np.zeros(0)
        if top_abs is not None and not (isinstance(top_abs, float) and math.isnan(top_abs)):
            top = np.asarray(top_abs, dtype=np.float64).reshape(-1)
            top = np.sort(top[np.isfinite(top) & (top > 0)])[::-1]
        if m <= 0 or not (amax > 0 and math.isfinite(amax)):
            top, m, amax = np.zeros(0), 0, 0.0
        self.amax = amax
        values, counts = top.copy(), np.ones(top.size)
        hb = h.copy()
        if values.size:
            np.subtract.at(hb, _binade(values), 1.0)
        t = float(values[-1]) if values.size else amax
        bulk_abs = max(float(sum_abs) - float(values.sum()), 0.0)
        bulk_sq = max(float(sum_sq) - float((values ** 2).sum()), 0.0)
        hb = np.maximum(hb, 0.0)
        self._bulk = hb.sum() > 0 and m > values.size
        if self._bulk:
            i0, last = int(np.flatnonzero(hb)[0]), int(np.flatnonzero(hb)[-1])
            i1 = int(_binade(np.array([t]))[0])
            if last > i1:              # counts above t (inconsistent statistics): whole binades
                i1, t = last, math.ldexp(1.0, last + 1 + HIST_MIN_EXP)
            lower_t = math.ldexp(1.0, i1 + HIST_MIN_EXP)
            if t <= lower_t:           # t is a power of two: the bulk's values in its binade equal t
                c = hb[i1]
                if c > 0:
                    values, counts = np.append(values, t), np.append(counts, c)
                    bulk_abs, bulk_sq = max(bulk_abs - c * t, 0.0), max(bulk_sq - c * t * t, 0.0)
                    hb[i1] = 0.0
                i1 -= 1
                self._bulk = i1 >= i0 and hb[i0:i1 + 1].sum() > 0
        self._values, self._counts = values, counts
        self._t = t
        self._bulk_mass = 0.0
        self._bulk_m1 = bulk_abs / n if self._bulk else 0.0
        self._bulk_m2 = bulk_sq / n if self._bulk else 0.0
        if self._bulk:
            lo = float(min_abs) if min_abs is not None and math.isfinite(float(min_abs)) else 0.0
            self._setup_bulk(hb[i0:i1 + 1], i0, t, lo)
        self._prepare_scalar()

    def _setup_bulk(self, counts: np.ndarray, i0: int, t: float, lowest: float) -> None:
        from scipy.interpolate import PchipInterpolator

        n = self.n
        e = np.arange(i0, i0 + counts.size + 1) + HIST_MIN_EXP
        x = np.ldexp(1.0, e).astype(np.float64)
        x[-1] = t
        if x[0] < lowest < x[1]:   # the smallest value starts the lowest bin
            x[0] = lowest
        l = np.log(x)
        F = self.p0 + np.concatenate([[0.0], np.cumsum(counts)]) / n
        if l.size >= 3:
            c = PchipInterpolator(l, F).c
        else:
            c = np.array([[0.0], [0.0], [(F[1] - F[0]) / (l[1] - l[0])], [F[0]]])
        w = np.diff(l)
        dF = np.diff(F)
        # partial moments of each bin under the interpolated F: int x^k dF over the bin
        ek = [np.exp(k * l[:-1]) for k in (1, 2)]
        pm = [ek[k - 1] * (_moment_antiderivative(c, w, k) - _moment_antiderivative(c, np.zeros_like(w), k))
              for k in (1, 2)]
        # two step functions: each bin's mass at its upper edge (u) or at its lower edge (d). The
        # mixture (1 - lu - ld) F + lu F_u + ld F_d that gives the bulk the data's E|g| and E g^2;
        # where none does, the one of them that gives it the data's E|g| (the sparsity stays
        # continuous at t, the added variance within a few percent)
        P = np.array([pm[0].sum(), pm[1].sum()])
        T = np.array([self._bulk_m1, self._bulk_m2])
        Cu = np.array([(dF * x[1:]).sum(), (dF * x[1:] ** 2).sum()]) - P
        Cd = np.array([(dF * x[:-1]).sum(), (dF * x[:-1] ** 2).sum()]) - P
        lu = ld = 0.0
        det = Cu[0] * Cd[1] - Cd[0] * Cu[1]
        sol = np.linalg.solve(np.column_stack([Cu, Cd]), T - P) if det != 0 and np.isfinite(det) else None
        if sol is not None and sol.min() >= 0 and sol.sum() <= 1:
            lu, ld = float(sol[0]), float(sol[1])
        elif T[0] > P[0] and Cu[0] > 0:
            lu = min(float((T[0] - P[0]) / Cu[0]), 1.0)
        elif T[0] < P[0] and Cd[0] < 0:
            ld = min(float((T[0] - P[0]) / Cd[0]), 1.0)
        self._x, self._l, self._F, self._c, self._lu, self._ld = x, l, F, c, lu, ld
        wp = 1.0 - lu - ld
        cm1 = wp * pm[0] + lu * dF * x[1:] + ld * dF * x[:-1]
        cm2 = wp * pm[1] + lu * dF * x[1:] ** 2 + ld * dF * x[:-1] ** 2
        self._cum_m1 = np.concatenate([[0.0], np.cumsum(cm1)])
        self._cum_m2 = np.concatenate([[0.0], np.cumsum(cm2)])
        self._bulk_mass = float(F[-1] - F[0])

    @classmethod
    def from_stats(cls, row: Any) -> "ConditionedModel":
        """From a statistics row of :mod:`gradstats.stats` (a dict or a pandas Series: ``n``,
        ``n_zero``, ``sum_abs``, ``sum_sq``, ``max_abs``, ``hist`` and, where recorded,
        ``top_abs`` and ``n_nonfinite``)."""
        try:
            return cls(n=row["n"], n_zero=row["n_zero"], sum_abs=row["sum_abs"], sum_sq=row["sum_sq"],
                       hist=row["hist"], max_abs=row["max_abs"],
                       top_abs=row["top_abs"] if "top_abs" in row else None,
                       n_nonfinite=row["n_nonfinite"] if "n_nonfinite" in row else 0,
                       min_abs=row["min_abs"] if "min_abs" in row else None)
        except KeyError as e:
            raise ValueError(f"the conditioned model needs a statistics row with {e.args[0]!r} "
                             "(fields n, n_zero, sum_abs, sum_sq, max_abs, hist)") from None

    # -- the partial moments
    def _prepare_scalar(self) -> None:
        """Python-float tables for one threshold at a time (what the allocation's solvers ask)."""
        order = np.argsort(self._values, kind="stable")
        v, c = self._values[order], self._counts[order]
        self._asc = v.tolist()
        self._cum_cnt = np.concatenate([[0.0], np.cumsum(c)]).tolist()
        self._cum_v1 = np.concatenate([[0.0], np.cumsum(c * v)]).tolist()
        self._cum_v2 = np.concatenate([[0.0], np.cumsum(c * v * v)]).tolist()
        if self._bulk:
            self._l_list = self._l.tolist()
            self._coef = self._c.T.tolist()
            self._x_list = self._x.tolist()
            self._F_list = self._F.tolist()
            self._cm1_list = self._cum_m1.tolist()
            self._cm2_list = self._cum_m2.tolist()

    def _parts1(self, a: float) -> tuple[float, float, float]:
        """:meth:`_parts` for one threshold, in Python floats."""
        if not a > 0:
            return self.p0, 0.0, 0.0
        if not self._bulk or a > self._t:
            j = bisect.bisect_left(self._asc, a)
            n = self.n
            return (self.p0 + self._bulk_mass + self._cum_cnt[j] / n, self._bulk_m1 + self._cum_v1[j] / n,
                    self._bulk_m2 + self._cum_v2[j] / n)
        x = self._x_list
        if a <= x[0]:
            return self.p0, 0.0, 0.0
        la = math.log(a)
        ls = self._l_list
        k = min(max(bisect.bisect_right(ls, la) - 1, 0), len(ls) - 2)
        T = la - ls[k]
        c0, c1, c2, c3 = self._coef[k]
        pF = ((c0 * T + c1) * T + c2) * T + c3
        q = (3.0 * c0 * T + 2.0 * c1) * T + c2
        q1 = 6.0 * c0 * T + 2.0 * c1
        q2 = 6.0 * c0
        eT = math.exp(T)
        xk = x[k]
        pm1 = xk * (eT * (q - q1 + q2) - (c2 - 2.0 * c1 + 6.0 * c0))
        pm2 = xk * xk * (eT * eT * (q / 2 - q1 / 4 + q2 / 8) - (c2 / 2 - c1 / 2 + 0.75 * c0))
        lu, ld = self._lu, self._ld
        wp = 1.0 - lu - ld
        Fk, Fk1 = self._F_list[k], self._F_list[k + 1]
        dF = Fk1 - Fk      # the bin's mass: at its upper edge above a (lu), at its lower edge below (ld)
        Fa = wp * pF + lu * Fk + ld * Fk1
        m1 = self._cm1_list[k] + wp * pm1 + ld * dF * xk
        m2 = self._cm2_list[k] + wp * pm2 + ld * dF * xk * xk
        return Fa, m1, m2

    def _parts(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``F(a-)``, ``E[|g| 1{|g|<a}]``, ``E[g^2 1{|g|<a}]`` per element (arrays like ``a``)."""
        a = np.asarray(a, dtype=np.float64)
        Fa = np.full(a.shape, self.p0)
        m1 = np.zeros(a.shape)
        m2 = np.zeros(a.shape)
        t = self._t
        hi = a > t if self._bulk else a > 0
        if hi.any():       # every bulk value lies below a: exact
            ah = a[hi]
            below = self._values[None, :] < ah[:, None]
            cnt = below @ self._counts
            Fa[hi] = self.p0 + (self._bulk_mass if self._bulk else 0.0) + cnt / self.n
            m1[hi] = self._bulk_m1 + below @ (self._counts * self._values) / self.n
            m2[hi] = self._bulk_m2 + below @ (self._counts * self._values ** 2) / self.n
        if self._bulk:
            mid = (a > self._x[0]) & ~hi
            if mid.any():
                la = np.log(a[mid])
                k = np.clip(np.searchsorted(self._l, la, side="right") - 1, 0, self._l.size - 2)
                T = la - self._l[k]
                c = self._c[:, k]
                x0 = self._x[k]
                pF = ((c[0] * T + c[1]) * T + c[2]) * T + c[3]
                pm1 = x0 * (_moment_antiderivative(c, T, 1) - _moment_antiderivative(c, np.zeros_like(T), 1))
                pm2 = x0 * x0 * (_moment_antiderivative(c, T, 2) - _moment_antiderivative(c, np.zeros_like(T), 2))
                lu, ld = self._lu, self._ld
                wp = 1.0 - lu - ld
                Fk, Fk1 = self._F[k], self._F[k + 1]
                dF = Fk1 - Fk
                Fa[mid] = wp * pF + lu * Fk + ld * Fk1
                m1[mid] = self._cum_m1[k] + wp * pm1 + ld * dF * x0
                m2[mid] = self._cum_m2[k] + wp * pm2 + ld * dF * x0 * x0
        return Fa, m1, m2

    def _sparsity1(self, a: float) -> float:
        if not a > 0:
            return self.p0
        if math.isinf(a):
            return self.f_inf
        Fa, m1, _ = self._parts1(a)
        return min(max(Fa - m1 / a, self.p0), self.f_inf)

    def _variance1(self, a: float) -> float:
        if not a > 0:
            return 0.0
        if math.isinf(a):
            return math.inf if self.mean_abs > 0 else 0.0
        _, m1, m2 = self._parts1(a)
        return max(a * m1 - m2, 0.0)

    def sparsity(self, a: Any) -> Any:
        """Expected fraction of zeros after stochastic pruning at threshold(s) ``a`` (zeros included)."""
        if np.ndim(a) == 0:
            return self._sparsity1(float(a))
        arr = np.asarray(a, dtype=np.float64)
        Fa, m1, _ = self._parts(arr)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = np.where(arr > 0, Fa - np.where(np.isinf(arr), 0.0, m1 / arr), self.p0)
        return np.clip(s, self.p0, self.f_inf)

    def added_variance(self, a: Any, *, relative: bool = False) -> Any:
        """Expected added variance per element, ``E[(a|g| - g^2) 1{|g|<a}]`` (``relative``: over
        ``E g^2``, i.e. ``1/cosine^2 - 1``)."""
        scale = (1.0 / self.mean_sq if self.mean_sq > 0 else 0.0) if relative else 1.0
        if np.ndim(a) == 0:
            return self._variance1(float(a)) * scale
        arr = np.asarray(a, dtype=np.float64)
        _, m1, m2 = self._parts(arr)
        with np.errstate(invalid="ignore"):
            v = np.where(np.isinf(arr), np.inf if self.mean_abs > 0 else 0.0, np.maximum(arr * m1 - m2, 0.0))
        return np.where(arr > 0, v, 0.0) * scale

    def cosine(self, a: Any) -> Any:
        """Expected cosine similarity between ``g`` and its pruning at ``a``: ``1/sqrt(1 + relative variance)``."""
        d = self.added_variance(a, relative=True)
        return 1.0 / math.sqrt(1.0 + d) if np.ndim(d) == 0 else 1.0 / np.sqrt(1.0 + d)

    def threshold(self, target: float) -> float:
        """The threshold whose expected sparsity is ``target`` (0 when the zeros meet it; above
        ``amax`` exactly ``E|g| / (f - target)``, ``f`` the finite fraction). Safeguarded Newton
        in ``ln a`` (``dS/d ln a = E[|g| 1{|g|<a}] / a``) to ``|S - target| <= 1e-13``."""
        s = float(target)
        if s <= self.p0 or self.mean_abs == 0:
            return 0.0
        if s >= self.f_inf:
            return math.inf
        if self.amax > 0 and s >= self._sparsity1(self.amax):
            return self.mean_abs / (self.f_inf - s)

        def f(la: float) -> tuple[float, float]:
            a = math.exp(la)
            Fa, m1, _ = self._parts1(a)
            return Fa - m1 / a - s, m1 / a

        return self._solve(f)

    def threshold_for_variance(self, relative: float) -> float:
        """The threshold whose relative added variance is ``relative`` (``1/floor^2 - 1``)."""
        d = float(relative)
        if d <= 0 or self.mean_abs == 0:
            return 0.0
        if self.amax > 0 and d >= self.added_variance(self.amax, relative=True):
            return (d * self.mean_sq + self.mean_sq) / self.mean_abs

        def f(la: float) -> tuple[float, float]:
            a = math.exp(la)
            _, m1, m2 = self._parts1(a)
            return (a * m1 - m2) / self.mean_sq - d, a * m1 / self.mean_sq

        return self._solve(f)

    def _solve(self, f: Any) -> float:
        """Root in ``ln a`` of ``f`` (``(value, derivative)``, increasing) between the smallest
        non-zero value and ``amax``: Newton steps that leave the bracket become bisections."""
        lo = math.log(self._x[0]) if self._bulk else math.log(max(self._t, 1e-300)) - 1.0
        hi = math.log(self.amax)
        return math.exp(bracketed_newton(f, lo, hi, 0.5 * (lo + hi), best=True))


def _binade(v: np.ndarray) -> np.ndarray:
    """Histogram bin of each positive value: ``floor(log2 v) - HIST_MIN_EXP``, exactly."""
    _, e = np.frexp(v)
    return e.astype(np.int64) - 1 - HIST_MIN_EXP


def _has_data(row: Any) -> bool:
    """Whether ``row`` is a statistics row that carries what :class:`ConditionedModel` needs."""
    if not (isinstance(row, Mapping) or (hasattr(row, "index") and hasattr(row, "get"))):
        return False
    if not {"n", "n_zero", "sum_abs", "sum_sq", "max_abs", "hist"} <= set(row.keys()):
        return False
    h = row["hist"]
    if h is None or np.ndim(h) != 1 or len(h) != HIST_BINS:
        return False
    nonfinite = int(row["n_nonfinite"]) if "n_nonfinite" in row else 0
    # the binade counts must cover every non-zero finite value (rows merged with rows that had
    # no histogram do not)
    return int(np.asarray(h, dtype=np.int64).sum()) == int(row["n"]) - int(row["n_zero"]) - nonfinite


# ----------------------------------------------------------------------------- result
@dataclass(frozen=True)
class Allocation:
    """Result of :func:`allocate`: per-layer targets, thresholds and their predicted cost.

    Attributes: ``layers`` (names), ``n`` (element counts), ``targets`` (expected sparsity of
    each layer, zeros included; an excluded layer's is its zeros alone), ``thresholds`` (0
    where nothing is pruned), ``cosine`` (predicted cosine similarity), ``added_variance``
    (relative, ``1/cos^2 - 1``), ``floors`` (NaN where none), ``caps`` (largest target allowed
    per layer), ``excluded`` (layers left unpruned: the output layer and ``exclude``),
    ``output_layer`` (its name, or None), ``budget``, ``achieved`` (element-weighted mean of the
    allocated layers' targets), ``objective`` (``sum w_i D_i``), ``uniform_objective`` (the same
    with every allocated layer at the budget, ignoring floors and caps), ``model`` (the
    magnitude model: ``"histogram"`` for the data-conditioned model, a family name, or
    ``"mixed"``), ``weights``.
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
    caps: np.ndarray = field(default_factory=lambda: np.zeros(0))
    excluded: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    output_layer: str | None = None

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per layer.

        Example:
            >>> a = allocate({"l1": {"mu": -9.0, "sigma": 2.0, "n": 1000},
            ...               "l2": {"mu": -12.0, "sigma": 1.0, "n": 3000}}, 0.8)
            >>> list(a.to_dataframe().columns)[:3]
            ['layer', 'n', 'target']
        """
        import pandas as pd

        L = len(self.layers)
        return pd.DataFrame({"layer": self.layers, "n": self.n, "target": self.targets,
                             "threshold": self.thresholds, "cosine": self.cosine,
                             "added_variance": self.added_variance, "cosine_floor": self.floors,
                             "cap": self.caps if len(self.caps) == L else np.full(L, np.nan),
                             "excluded": self.excluded if len(self.excluded) == L else np.zeros(L, bool)})

    def to_dict(self) -> dict[str, Any]:
        """Plain-Python form (lists and floats), e.g. for JSON."""
        return {"layers": list(self.layers), "n": [int(v) for v in self.n],
                "targets": self.targets.tolist(), "thresholds": self.thresholds.tolist(),
                "cosine": self.cosine.tolist(), "added_variance": self.added_variance.tolist(),
                "floors": [None if math.isnan(v) else float(v) for v in self.floors],
                "caps": [float(v) for v in self.caps], "excluded": [bool(v) for v in self.excluded],
                "output_layer": self.output_layer,
                "budget": self.budget, "achieved": self.achieved, "objective": self.objective,
                "uniform_objective": self.uniform_objective, "model": self.model}

    def layer_targets(self) -> dict[str, float | None]:
        """``{layer: target sparsity}`` of the allocation, None for a layer it leaves unpruned; a plan
        takes them with :meth:`gradstats.Plan.with_allocation`.

        Example:
            >>> a = allocate({"fc1": {"mu": -9.0, "sigma": 2.0, "n": 1000},
            ...               "fc2": {"mu": -12.0, "sigma": 1.0, "n": 30}}, 0.8,
            ...              layer_info={"fc1": "Linear", "fc2": "Linear"})
            >>> a.layer_targets()["fc2"] is None
            True
        """
        ex = self.excluded if len(self.excluded) == len(self.layers) else np.zeros(len(self.layers), bool)
        return {name: None if x else float(t) for name, t, x in zip(self.layers, self.targets, ex)}

    def plot(self, path: str | None = None) -> Any:
        """Bar chart of per-layer targets and cosines (see :mod:`gradstats.plots.pruning`)."""
        from gradstats.plots.pruning import plot_allocation

        return plot_allocation(self, path)


# ----------------------------------------------------------------------------- inputs
def _layers(layers: Any, sizes: Any) -> tuple[list[str], list[Any], np.ndarray, Any]:
    """Names, rows, element counts, and the run (or None) the rows came from."""
    import pandas as pd

    from gradstats.run import Run

    run = None
    if isinstance(layers, Run):
        run = layers
        st = run.stats(kinds=["grad"])
        order = [str(v) for v in run.layer_info().get("name", pd.Series(dtype=str))]
        rank = {k: i for i, k in enumerate(order)}
        if len(st):
            st = st.assign(_order=st["layer"].map(lambda v: rank.get(str(v), len(rank))))
            st = st.sort_values(["_order", "step"], kind="stable").drop(columns="_order")
        layers = st
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
                        if not isinstance(r.get("hist"), (np.ndarray, list)):
                            r["hist"] = np.zeros(HIST_BINS, dtype=np.int64)
                    recs = [merge_stats(recs)]
                rows.append(recs[0])
                names.append(str(name))
        else:
            names = [str(i) for i in df.index]
            rows = df.to_dict("records")
    elif isinstance(layers, Mapping):
        names, rows = [str(k) for k in layers], list(layers.values())
    else:
        raise ValueError("layers must be a Run, a DataFrame (one statistics row per layer, or a "
                         "'layer' column) or a mapping name -> statistics row / fit result; got "
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
    return names, rows, n, run


def _excluded(names: list[str], output: Any, exclude: Any, layer_info: Any, run: Any,
              warn: bool) -> tuple[np.ndarray, str | None]:
    if isinstance(exclude, str):
        exclude = [exclude]
    exclude = [str(e) for e in (exclude or ())]
    out_name = None
    if isinstance(output, str) and output == "auto":
        source = layer_info if layer_info is not None else run
        if source is not None:     # the model's output layer, if it is among the layers given
            out_name = output_layer(source)
            if out_name not in names:
                out_name = None
        elif warn:
            log.warning("allocate: no layer types (pass the run itself, layer_info=, or output_layer=), "
                        "so the output layer is not identified and not excluded")
    elif output is not None:
        out_name = str(output)
        if out_name not in names:
            raise ValueError(f"output_layer {out_name!r} is not one of the layers {names}")
    unknown = sorted(set(exclude) - set(names))
    if unknown:
        raise ValueError(f"exclude names unknown layers: {unknown}")
    ex = np.array([k == out_name or k in exclude for k in names], dtype=bool)
    return ex, out_name


# ----------------------------------------------------------------------------- the solver
class _Costs:
    """Per-layer sparsity and relative added variance at given thresholds (one per layer),
    from the conditioned model or a parametric family."""

    def __init__(self, rows: list[Any], model: str | None) -> None:
        L = len(rows)
        if model is None:
            kinds = ["histogram" if _has_data(r) else "lognormal" for r in rows]
        elif model == "histogram":
            bad = [i for i, r in enumerate(rows) if not _has_data(r)]
            if bad:
                raise ValueError("threshold_rule='histogram' needs statistics rows with n, n_zero, sum_abs, "
                                 f"sum_sq, max_abs and hist; row(s) {bad} lack them")
            kinds = ["histogram"] * L
        elif model in MODELS:
            kinds = [model] * L
        else:
            raise ValueError(f"model must be None or one of {ALLOCATION_MODELS}, got {model!r}")
        self.kinds = kinds
        self.name = kinds[0] if len(set(kinds)) == 1 else "mixed"
        self.data = np.array([k == "histogram" for k in kinds])
        self.cond = [ConditionedModel.from_stats(r) if d else None for r, d in zip(rows, self.data)]
        self.p0 = np.zeros(L)
        self.m2 = np.zeros(L)
        self.fam = None
        par = ~self.data
        if par.any():
            fam = kinds[int(np.flatnonzero(par)[0])]
            params = [_row_params(rows[i]) for i in np.flatnonzero(par)]
            get = lambda k, d: np.array([p.get(k, d) for p in params], dtype=np.float64)  # noqa: E731
            scale_key = "scale_normal" if fam == "normal" else "scale_laplace"
            m, p0, _ = resolve(None, model=fam, mu=get("mu", np.nan) if fam == "lognormal" else None,
                               sigma=get("sigma", np.nan) if fam == "lognormal" else None,
                               p0=get("p0", 0.0), scale=get(scale_key, np.nan) if fam != "lognormal" else None)
            self.fam, self.m, self.par = fam, m, par
            self.p0[par] = p0
            self.m2[par] = (1.0 - p0) * m.m2()
        for i, c in enumerate(self.cond):
            if c is not None:
                self.p0[i], self.m2[i] = c.p0, c.mean_sq

    def _kw(self, mask: np.ndarray, key: str = "threshold_rule") -> dict[str, Any]:
        """The family's parameters of the layers in ``mask``, and the family under ``key``
        (``"threshold_rule"`` for threshold and expected_sparsity, ``"family"`` for added_variance)."""
        sub = mask[self.par]
        if hasattr(self.m, "mu"):
            return {"mu": self.m.mu[sub], "sigma": self.m.sigma[sub], key: self.fam}
        return {"scale": self.m.scale[sub], key: self.fam}

    def sparsity(self, a: np.ndarray) -> np.ndarray:
        s = np.empty(a.size)
        for i, c in enumerate(self.cond):
            if c is not None:
                s[i] = c.sparsity(a[i])
        if self.fam is not None:
            p = self.par
            ap = a[p]
            sp = np.where(np.isinf(ap), 1.0, 0.0)
            fin = np.isfinite(ap)
            if fin.any():
                mask = p.copy()
                mask[p] = fin
                sp[fin] = np.asarray(expected_sparsity(ap[fin], p0=self.p0[mask], **self._kw(mask)))
            s[p] = sp
        return s

    def relative_variance(self, a: np.ndarray) -> np.ndarray:
        d = np.empty(a.size)
        for i, c in enumerate(self.cond):
            if c is not None:
                d[i] = c.added_variance(a[i], relative=True)
        if self.fam is not None:
            p = self.par
            d[p] = np.asarray(added_variance(a[p], relative=True, **self._kw(p, "family")), dtype=np.float64)
        return d

    def cosine(self, a: np.ndarray) -> np.ndarray:
        return 1.0 / np.sqrt(1.0 + self.relative_variance(a))

    def threshold(self, s: np.ndarray) -> np.ndarray:
        """Thresholds for targets ``s`` (one per layer)."""
        out = np.empty(s.size)
        for i, c in enumerate(self.cond):
            if c is not None:
                out[i] = c.threshold(s[i])
        if self.fam is not None:
            p = self.par
            out[p] = np.asarray(threshold(s[p], p0=self.p0[p], **self._kw(p)), dtype=np.float64)
        return out

    def threshold_for_floor(self, floors: np.ndarray, sel: np.ndarray) -> np.ndarray:
        """Largest thresholds whose cosine is at least ``floors`` on the layers ``sel``."""
        out = np.full(floors.size, np.inf)
        for i in np.flatnonzero(sel):
            c = self.cond[i]
            if c is not None:
                out[i] = c.threshold_for_variance(1.0 / floors[i] ** 2 - 1.0)
        if self.fam is not None:
            ps = sel & self.par
            if ps.any():
                sub = _subset(self.m, ps[self.par])
                out[ps] = sub.from_x(solve_ratio(sub, 1.0 / floors[ps] ** 2))
        return out


def allocate(layers: Any, budget: float, *, cosine_floor: Any = None, weights: Any = None,
             sizes: Any = None, threshold_rule: str | None = None, cap: Any = DEFAULT_CAP,
             output_layer: str | None = "auto", exclude: Any = (), layer_info: Any = None) -> Allocation:
    """Per-layer sparsity targets meeting a global ``budget`` (element-weighted mean target of
    the allocated layers) at the least weighted relative added noise, with a per-layer cap,
    optional per-layer cosine-similarity floors, and the output layer left unpruned.

    ``layers``: a :class:`gradstats.run.Run` (its neural-gradient statistics, every step merged
    per layer, in model order; its layer types identify the output layer), a DataFrame of
    statistics rows (one per layer, or a ``layer`` column whose rows are merged, e.g.
    ``run.stats()``: only rows of kind ``"grad"`` are used), or a mapping name -> statistics
    row / fit result / ``{"mu", "sigma", "p0", "n"}``.

    ``threshold_rule``: ``None`` (default) models each layer from its own data where the row carries the
    statistics (:class:`ConditionedModel`, reported as ``"histogram"``: exact sums, exact top
    magnitudes, binade histogram; exact above the maximum) and by the lognormal closed forms
    where it carries parameters only; ``"histogram"`` insists on the data; ``"lognormal"``,
    ``"normal"``, ``"laplace"`` use the family's closed forms from the fitted parameters
    (what-if reasoning: a family's tail beyond the data's maximum can make heavy pruning look
    free).

    ``cap``: the largest target any layer is given (expected sparsity, zeros included; default
    :data:`DEFAULT_CAP` = 0.98), one number, a mapping name -> cap or one value per layer;
    ``None`` for no cap. A layer whose zeros already exceed its cap is left as it is.
    ``cosine_floor``: one number, a mapping name -> floor, or an array (NaN: none).
    ``output_layer``: ``"auto"`` (default) excludes the layer :func:`output_layer` finds from
    ``layer_info`` (a Run, its ``layer_info()``, an ``nn.Module`` or a mapping name -> type) or
    from ``layers`` when it is a Run (without either, nothing is excluded and a warning is
    logged); a layer name excludes that layer; ``None`` excludes none. ``exclude``: further
    layer names to leave unpruned. Excluded layers stay in the result with threshold 0 and
    their zeros as target, and do not count towards the budget.

    ``weights``: importance per layer (default: element counts). ``sizes``: element counts
    when the rows lack ``n``. A budget below the zeros already present gives threshold 0
    everywhere (and ``achieved`` above the budget); a budget the caps and floors cannot allow
    raises ``ValueError`` naming the most they allow.

    Example:
        >>> layers = {"conv1": {"mu": -9.0, "sigma": 2.5, "p0": 0.4, "n": 20000},
        ...           "fc": {"mu": -12.0, "sigma": 1.2, "n": 5000}}
        >>> a = allocate(layers, 0.85)
        >>> round(a.achieved, 9), bool(a.objective < a.uniform_objective)
        (0.85, True)
        >>> bool(a.targets.max() <= 0.98)
        True
        >>> b = allocate(layers, 0.85, cosine_floor={"conv1": 0.9})
        >>> bool(b.cosine[0] >= 0.9 - 1e-12)
        True
        >>> c = allocate(layers, 0.5, layer_info={"conv1": "Conv2d", "fc": "Linear"})
        >>> c.output_layer, c.excluded.tolist(), float(c.thresholds[1])
        ('fc', [False, True], 0.0)
    """
    try:
        B = float(budget)
    except (TypeError, ValueError):
        raise ValueError(f"budget must be a number in [0, 1), got {budget!r}") from None
    if not 0.0 <= B < 1.0:
        raise ValueError(f"budget must lie in [0, 1) (a fraction of all elements), got {B}")
    model = threshold_rule
    if model is not None and model not in ALLOCATION_MODELS:
        raise ValueError(f"threshold_rule must be None or one of {ALLOCATION_MODELS}, got {model!r}")
    names, rows, n, run = _layers(layers, sizes)
    L = len(names)
    costs = _Costs(rows, model)
    # without layer types the output layer is unknown: worth a warning for a run's statistics
    excluded, out_name = _excluded(names, output_layer, exclude, layer_info, run, warn=bool(costs.data.any()))
    p0 = costs.p0
    w = n.copy() if weights is None else _per_layer(weights, names, "weights")
    if not (np.isfinite(w) & (w > 0)).all():
        raise ValueError(f"weights must be positive and finite, got {w}")
    floors = np.full(L, np.nan) if cosine_floor is None else _per_layer(cosine_floor, names,
                                                                        "cosine_floor")
    bad = ~np.isnan(floors) & ~((floors > 0) & (floors <= 1))
    if bad.any():
        raise ValueError(f"cosine floors must lie in (0, 1], got {floors[bad]}")
    caps = np.ones(L) if cap is None else _per_layer(cap, names, "cap")
    caps = np.where(np.isnan(caps), 1.0, caps)
    if not ((caps > 0) & (caps <= 1)).all():
        raise ValueError(f"caps must lie in (0, 1] (largest target per layer), got {caps}")
    # largest threshold each layer may take: floor (E T^2 / E g^2 <= 1 / floor^2), cap, exclusion
    a_max = np.full(L, np.inf)
    has = ~np.isnan(floors)
    a_max[has & (floors >= 1)] = 0.0
    sel = has & (floors < 1)
    if sel.any():
        a_max = np.minimum(a_max, costs.threshold_for_floor(floors, sel))
    capped = caps < 1
    if capped.any():
        ca = np.full(L, np.inf)
        ca[capped] = costs.threshold(np.where(capped, np.maximum(caps, 0.0), 0.0))[capped]
        ca[capped & (caps <= p0)] = 0.0
        a_max = np.minimum(a_max, ca)
    a_max[excluded] = 0.0
    alloc = ~excluded
    if not alloc.any():
        raise ValueError("every layer is excluded: nothing to allocate")
    r = np.sqrt(n * costs.m2 / w)
    Na = n[alloc].sum()

    def thresholds(lnc: float) -> np.ndarray:
        return np.minimum(math.exp(lnc) * r if lnc < 700 else np.where(r > 0, np.inf, 0.0), a_max)

    def total(a: np.ndarray) -> float:
        return float((n * costs.sparsity(a))[alloc].sum() / Na)

    floor_total = float((n * p0)[alloc].sum() / Na)
    if B <= floor_total:
        log.info("budget %.4f is met by the exact zeros alone (%.4f): nothing to prune", B,
                 floor_total)
        a = np.zeros(L)
    else:
        most = total(a_max)
        if most < B - 1e-12:
            what = " and ".join(k for k, v in (("caps", capped.any()), ("cosine floors", sel.any()),
                                               ("exclusions", excluded.any())) if v) or "layers' data"
            raise ValueError(f"budget {B} cannot be met under the {what}: they allow at most {most:.6f}")
        lo, hi = 0.0, 0.0
        while total(thresholds(lo)) > B and lo > -700:
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
    targets = np.minimum(costs.sparsity(a), np.maximum(caps, p0))   # a cap's threshold, to rounding
    dvar = costs.relative_variance(a)
    cos = 1.0 / np.sqrt(1.0 + dvar)
    ua = np.where(alloc, costs.threshold(np.where(alloc, np.maximum(B, p0), 0.0)), 0.0)
    udvar = costs.relative_variance(ua)
    return Allocation(layers=names, n=n, targets=targets, thresholds=a, cosine=cos,
                      added_variance=dvar, floors=floors, budget=B,
                      achieved=float((n * targets)[alloc].sum() / Na),
                      objective=float((w * dvar)[alloc].sum()),
                      uniform_objective=float((w * udvar)[alloc].sum()), model=costs.name,
                      weights=w, caps=caps, excluded=excluded, output_layer=out_name)


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
