"""Scalar fast paths of :func:`gradstats.apply`'s refresh: one layer's threshold, predicted
sparsity, scale and predicted format effects, in Python floats.

The vectorised solvers of :mod:`gradstats.pruning` and :mod:`gradstats.fpanalysis` are the
reference; for one layer their cost is array bookkeeping (validation, broadcasting, error-state
contexts, scipy calls on size-1 arrays), not arithmetic. The functions here repeat the same
algorithms -- the same brackets, iterations, stopping rules and tie rules -- on Python floats
(``math``), and agree with the reference to rounding (``tests/test_scalar.py`` checks about
1e-12 relative over a grid of ``mu``, ``sigma``, ``p0`` and targets for every threshold rule):

- :func:`threshold` and :func:`expected_sparsity`: the ``"lognormal"``, ``"naive_lognormal"``,
  ``"normal"`` and ``"laplace"`` rules of :func:`gradstats.pruning.threshold` (with the
  conditioning on ``amax`` and ``mean_abs``) and :func:`gradstats.pruning.expected_sparsity`,
  step for step;
- :class:`Histogram`: the model-free ``"histogram"`` rule of
  :class:`gradstats.pruning.histogram.LogHistogram` (the same monotone cubic through the bin
  edges, built without scipy, the same atoms and bracket; a safeguarded Newton iteration where
  the reference bisects, to the same float resolution of ``ln a``);
- :func:`optimal_log2_scale` and :func:`lognormal_scale`: the power-of-two search of
  :func:`gradstats.fpanalysis.optimal_scale` and :meth:`gradstats.plan.Rule.scale_for`. Its
  objective sums lognormal partial moments over the format's cells (33 for e3m2fn, 128 for
  e4m3fn) at five scales at once: one array expression per step of the search, the reference's
  terms in its order (bit for bit) without its validation and broadcasting, which is faster
  than a Python loop over the cells;
- :func:`predict`: the fractions of the entries a format flushes to zero and saturates, and the
  relative error of the layer's output, after pruning at a threshold, conditioned on the
  tensor's largest magnitude (what apply records as predicted beside the achieved counts).

Inputs outside a function's domain raise :class:`Outside` (a ``ValueError``); callers then use
the reference, which raises its documented errors.
"""
from __future__ import annotations

import bisect
import functools
import math
from statistics import NormalDist
from typing import Optional, Sequence

import numpy as np
from scipy.special import ndtr as _np_ndtr

from gradstats._roots import bracketed_newton
from gradstats.formats import FPFormat

_SQRT1_2 = math.sqrt(0.5)
_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_LN_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_LN2 = math.log(2.0)
_EXP_MAX = 709.78
_inv_cdf = NormalDist().inv_cdf


class Outside(ValueError):
    """Raised for inputs outside a fast path's domain (the caller then uses the reference)."""


# ----------------------------------------------------------------------------- the normal law
def _exp(x: float) -> float:
    """``exp`` that overflows to inf instead of raising (numpy's behaviour)."""
    return math.exp(x) if x < _EXP_MAX else math.inf


def ndtr(x: float) -> float:
    """The standard normal CDF (as scipy's ``ndtr``: ``erf`` near 0, ``erfc`` in the tails)."""
    z = abs(x) * _SQRT1_2
    if z < _SQRT1_2:
        return 0.5 + 0.5 * math.erf(x * _SQRT1_2)
    y = 0.5 * math.erfc(z)
    return 1.0 - y if x > 0 else y


def log_ndtr(x: float) -> float:
    """``ln Phi(x)``, accurate in both tails (the asymptotic series far below the mean)."""
    if x >= -1.0:
        return math.log1p(-0.5 * math.erfc(x * _SQRT1_2))
    if x > -37.0:
        return math.log(0.5 * math.erfc(-x * _SQRT1_2))
    r = 1.0 / (x * x)
    # 1 - 1/x^2 + 3/x^4 - 15/x^6 + ...: at |x| >= 37 the terms fall below 1e-17 by the eighth
    series, term = 1.0, 1.0
    for k in range(1, 10):
        term *= -(2 * k - 1) * r
        series += term
    return -0.5 * x * x - math.log(-x) - _LN_SQRT_2PI + math.log(series)


def ndtri(q: float) -> float:
    """The standard normal quantile, ``Phi^-1(q)`` for ``0 < q < 1`` (-inf at 0, inf at 1)."""
    if q <= 0.0:
        return -math.inf if q == 0.0 else math.nan
    if q >= 1.0:
        return math.inf if q == 1.0 else math.nan
    return _inv_cdf(q)


def erfinv(q: float) -> float:
    """The inverse error function on ``[0, 1]``: the normal quantile, refined by Newton steps on
    ``erf`` (or ``erfc`` above 1/2, where ``1 - q`` is exact)."""
    if q <= 0.0:
        return 0.0 if q == 0.0 else -erfinv(-q)
    if q >= 1.0:
        return math.inf if q == 1.0 else math.nan
    x = ndtri(0.5 * (1.0 + q)) * _SQRT1_2
    for _ in range(3):
        f = math.erf(x) - q if q < 0.5 else (1.0 - q) - math.erfc(x)
        d = _TWO_OVER_SQRT_PI * math.exp(-x * x)
        if d == 0.0:
            break
        x -= f / d
    return x


# ----------------------------------------------------------------------------- magnitude models
class _Lognormal:
    __slots__ = ("mu", "sigma")
    step = property(lambda self: self.sigma)

    def __init__(self, mu: float, sigma: float) -> None:
        self.mu, self.sigma = mu, sigma

    def to_x(self, a: float) -> float:
        return math.log(a) - self.mu

    def from_x(self, x: float) -> float:
        return _exp(self.mu + x)

    def hard(self, x: float) -> float:
        return ndtr(x / self.sigma)

    def up(self, x: float) -> float:
        s = self.sigma
        return _exp(0.5 * s * s - x + log_ndtr(x / s - s))

    def hard_quantile(self, q: float) -> float:
        return self.sigma * ndtri(q)


class _ScaleFamily:
    __slots__ = ("scale",)
    step = 1.0

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def to_x(self, a: float) -> float:
        return math.log(a / self.scale)

    def from_x(self, x: float) -> float:
        return self.scale * _exp(x)


class _HalfNormal(_ScaleFamily):
    __slots__ = ()

    def hard(self, x: float) -> float:
        return math.erf(_exp(x) / _SQRT2)

    def up(self, x: float) -> float:
        u = _exp(x)
        return _SQRT_2_OVER_PI * -math.expm1(-0.5 * u * u) / u if u < math.inf else 0.0

    def hard_quantile(self, q: float) -> float:
        return math.log(_SQRT2 * erfinv(q))


class _Exponential(_ScaleFamily):
    __slots__ = ()

    def hard(self, x: float) -> float:
        return -math.expm1(-_exp(x))

    def up(self, x: float) -> float:
        v = _exp(x)
        return (-math.expm1(-v) - v * math.exp(-v)) / v if v < math.inf else 0.0

    def hard_quantile(self, q: float) -> float:
        return math.log(-math.log1p(-q))


def _finite(v: Optional[float]) -> bool:
    return v is not None and math.isfinite(v)


def _model(model: str, mu: Optional[float], sigma: Optional[float], scale: Optional[float]):
    """The magnitude model of a threshold rule, or :class:`Outside` for parameters the reference
    rejects (it raises the documented error)."""
    if model == "lognormal":
        if not (_finite(mu) and _finite(sigma) and sigma > 0):
            raise Outside("lognormal model parameters")
        return _Lognormal(float(mu), float(sigma))
    if model in ("normal", "laplace"):
        if not (_finite(scale) and scale > 0):
            raise Outside("scale parameter")
        return _HalfNormal(float(scale)) if model == "normal" else _Exponential(float(scale))
    raise Outside(f"model {model!r}")


def _stochastic(m, x: float) -> float:
    return m.hard(x) - m.up(x)


def solve_sparsity(m, target: float, stochastic: bool = True) -> float:
    """``x`` with ``S(x) = target`` (``0 < target < 1``): the bracket and safeguarded Newton
    iteration of :func:`gradstats.pruning._models.solve_sparsity_scalar`, step for step."""
    xh = m.hard_quantile(target)
    if not stochastic:
        return xh
    step = m.step
    hi = xh + step
    for _ in range(64):
        if not _stochastic(m, hi) < target:
            break
        step *= 2.0
        hi += step

    def f(x: float) -> tuple[float, float]:
        u = m.up(x)
        return m.hard(x) - u - target, u
    return bracketed_newton(f, xh, hi, 0.5 * (xh + hi))


def threshold(target: float, model: str = "lognormal", *, mu: Optional[float] = None,
              sigma: Optional[float] = None, p0: float = 0.0, scale: Optional[float] = None,
              amax: Optional[float] = None, mean_abs: Optional[float] = None,
              stochastic: bool = True) -> float:
    """:func:`gradstats.pruning.threshold` for one layer given as numbers (models
    ``"lognormal"``, ``"naive_lognormal"``, ``"normal"``, ``"laplace"``). Raises
    :class:`Outside` where the reference raises or takes a path this one does not repeat.

    Example:
        >>> a = threshold(0.9, mu=-10.0, sigma=2.0)
        >>> from gradstats import pruning
        >>> abs(a / pruning.threshold(0.9, mu=-10.0, sigma=2.0) - 1) < 1e-12
        True
    """
    if model == "naive_lognormal":
        model, stochastic = "lognormal", False
    s, z = float(target), float(p0)
    if not (0.0 <= s < 1.0 and 0.0 <= z < 1.0):
        raise Outside("target or p0")
    m = _model(model, mu, sigma, scale)
    q = (s - z) / (1.0 - z)
    a = 0.0
    if q > 0:
        a = m.from_x(solve_sparsity(m, q, stochastic))
    if amax is None:
        return a
    am = float(amax)
    ma = None if mean_abs is None else float(mean_abs)
    if not (am > 0 and math.isfinite(am)) or (stochastic and (ma is None or not 0 <= ma <= am)):
        raise Outside("amax or mean_abs")
    if stochastic and a > 0 and s >= 1.0 - ma / am:
        return ma / (1.0 - s)
    return min(a, am)


def expected_sparsity(a: float, model: str = "lognormal", *, mu: Optional[float] = None,
                      sigma: Optional[float] = None, p0: float = 0.0, scale: Optional[float] = None,
                      stochastic: bool = True) -> float:
    """:func:`gradstats.pruning.expected_sparsity` for one layer given as numbers.

    Example:
        >>> round(expected_sparsity(1.0, mu=0.0, sigma=1.0), 6)
        0.238422
    """
    a, z = float(a), float(p0)
    if not (a >= 0 and 0.0 <= z < 1.0):
        raise Outside("threshold or p0")
    m = _model(model, mu, sigma, scale)
    if math.isinf(a):
        s = 1.0
    elif a > 0:
        x = m.to_x(a)
        s = _stochastic(m, x) if stochastic else m.hard(x)
    else:
        s = 0.0
    return z + (1.0 - z) * min(max(s, 0.0), 1.0)


# ----------------------------------------------------------------------------- the histogram rule
def _sign(v: float) -> float:
    return (v > 0) - (v < 0)


def _pchip_slopes(x: Sequence[float], y: Sequence[float]) -> list[float]:
    """The node derivatives of scipy's ``PchipInterpolator`` (Fritsch-Butland weighted harmonic
    means, Moler's one-sided three-point ends)."""
    n = len(x)
    hk = [x[i + 1] - x[i] for i in range(n - 1)]
    mk = [(y[i + 1] - y[i]) / hk[i] for i in range(n - 1)]
    if n == 2:
        return [mk[0], mk[0]]
    dk = [0.0] * n
    for i in range(1, n - 1):
        m0, m1 = mk[i - 1], mk[i]
        if _sign(m1) != _sign(m0) or m1 == 0 or m0 == 0:
            continue
        w1 = 2 * hk[i] + hk[i - 1]
        w2 = hk[i] + 2 * hk[i - 1]
        dk[i] = 1.0 / ((w1 / m0 + w2 / m1) / (w1 + w2))

    def edge(h0: float, h1: float, m0: float, m1: float) -> float:
        d = ((2 * h0 + h1) * m0 - h0 * m1) / (h0 + h1)
        if _sign(d) != _sign(m0):
            return 0.0
        if _sign(m0) != _sign(m1) and abs(d) > 3.0 * abs(m0):
            return 3.0 * m0
        return d

    dk[0] = edge(hk[0], hk[1], mk[0], mk[1])
    dk[-1] = edge(hk[-1], hk[-2], mk[-1], mk[-2])
    return dk


def _piece_integral(c: tuple[float, float, float, float], lk: float, T: float) -> float:
    """``integral_0^T F(l_k + t) e^(l_k + t) dt`` on one cubic piece (as the reference)."""
    c0, c1, c2, c3 = c

    def G(t: float) -> float:
        p = ((c0 * t + c1) * t + c2) * t + c3
        d1 = (3 * c0 * t + 2 * c1) * t + c2
        d2 = 6 * c0 * t + 2 * c1
        return math.exp(t) * (p - d1 + d2 - 6 * c0)

    return math.exp(lk) * (G(T) - G(0.0))


class Histogram:
    """The model-free threshold rule of :class:`gradstats.pruning.histogram.LogHistogram` on
    Python floats: counts of the non-zero finite ``|g|`` in contiguous bins ``[lower, upper)``,
    the zero count, the number of entries, and ``atoms``: magnitudes known exactly (not in the
    counts), each a step of ``1/n``.

    Example:
        >>> h = Histogram([10.0], [1.0], [2.0], 20, 10)
        >>> h.expected_sparsity(2.0, stochastic=False)
        1.0
    """

    __slots__ = ("n", "n_zero", "binned", "l", "x", "F", "c", "J", "atoms", "cs", "finite_fraction", "_b")

    def __init__(self, counts: Sequence[float], lower: Sequence[float], upper: Sequence[float],
                 n: int, n_zero: int, atoms: Sequence[float] = ()) -> None:
        self.n, self.n_zero = int(n), int(n_zero)
        if self.n <= 0:
            raise Outside("empty tensor")
        self.atoms = sorted(float(t) for t in atoms)
        cs = [0.0]
        for t in self.atoms:
            cs.append(cs[-1] + t)
        self.cs = cs
        self.binned = len(counts) > 0
        self._b = None
        total = 0.0
        for v in counts:
            total += float(v)
        self.finite_fraction = (self.n_zero + total + len(self.atoms)) / self.n
        if not self.binned:
            return
        x = [float(lower[0])] + [float(u) for u in upper]
        l = [math.log(v) for v in x]
        F = [float(self.n_zero)]
        for v in counts:
            F.append(F[-1] + float(v))
        F = [v / self.n for v in F]
        if len(l) >= 3:
            d = _pchip_slopes(l, F)
            c = []
            for i in range(len(l) - 1):
                dx = l[i + 1] - l[i]
                slope = (F[i + 1] - F[i]) / dx
                t = (d[i] + d[i + 1] - 2 * slope) / dx
                c.append((t / dx, (slope - d[i]) / dx - t, d[i], F[i]))
        else:  # a single bin: linear
            c = [(0.0, 0.0, (F[1] - F[0]) / (l[1] - l[0]), F[0])]
        J = [F[0] * x[0]]
        acc = 0.0
        for i, (c0, c1, c2, c3) in enumerate(c):    # _piece_integral over whole pieces, inlined
            T = l[i + 1] - l[i]
            p = ((c0 * T + c1) * T + c2) * T + c3
            d1 = (3 * c0 * T + 2 * c1) * T + c2
            d2 = 6 * c0 * T + 2 * c1
            acc += math.exp(l[i]) * (math.exp(T) * (p - d1 + d2 - 6 * c0) - (c3 - c2 + 2 * c1 - 6 * c0))
            J.append(J[0] + acc)
        self.l, self.F, self.c, self.J = l, F, c, J
        self.x = [math.exp(v) for v in l]           # the edges as the reference evaluates them

    @classmethod
    def from_stats(cls, hist: Sequence[float], min_exp: int, n: int, n_zero: int, top: Sequence[float] = (),
                   min_abs: float = math.nan, max_abs: float = math.nan) -> "Histogram":
        """As :meth:`LogHistogram.from_stats`: the counts of ``floor(log2|g|)`` from binade
        ``min_exp`` on (a statistics row's ``hist``), less the largest magnitudes ``top`` (NaN
        padding ignored), which become atoms; the empty bins at both ends trimmed, the highest
        bin ending at the smallest atom (without atoms at ``max_abs``), the lowest starting at
        ``min_abs``. Raises :class:`Outside` where the reference raises (``top`` not the
        largest values the counts hold)."""
        h = [float(v) for v in hist]
        t = sorted(abs(float(v)) for v in top if math.isfinite(v) and v != 0)
        for v in t:
            j = math.frexp(v)[1] - 1 - min_exp
            if not 0 <= j < len(h):
                raise Outside("top_abs outside the binades")
            h[j] -= 1.0
        if t:
            j0 = math.frexp(t[0])[1] - 1 - min_exp
            if min(h) < 0 or any(h[j0 + 1:]):
                raise Outside("top_abs is not the largest values of the counts")
        nz = [i for i, v in enumerate(h) if v > 0]
        if not nz:
            return cls([], [], [], n, n_zero, t)
        i, j = nz[0], nz[-1]
        counts = h[i:j + 1]
        lower = [math.ldexp(1.0, e + min_exp) for e in range(i, j + 1)]
        upper = [2.0 * v for v in lower]
        top_edge = t[0] if t else float(max_abs)
        if top_edge > 0 and math.isfinite(top_edge):   # a sliver, where the bin is one value
            upper[-1] = max(min(upper[-1], top_edge), lower[-1] * (1 + 2.0 ** -30))
        low_edge = float(min_abs)
        if low_edge > 0 and math.isfinite(low_edge):
            lower[0] = min(max(lower[0], low_edge), upper[0] * (1 - 2.0 ** -30))
        return cls(counts, lower, upper, n, n_zero, t)

    # -- the sparsity
    def _atoms_at(self, a: float, stochastic: bool) -> float:
        if not self.atoms:
            return 0.0
        k = bisect.bisect_left(self.atoms, a)
        return (k if not stochastic else k - self.cs[k] / a) / self.n

    def _continuous_at(self, la: float, stochastic: bool) -> float:
        if not self.binned:
            return self.n_zero / self.n
        l, F, J = self.l, self.F, self.J
        if la <= l[0]:
            return F[0]
        if la >= l[-1]:
            if not stochastic:
                return F[-1]
            a = math.exp(la)
            return (J[-1] + F[-1] * (a - math.exp(l[-1]))) / a
        k = bisect.bisect_right(l, la) - 1
        t = la - l[k]
        if not stochastic:
            c0, c1, c2, c3 = self.c[k]
            return ((c0 * t + c1) * t + c2) * t + c3
        return (J[k] + _piece_integral(self.c[k], l[k], t)) / math.exp(la)

    def _at(self, la: float, stochastic: bool) -> float:
        s = self._continuous_at(la, stochastic)
        if self.atoms:
            s += self._atoms_at(math.exp(la), stochastic)
        return s

    def expected_sparsity(self, a: float, *, stochastic: bool = True) -> float:
        """Expected zero fraction at threshold ``a`` (hard fraction with ``stochastic=False``)."""
        if not a > 0 or (not self.binned and not self.atoms):
            return self.n_zero / self.n
        if math.isinf(a):
            return self.finite_fraction
        return self._at(math.log(a), stochastic)

    def _breakpoints(self) -> list[tuple[float, int]]:
        """The bin edges and the atoms, ascending (edges first among equals, as the reference's
        stable sort): ``(value, index)`` with the index of an edge (``>= 0``) or ``-1`` for an atom."""
        if self._b is None:
            pts = [(v, i) for i, v in enumerate(self.x)] if self.binned else []
            pts += [(v, -1) for v in self.atoms]
            pts.sort(key=lambda p: p[0])
            self._b = pts
        return self._b

    def _s_at_breakpoint(self, p: tuple[float, int], stochastic: bool) -> float:
        """The sparsity at a breakpoint, as the reference computes it there."""
        v, i = p
        if i >= 0:
            base = self.J[i] / v if stochastic else self.F[i]
        else:
            base = self._continuous_at(math.log(v), stochastic)
        return base + self._atoms_at(v, stochastic)

    def threshold(self, target: float, *, stochastic: bool = True) -> float:
        """The threshold whose expected sparsity is ``target`` (0 when the zeros reach it,
        ``inf`` when non-finite entries make it unreachable): the reference's bracket between
        breakpoints (bin edges and atoms; found by bisection over them, evaluating the sparsity
        at the few it visits), then, for the stochastic operator, a safeguarded Newton
        iteration in ``ln a`` where the reference bisects (``dS/d ln a = F - S``; both stop at
        the float resolution of ``ln a``)."""
        if not 0.0 <= target < 1.0:
            raise Outside("target")
        if target * self.n <= self.n_zero or (not self.binned and not self.atoms):
            return 0.0
        if target >= self.finite_fraction:
            return math.inf
        b = self._breakpoints()
        if self._s_at_breakpoint(b[-1], stochastic) < target:   # beyond every breakpoint
            if not stochastic:  # just above the largest value (the reference's margin)
                return b[-1][0] * (1 + 2.0 ** -20)
            m = self.cs[-1] / self.n                 # S = f - M/a exactly
            if self.binned:
                m += self.x[-1] * self.F[-1] - self.J[-1]   # the binned entries' sum |g| / n
            return m / (self.finite_fraction - target)
        lo_i, hi_i = 0, len(b)                       # the first breakpoint whose sparsity reaches it
        while lo_i < hi_i:
            mid_i = (lo_i + hi_i) // 2
            if self._s_at_breakpoint(b[mid_i], stochastic) < target:
                lo_i = mid_i + 1
            else:
                hi_i = mid_i
        k = max(lo_i, 1)
        if not stochastic and (not self.binned or b[k - 1][0] >= self.x[-1]):
            return b[k][0]                           # between two atoms the hard fraction is a step
        lo, hi = math.log(b[k - 1][0]), math.log(b[k][0])
        if not stochastic:      # the hard fraction: bisection, as the reference
            for _ in range(200):
                mid = 0.5 * (lo + hi)
                if self._at(mid, False) < target:
                    lo = mid
                else:
                    hi = mid
                if hi - lo < 4e-16 * max(1.0, abs(mid)):
                    break
            return math.exp(hi)
        x = 0.5 * (lo + hi)
        for _ in range(100):
            sx = self._at(x, True)
            f = sx - target
            if f == 0.0:
                break
            if f < 0:
                lo = x
            else:
                hi = x
            d = self._at(x, False) - sx
            nx = x - f / d if d > 0 else math.nan
            if not lo < nx < hi:
                nx = 0.5 * (lo + hi)
            done = abs(nx - x) <= 4e-16 * max(1.0, abs(x)) or hi - lo <= 4e-16 * max(1.0, abs(x))
            x = nx
            if done:
                break
        return math.exp(x)


# ----------------------------------------------------------------------------- the format's cells
class _Cells:
    """One format's quantisation cells under a rounding (saturating), from
    :func:`gradstats.fpanalysis._pieces.build`: the log bounds, the coefficient matrices per
    moment order, and per piece the polynomials of the squared error, the flushed and the
    saturated probability (for the point mass of :func:`predict`)."""

    def __init__(self, fmt: FPFormat, rounding: str) -> None:
        from gradstats.fpanalysis._pieces import FRACTIONS, PARTS, build, coef_matrices

        pc = build(fmt, rounding, "saturate")
        self.fmt, self.rounding = fmt, rounding
        self.bounds = pc.bounds.tolist()
        with np.errstate(divide="ignore"):
            self.lnb = np.log(pc.bounds)
        self.mats = [(float(k), m) for k, m in coef_matrices(pc, "relative").items()]
        self.n_err = n_err = len(PARTS)
        self.is_err = np.arange(n_err + len(FRACTIONS)) < n_err
        self.k = np.array([k for k, _ in self.mats])
        self.cm = np.stack([m for _, m in self.mats])                        # (K, P, 7)
        fl, sa = n_err + FRACTIONS.index("flushed"), n_err + FRACTIONS.index("saturated")
        # per piece, polynomials in y (degree <= 3) of the squared error, flushed, saturated
        coef = pc.sign * np.exp(pc.lnc)
        polys = np.zeros((pc.n_pieces, 3, 4))
        col = np.where(pc.out < n_err, 0, np.where(pc.out == fl, 1, np.where(pc.out == sa, 2, -1)))
        for t in range(pc.piece.size):
            if col[t] >= 0:
                polys[pc.piece[t], col[t], pc.k[t]] += coef[t]
        self.polys = polys.tolist()
        self.top = pc.n_pieces - 1                                   # the saturating piece
        self.centre = 0.5 * (math.log(fmt.max) + math.log(fmt.min_normal))

    def integrate(self, mu: float, sigma: float, log_scale: np.ndarray, lower: float = 0.0,
                  upper: float = math.inf) -> np.ndarray:
        """``(J, 7)``: :func:`gradstats.fpanalysis._pieces.integrate` (relative mode) for one
        ``mu``, ``sigma`` at the scales ``exp(log_scale)``, term for term in the same order, with
        the distribution cut to ``lower <= y < upper`` (in scaled units)."""
        s = sigma
        m = mu + log_scale                                                   # (J,)
        lnb = self.lnb
        if upper < math.inf:
            lnb = np.minimum(lnb, math.log(upper))
        if lower > 0:
            lnb = np.maximum(lnb, math.log(min(lower, upper)))
        z0 = (lnb[None, :] - m[:, None]) / s                                 # (J, P + 1)
        lnn = 2 * m + 2 * s * s
        # every moment order at once (K, J, P + 1): the reference's terms, in its order
        z = z0[None, :, :] - (self.k * s)[:, None, None]
        t = _np_ndtr(-np.abs(z))
        za, zb, ta, tb = z[..., :-1], z[..., 1:], t[..., :-1], t[..., 1:]
        dphi = np.where(za >= 0, ta - tb, np.where(zb <= 0, tb - ta, 1.0 - ta - tb))
        base = self.k[:, None] * m[None, :] + (0.5 * self.k * self.k * s * s)[:, None]      # (K, J)
        w = np.exp(base[:, :, None] - np.where(self.is_err[None, None, :], lnn[None, :, None], 0.0))
        return (np.matmul(dphi, self.cm) * w).sum(axis=0)

    def errors(self, mu: float, sigma: float, log2_scales: np.ndarray) -> np.ndarray:
        """Relative MSE at the scales ``2**log2_scales`` (what the scale search minimises)."""
        return self.integrate(mu, sigma, log2_scales * _LN2)[:, :self.n_err].sum(axis=1)


@functools.lru_cache(maxsize=64)
def _cells(fmt: FPFormat, rounding: str) -> _Cells:
    return _Cells(fmt, rounding)


#: the tie tolerance and exponent range of :func:`gradstats.fpanalysis.optimal_scale`
_TIE_RTOL = 1e-6
_LOG2_RANGE = (-126, 127)
_SIGMA_MAX = 12.0
_OFFS = np.arange(-2, 3, dtype=np.float64)


def optimal_log2_scale(fmt: FPFormat, mu: float, sigma: float, rounding: str = "nearest") -> tuple[int, float]:
    """``(log2 scale, relative MSE)`` of :func:`gradstats.fpanalysis.optimal_scale` for one
    layer (power of two, the MSE criterion, no ``amax``): the same centring start, five
    neighbouring powers of two with the same tie rule (within ``TIE_RTOL`` of the best, the one
    nearest the start wins, the lower one of two), and the same downhill walk from the edge of
    the five. Raises :class:`Outside` for parameters the reference rejects, and a plain
    ``ValueError`` when the best scale is outside ``2**-126..2**127`` (as the reference).

    Example:
        >>> optimal_log2_scale(FPFormat.parse("e4m3fn"), -9.0, 1.5)[0]
        7
    """
    if not (fmt.signed and fmt.has_zero and fmt.bits <= 16) or rounding not in ("nearest", "stochastic"):
        raise Outside("format or rounding")
    if not (math.isfinite(mu) and math.isfinite(sigma) and 0 < sigma <= _SIGMA_MAX):
        raise Outside("mu or sigma")
    cells = _cells(fmt, rounding)
    anchor = (cells.centre - (mu + 2 * sigma * sigma)) / _LN2
    j0 = float(np.round(anchor))
    e = cells.errors(mu, sigma, j0 + _OFFS).tolist()
    best = min(e)
    pick, far = 0, math.inf
    for i, ei in enumerate(e):           # within the tolerance of the best, nearest the start
        if ei <= best * (1 + _TIE_RTOL) and abs(_OFFS[i]) < far:
            pick, far = i, abs(_OFFS[i])
    j, ej = j0 + _OFFS[pick], e[pick]
    if pick in (0, len(e) - 1):          # on the edge of the five: walk downhill
        for _ in range(400):
            lo_e, hi_e = cells.errors(mu, sigma, np.array([j - 1.0, j + 1.0])).tolist()
            side, emin = (0, lo_e) if lo_e <= hi_e else (1, hi_e)
            if not emin < ej * (1 - _TIE_RTOL):
                break
            j, ej = j + (-1.0 if side == 0 else 1.0), emin
    lo, hi = _LOG2_RANGE
    if j < lo or j > hi:
        raise ValueError(f"format {fmt}: the best scale 2**{j:.1f} lies outside 2**{lo}..2**{hi}, "
                         "which float32 (and an E8M0 scale) cannot represent: mu of ln|g| is too far "
                         "from the format's range")
    return int(j), float(ej)


def lognormal_scale(fmt: FPFormat, rounding: str, mu: float, sigma: float, amax: Optional[float]) -> float:
    """:meth:`gradstats.plan.Rule.scale_for` of a ``scale="lognormal"`` rule: the optimal power
    of two, floored at :func:`gradstats.formats.amax_scale` when ``amax`` is known (which also
    decides when the optimum is out of range)."""
    from gradstats.formats import amax_scale

    rounding = rounding if rounding in ("nearest", "stochastic") else "nearest"
    has_amax = amax is not None and math.isfinite(float(amax)) and float(amax) > 0
    try:
        s = math.ldexp(1.0, optimal_log2_scale(fmt, mu, sigma, rounding)[0])
    except Outside:
        raise
    except ValueError:
        if not has_amax:
            raise
        return amax_scale(fmt, amax)
    if has_amax:
        s = max(s, amax_scale(fmt, amax))
    return s


# ----------------------------------------------------------------------------- predictions
def _poly(c: Sequence[float], y: float) -> float:
    return ((c[3] * y + c[2]) * y + c[1]) * y + c[0]


def predict(fmt: Optional[FPFormat], rounding: str, mu: float, sigma: float, p0: float,
            threshold: float, scale: float, amax: Optional[float] = None,
            numel: Optional[float] = None) -> tuple[float, float, float]:
    """What the lognormal model ``ln|g| ~ N(mu, sigma^2)`` (non-zero entries, a fraction ``p0``
    exactly zero) predicts for stochastic pruning at ``threshold`` (0: none) followed by rounding
    to ``fmt`` at ``scale`` (saturating): ``(underflow, saturated, error)``, the fractions of all
    entries that are non-zero after pruning and flushed to zero by the rounding, and that
    saturate at the format's max, and the relative error ``E[(out - g)^2] / E[g^2]`` of the
    output (pruning and rounding together; without pruning the rounding's alone, which is
    :func:`gradstats.fpanalysis.expected_error`'s ``total``, ``flushed`` and ``saturated``).

    Given the tensor's largest magnitude ``amax`` (and its ``numel`` entries), conditioned on it
    as :func:`~gradstats.fpanalysis.expected_error` is: one entry at ``amax``, the other non-zero
    ones from the lognormal truncated there (infinitely many without ``numel``), so that a tail
    beyond the data does not count as saturation or error that never happen.

    Kept entries (``|g| >= a``) are summed over the format's cells from ``a`` up; those below are
    output as ``a`` with probability ``|g|/a``: a point mass at ``a`` whose rounding is exact. With
    ``x = |g|`` and ``Q = Q(a)`` the squared error below ``a`` is
    ``E[(x/a) (Q - x)^2 + (1 - x/a) x^2] = E[Q^2] M1/a - 2 E[Q] M2/a + M2`` in the partial
    moments ``Mk = E[x^k 1{x<a}]``. ``fmt=None``: no rounding (the pruning's error alone).
    Stochastic rounding takes ``rounding="stochastic"``; other roundings are modelled as nearest.

    Example:
        >>> u, s, e = predict(FPFormat.parse("e4m3fn"), "nearest", -9.0, 1.5, 0.0, 0.0, 2.0 ** 7)
        >>> round(e * 1e4, 2), round(s, 9)
        (7.15, 0.0)
    """
    if not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0 and 0 <= p0 < 1
            and 0 <= threshold < math.inf and 0 < scale < math.inf):
        raise Outside("parameters")
    s = sigma
    ls = math.log(scale)
    m = mu + ls                                  # ln of the scaled magnitudes y = |g| s
    ln_e2 = 2 * m + 2 * s * s                    # ln E[y^2] of the lognormal
    A = threshold * scale
    cond = amax is not None and 0 < amax < math.inf
    ym = amax * scale if cond else math.inf      # the tensor's largest scaled magnitude
    w = 1.0 / max((1 - p0) * numel, 1.0) if cond and numel is not None else 0.0   # its weight
    ln_mass = log_ndtr((math.log(ym) - m) / s) if cond else 0.0                  # P(y < ym)
    e2 = _exp(ln_e2 + log_ndtr((math.log(ym) - m) / s - 2 * s) - ln_mass) if cond else _exp(ln_e2)
    if A > 0:                                    # the truncated lognormal below min(A, ym)
        zb = (math.log(min(A, ym)) - m) / s
        m1 = _exp(m + 0.5 * s * s + log_ndtr(zb - s) - ln_mass)                 # E[y 1{y<A}]
        m2 = _exp(ln_e2 + log_ndtr(zb - 2 * s) - ln_mass)                        # E[y^2 1{y<A}]
    else:
        m1 = m2 = 0.0
    if fmt is None:
        err_t = A * m1 - m2 if A > 0 else 0.0            # E[(x/A)(A - x)^2 + (1 - x/A) x^2]
        err_a = (ym * (A - ym) if ym < A else 0.0) if w else 0.0
        err = ((1 - w) * err_t + w * err_a) / ((1 - w) * e2 + (w * ym * ym if w else 0.0))
        return 0.0, 0.0, max(err, 0.0)
    cells = _cells(fmt, "stochastic" if rounding == "stochastic" else "nearest")
    res = cells.integrate(mu, sigma, np.array([ls]), lower=A, upper=ym)[0]
    mass = math.exp(ln_mass)
    err_t = float(res[:cells.n_err].sum()) * _exp(ln_e2) / mass                 # kept, E[err 1{A<=y<ym}]
    uf_t, sat_t = float(res[cells.n_err]) / mass, float(res[cells.n_err + 1]) / mass

    def at(y: float) -> tuple[float, float, float, float, float]:
        """E[(Q(y) - y)^2], E[Q(y)], E[Q(y)^2], P(flushed), P(saturated) of one value."""
        i = min(max(bisect.bisect_right(cells.bounds, y) - 1, 0), cells.top)
        pe, pf, ps = cells.polys[i]
        e = _poly(pe, y)
        eq = -0.5 * pe[1] if (cells.rounding == "nearest" or i == cells.top) else y
        return e, eq, e + 2 * y * eq - y * y, _poly(pf, y), _poly(ps, y)

    if A > 0:                                    # values below A, rounded up to it with prob x/A
        _, eq, eq2, fl_a, sa_a = at(A)
        err_t += (eq2 / A) * m1 - 2 * (eq / A) * m2 + m2
        uf_t += m1 / A * fl_a
        sat_t += m1 / A * sa_a
    err_a = uf_a = sat_a = 0.0
    if w:                                        # the entry at amax
        if ym >= A:
            err_a, _, _, uf_a, sat_a = at(ym)
        else:
            q = ym / A
            _, eq, eq2, fl_a, sa_a = at(A)
            err_a = q * (eq2 - 2 * eq * ym + ym * ym) + (1 - q) * ym * ym
            uf_a, sat_a = q * fl_a, q * sa_a
    err = ((1 - w) * err_t + w * err_a) / ((1 - w) * e2 + (w * ym * ym if w else 0.0))
    uf = (1 - w) * uf_t + w * uf_a
    sat = (1 - w) * sat_t + w * sat_a
    return (1 - p0) * uf, (1 - p0) * sat, max(err, 0.0)
