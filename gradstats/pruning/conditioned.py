"""The data-conditioned model of one layer's gradient magnitudes (:class:`ConditionedModel`): what
:func:`gradstats.pruning.allocate` spends a sparsity budget with, read from a statistics row.

The sums ``sum_abs``, ``sum_sq`` give ``E|g|`` and ``E g^2`` exactly, the 64 largest magnitudes
(``top_abs``) are known one by one, and the binade histogram gives the cumulative distribution
exactly at every power of two; above the largest entry every value is pruned, and
``S = 1 - E|g| / a``, ``Var = a E|g| - E g^2`` hold exactly (see :mod:`gradstats.pruning.allocation`).

Example:
    >>> import torch
    >>> from gradstats.stats import tensor_stats
    >>> m = ConditionedModel.from_stats(tensor_stats(torch.tensor([0.0, 1.0, 2.0, 4.0])))
    >>> round(float(m.sparsity(8.0)), 6)      # above the maximum: 1 - E|g| / a, exactly
    0.78125
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from gradstats._roots import bracketed_newton
from gradstats.stats import HIST_BINS, HIST_MIN_EXP


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

        def f(la: float, _: None) -> tuple[float, float]:
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

        def f(la: float, _: None) -> tuple[float, float]:
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


def has_data(row: Any) -> bool:
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
