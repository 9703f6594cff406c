"""The families of gradient magnitudes, one vocabulary for every stage: the lognormal, the half-normal
(``"normal"``: the magnitudes of a zero-mean normal) and the exponential (``"laplace"``).

For fitting (:mod:`gradstats.fitting`): the closed-form mean log-likelihood at the MLE, the CDF and the
log-density of each family. For pruning (:mod:`gradstats.pruning`): the sparsity and added variance of the
stochastic pruning operator in each family, and the bracketed solver of a target sparsity.

Example:
    >>> import math, torch
    >>> from gradstats.families import FAMILIES, cdf64
    >>> FAMILIES
    ('lognormal', 'normal', 'laplace')
    >>> round(float(cdf64("lognormal", torch.tensor([1.0]), {"mu": 0.0, "sigma": 1.0})[0]), 6)
    0.5

Each family describes ``|g|`` of the non-zero entries and works in a standardised log-threshold
``x`` (float64 numpy arrays, vectorised over layers):

============  ========================  =====================================================
model         parameters                ``x`` for a threshold ``a``
============  ========================  =====================================================
lognormal     ``mu``, ``sigma`` of ln|g|  ``x = ln a - mu``
normal        ``scale`` (``s^2 = E g^2``) ``x = ln(a / s)``   (half-normal magnitudes)
laplace       ``scale`` (``b = E|g|``)    ``x = ln(a / b)``   (exponential magnitudes)
============  ========================  =====================================================

For every model the stochastic operator's zero fraction is ``S = H - U`` with ``H = P(|g| < a)``
(the hard-threshold fraction) and ``U = E[|g| 1{|g| < a}] / a`` (the mass rounded *up* to ``a``),
and ``dS/dx = U > 0``: ``S`` is increasing and the safeguarded Newton step is cheap.
``r(x) = E[T(g)^2] / E[g^2]`` gives the cosine similarity ``1/sqrt(r)`` and the relative added
variance ``r - 1``.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Callable, Mapping, Optional

import numpy as np
import torch
from scipy import special

from gradstats._roots import bracketed_newton

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_LN2_ = math.log(2.0)
_HALF_LN_2PI = 0.5 * math.log(2.0 * math.pi)
_HALF_LN_2_OVER_PI = 0.5 * math.log(2.0 / math.pi)

#: the families compared, in display order
FAMILIES = ("lognormal", "normal", "laplace")
#: number of fitted parameters of each magnitude model (for AIC and BIC)
N_PARAMS = {"lognormal": 2, "normal": 1, "laplace": 1}
#: the magnitude model behind each family name
MAGNITUDE_MODEL = {"lognormal": "lognormal", "normal": "half-normal", "laplace": "exponential"}


class Family:
    """Base: subclasses set ``name`` and implement the methods on float64 arrays."""

    name = ""

    def to_x(self, a: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def from_x(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def hard(self, x: np.ndarray) -> np.ndarray:
        """``P(|g| < a)``."""
        raise NotImplementedError

    def up(self, x: np.ndarray) -> np.ndarray:
        """``E[|g| 1{|g| < a}] / a`` (also ``dS/dx``)."""
        raise NotImplementedError

    def hard_quantile(self, q: np.ndarray) -> np.ndarray:
        """``x`` with ``hard(x) = q``."""
        raise NotImplementedError

    def step(self) -> np.ndarray:
        """A natural unit of ``x`` for bracketing."""
        return np.ones(1)

    def et2_ratio(self, x: np.ndarray) -> np.ndarray:
        """``E[T(g)^2] / E[g^2]`` of the non-zero entries."""
        raise NotImplementedError

    def m2(self) -> np.ndarray:
        """``E[g^2]`` of the non-zero entries."""
        raise NotImplementedError

    def added_rel(self, x: np.ndarray) -> np.ndarray:
        """``E[T(g)^2] / E[g^2] - 1`` (relative added variance), >= 0."""
        return np.maximum(self.et2_ratio(x) - 1.0, 0.0)

    def stochastic(self, x: np.ndarray) -> np.ndarray:
        return self.hard(x) - self.up(x)


class Lognormal(Family):
    name = "lognormal"

    def __init__(self, mu: np.ndarray, sigma: np.ndarray) -> None:
        self.mu, self.sigma = mu, sigma

    def to_x(self, a):
        with np.errstate(divide="ignore"):
            return np.log(a) - self.mu

    def from_x(self, x):
        return np.exp(self.mu + x)

    def hard(self, x):
        return special.ndtr(x / self.sigma)

    def up(self, x):
        s = self.sigma
        # exp(mu + s^2/2) / a * Phi(z - s), in logs so that no factor overflows: the exponent
        # is about -x^2 / (2 s^2) for very negative x, and at most s^2/2 - x + 0 otherwise
        return np.exp(0.5 * s * s - x + special.log_ndtr(x / s - s))

    def hard_quantile(self, q):
        return self.sigma * special.ndtri(q)

    def step(self):
        return self.sigma

    def et2_ratio(self, x):
        s = self.sigma
        z = x / s
        with np.errstate(over="ignore", invalid="ignore"):
            tail = special.ndtr(2.0 * s - z)  # E[g^2 1{|g| >= a}] / E g^2
            low = np.exp(x - 1.5 * s * s + special.log_ndtr(z - s))  # a E[|g| 1{|g|<a}] / E g^2
        return tail + low

    def m2(self):
        return np.exp(2.0 * self.mu + 2.0 * self.sigma ** 2)

    def added_rel(self, x):
        # a E[|g| 1{|g|<a}] / E g^2 - E[g^2 1{|g|<a}] / E g^2, without forming 1 + tiny - 1
        s = self.sigma
        z = x / s
        with np.errstate(over="ignore", invalid="ignore"):
            up = np.exp(x - 1.5 * s * s + special.log_ndtr(z - s))
        return np.maximum(up - special.ndtr(z - 2.0 * s), 0.0)


class _ScaleFamily(Family):
    """A magnitude model with one scale parameter, solved in ``x = ln(a / scale)``."""

    def __init__(self, scale: np.ndarray) -> None:
        self.scale = scale

    def to_x(self, a):
        with np.errstate(divide="ignore"):
            return np.log(a / self.scale)

    def from_x(self, x):
        return self.scale * np.exp(x)


class HalfNormal(_ScaleFamily):
    name = "normal"

    def hard(self, x):
        return special.erf(np.exp(x) / math.sqrt(2.0))

    def up(self, x):
        u = np.exp(x)
        return _SQRT_2_OVER_PI * -np.expm1(-0.5 * u * u) / u

    def hard_quantile(self, q):
        return np.log(math.sqrt(2.0) * special.erfinv(q))

    def et2_ratio(self, x):
        u = np.exp(x)
        return 2.0 * special.ndtr(-u) + _SQRT_2_OVER_PI * u

    def m2(self):
        return self.scale ** 2


class Exponential(_ScaleFamily):
    name = "laplace"

    def hard(self, x):
        return -np.expm1(-np.exp(x))

    def up(self, x):
        v = np.exp(x)
        return (-np.expm1(-v) - v * np.exp(-v)) / v

    def hard_quantile(self, q):
        return np.log(-np.log1p(-q))

    def et2_ratio(self, x):
        v = np.exp(x)
        return 0.5 * (np.exp(-v) * (v + 2.0) + v)

    def m2(self):
        return 2.0 * self.scale ** 2


def bracket_solve(fg: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray | None]],
                  lo: np.ndarray, hi: np.ndarray, *, ftol: float = 1e-13,
                  max_iter: int = 200) -> np.ndarray:
    """Root of increasing ``f(x, idx)`` in ``[lo, hi]`` elementwise (``f(lo) <= 0 <= f(hi)``).

    ``fg(x, idx)`` returns ``(f, f')`` (``f'`` may be None) for the entries ``idx`` still being
    solved (so that it can pick their parameters). Safeguarded Newton when ``f'`` is given (a
    step leaving the current bracket becomes a bisection), plain bisection otherwise. Stops per
    entry when ``|f| <= ftol`` or the bracket no longer shrinks in float64.
    """
    lo = np.array(lo, dtype=np.float64, copy=True)
    hi = np.array(hi, dtype=np.float64, copy=True)
    x = 0.5 * (lo + hi)
    active = np.arange(x.size)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
        for _ in range(max_iter):
            if active.size == 0:
                break
            xa = x[active]
            fa, da = fg(xa, active)
            done = np.abs(fa) <= ftol
            neg = fa < 0
            la = np.where(neg, xa, lo[active])
            ha = np.where(neg, hi[active], xa)
            lo[active], hi[active] = la, ha
            mid = 0.5 * (la + ha)
            if da is not None:
                nx = xa - fa / da
                nx = np.where(np.isfinite(nx) & (nx > la) & (nx < ha), nx, mid)
            else:
                nx = mid
            stuck = (mid <= la) | (mid >= ha)  # the bracket is two adjacent floats
            x[active] = np.where(done, xa, nx)
            active = active[~(done | stuck)]
    return x


def solve_sparsity(model: Family, target: np.ndarray, *, stochastic: bool = True) -> np.ndarray:
    """``x`` with ``S(x) = target`` for ``0 < target < 1`` (arrays of one shape)."""
    xh = model.hard_quantile(target)
    if not stochastic:
        return xh
    # S <= H everywhere, so the hard quantile is a lower bound; walk up to an upper bound
    step = np.broadcast_to(model.step(), target.shape).astype(np.float64)
    hi = xh + step
    for _ in range(64):
        low = model.stochastic(hi) < target
        if not low.any():
            break
        step = np.where(low, 2.0 * step, step)
        hi = np.where(low, hi + step, hi)
    sub = _Sub(model)

    def fg(x: np.ndarray, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        m = sub.at(i)
        u = m.up(x)  # dS/dx
        return m.hard(x) - u - target[i], u

    return bracket_solve(fg, xh, hi)


def solve_ratio(model: Family, ratio: np.ndarray) -> np.ndarray:
    """``x`` with ``et2_ratio(x) = ratio`` (``ratio > 1``; the ratio grows from 1 with ``x``)."""
    shape = ratio.shape
    lo = np.full(shape, -1.0)
    hi = np.full(shape, 1.0)
    sub = _Sub(model)
    for _ in range(200):
        bad = model.et2_ratio(lo) > ratio
        if not bad.any():
            break
        lo = np.where(bad, 2.0 * lo, lo)
    for _ in range(200):
        bad = model.et2_ratio(hi) < ratio
        if not bad.any():
            break
        hi = np.where(bad, 2.0 * hi, hi)
    return bracket_solve(lambda x, i: (sub.at(i).et2_ratio(x) - ratio[i], None), lo, hi)


class _Sub:
    """The model restricted to a subset of entries (parameters indexed by ``idx``)."""

    def __init__(self, model: Family) -> None:
        self.model = model

    def at(self, idx: np.ndarray) -> Family:
        m = self.model
        if idx.size == _size(m):
            return m
        if isinstance(m, Lognormal):
            return Lognormal(_take(m.mu, idx), _take(m.sigma, idx))
        if isinstance(m, HalfNormal):
            return HalfNormal(_take(m.scale, idx))
        return Exponential(_take(m.scale, idx))


def _size(m: Family) -> int:
    return (m.mu if isinstance(m, Lognormal) else m.scale).size


def _take(p: np.ndarray, idx: np.ndarray) -> np.ndarray:
    return p if p.size == 1 else p.reshape(-1)[idx]


# ----------------------------------------------------------------------------- one layer, in floats
# The same families for one layer in Python floats (``math``): a single layer's solve is
# dominated by array bookkeeping (validation, broadcasting, error-state contexts, scipy calls on
# size-1 arrays), not arithmetic. Each method repeats its array twin's formula; tests compare
# them over a grid (``tests/test_families.py``).
_SQRT1_2 = math.sqrt(0.5)
_SQRT2 = math.sqrt(2.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_EXP_MAX = 709.78
_inv_cdf = NormalDist().inv_cdf


def exp_or_inf(x: float) -> float:
    """``exp`` that overflows to inf instead of raising (numpy's behaviour): ``exp_or_inf(1e3) == inf``."""
    return math.exp(x) if x < _EXP_MAX else math.inf


def ndtr1(x: float) -> float:
    """The standard normal CDF of one float (as scipy's ``ndtr``: ``erf`` near 0, ``erfc`` in the tails).

    Example:
        >>> ndtr1(0.0)
        0.5
    """
    z = abs(x) * _SQRT1_2
    if z < _SQRT1_2:
        return 0.5 + 0.5 * math.erf(x * _SQRT1_2)
    y = 0.5 * math.erfc(z)
    return 1.0 - y if x > 0 else y


def log_ndtr1(x: float) -> float:
    """``ln Phi(x)`` of one float, accurate in both tails (the asymptotic series far below the mean).

    Example:
        >>> round(log_ndtr1(0.0), 12) == round(math.log(0.5), 12)
        True
    """
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
    return -0.5 * x * x - math.log(-x) - _HALF_LN_2PI + math.log(series)


def _ndtri1(q: float) -> float:
    """The standard normal quantile ``Phi^-1(q)`` of one float (-inf at 0, inf at 1, NaN outside)."""
    if q <= 0.0:
        return -math.inf if q == 0.0 else math.nan
    if q >= 1.0:
        return math.inf if q == 1.0 else math.nan
    return _inv_cdf(q)


def _erfinv1(q: float) -> float:
    """The inverse error function of one float in ``[0, 1]``: the normal quantile, refined by
    Newton steps on ``erf`` (or ``erfc`` above 1/2, where ``1 - q`` is exact)."""
    if q <= 0.0:
        return 0.0 if q == 0.0 else -_erfinv1(-q)
    if q >= 1.0:
        return math.inf if q == 1.0 else math.nan
    x = _ndtri1(0.5 * (1.0 + q)) * _SQRT1_2
    for _ in range(3):
        f = math.erf(x) - q if q < 0.5 else (1.0 - q) - math.erfc(x)
        d = _TWO_OVER_SQRT_PI * math.exp(-x * x)
        if d == 0.0:
            break
        x -= f / d
    return x


class OneLognormal:
    """:class:`Lognormal` for one layer in floats (the same methods; ``step`` an attribute)."""

    __slots__ = ("mu", "sigma")
    name = "lognormal"

    def __init__(self, mu: float, sigma: float) -> None:
        self.mu, self.sigma = mu, sigma

    @property
    def step(self) -> float:
        return self.sigma

    def to_x(self, a: float) -> float:
        return math.log(a) - self.mu

    def from_x(self, x: float) -> float:
        return exp_or_inf(self.mu + x)

    def hard(self, x: float) -> float:
        return ndtr1(x / self.sigma)

    def up(self, x: float) -> float:
        s = self.sigma
        return exp_or_inf(0.5 * s * s - x + log_ndtr1(x / s - s))

    def hard_quantile(self, q: float) -> float:
        return self.sigma * _ndtri1(q)

    def stochastic(self, x: float) -> float:
        return self.hard(x) - self.up(x)


class _OneScaleFamily:
    __slots__ = ("scale",)
    name = ""
    step = 1.0

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def to_x(self, a: float) -> float:
        return math.log(a / self.scale)

    def from_x(self, x: float) -> float:
        return self.scale * exp_or_inf(x)

    def stochastic(self, x: float) -> float:
        return self.hard(x) - self.up(x)


class OneHalfNormal(_OneScaleFamily):
    """:class:`HalfNormal` for one layer in floats."""

    __slots__ = ()
    name = "normal"

    def hard(self, x: float) -> float:
        return math.erf(exp_or_inf(x) / _SQRT2)

    def up(self, x: float) -> float:
        u = exp_or_inf(x)
        return _SQRT_2_OVER_PI * -math.expm1(-0.5 * u * u) / u if u < math.inf else 0.0

    def hard_quantile(self, q: float) -> float:
        return math.log(_SQRT2 * _erfinv1(q))


class OneExponential(_OneScaleFamily):
    """:class:`Exponential` for one layer in floats."""

    __slots__ = ()
    name = "laplace"

    def hard(self, x: float) -> float:
        return -math.expm1(-exp_or_inf(x))

    def up(self, x: float) -> float:
        v = exp_or_inf(x)
        return (-math.expm1(-v) - v * math.exp(-v)) / v if v < math.inf else 0.0

    def hard_quantile(self, q: float) -> float:
        return math.log(-math.log1p(-q))


def one_family(name: str, *, mu: Optional[float] = None, sigma: Optional[float] = None,
               scale: Optional[float] = None) -> "OneLognormal | _OneScaleFamily":
    """The family ``name`` of :data:`FAMILIES` for one layer in floats; a ``ValueError`` names a
    missing or invalid parameter.

    Example:
        >>> m = one_family("lognormal", mu=0.0, sigma=1.0)
        >>> round(m.stochastic(0.0), 6)
        0.238422
    """
    fam = family(name)
    if fam is Lognormal:
        if mu is None or sigma is None or not (math.isfinite(mu) and math.isfinite(sigma) and sigma > 0):
            raise ValueError(f"the lognormal family needs a finite mu and a positive finite sigma (of ln|g|), "
                             f"got mu={mu!r}, sigma={sigma!r}")
        return OneLognormal(float(mu), float(sigma))
    if scale is None or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale of the {name} family must be positive and finite, got {scale!r}")
    return fam.one(float(scale))


def solve_sparsity_one(model: "OneLognormal | _OneScaleFamily", target: float, *,
                       stochastic: bool = True) -> float:
    """:func:`solve_sparsity` for one layer in floats (a family of :func:`one_family`): the same
    bracket (walked up from the hard quantile in doubling steps) and safeguarded Newton iteration.

    Example:
        >>> x = solve_sparsity_one(one_family("lognormal", mu=0.0, sigma=1.0), 0.238422)
        >>> abs(x) < 1e-5
        True
    """
    xh = model.hard_quantile(target)
    if not stochastic:
        return xh
    step = model.step
    hi = xh + step
    for _ in range(64):
        if not model.stochastic(hi) < target:
            break
        step *= 2.0
        hi += step

    def f(x: float) -> tuple[float, float]:
        u = model.up(x)
        return model.hard(x) - u - target, u
    return bracketed_newton(f, xh, hi, 0.5 * (xh + hi))


Lognormal.one = OneLognormal          # type: ignore[attr-defined]
HalfNormal.one = OneHalfNormal        # type: ignore[attr-defined]
Exponential.one = OneExponential      # type: ignore[attr-defined]

#: the registry of magnitude families: name -> its class (arrays; ``.one``: the same for one layer
#: in floats). Adding a family is one class with the :class:`Family` methods and its entry here.
FAMILY_REGISTRY: dict[str, type[Family]] = {"lognormal": Lognormal, "normal": HalfNormal, "laplace": Exponential}


def family(name: str) -> type[Family]:
    """The family class registered under ``name`` (a ``ValueError`` lists the names).

    Example:
        >>> family("laplace").__name__
        'Exponential'
    """
    try:
        return FAMILY_REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"family must be one of {tuple(FAMILY_REGISTRY)}, got {name!r}") from None



# ----------------------------------------------------------------------------- likelihood
def mean_loglik(family: str, p: Mapping[str, float]) -> float:
    """Mean log-likelihood per magnitude at the MLE (closed form; see the module docstring)."""
    if family == "lognormal":
        return -p["mu"] - math.log(p["sigma"]) - _HALF_LN_2PI - 0.5
    if family == "normal":
        return _HALF_LN_2_OVER_PI - math.log(p["scale"]) - 0.5
    return -math.log(p["scale"]) - 1.0


def cdf64(family: str, a: torch.Tensor, p: Mapping[str, float]) -> torch.Tensor:
    """The family's CDF of the magnitudes at ``a`` (computed in float64; ``a >= 0``, may hold inf)."""
    a = a.to(torch.float64)
    if family == "lognormal":
        return torch.special.ndtr((torch.log(a) - p["mu"]) / p["sigma"])
    if family == "normal":
        return torch.erf(a / (p["scale"] * math.sqrt(2.0)))
    return -torch.expm1(-a / p["scale"])


def log_density64(family: str, a: torch.Tensor, p: Mapping[str, float]) -> torch.Tensor:
    """The family's log-density of the magnitudes at ``a > 0`` (float64)."""
    a = a.to(torch.float64)
    if family == "lognormal":
        la = torch.log(a)
        return -la - math.log(p["sigma"]) - _HALF_LN_2PI - 0.5 * ((la - p["mu"]) / p["sigma"]) ** 2
    if family == "normal":
        return _HALF_LN_2_OVER_PI - math.log(p["scale"]) - 0.5 * (a / p["scale"]) ** 2
    return -math.log(p["scale"]) - a / p["scale"]


def log2_density(family: str, t: np.ndarray, p: Mapping[str, float]) -> np.ndarray:
    """The family's density of ``log2|g|`` at ``t`` (parameters ``p`` as a fit gives them)."""
    a = np.exp2(t)
    if family == "lognormal":
        z = (t * _LN2_ - p["mu"]) / p["sigma"]
        return np.exp(-0.5 * z * z) / (p["sigma"] * math.sqrt(2 * math.pi)) * _LN2_
    s = p["scale"]
    if family == "normal":
        f = math.sqrt(2 / math.pi) / s * np.exp(-0.5 * (a / s) ** 2)
    else:
        f = np.exp(-a / s) / s
    return f * a * _LN2_


def ln_quantile(family: str, q: np.ndarray, p: Mapping[str, float]) -> np.ndarray:
    """The family's quantiles of ``ln|g|`` at probabilities ``q`` (for Q-Q plots)."""
    if family == "lognormal":
        return p["mu"] + p["sigma"] * special.ndtri(q)
    if family == "normal":
        return np.log(p["scale"] * math.sqrt(2.0) * special.erfinv(q))
    return np.log(-p["scale"] * np.log1p(-q))
