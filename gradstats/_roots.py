"""The one root finder of the package: a safeguarded Newton iteration inside a bracket, for one
root in Python floats or for many at once in numpy arrays (the threshold for a target sparsity in
every family, the histogram rule, the allocation's variance and sparsity budgets, the ratio of the
cosine floors).

Each iteration evaluates the function, stops where ``|value| <= tol``, shrinks the bracket to the
side of the root, then takes the Newton step if it lands strictly inside the bracket and bisects
otherwise (bisects always where no slope is given); it stops where the bracket is two adjacent
floats. The array path runs the same iteration on every entry, evaluating only the entries not yet
done (``fn(x, idx)`` gets their indices, so that it can pick their parameters).
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np

from gradstats._special import quiet

#: ``fn(x, idx) -> (value, slope)``: ``idx`` None for one root, else the indices of the entries of
#: ``x`` (those not yet done); ``slope`` may be None (bisection)
RootFunction = Callable[[Any, Optional[np.ndarray]], tuple[Any, Any]]


def bracketed_newton(fn: RootFunction, lo: Any, hi: Any, x: Any = None, *, tol: float = 1e-13,
                     iters: int = 200, best: bool = False) -> Any:
    """A root of the increasing ``fn`` in ``[lo, hi]`` (``fn(lo) <= 0 <= fn(hi)``), from ``x``
    (default: the bracket's middle); elementwise where ``lo`` and ``hi`` are arrays.

    ``fn(x, idx)`` returns ``(value, slope)`` at ``x``: with float ``lo`` and ``hi`` one root, ``x``
    a float and ``idx`` None; with arrays ``x`` holds the entries ``idx`` still being solved.
    Returns the last iterate, or with ``best`` the evaluated point of smallest ``|value|``.

    Example:
        >>> round(bracketed_newton(lambda x, _: (x * x - 2.0, 2.0 * x), 0.0, 2.0), 12)
        1.414213562373
        >>> import numpy as np
        >>> c = np.array([2.0, 3.0])
        >>> bracketed_newton(lambda x, i: (x * x - c[i], 2.0 * x), np.zeros(2), np.full(2, 2.0)).round(12).tolist()
        [1.414213562373, 1.732050807569]
    """
    if not (type(lo) is float and type(hi) is float or isinstance(lo, (float, int)) and isinstance(hi, (float, int))):
        return _many(fn, lo, hi, x, tol, iters, best)
    # one root, in floats (a few microseconds: what apply's refresh solves on every step)
    x = 0.5 * (lo + hi) if x is None else x
    lo, hi = float(lo), float(hi)
    best_v, best_x = math.inf, hi
    isfinite = math.isfinite
    for _ in range(iters):
        v, slope = fn(x, None)
        av = abs(v)
        if best and av < best_v:
            best_v, best_x = av, x
        if av <= tol:
            break
        if v < 0:
            lo = x
        else:
            hi = x
        mid = 0.5 * (lo + hi)
        nx = x - v / slope if slope else math.nan
        x = nx if (isfinite(nx) and lo < nx < hi) else mid
        if mid <= lo or mid >= hi:  # the bracket is two adjacent floats
            break
    return best_x if best else x


def _many(fn: RootFunction, lo: Any, hi: Any, x0: Any, tol: float, iters: int, best: bool) -> np.ndarray:
    """Every root of the arrays at once: the iteration of one root, entry by entry."""
    lo = np.array(lo, dtype=np.float64, copy=True)
    hi = np.array(hi, dtype=np.float64, copy=True)
    x = 0.5 * (lo + hi) if x0 is None else np.array(np.broadcast_to(x0, lo.shape), dtype=np.float64)
    best_x = hi.copy() if best else None
    bv_f = np.full(x.size, np.inf) if best else None
    active = np.arange(x.size)
    lo_f, hi_f, x_f = lo.reshape(-1), hi.reshape(-1), x.reshape(-1)
    bx_f = best_x.reshape(-1) if best else None
    with quiet():
        for _ in range(iters):
            if active.size == 0:
                break
            xa = x_f[active]
            fa, da = fn(xa, active)
            fa = np.asarray(fa, dtype=np.float64)
            if best:
                better = np.abs(fa) < bv_f[active]
                bv_f[active[better]], bx_f[active[better]] = np.abs(fa[better]), xa[better]
            done = np.abs(fa) <= tol
            neg = fa < 0
            la = np.where(neg, xa, lo_f[active])
            ha = np.where(neg, hi_f[active], xa)
            lo_f[active], hi_f[active] = la, ha
            mid = 0.5 * (la + ha)
            if da is not None:
                nx = xa - fa / da
                nx = np.where(np.isfinite(nx) & (nx > la) & (nx < ha), nx, mid)
            else:
                nx = mid
            stuck = (mid <= la) | (mid >= ha)  # the bracket is two adjacent floats
            x_f[active] = np.where(done, xa, nx)
            active = active[~(done | stuck)]
    return best_x if best else x
