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
``x``. Every formula is written once, for Python floats (one layer, in ``math``: what apply's refresh
solves on every step) and float64 numpy arrays (vectorised over layers) alike, and the fitting's
for torch tensors too (:func:`gradstats._special.backend` picks the library from the arguments' types,
once per method, and the formula runs on its functions):

============  ========================  =====================================================
model         parameters                ``x`` for a threshold ``a``
============  ========================  =====================================================
lognormal     ``mu``, ``sigma`` of ln|g|  ``x = ln a - mu``
normal        ``scale`` (``s^2 = E g^2``) ``x = ln(a / s)``   (half-normal magnitudes)
laplace       ``scale`` (``b = E|g|``)    ``x = ln(a / b)``   (exponential magnitudes)
============  ========================  =====================================================

For every model the stochastic operator's zero fraction is ``S = H - U`` with ``H = P(|g| < a)``
(the hard-threshold fraction) and ``U = E[|g| 1{|g| < a}] / a`` (the mass rounded *up* to ``a``),
and ``dS/dx = U > 0``: ``S`` is increasing and the safeguarded Newton step of
:func:`gradstats._roots.bracketed_newton` (the package's one root finder) is cheap.
``r(x) = E[T(g)^2] / E[g^2]`` gives the cosine similarity ``1/sqrt(r)`` and the relative added
variance ``r - 1``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import numpy as np
import torch

from gradstats._roots import bracketed_newton
from gradstats._special import MATH, Backend, backend, join, quiet

_SQRT2 = math.sqrt(2.0)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_LN2_ = math.log(2.0)
_HALF_LN_2PI = 0.5 * math.log(2.0 * math.pi)
_HALF_LN_2_OVER_PI = 0.5 * math.log(2.0 / math.pi)


def _size(p: Any) -> int:
    return p.size if type(p) is np.ndarray else np.size(p)


class Family:
    """Base of the magnitude models: subclasses set ``name``, ``n_params``, ``magnitude_model``
    and implement the methods once, for parameters and arguments that are Python floats (one layer,
    computed in ``math``), numpy arrays of one shape (many layers) or, for the fitting's methods,
    torch tensors (:func:`gradstats._special.backend` picks the library once per method: the
    parameters' at construction, joined with the argument's).

    Example:
        >>> import numpy as np
        >>> one = Lognormal(0.0, 1.0).stochastic(0.0)                                # math
        >>> many = Lognormal(np.zeros(2), np.array([1.0, 2.0])).stochastic(np.zeros(2))  # numpy
        >>> round(one, 6), many.round(6).tolist()
        (0.238422, [0.238422, 0.331898])
    """

    __slots__ = ()
    name = ""
    #: number of fitted parameters (for AIC and BIC)
    n_params = 0
    #: the distribution of ``|g|`` the family name stands for
    magnitude_model = ""

    def params(self) -> tuple[Any, ...]:
        """The parameters, in the constructor's order."""
        raise NotImplementedError

    @property
    def _S(self) -> Backend:
        """The library of the parameters (the families here keep it from their construction)."""
        return backend(*self.params())

    @classmethod
    def from_params(cls, p: Mapping[str, Any]) -> "Family":
        """The family at a fit's parameters (``{"mu": ..., "sigma": ...}`` or ``{"scale": ...}``)."""
        raise NotImplementedError

    def at(self, idx: Optional[np.ndarray]) -> "Family":
        """The model restricted to the entries ``idx`` of its (flat) parameters; itself for None."""
        if idx is None:
            return self
        ps = self.params()
        if idx.size == _size(ps[0]):
            return self
        return type(self)(*(p if _size(p) == 1 else np.reshape(p, -1)[idx] for p in ps))

    # -- the threshold's maths, in x
    def to_x(self, a: Any) -> Any:
        """The standardised log-threshold of a threshold ``a``."""
        raise NotImplementedError

    def from_x(self, x: Any) -> Any:
        """The threshold at ``x``."""
        raise NotImplementedError

    def ln_from_x(self, x: Any) -> Any:
        """``ln`` of the threshold at ``x`` (without forming it)."""
        raise NotImplementedError

    def hard(self, x: Any) -> Any:
        """``P(|g| < a)``."""
        raise NotImplementedError

    def up(self, x: Any) -> Any:
        """``E[|g| 1{|g| < a}] / a`` (also ``dS/dx``)."""
        raise NotImplementedError

    def hard_quantile(self, q: Any) -> Any:
        """``x`` with ``hard(x) = q``."""
        raise NotImplementedError

    def step(self) -> Any:
        """A natural unit of ``x`` for bracketing."""
        return 1.0

    def et2_ratio(self, x: Any) -> Any:
        """``E[T(g)^2] / E[g^2]`` of the non-zero entries."""
        raise NotImplementedError

    def m2(self) -> Any:
        """``E[g^2]`` of the non-zero entries."""
        raise NotImplementedError

    def added_rel(self, x: Any) -> Any:
        """``E[T(g)^2] / E[g^2] - 1`` (relative added variance), >= 0."""
        return (self._S if type(x) is float else join(self._S, x)).maximum(self.et2_ratio(x) - 1.0, 0.0)

    def stochastic(self, x: Any) -> Any:
        """The stochastic operator's zero fraction ``S = H - U`` of the non-zero entries."""
        return self.hard(x) - self.up(x)

    # -- the fitting's maths, in the magnitudes a
    def cdf(self, a: Any) -> Any:
        """``P(|g| <= a)`` (``a >= 0``, may hold inf)."""
        return self.hard(self.to_x(a))

    def log_density(self, a: Any) -> Any:
        """The log-density of ``|g|`` at ``a > 0``."""
        raise NotImplementedError

    def mean_loglik(self) -> float:
        """The mean log-likelihood per magnitude of the data the parameters are the MLE of (closed form)."""
        raise NotImplementedError

    def log2_density(self, t: Any) -> Any:
        """The density of ``log2|g|`` at ``t``: ``ln 2 * a * f(a)`` at ``a = 2**t``, in logs."""
        T = backend(t)
        a = T.exp(t * _LN2_)
        return _LN2_ * join(self._S, t).exp(self.log_density(a) + T.log(a))

    def ln_quantile(self, q: Any) -> Any:
        """The quantiles of ``ln|g|`` at probabilities ``q`` (Q-Q plots)."""
        return self.ln_from_x(self.hard_quantile(q))


class Lognormal(Family):
    """``ln|g| ~ N(mu, sigma^2)``, solved in ``x = ln a - mu``.

    Example:
        >>> round(Lognormal(0.0, 1.0).stochastic(0.0), 6)     # the brief's check value
        0.238422
    """

    __slots__ = ("mu", "sigma", "_S")
    name = "lognormal"
    n_params = 2
    magnitude_model = "lognormal"

    def __init__(self, mu: Any, sigma: Any) -> None:
        self.mu, self.sigma = mu, sigma
        self._S = MATH if type(mu) is float and type(sigma) is float else backend(mu, sigma)

    def params(self) -> tuple[Any, ...]:
        return self.mu, self.sigma

    @classmethod
    def from_params(cls, p: Mapping[str, Any]) -> "Lognormal":
        return cls(p["mu"], p["sigma"])

    def to_x(self, a):
        return (MATH if type(a) is float else backend(a)).log(a) - self.mu

    def from_x(self, x):
        return (self._S if type(x) is float else join(self._S, x)).exp(self.mu + x)

    def ln_from_x(self, x):
        return self.mu + x

    def hard(self, x):
        return (self._S if type(x) is float else join(self._S, x)).ndtr(x / self.sigma)

    def up(self, x):
        S = self._S if type(x) is float else join(self._S, x)
        s = self.sigma
        # exp(mu + s^2/2) / a * Phi(z - s), in logs so that no factor overflows: the exponent
        # is about -x^2 / (2 s^2) for very negative x, and at most s^2/2 - x + 0 otherwise
        return S.exp(0.5 * s * s - x + S.log_ndtr(x / s - s))

    def hard_quantile(self, q):
        return self.sigma * (MATH if type(q) is float else backend(q)).ndtri(q)

    def step(self):
        return self.sigma

    def et2_ratio(self, x):
        S = self._S if type(x) is float else join(self._S, x)
        s = self.sigma
        z = x / s
        tail = S.ndtr(2.0 * s - z)  # E[g^2 1{|g| >= a}] / E g^2
        low = S.exp(x - 1.5 * s * s + S.log_ndtr(z - s))  # a E[|g| 1{|g|<a}] / E g^2
        return tail + low

    def m2(self):
        return self._S.exp(2.0 * self.mu + 2.0 * self.sigma ** 2)

    def added_rel(self, x):
        # a E[|g| 1{|g|<a}] / E g^2 - E[g^2 1{|g|<a}] / E g^2, without forming 1 + tiny - 1
        S = self._S if type(x) is float else join(self._S, x)
        s = self.sigma
        z = x / s
        up = S.exp(x - 1.5 * s * s + S.log_ndtr(z - s))
        return S.maximum(up - S.ndtr(z - 2.0 * s), 0.0)

    def log_density(self, a):
        la = backend(a).log(a)
        z = (la - self.mu) / self.sigma
        return -la - backend(self.sigma).log(self.sigma) - _HALF_LN_2PI - 0.5 * z * z

    def mean_loglik(self):
        return -self.mu - backend(self.sigma).log(self.sigma) - _HALF_LN_2PI - 0.5


class _ScaleFamily(Family):
    """A magnitude model with one scale parameter, solved in ``x = ln(a / scale)``."""

    __slots__ = ("scale", "_S")
    n_params = 1

    def __init__(self, scale: Any) -> None:
        self.scale = scale
        self._S = MATH if type(scale) is float else backend(scale)

    def params(self) -> tuple[Any, ...]:
        return (self.scale,)

    @classmethod
    def from_params(cls, p: Mapping[str, Any]) -> "_ScaleFamily":
        return cls(p["scale"])

    def to_x(self, a):
        return (self._S if type(a) is float else join(self._S, a)).log(a / self.scale)

    def from_x(self, x):
        return self.scale * (MATH if type(x) is float else backend(x)).exp(x)

    def ln_from_x(self, x):
        return self._S.log(self.scale) + x


class HalfNormal(_ScaleFamily):
    """``|g|`` of a zero-mean normal (``scale^2 = E g^2``).

    Example:
        >>> round(HalfNormal(1.0).cdf(1.0), 6)     # P(|N(0, 1)| <= 1)
        0.682689
    """

    __slots__ = ()
    name = "normal"
    magnitude_model = "half-normal"

    def hard(self, x):
        S = MATH if type(x) is float else backend(x)
        return S.erf(S.exp(x) / _SQRT2)

    def up(self, x):
        S = MATH if type(x) is float else backend(x)
        u = S.exp(x)
        return _SQRT_2_OVER_PI * -S.expm1(-0.5 * u * u) / u

    def hard_quantile(self, q):
        S = MATH if type(q) is float else backend(q)
        return S.log(_SQRT2 * S.erfinv(q))

    def et2_ratio(self, x):
        S = MATH if type(x) is float else backend(x)
        u = S.exp(x)
        return 2.0 * S.ndtr(-u) + _SQRT_2_OVER_PI * u

    def m2(self):
        return self.scale ** 2

    def log_density(self, a):
        return _HALF_LN_2_OVER_PI - self._S.log(self.scale) - 0.5 * (a / self.scale) ** 2

    def mean_loglik(self):
        return _HALF_LN_2_OVER_PI - self._S.log(self.scale) - 0.5


class Exponential(_ScaleFamily):
    """``|g|`` of a zero-mean Laplace (``scale = E|g|``).

    Example:
        >>> round(Exponential(1.0).cdf(1.0), 6)     # 1 - 1/e
        0.632121
    """

    __slots__ = ()
    name = "laplace"
    magnitude_model = "exponential"

    def hard(self, x):
        S = MATH if type(x) is float else backend(x)
        return -S.expm1(-S.exp(x))

    def up(self, x):
        S = MATH if type(x) is float else backend(x)
        v = S.exp(x)
        return -S.expm1(-v) / v - S.exp(-v)      # (1 - e^-v) / v - e^-v: 0 at v = inf

    def hard_quantile(self, q):
        S = MATH if type(q) is float else backend(q)
        return S.log(-S.log1p(-q))

    def et2_ratio(self, x):
        S = MATH if type(x) is float else backend(x)
        v = S.exp(x)
        return 0.5 * (S.exp(-v) * (v + 2.0) + v)

    def m2(self):
        return 2.0 * self.scale ** 2

    def log_density(self, a):
        return -self._S.log(self.scale) - a / self.scale

    def mean_loglik(self):
        return -self._S.log(self.scale) - 1.0


#: the registry of magnitude families: name -> its class. Adding a family is one class with the
#: :class:`Family` methods and its entry here.
FAMILY_REGISTRY: dict[str, type[Family]] = {"lognormal": Lognormal, "normal": HalfNormal, "laplace": Exponential}
#: the families compared, in display order
FAMILIES = tuple(FAMILY_REGISTRY)
#: number of fitted parameters of each magnitude model (for AIC and BIC)
N_PARAMS = {name: cls.n_params for name, cls in FAMILY_REGISTRY.items()}
#: the magnitude model behind each family name
MAGNITUDE_MODEL = {name: cls.magnitude_model for name, cls in FAMILY_REGISTRY.items()}


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


def make_family(name: str, *, mu: Any = None, sigma: Any = None, scale: Any = None) -> Family:
    """The family ``name`` at checked parameters: floats (one layer) or arrays of one shape; a
    ``ValueError`` names a missing or invalid parameter.

    Example:
        >>> m = make_family("lognormal", mu=0.0, sigma=1.0)
        >>> round(m.stochastic(0.0), 6)
        0.238422
    """
    cls = family(name)
    if cls is Lognormal:
        if type(mu) is float and type(sigma) is float and math.isfinite(mu) and 0 < sigma < math.inf:
            return Lognormal(mu, sigma)          # one layer: the common case, checked in floats
        S = backend(mu, sigma)
        if mu is None or sigma is None or not S.all_(S.isfinite(mu) & S.isfinite(sigma) & (sigma > 0)):
            raise ValueError(f"the lognormal family needs a finite mu and a positive finite sigma (of ln|g|), "
                             f"got mu={mu!r}, sigma={sigma!r}")
        return Lognormal(mu, sigma)
    if type(scale) is float and 0 < scale < math.inf:
        return cls(scale)
    S = backend(scale)
    if scale is None or not S.all_(S.isfinite(scale) & (scale > 0)):
        raise ValueError(f"scale of the {name} family must be positive and finite, got "
                         f"{scale if scale is None else S.shown(scale, S.isfinite(scale) & (scale > 0))!r}")
    return cls(scale)


def solve_sparsity(model: Family, target: Any, *, stochastic: bool = True) -> Any:
    """``x`` with ``S(x) = target`` for ``0 < target < 1``: one layer in floats, or arrays of one
    shape. The hard quantile bounds it below (``S <= H``); an upper bound is walked up from there
    in doubling steps of :meth:`Family.step`; then :func:`gradstats._roots.bracketed_newton`
    (``dS/dx = up``).

    Example:
        >>> abs(solve_sparsity(Lognormal(0.0, 1.0), 0.238422)) < 1e-5
        True
    """
    if not stochastic:
        return model.hard_quantile(target)
    S = model._S if type(target) is float else join(model._S, target)
    if S is not MATH and not quiet.active():
        with quiet():                            # arrays: numpy's warnings off once for the whole solve
            return solve_sparsity(model, target)
    xh = model.hard_quantile(target)
    step = model.step()
    hi = xh + step
    for _ in range(64):
        low = model.stochastic(hi) < target
        if not S.any_(low):
            break
        if S.all_(low):                          # every entry walks on
            step = 2.0 * step
            hi = hi + step
        else:
            step = S.where(low, 2.0 * step, step)
            hi = S.where(low, hi + step, hi)

    def fg(x: Any, i: Optional[np.ndarray]) -> tuple[Any, Any]:
        m, t = model, target
        if i is not None:
            m, t = model.at(i), target[i]
        u = m.up(x)  # dS/dx
        return m.hard(x) - u - t, u

    return bracketed_newton(fg, xh, hi)


def solve_ratio(model: Family, ratio: Any) -> Any:
    """``x`` with ``et2_ratio(x) = ratio`` (``ratio > 1``; the ratio grows from 1 with ``x``):
    one layer in floats, or arrays of one shape.

    Example:
        >>> m = Lognormal(0.0, 2.0)
        >>> abs(m.et2_ratio(solve_ratio(m, 1.25)) - 1.25) < 1e-12
        True
    """
    S = join(model._S, ratio)
    lo = -1.0 + 0.0 * ratio
    hi = 1.0 + 0.0 * ratio
    for _ in range(200):
        bad = model.et2_ratio(lo) > ratio
        if not S.any_(bad):
            break
        lo = S.where(bad, 2.0 * lo, lo)
    for _ in range(200):
        bad = model.et2_ratio(hi) < ratio
        if not S.any_(bad):
            break
        hi = S.where(bad, 2.0 * hi, hi)

    def f(x: Any, i: Optional[np.ndarray]) -> tuple[Any, None]:
        return model.at(i).et2_ratio(x) - (ratio if i is None else ratio[i]), None

    return bracketed_newton(f, lo, hi)


# ----------------------------------------------------------------------------- by name (fitting, plots)
def _of(name: str, p: Mapping[str, Any]) -> Family:
    return family(name).from_params(p)


def mean_loglik(family: str, p: Mapping[str, float]) -> float:
    """Mean log-likelihood per magnitude at the MLE (:meth:`Family.mean_loglik`)."""
    return _of(family, p).mean_loglik()


def cdf64(family: str, a: torch.Tensor, p: Mapping[str, float]) -> torch.Tensor:
    """The family's CDF of the magnitudes at ``a`` (:meth:`Family.cdf` in float64; ``a >= 0``, may hold inf)."""
    return _of(family, p).cdf(a.to(torch.float64))


def log_density64(family: str, a: torch.Tensor, p: Mapping[str, float]) -> torch.Tensor:
    """The family's log-density of the magnitudes at ``a > 0`` (:meth:`Family.log_density` in float64)."""
    return _of(family, p).log_density(a.to(torch.float64))


def log2_density(family: str, t: np.ndarray, p: Mapping[str, float]) -> np.ndarray:
    """The family's density of ``log2|g|`` at ``t`` (:meth:`Family.log2_density`; ``p`` as a fit gives them)."""
    return _of(family, p).log2_density(np.asarray(t, dtype=np.float64))


def ln_quantile(family: str, q: np.ndarray, p: Mapping[str, float]) -> np.ndarray:
    """The family's quantiles of ``ln|g|`` at probabilities ``q`` (:meth:`Family.ln_quantile`, for Q-Q plots)."""
    return _of(family, p).ln_quantile(np.asarray(q, dtype=np.float64))
