"""The exact engine: a format's quantisation cells as polynomial pieces, integrated against a
lognormal with its partial moments.

Everything here works on the magnitude ``y = |x| * s`` (the scaled value the format sees).
A *piece* is an interval ``[lo, hi)`` of ``y`` on which each tracked quantity is a polynomial
in ``y`` of degree <= 3:

- the squared error ``(Q(y) - y)**2`` (nearest rounding: ``(q - y)**2`` on the cell of ``q``;
  stochastic rounding between neighbours ``q0 < q1``: its variance ``(y - q0)(q1 - y)``;
  saturation: ``(y - max)**2``), filed under one of :data:`PARTS`;
- the probability that ``y`` is flushed to zero, saturated to ``max``, or becomes non-finite.

With ``ln y ~ N(m, s**2)`` every integral is a sum of partial moments
``E[y**k 1{a <= y < b}] = exp(k m + k**2 s**2 / 2) [Phi(z_b - k s) - Phi(z_a - k s)]``,
``z_t = (ln t - m) / s``. The pieces of a format are contiguous (``hi[p] == lo[p+1]``), so the
normal CDF is evaluated once per boundary. Differences of Phi are taken on the tail that keeps
precision (upper tails for positive arguments), and every term is combined in log space, so
the engine neither overflows nor loses the tails.
"""
from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.special import ndtr

from gradstats.formats import FPFormat

#: error parts, in the order of the engine's output columns
PARTS = ("overflow", "normal", "subnormal", "underflow")
#: probability quantities that follow the error parts in the output columns
FRACTIONS = ("flushed", "saturated", "nonfinite")
_OUT = PARTS + FRACTIONS
_N_ERR = len(PARTS)

#: error normalisations of :func:`integrate`
MODES = ("relative", "absolute", "elementwise")


@dataclass(frozen=True)
class Pieces:
    """Contiguous pieces of one format (see the module doc).

    ``bounds`` has ``P + 1`` entries (``0 ... inf``); the ``T`` terms each say: piece ``piece[t]``
    contributes ``sign[t] * exp(lnc[t]) * E[y**k[t] 1{piece}]`` to output column ``out[t]``.
    """

    fmt: FPFormat
    rounding: str
    overflow: str
    bounds: np.ndarray
    piece: np.ndarray
    k: np.ndarray
    lnc: np.ndarray
    sign: np.ndarray
    out: np.ndarray
    lnb: np.ndarray = field(init=False, repr=False, compare=False)   #: ``log(bounds)`` (``-inf`` at 0)

    def __post_init__(self) -> None:
        with np.errstate(divide="ignore"):
            object.__setattr__(self, "lnb", np.log(self.bounds))

    @property
    def n_pieces(self) -> int:
        return self.bounds.size - 1


def _overflow_threshold(fmt: FPFormat) -> float:
    """The next value of the format's unbounded grid above ``max`` (``max + 2**(emax - M)``)."""
    return fmt.max + math.ldexp(1.0, fmt.emax - fmt.man_bits)


def nonfinite_applies(fmt: FPFormat, overflow: str) -> bool:
    """Whether ``overflow="nonfinite"`` can produce inf/NaN in ``fmt`` (6/4-bit fn saturate anyway)."""
    return overflow == "nonfinite" and (fmt.has_inf or fmt.has_nan)


@functools.lru_cache(maxsize=512)
def build(fmt: FPFormat, rounding: str, overflow: str, split: tuple[float, ...] = ()) -> Pieces:
    """The pieces of ``fmt`` under ``rounding`` (``nearest``/``stochastic``) and ``overflow``;
    ``split`` adds boundaries (pieces containing them are cut in two, polynomials unchanged)."""
    v = fmt.values().numpy()
    v = v[v >= 0]
    vmax, vmin_normal = fmt.max, fmt.min_normal
    nonfinite = nonfinite_applies(fmt, overflow)
    nxt = _overflow_threshold(fmt)
    # each piece: (lo, hi, [(out column, poly coefficients c0..c3)])
    pieces: list[tuple[float, float, list[tuple[int, tuple[float, ...]]]]] = []
    UF, NR, SB, OV = (PARTS.index(p) for p in ("underflow", "normal", "subnormal", "overflow"))
    FL, SA, NF = (_OUT.index(p) for p in FRACTIONS)
    if rounding == "nearest":
        mids = (v[:-1] + v[1:]) / 2
        lows = np.concatenate([[0.0], mids])
        highs = np.concatenate([mids, [vmax]])
        for q, lo, hi in zip(v, lows, highs):
            if q == 0:
                pieces.append((lo, hi, [(UF, (0, 0, 1)), (FL, (1,))]))
            else:
                part = NR if q >= vmin_normal else SB
                pieces.append((lo, hi, [(part, (q * q, -2 * q, 1))]))
        if nonfinite:
            thr = (vmax + nxt) / 2
            pieces.append((vmax, thr, [(OV, (vmax * vmax, -2 * vmax, 1))]))
            pieces.append((thr, math.inf, [(NF, (1,))]))
        else:
            pieces.append((vmax, math.inf, [(OV, (vmax * vmax, -2 * vmax, 1)), (SA, (1,))]))
    elif rounding == "stochastic":
        for q0, q1 in zip(v[:-1], v[1:]):
            poly = (-q0 * q1, q0 + q1, -1)
            if q0 == 0:
                pieces.append((q0, q1, [(UF, poly), (FL, (1, -1 / q1))]))
            else:
                pieces.append((q0, q1, [(NR if q1 > vmin_normal else SB, poly)]))
        if nonfinite:
            d = nxt - vmax
            # finite with probability (nxt - y)/d, then error (y - max)**2
            cubic = (vmax * vmax * nxt / d, -(2 * vmax * nxt + vmax * vmax) / d, (nxt + 2 * vmax) / d, -1 / d)
            pieces.append((vmax, nxt, [(OV, cubic), (NF, (-vmax / d, 1 / d))]))
            pieces.append((nxt, math.inf, [(NF, (1,))]))
        else:
            pieces.append((vmax, math.inf, [(OV, (vmax * vmax, -2 * vmax, 1)), (SA, (1,))]))
    else:  # pragma: no cover - validated by callers
        raise ValueError(f"rounding must be 'nearest' or 'stochastic', got {rounding!r}")
    for t in split:
        for i, (lo, hi, terms) in enumerate(pieces):
            if lo < t < hi:
                pieces[i:i + 1] = [(lo, t, terms), (t, hi, terms)]
                break
    bounds = np.array([p[0] for p in pieces] + [pieces[-1][1]], dtype=np.float64)
    assert np.all(np.diff(bounds) >= 0) and bounds[0] == 0 and np.isinf(bounds[-1])
    rows = [(i, out, k, c) for i, (_, _, terms) in enumerate(pieces) for out, poly in terms
            for k, c in enumerate(poly) if c != 0]
    arr = np.array([(i, out, k) for i, out, k, _ in rows], dtype=np.int64)
    coef = np.array([c for *_, c in rows], dtype=np.float64)
    return Pieces(fmt, rounding, overflow, bounds, arr[:, 0], arr[:, 2], np.log(np.abs(coef)),
                  np.sign(coef), arr[:, 1])


def _tails(z: np.ndarray) -> np.ndarray:
    """``ndtr(-|z|)``: the smaller tail probability at ``z`` (exact in both tails)."""
    return ndtr(-np.abs(z))


def _delta_phi(z: np.ndarray) -> np.ndarray:
    """``Phi(z[..., 1:]) - Phi(z[..., :-1])`` for non-decreasing ``z``, accurate in both tails."""
    t = _tails(z)
    za, zb, ta, tb = z[..., :-1], z[..., 1:], t[..., :-1], t[..., 1:]
    return np.where(za >= 0, ta - tb, np.where(zb <= 0, tb - ta, 1.0 - ta - tb))


def coef_matrices(pc: Pieces, mode: str) -> dict[int, np.ndarray]:
    """``{k_eff: (P, 7) coefficients}``; error terms of the elementwise mode move to ``k - 2``."""
    key = (id(pc), mode)
    hit = _COEF_CACHE.get(key)
    if hit is not None and hit[0] is pc:
        return hit[1]
    err = pc.out < _N_ERR
    k_eff = pc.k - 2 * (err & (mode == "elementwise"))
    coef = pc.sign * np.exp(pc.lnc)
    mats: dict[int, np.ndarray] = {}
    for kk in np.unique(k_eff):
        m = np.zeros((pc.n_pieces, len(_OUT)))
        sel = k_eff == kk
        np.add.at(m, (pc.piece[sel], pc.out[sel]), coef[sel])
        mats[int(kk)] = m
    _COEF_CACHE[key] = (pc, mats)
    return mats


_COEF_CACHE: dict = {}


def coef_stack(pc: Pieces, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """:func:`coef_matrices` stacked: the moment orders ``(K,)`` and their matrices ``(K, P, 7)`` (cached)."""
    key = (id(pc), mode, "stack")
    hit = _COEF_CACHE.get(key)
    if hit is not None and hit[0] is pc:
        return hit[1]
    mats = coef_matrices(pc, mode)
    out = (np.array(sorted(mats), dtype=np.float64), np.stack([mats[k] for k in sorted(mats)]))
    _COEF_CACHE[key] = (pc, out)
    return out


_IS_ERR = np.arange(len(_OUT)) < _N_ERR


def integrate(pc: Pieces, mu: np.ndarray, sigma: np.ndarray, log_scale: np.ndarray, *,
              mode: str = "relative", upper: np.ndarray | None = None,
              lower: np.ndarray | None = None) -> np.ndarray:
    """Integrals of the tracked quantities for ``ln|x| ~ N(mu, sigma**2)`` quantised as ``|x| * s``.

    Args: flat float64 arrays of one length ``N`` (``log_scale = ln s``); ``upper``, ``lower``:
    optional per-row truncation ``lower <= y < upper`` in scaled units (pieces are cut there: block
    scaling, a pruning threshold, a tensor's maximum).

    Returns ``(N, 7)``: the error parts (:data:`PARTS`) normalised by ``mode`` -- ``"relative"``:
    divided by ``E[x**2]``; ``"absolute"``: in units of ``x**2``; ``"elementwise"``: the error of
    ``x`` divided by ``x**2`` -- then the probabilities (:data:`FRACTIONS`), all per non-zero entry.

    Every moment order ``k`` at once: ``(Phi differences, K x N x P) @ (coefficients, K x P x 7)``,
    scaled by ``exp(k m + k**2 s**2 / 2)`` over the normalisation and summed over ``k``.

    Example:
        >>> from gradstats.formats import FPFormat
        >>> pc = build(FPFormat.parse("e4m3fn"), "nearest", "saturate")
        >>> r = integrate(pc, np.array([-9.0]), np.array([1.5]), np.array([7 * math.log(2.0)]))
        >>> round(float(r[0, :4].sum()) * 1e4, 2)
        7.15
    """
    m = mu + log_scale  # location of ln y
    s = sigma
    lnb = pc.lnb[None, :]
    if upper is not None or lower is not None:
        with np.errstate(divide="ignore"):
            if upper is not None:
                lnb = np.minimum(lnb, np.log(upper)[:, None])
            if lower is not None:
                lnb = np.maximum(lnb, np.log(np.minimum(lower, np.inf if upper is None else upper))[:, None])
    z0 = (lnb - m[:, None]) / s[:, None]                                    # (N, P + 1)
    if mode == "relative":
        lnn = 2 * m + 2 * s * s  # E[y^2]; relative error is scale free
    elif mode == "absolute":
        lnn = 2 * log_scale  # back to units of x
    else:
        lnn = np.zeros_like(m)
    k, cm = coef_stack(pc, mode)
    z = z0[None, :, :] - (k[:, None] * s[None, :])[:, :, None]              # (K, N, P + 1)
    dphi = _delta_phi(z)
    base = k[:, None] * m[None, :] + (0.5 * k * k)[:, None] * (s * s)[None, :]          # (K, N)
    w = np.exp(base[:, :, None] - np.where(_IS_ERR[None, None, :], lnn[None, :, None], 0.0))
    return (np.matmul(dphi, cm) * w).sum(axis=0)


def point(pc: Pieces, y: Any) -> Any:
    """The tracked quantities at single values ``y`` (``(N, 7)``: squared errors in units of ``y**2``
    -- not normalised -- then the probabilities): the exact error of one entry. A float ``y`` gives
    the list of its 7 (one layer's refresh: no array is built)."""
    if isinstance(y, float):
        bounds, polys = _point_lists(pc)
        c = polys[min(max(bisect.bisect_right(bounds, y) - 1, 0), len(polys) - 1)]
        return [((c3 * y + c2) * y + c1) * y + c0 for c0, c1, c2, c3 in c]
    idx = np.minimum(np.maximum(np.searchsorted(pc.bounds, y, side="right") - 1, 0), pc.n_pieces - 1)
    c = _point_polys(pc)[idx]                                 # (N, 7, 4): the piece's polynomials
    return ((c[:, :, 3] * y[:, None] + c[:, :, 2]) * y[:, None] + c[:, :, 1]) * y[:, None] + c[:, :, 0]


def _point_polys(pc: Pieces) -> np.ndarray:
    """Per piece, the polynomials (coefficients of ``y**0 .. y**3``) of the tracked quantities:
    ``(P, 7, 4)`` (cached)."""
    key = (id(pc), "points")
    hit = _COEF_CACHE.get(key)
    if hit is not None and hit[0] is pc:
        return hit[1]
    polys = np.zeros((pc.n_pieces, len(_OUT), 4))
    np.add.at(polys, (pc.piece, pc.out, pc.k), pc.sign * np.exp(pc.lnc))
    _COEF_CACHE[key] = (pc, polys)
    return polys


def _point_lists(pc: Pieces) -> tuple[list[float], list[list[list[float]]]]:
    """:func:`_point_polys` and the bounds as Python lists, for one float (cached)."""
    key = (id(pc), "point lists")
    hit = _COEF_CACHE.get(key)
    if hit is not None and hit[0] is pc:
        return hit[1]
    out = (pc.bounds.tolist(), _point_polys(pc).tolist())
    _COEF_CACHE[key] = (pc, out)
    return out


# --------------------------------------------------------------------------- first moments
#: signed first-moment quantities of :func:`build_bias`, in column order: the magnitude bias
#: ``Q(y) - y`` (non-finite outcomes excluded) and the magnitude a value loses to zero
BIAS_COLUMNS = ("bias", "flushed_mass")


@functools.lru_cache(maxsize=512)
def build_bias(fmt: FPFormat, rounding: str, overflow: str) -> tuple[np.ndarray, np.ndarray]:
    """The cells of ``fmt`` with, per cell, the polynomials (degree <= 2 in ``y``) of
    :data:`BIAS_COLUMNS`: ``(bounds (P + 1,), coefficients (P, 2, 3))``.

    Nearest rounding: ``q - y`` on the cell of ``q``, and ``y`` lost on the cell of 0. Stochastic:
    no bias inside the range (``E[Q(y)] = y``), ``y (1 - y / q1)`` lost to zero below the smallest
    value ``q1``. Saturation: ``max - y``. Values that become inf/NaN count in neither.
    """
    v = fmt.values().numpy()
    v = v[v >= 0]
    vmax = fmt.max
    nonfinite = nonfinite_applies(fmt, overflow)
    nxt = _overflow_threshold(fmt)
    cells: list[tuple[float, float, tuple[float, ...], tuple[float, ...]]] = []   # lo, hi, bias, lost
    zero3 = (0.0, 0.0, 0.0)
    if rounding == "nearest":
        mids = (v[:-1] + v[1:]) / 2
        for q, lo, hi in zip(v, np.concatenate([[0.0], mids]), np.concatenate([mids, [vmax]])):
            cells.append((lo, hi, (q, -1.0, 0.0), (0.0, 1.0, 0.0) if q == 0 else zero3))
        if nonfinite:
            thr = (vmax + nxt) / 2
            cells += [(vmax, thr, (vmax, -1.0, 0.0), zero3), (thr, math.inf, zero3, zero3)]
        else:
            cells.append((vmax, math.inf, (vmax, -1.0, 0.0), zero3))
    else:
        for q0, q1 in zip(v[:-1], v[1:]):
            cells.append((q0, q1, zero3, (0.0, 1.0, -1.0 / q1) if q0 == 0 else zero3))
        if nonfinite:
            d = nxt - vmax
            cells += [(vmax, nxt, (nxt * vmax / d, -(nxt + vmax) / d, 1.0 / d), zero3),
                      (nxt, math.inf, zero3, zero3)]
        else:
            cells.append((vmax, math.inf, (vmax, -1.0, 0.0), zero3))
    bounds = np.array([c[0] for c in cells] + [cells[-1][1]], dtype=np.float64)
    coef = np.array([[c[2], c[3]] for c in cells], dtype=np.float64)
    return bounds, coef


def first_moments(bounds: np.ndarray, coef: np.ndarray, m: np.ndarray, s: np.ndarray,
                  upper: np.ndarray | None = None) -> np.ndarray:
    """``E[p(y) 1{y < upper}]`` of each column's piecewise polynomial ``p`` for ``ln y ~ N(m, s**2)``
    (flat arrays of one length ``N``): ``(N, columns)``, in units of ``y``."""
    b = bounds[None, :]
    if upper is not None:
        b = np.minimum(b, upper[:, None])
    with np.errstate(divide="ignore"):
        z0 = (np.log(b) - m[:, None]) / s[:, None]
    out = np.zeros((m.size, coef.shape[1]))
    for k in range(coef.shape[2]):
        dphi = _delta_phi(z0 - k * s[:, None])
        out += (dphi @ coef[:, :, k]) * np.exp(k * m + 0.5 * k * k * s * s)[:, None]
    return out


def first_moments_at(bounds: np.ndarray, coef: np.ndarray, y: Any) -> Any:
    """The polynomials of :func:`first_moments` at single values ``y``: ``(N, columns)`` (a float ``y``:
    the list of its columns)."""
    if isinstance(y, float):
        i = min(max(int(np.searchsorted(bounds, y, side="right")) - 1, 0), bounds.size - 2)
        return [c0 + c1 * y + c2 * (y * y) for c0, c1, c2 in coef[i].tolist()]
    idx = np.minimum(np.maximum(np.searchsorted(bounds, y, side="right") - 1, 0), bounds.size - 2)
    c = coef[idx]                                            # (N, columns, 3)
    return c[:, :, 0] + c[:, :, 1] * y[:, None] + c[:, :, 2] * (y * y)[:, None]
