"""Elementwise functions for a Python float, a numpy array or a torch tensor alike: each formula of
:mod:`gradstats.families` (and the lognormal predictions of :mod:`gradstats.fpanalysis.composed`)
is written once on them.

A float goes through ``math`` (the standard normal's CDF, its logarithm and its quantile, and the
inverse error function written here in floats), an array through numpy and scipy, a tensor through
torch: on one layer's floats a numpy call costs a microsecond of bookkeeping per ufunc, ``math``
a few tens of nanoseconds. The float versions follow numpy where ``math`` would raise: ``exp``
overflows to ``inf``, ``log(0)`` is ``-inf``. ``numpy`` scalars (``np.float64``) and ints count as
floats; anything else (lists, 0-d arrays) as arrays.

Each library's functions form a namespace (:data:`Backend`: :data:`MATH`, :data:`NUMPY`, :data:`TORCH`)
under the same names as this module's functions; :func:`backend` picks one from the arguments' types,
once per formula, and the formula calls its functions (``S.exp(x)``), which then check nothing. The
module's functions (``exp(x)``, ...) pick the library on every call: for the odd call outside a formula.

Example:
    >>> import numpy as np
    >>> from gradstats._special import backend, ndtr
    >>> ndtr(0.0), ndtr(np.array([0.0])).tolist()
    (0.5, [0.5])
    >>> S = backend(0.0, 1.0)
    >>> S.name, S.ndtr(0.0), backend(np.zeros(1), 1.0).name
    ('math', 0.5, 'numpy')
"""
from __future__ import annotations

import contextvars
import math
import types
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


def _log1(x: float) -> float:
    return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)


def _expm1_1(x: float) -> float:
    return math.expm1(x) if x < _EXP_MAX else math.inf


def _log1p1(x: float) -> float:
    return math.log1p(x) if x > -1.0 else (-math.inf if x == -1.0 else math.nan)


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


# ----------------------------------------------------------------------------- selections, any kind
_FLOATS = (float, int, np.floating, np.integer)


def is_float(x: Any) -> bool:
    """Whether ``x`` is one number (a Python or numpy scalar), which the functions here compute in ``math``."""
    return type(x) is float or isinstance(x, _FLOATS)


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


# ----------------------------------------------------------------------------- the libraries
#: a library's functions under the names of this module's functions (``exp``, ``log``, ``expm1``,
#: ``log1p``, ``erf``, ``erfinv``, ``ndtr``, ``log_ndtr``, ``ndtri``, ``isfinite``, ``where``,
#: ``minimum``, ``maximum``, ``any_``, ``all_``, ``shown``), its ``name`` and ``rank`` (math < numpy <
#: torch: an expression in values of two libraries is in the higher one's). A plain module object,
#: whose attributes a call site looks up as fast as a global: :data:`MATH`, :data:`NUMPY`, :data:`TORCH`
Backend = types.ModuleType


def _library(name: str, rank: int, doc: str, **fns: Any) -> Backend:
    lib = types.ModuleType(f"{__name__}.{name}", doc)
    lib.__dict__.update(fns, name=name, rank=rank)
    return lib


def join(lib: Backend, x: Any) -> Backend:
    """The library of an expression in ``lib``'s values and ``x``: the higher of the two.

    Example:
        >>> import numpy as np
        >>> join(MATH, 1.0).name, join(MATH, np.zeros(1)).name
        ('math', 'numpy')
    """
    t = type(x)
    if t is float:
        return lib
    o = NUMPY if t is np.ndarray else backend(x)
    return o if o.rank > lib.rank else lib


#: whether numpy's floating-point warnings are known to be off here (inside :class:`quiet`)
_QUIET = contextvars.ContextVar("gradstats_special_quiet", default=False)


class quiet:
    """A context with numpy's floating-point warnings off (``np.errstate(all="ignore")``) in which the
    :data:`NUMPY` library's ``exp`` and ``log`` know it and skip their own ``errstate`` (a microsecond
    a call): for the array solvers' loops.

    Example:
        >>> import numpy as np
        >>> with quiet():
        ...     float(NUMPY.log(np.zeros(1))[0])
        -inf
    """

    __slots__ = ("_state", "_token")

    @staticmethod
    def active() -> bool:
        """Whether inside a :class:`quiet` context."""
        return _QUIET.get()

    def __enter__(self) -> "quiet":
        self._state = np.errstate(all="ignore")
        self._state.__enter__()
        self._token = _QUIET.set(True)
        return self

    def __exit__(self, *exc: Any) -> None:
        _QUIET.reset(self._token)
        self._state.__exit__(*exc)


def _quiet(fn: Any) -> Any:
    """``fn`` without numpy's divide, overflow and invalid warnings."""
    def g(x: np.ndarray) -> np.ndarray:
        if _QUIET.get():
            return fn(x)
        with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
            return fn(x)
    return g


def _where1(cond: Any, a: Any, b: Any) -> Any:
    return a if cond else b


def _shown1(v: Any, ok: Any) -> Any:
    return v


#: one number, in ``math`` (numpy's conventions where ``math`` would raise)
MATH = _library("math", 0, "One number, in math.", exp=exp_or_inf, log=_log1, expm1=_expm1_1, log1p=_log1p1,
                erf=math.erf, erfinv=erfinv1, ndtr=ndtr1, log_ndtr=log_ndtr1, ndtri=ndtri1, isfinite=math.isfinite,
                where=_where1, minimum=min, maximum=max, any_=bool, all_=bool, shown=_shown1)
#: numpy arrays, in numpy and scipy (``exp`` and ``log`` without warnings); the selections take any kind
NUMPY = _library("numpy", 1, "Arrays, in numpy and scipy.", exp=_quiet(np.exp), log=_quiet(np.log),
                 expm1=np.expm1, log1p=np.log1p, erf=special.erf, erfinv=special.erfinv, ndtr=special.ndtr,
                 log_ndtr=special.log_ndtr, ndtri=special.ndtri, isfinite=np.isfinite, where=where,
                 minimum=minimum, maximum=maximum, any_=any_, all_=all_, shown=shown)
#: torch tensors, in torch; the selections take any kind
TORCH = _library("torch", 2, "Tensors, in torch.", exp=torch.exp, log=torch.log, expm1=torch.expm1,
                 log1p=torch.log1p, erf=torch.erf, erfinv=torch.erfinv, ndtr=torch.special.ndtr,
                 log_ndtr=torch.special.log_ndtr, ndtri=torch.special.ndtri, isfinite=torch.isfinite, where=where,
                 minimum=minimum, maximum=maximum, any_=any_, all_=all_, shown=shown)


def backend(*xs: Any) -> Backend:
    """The library of an expression in ``xs``: :data:`TORCH` if any is a tensor, else :data:`NUMPY`
    if any is an array (or anything but a number and None), else :data:`MATH`.

    Example:
        >>> backend(1.0, None).name, backend(1.0, [2.0]).name
        ('math', 'numpy')
    """
    b = MATH
    for x in xs:
        t = type(x)
        if t is float or x is None:
            continue
        if t is np.ndarray:
            b = NUMPY
        elif isinstance(x, torch.Tensor):
            return TORCH
        elif not isinstance(x, _FLOATS):
            b = NUMPY
    return b


# ----------------------------------------------------------------------------- one call, any kind
def _array(x: Any) -> Any:
    """``x`` for the numpy or torch branch: a tensor as it is, anything else as an array."""
    return x if isinstance(x, (np.ndarray, torch.Tensor)) else np.asarray(x, dtype=np.float64)


def _call(name: str, x: Any) -> Any:
    """The function ``name`` of the library of ``x``, but a float: an array, a tensor, a numpy
    scalar or int (as a float), or what converts to an array."""
    if type(x) is np.ndarray:
        return getattr(NUMPY, name)(x)
    if isinstance(x, _FLOATS):
        return getattr(MATH, name)(float(x))
    x = _array(x)
    return getattr(TORCH if isinstance(x, torch.Tensor) else NUMPY, name)(x)


def exp(x: Any) -> Any:
    """``e**x`` (a float overflows to inf)."""
    return exp_or_inf(x) if type(x) is float else _call("exp", x)


def log(x: Any) -> Any:
    """The natural logarithm (``-inf`` at 0, NaN below)."""
    return _log1(x) if type(x) is float else _call("log", x)


def expm1(x: Any) -> Any:
    """``e**x - 1``."""
    return _expm1_1(x) if type(x) is float else _call("expm1", x)


def log1p(x: Any) -> Any:
    """``ln(1 + x)``."""
    return _log1p1(x) if type(x) is float else _call("log1p", x)


def erf(x: Any) -> Any:
    """The error function."""
    return math.erf(x) if type(x) is float else _call("erf", x)


def erfinv(x: Any) -> Any:
    """The inverse error function."""
    return erfinv1(x) if type(x) is float else _call("erfinv", x)


def ndtr(x: Any) -> Any:
    """The standard normal CDF."""
    return ndtr1(x) if type(x) is float else _call("ndtr", x)


def log_ndtr(x: Any) -> Any:
    """``ln`` of the standard normal CDF, accurate in the lower tail."""
    return log_ndtr1(x) if type(x) is float else _call("log_ndtr", x)


def ndtri(x: Any) -> Any:
    """The standard normal quantile."""
    return ndtri1(x) if type(x) is float else _call("ndtri", x)


def isfinite(x: Any) -> Any:
    """Whether finite."""
    return math.isfinite(x) if type(x) is float else _call("isfinite", x)
