"""The best scale of a format for lognormal gradients: :func:`optimal_scale`.

With a per-tensor scale ``s`` the format sees ``ln(|g| s) ~ N(mu + ln s, sigma**2)``, so the error
depends on ``mu + ln s`` and ``sigma`` only: the best ``ln s`` is ``m*(sigma) - mu`` and the best
split, once the scale is optimised, depends on ``sigma`` alone.

Search (vectorised over layers): start at the power of two that centres the format's normal range
``[min_normal, max]`` on ``mu + 2 sigma**2`` (the location of the ``x**2``-weighted distribution
that the MSE sees; ``mu`` for the elementwise criterion), evaluate 5 neighbouring powers of two,
walk downhill until both neighbours are worse, and (``power_of_two=False``) refine on a grid of
quarter binades over the two neighbouring binades followed by successive parabolic interpolation.
Powers of two whose error lies within ``tie_rtol`` (relative) of the best are ties; the one nearest the centring scale
wins, which keeps the most headroom on both sides when the error is flat over many binades. Given
the tensor's maximum (``amax``) the largest tied scale wins instead: nothing above ``amax`` can
clip, and the extra binades at the bottom protect the small values (real gradients have a longer
lower tail than the lognormal).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gradstats._special import backend
from gradstats.formats import FPFormat
from gradstats.fpanalysis import _params as P
from gradstats.fpanalysis.error import integrals

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["optimal_scale", "ScaleResult", "TIE_RTOL"]

#: relative tolerance within which two powers of two count as equally good
TIE_RTOL = 1e-6


def _mode(criterion: str) -> str:
    return "elementwise" if criterion == "elementwise" else "relative"


@functools.lru_cache(maxsize=256)
def _centre(fmt: FPFormat) -> float:
    """ln of the middle of the format's normal range (in ln)."""
    return 0.5 * (math.log(fmt.max) + math.log(fmt.min_normal))


def _anchor(fmt: FPFormat, mu: Any, sigma: Any, criterion: str, amax=None) -> Any:
    """log2 of the scale that centres the normal range on the distribution the criterion weighs
    (kept a sigma below ``amax`` when the lognormal is truncated there); floats or arrays."""
    centre = _centre(fmt)
    loc = mu + (2 * sigma * sigma if criterion == "mse" else 0.0)
    if amax is not None:
        S = backend(amax)
        loc = S.minimum(loc, S.log(amax) - sigma)
    return (centre - loc) / P.LN2


class _Objective:
    """Total error as a function of log2(scale), rows = layers."""

    def __init__(self, fmt, mu, sigma, rounding, criterion, amax=None, n_nonzero=None):
        self.fmt, self.mu, self.sigma, self.amax, self.nnz = fmt, mu, sigma, amax, n_nonzero
        self.rounding, self.mode = rounding, _mode(criterion)

    def __call__(self, j: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """``j``: (len(rows), K) log2 scales; returns the totals, same shape."""
        k = j.shape[1]
        every = rows.size == self.mu.size                  # all rows, in order: no gather

        def at(v: np.ndarray) -> np.ndarray:
            v = v if every else v[rows]
            return v.repeat(k) if k > 1 else v

        res = integrals(self.fmt, at(self.mu), at(self.sigma), None, j.ravel() * P.LN2, rounding=self.rounding,
                        overflow="saturate", mode=self.mode, amax=None if self.amax is None else at(self.amax),
                        n_nonzero=None if self.nnz is None else at(self.nnz))
        return np.add.reduce(res[:, :4], axis=1).reshape(j.shape)


def _parabola(a, b, c, fa, fb, fc):
    """Vertex of the parabola through three points (b the lowest); bisects the larger side when
    the parabola is not convex or the vertex leaves ``(a, c)``."""
    p = (b - a) ** 2 * (fb - fc) - (b - c) ** 2 * (fb - fa)
    q = (b - a) * (fb - fc) - (b - c) * (fb - fa)
    with np.errstate(divide="ignore", invalid="ignore"):
        x = b - 0.5 * p / q
    fallback = np.where(b - a > c - b, 0.5 * (a + b), 0.5 * (b + c))
    bad = ~np.isfinite(x) | (q >= 0) | (x <= a) | (x >= c) | (np.abs(x - b) < 1e-7)
    return np.where(bad, fallback, x)


#: the powers of two of the search's first grid (log2, around the centring scale), their distance
#: from it, and the two neighbours of a power of two
_OFFS = np.arange(-2, 3, dtype=np.float64)
_FAR = np.abs(_OFFS)[None, :]
_INNER = np.array([False, True, True, True, False])      # the grid's interior
_EDGE = ~_INNER
_SIDES = np.array([[-1.0, 1.0]])


def _search(obj: _Objective, j0: np.ndarray, power_of_two: bool, tie_rtol: float,
            prefer_large: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The search (see the module doc) from the powers of two ``2**j0`` (the rounded anchors)."""
    n = j0.size
    allrows = np.arange(n)
    grid = j0[:, None] + _OFFS
    e = obj(grid, allrows)
    ok = e <= np.minimum.reduce(e, axis=1, keepdims=True) * (1 + tie_rtol)
    pick = np.where(ok, _FAR, np.inf).argmin(axis=1)
    j = grid[allrows, pick]
    ej = e[allrows, pick]
    # the errors at j - 1 and j + 1, which only the continuous refinement reads
    nbr = None if power_of_two else np.empty((n, 2))
    # an interior pick is the grid's minimum (up to the tie tolerance): its neighbours are known and
    # no step from it goes downhill, so only picks on the grid's edge walk on
    if nbr is not None:
        inner = _INNER[pick]
        nbr[inner, 0] = e[allrows[inner], pick[inner] - 1]
        nbr[inner, 1] = e[allrows[inner], pick[inner] + 1]
    active = allrows[_EDGE[pick]]
    for _ in range(400):  # walk downhill (rarely more than a few steps)
        if active.size == 0:
            break
        nb = j[active, None] + _SIDES
        en = obj(nb, active)
        side = np.argmin(en, axis=1)
        emin = en[np.arange(active.size), side]
        move = emin < ej[active] * (1 - tie_rtol)
        if nbr is not None:
            nbr[active[~move]] = en[~move]
        j[active[move]] = nb[move, side[move]]
        ej[active[move]] = emin[move]
        active = active[move]
    if prefer_large:  # climb to the largest scale of a flat optimum
        active = allrows
        for _ in range(400):
            if active.size == 0:
                break
            up = obj(j[active, None] + 1.0, active)[:, 0]
            move = up <= ej[active] * (1 + tie_rtol)
            j[active[move]] += 1.0
            if nbr is not None:
                nbr[active[move], 0] = ej[active[move]]
                nbr[active[~move], 1] = up[~move]
            ej[active[move]] = np.minimum(ej[active[move]], up[move])
            active = active[move]
    if power_of_two:
        return j, ej
    # continuous: quarter binades over [j - 1, j + 1] (with small sigma the error is nearly periodic
    # in log2(scale), so there may be several local minima), then successive parabolic
    # interpolation around the best point
    offs = np.arange(-4, 5) / 4.0
    xs = j[:, None] + offs[None, :]
    mid = obj(xs[:, [1, 2, 3, 5, 6, 7]], allrows)
    fs = np.column_stack([nbr[:, 0], mid[:, :3], ej, mid[:, 3:], nbr[:, 1]])
    i = np.clip(np.argmin(fs, axis=1), 1, offs.size - 2)
    a, b, c = (xs[allrows, i + d] for d in (-1, 0, 1))
    fa, fb, fc = (fs[allrows, i + d] for d in (-1, 0, 1))
    for _ in range(6):
        x = _parabola(a, b, c, fa, fb, fc)
        fx = obj(x[:, None], allrows)[:, 0]
        better, left = fx < fb, x < b
        a, fa = np.where(better & ~left, b, np.where(~better & left, x, a)), \
            np.where(better & ~left, fb, np.where(~better & left, fx, fa))
        c, fc = np.where(better & left, b, np.where(~better & ~left, x, c)), \
            np.where(better & left, fb, np.where(~better & ~left, fx, fc))
        b, fb = np.where(better, x, b), np.where(better, fx, fb)
    return b, fb


def _check_range(fmt: FPFormat, j: Any) -> None:
    lo, hi = P.LOG2_SCALE_RANGE
    bad = (j < lo) | (j > hi)
    if backend(j).any_(bad):
        first = j if type(j) is float else j[bad][0]
        raise ValueError(f"format {fmt}: the best scale 2**{first:.1f} lies outside 2**{lo}..2**{hi}, "
                         "which float32 (and an E8M0 scale) cannot represent: mu of ln|g| is too far "
                         "from the format's range")


def _optimal(fmt, mu, sigma, *, power_of_two, rounding, criterion, amax=None, n_nonzero=None,
             tie_rtol=TIE_RTOL):
    """``(log2 scale, error)`` per layer: ``mu``, ``sigma`` flat arrays (and ``amax``, ``n_nonzero``),
    or one layer's floats (then floats out; the search runs on arrays of one entry, the anchor
    and the range check in floats)."""
    one = type(mu) is float
    anchor = _anchor(fmt, mu, sigma, criterion, amax)
    if one:
        v = np.array([mu, sigma, round(anchor)], dtype=np.float64)
        mu, sigma, j0 = v[0:1], v[1:2], v[2:3]
    else:
        j0 = np.round(anchor)
    obj = _Objective(fmt, mu, sigma, rounding, criterion, amax, n_nonzero)
    j, e = _search(obj, j0, power_of_two, tie_rtol, prefer_large=amax is not None)
    if one:
        j, e = float(j[0]), float(e[0])
    _check_range(fmt, j)
    return j, e


def _valid_floats(mu: Any, sigma: Any, p0: Any) -> bool:
    """Whether ``mu``, ``sigma``, ``p0`` are one layer's numbers in the domain of
    :func:`gradstats.fpanalysis._params.lognormal` (which checks, and names, anything else)."""
    return (type(mu) is float and type(sigma) is float and type(p0) is float
            and math.isfinite(mu) and 0 < sigma <= P.SIGMA_MAX and 0 <= p0 < 1)


@dataclass(frozen=True)
class ScaleResult:
    """The error-minimising scale of one format (see :func:`optimal_scale`).

    Attributes:
        format: the format.
        scale: multiply gradients by it before quantising (``quantize(g * scale, fmt) / scale``).
        log2_scale: ``log2(scale)`` (an integer when ``power_of_two``).
        error: the predicted error at that scale (the criterion's, relative).
        mu, sigma: the inputs; power_of_two, rounding, criterion: the setting.

    Example:
        >>> r = optimal_scale("e4m3fn", mu=-9.0, sigma=1.5)
        >>> r.log2_scale, round(r.error * 1e4, 2)
        (7.0, 7.15)
    """

    format: FPFormat
    scale: Any
    log2_scale: Any
    error: Any
    mu: Any
    sigma: Any
    power_of_two: bool = True
    rounding: str = "nearest"
    criterion: str = "mse"

    def __float__(self) -> float:
        return float(self.scale)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (arrays as lists)."""
        tl = lambda v: v.tolist() if isinstance(v, np.ndarray) else v  # noqa: E731
        return {"format": str(self.format), "scale": tl(self.scale), "log2_scale": tl(self.log2_scale),
                "error": tl(self.error), "mu": tl(self.mu), "sigma": tl(self.sigma),
                "power_of_two": self.power_of_two, "rounding": self.rounding, "criterion": self.criterion}

    def to_dataframe(self) -> "pd.DataFrame":
        """One row per layer."""
        import pandas as pd

        cols = {k: np.ravel(np.asarray(getattr(self, k), dtype=np.float64))
                for k in ("mu", "sigma", "scale", "log2_scale", "error")}
        df = pd.DataFrame(cols)
        df.insert(0, "format", str(self.format))
        return df


def optimal_scale(
    fmt: FPFormat | str,
    *,
    mu: P.ArrayLike,
    sigma: P.ArrayLike,
    power_of_two: bool = True,
    rounding: str = "nearest",
    criterion: str = "mse",
    amax: P.ArrayLike | None = None,
    numel: P.ArrayLike | None = None,
    p0: P.ArrayLike = 0.0,
) -> ScaleResult:
    """The per-tensor scale that minimises the predicted error of ``fmt`` on lognormal gradients.

    Vectorised over layers (``mu``, ``sigma`` arrays). Saturating casts are assumed (with
    non-saturating ones, check ``expected_error(..., overflow="nonfinite").nonfinite`` at this scale).
    The criterion is ``"mse"`` (MSE / E[g**2]; exact zeros change nothing) or ``"elementwise"``
    (mean relative squared error): both give the same minimum error, the elementwise scale is larger
    by ``2 sigma**2`` nats (see ``docs/fpanalysis.md``).

    Args:
        fmt: the format (name or :class:`~gradstats.formats.FPFormat`).
        mu, sigma: mean and std of ``ln|g|`` (natural log).
        power_of_two: restrict to ``2**k`` (exact scaling, what hardware applies); ``False``
            refines continuously.
        rounding: ``"nearest"`` or ``"stochastic"``.
        criterion: ``"mse"`` or ``"elementwise"``.
        amax, numel, p0: the tensor's largest magnitude, entries and zero fraction, if known: optimise
            the error of this tensor given its maximum (see :func:`~gradstats.fpanalysis.expected_error`).

    Raises ``ValueError`` when the best scale lies outside ``2**-126..2**127`` (not representable).

    Example:
        >>> r = optimal_scale("e5m2", mu=[-12.0, -6.0], sigma=[2.0, 2.0])
        >>> r.log2_scale.tolist()
        [6.0, -2.0]
        >>> round(optimal_scale("e2m1fn", mu=0.0, sigma=1.0, power_of_two=False).log2_scale, 3)
        -1.694
    """
    fmt = P.check_format(fmt)
    P.check_choice("rounding", rounding, P.PREDICTED_ROUNDINGS)
    P.check_choice("criterion", criterion, P.CRITERIA)
    if amax is None and _valid_floats(mu, sigma, p0):        # one layer: its floats, checked in floats
        P.numel_array(numel, ())
        j, e = _optimal(fmt, mu, sigma, power_of_two=bool(power_of_two), rounding=rounding, criterion=criterion)
        return ScaleResult(format=fmt, scale=float(np.exp2(j)), log2_scale=j, error=e, mu=mu, sigma=sigma,
                           power_of_two=bool(power_of_two), rounding=rounding, criterion=criterion)
    shape, arrs = P.lognormal(mu, sigma, p0, *([("amax", amax)] if amax is not None else []))
    mu_, s_, p0_ = arrs[:3]
    am = P.check_amax(arrs[3]) if amax is not None else None
    nn = P.numel_array(numel, shape)
    nz = None if (am is None or nn is None) else (1 - p0_) * nn
    j, e = _optimal(fmt, mu_, s_, power_of_two=bool(power_of_two), rounding=rounding, criterion=criterion,
                    amax=am, n_nonzero=nz)
    o = lambda v: P.out(v, shape)  # noqa: E731
    return ScaleResult(format=fmt, scale=o(np.exp2(j)), log2_scale=o(j), error=o(e), mu=o(mu_), sigma=o(s_),
                       power_of_two=bool(power_of_two), rounding=rounding, criterion=criterion)
