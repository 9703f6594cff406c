"""Elementwise functions for a Python float, a numpy array or a torch tensor alike: each formula of
:mod:`gradstats.families` (and the lognormal predictions of :mod:`gradstats.fpanalysis.composed`)
is written once on them.

A float goes through ``math`` (the standard normal's CDF, its logarithm and its quantile, and the
inverse error function written here in floats), an array through numpy and scipy, a tensor through
torch: on one layer's floats a numpy call costs a microsecond of bookkeeping per ufunc, ``math``
a few tens of nanoseconds. The float versions follow numpy where ``math`` would raise: ``exp``
overflows to ``inf``, ``log(0)`` is ``-inf``. ``numpy`` scalars (``np.float64``) and ints count as
floats; anything else (lists, 0-d arrays) as arrays.

Example:
    >>> import numpy as np
    >>> from gradstats._special import ndtr
    >>> ndtr(0.0), ndtr(np.array([0.0])).tolist()
    (0.5, [0.5])
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import Any

import numpy as np
import torch
from scipy import special

_SQRT1_2 = math.sqrt(0.5)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_HALF_LN_2PI = 0.5 * math.log(2.0 * math.pi)
_EXP_MAX = 709.78
_inv_cdf = NormalDist().inv_cdf


# ----------------------------------------------------------------------------- floats
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
    if x == -math.inf:
        return -math.inf
    r = 1.0 / (x * x)
    # 1 - 1/x^2 + 3/x^4 - 15/x^6 + ...: at |x| >= 37 the terms fall below 1e-17 by the eighth
    series, term = 1.0, 1.0
    for k in range(1, 10):
        term *= -(2 * k - 1) * r
        series += term
    return -0.5 * x * x - math.log(-x) - _HALF_LN_2PI + math.log(series)


def ndtri1(q: float) -> float:
    """The standard normal quantile ``Phi^-1(q)`` of one float (-inf at 0, inf at 1, NaN outside).

    Example:
        >>> ndtri1(0.5)
        0.0
    """
    if q <= 0.0:
        return -math.inf if q == 0.0 else math.nan
    if q >= 1.0:
        return math.inf if q == 1.0 else math.nan
    return _inv_cdf(q)


def erfinv1(q: float) -> float:
    """The inverse error function of one float in ``[-1, 1]``: the normal quantile, refined by
    Newton steps on ``erf`` (or ``erfc`` above 1/2, where ``1 - q`` is exact).

    Example:
        >>> round(math.erf(erfinv1(0.3)), 15)
        0.3
    """
    if q <= 0.0:
        return 0.0 if q == 0.0 else -erfinv1(-q)
    if q >= 1.0:
        return math.inf if q == 1.0 else math.nan
    x = ndtri1(0.5 * (1.0 + q)) * _SQRT1_2
    for _ in range(3):
        f = math.erf(x) - q if q < 0.5 else (1.0 - q) - math.erfc(x)
        d = _TWO_OVER_SQRT_PI * math.exp(-x * x)
        if d == 0.0:
            break
        x -= f / d
    return x


# ----------------------------------------------------------------------------- dispatch
_FLOATS = (float, int, np.floating, np.integer)


def is_float(x: Any) -> bool:
    """Whether ``x`` is one number (a Python or numpy scalar), which the functions here compute in ``math``."""
    return type(x) is float or isinstance(x, _FLOATS)


def _array(x: Any) -> Any:
    """``x`` for the numpy or torch branch: a tensor as it is, anything else as an array."""
    return x if isinstance(x, (np.ndarray, torch.Tensor)) else np.asarray(x, dtype=np.float64)


def _other(x: Any, on_array: Any, on_tensor: Any, on_float: Any) -> Any:
    """The branch of anything but a Python float: an array, a tensor, a numpy scalar or int (as a
    float), or what converts to an array."""
    if type(x) is np.ndarray:
        return on_array(x)
    if isinstance(x, _FLOATS):
        return on_float(float(x))
    x = _array(x)
    return on_tensor(x) if isinstance(x, torch.Tensor) else on_array(x)


def _quiet(fn: Any) -> Any:
    def g(x: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return fn(x)
    return g


_np_exp, _np_log = _quiet(np.exp), _quiet(np.log)

# Each function: the float branch written inline (one call per operation on one layer's floats),
# then numpy or torch. The float branches of ndtr and log_ndtr are ndtr1 and log_ndtr1, inlined.


def exp(x: Any) -> Any:
    """``e**x`` (a float overflows to inf)."""
    if type(x) is float:
        return math.exp(x) if x < _EXP_MAX else math.inf
    return _other(x, _np_exp, torch.exp, exp)


def log(x: Any) -> Any:
    """The natural logarithm (``-inf`` at 0, NaN below)."""
    if type(x) is float:
        return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)
    return _other(x, _np_log, torch.log, log)


def expm1(x: Any) -> Any:
    """``e**x - 1``."""
    if type(x) is float:
        return math.expm1(x) if x < _EXP_MAX else math.inf
    return _other(x, np.expm1, torch.expm1, expm1)


def log1p(x: Any) -> Any:
    """``ln(1 + x)``."""
    if type(x) is float:
        return math.log1p(x) if x > -1.0 else (-math.inf if x == -1.0 else math.nan)
    return _other(x, np.log1p, torch.log1p, log1p)


def erf(x: Any) -> Any:
    """The error function."""
    if type(x) is float:
        return math.erf(x)
    return _other(x, special.erf, torch.erf, erf)


def erfinv(x: Any) -> Any:
    """The inverse error function."""
    if type(x) is float:
        return erfinv1(x)
    return _other(x, special.erfinv, torch.erfinv, erfinv)


def ndtr(x: Any) -> Any:
    """The standard normal CDF."""
    if type(x) is float:
        z = abs(x) * _SQRT1_2
        if z < _SQRT1_2:
            return 0.5 + 0.5 * math.erf(x * _SQRT1_2)
        y = 0.5 * math.erfc(z)
        return 1.0 - y if x > 0 else y
    return _other(x, special.ndtr, torch.special.ndtr, ndtr)


def log_ndtr(x: Any) -> Any:
    """``ln`` of the standard normal CDF, accurate in the lower tail."""
    if type(x) is float:
        if x >= -1.0:
            return math.log1p(-0.5 * math.erfc(x * _SQRT1_2))
        if x > -37.0:
            return math.log(0.5 * math.erfc(-x * _SQRT1_2))
        return log_ndtr1(x)
    return _other(x, special.log_ndtr, torch.special.log_ndtr, log_ndtr)


def ndtri(x: Any) -> Any:
    """The standard normal quantile."""
    if type(x) is float:
        return ndtri1(x)
    return _other(x, special.ndtri, torch.special.ndtri, ndtri)


def isfinite(x: Any) -> Any:
    """Whether finite."""
    if type(x) is float:
        return math.isfinite(x)
    return _other(x, np.isfinite, torch.isfinite, isfinite)


def where(cond: Any, a: Any, b: Any) -> Any:
    """``a`` where ``cond``, else ``b`` (for one float: ``a if cond else b``)."""
    if cond is True:
        return a
    if cond is False or isinstance(cond, np.bool_):
        return a if cond else b
    if isinstance(cond, torch.Tensor):
        return torch.where(cond, a, b)
    return np.where(cond, a, b)


def _pairwise(a: Any, b: Any, on_floats: Any, on_tensors: Any, on_arrays: Any) -> Any:
    if type(a) is float and type(b) is float or is_float(a) and is_float(b):
        return on_floats(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return on_tensors(torch.as_tensor(a), torch.as_tensor(b))
    return on_arrays(a, b)


def minimum(a: Any, b: Any) -> Any:
    """The elementwise smaller (``min`` of two floats)."""
    return _pairwise(a, b, min, torch.minimum, np.minimum)


def maximum(a: Any, b: Any) -> Any:
    """The elementwise larger (``max`` of two floats)."""
    return _pairwise(a, b, max, torch.maximum, np.maximum)


def any_(cond: Any) -> bool:
    """Whether any entry holds (``bool`` of one)."""
    if cond is True or cond is False:
        return cond
    return bool(cond) if isinstance(cond, (bool, np.bool_)) else bool(cond.any())


def all_(cond: Any) -> bool:
    """Whether every entry holds (``bool`` of one)."""
    if cond is True or cond is False:
        return cond
    return bool(cond) if isinstance(cond, (bool, np.bool_)) else bool(cond.all())


def shown(v: Any, ok: Any) -> Any:
    """What an error message shows of ``v`` where ``ok`` fails: ``v`` itself (one float), or its
    first five failing entries."""
    if isinstance(ok, (bool, np.bool_)):
        return v
    return np.asarray(v)[~np.asarray(ok)].reshape(-1)[:5]
