"""One safeguarded Newton iteration for the scalar root finders (threshold for a target
sparsity, the allocation's variance and sparsity budgets): Newton steps inside a bracket,
bisection whenever a step would leave it."""
from __future__ import annotations

import math
from typing import Callable


def bracketed_newton(fn: Callable[[float], tuple[float, float]], lo: float, hi: float, x: float, *,
                     tol: float = 1e-13, iters: int = 200, best: bool = False) -> float:
    """A root of the increasing ``fn`` (``x -> (value, slope)``) in ``[lo, hi]``, from ``x``.

    Each iteration evaluates ``fn(x)``, stops when ``|value| <= tol``, shrinks the bracket to
    the side of the root, then takes the Newton step if it lands strictly inside the bracket and
    bisects otherwise; it stops when the bracket is two adjacent floats. Returns the last
    iterate, or with ``best`` the evaluated point of smallest ``|value|``.

    Example:
        >>> round(bracketed_newton(lambda x: (x * x - 2.0, 2.0 * x), 0.0, 2.0, 1.0), 12)
        1.414213562373
    """
    best_v, best_x = math.inf, hi
    for _ in range(iters):
        v, slope = fn(x)
        if abs(v) < best_v:
            best_v, best_x = abs(v), x
        if abs(v) <= tol:
            break
        if v < 0:
            lo = x
        else:
            hi = x
        mid = 0.5 * (lo + hi)
        nx = x - v / slope if slope != 0 else math.nan
        x = nx if (math.isfinite(nx) and lo < nx < hi) else mid
        if mid <= lo or mid >= hi:  # the bracket is two adjacent floats
            break
    return best_x if best else x
