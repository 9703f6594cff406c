"""The law of a statistics row's binade histogram, read as a distribution of the non-zero magnitudes:
each binade ``[2**j, 2**(j+1))`` holds its observed mass with a log-linear density within (the slope of the
neighbouring binades' log-densities; ``shape="flat"``: log-uniform), the top binade ends at ``amax``, and the
row's largest magnitudes (``top_abs``) are exact point masses. The format analysis integrates its quantisation
errors against it (:mod:`gradstats.fpanalysis.histogram`, :mod:`gradstats.fpanalysis.what_if`), and
:func:`flushed_fraction` reads off it what a format flushes to zero, cheaply enough for the tracer's alarms.

Example:
    >>> import torch
    >>> from gradstats.stats import tensor_stats
    >>> row = tensor_stats(torch.tensor([2.0 ** -12, 2.0 ** -3, 0.5, 1.0]))
    >>> flushed_fraction(row, "e2m1fn")     # amax scale 4: only 2^-12 * 4 lies below half of e2m1's 0.5
    0.25
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch

from gradstats.formats import PREDICTED_ROUNDINGS, FPFormat, amax_scale, parse
from gradstats.stats import HIST_MIN_EXP, StatsRow, split_top

__all__ = ["HistogramLaw", "flushed_fraction", "law_flushed", "tensor_scale", "SHAPES", "TOP_FIELD", "MAX_SLOPE"]


def expm1_ratio(c: np.ndarray, t: np.ndarray) -> np.ndarray:
    """``(exp(c t) - 1) / c`` with its limit ``t`` at ``c = 0``."""
    c = np.asarray(c, dtype=np.float64)
    small = np.abs(c) < 1e-12
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(small, t, np.expm1(c * t) / np.where(small, 1.0, c))


#: bound on the within-binade slope of the log-density (a binade beside an empty one)
MAX_SLOPE = 6.0


#: the statistics field :meth:`HistogramLaw.from_stats` reads the largest magnitudes from
TOP_FIELD = "top_abs"


def _check_top(top: Any) -> np.ndarray:
    """The largest magnitudes as positive float64, descending; zeros and NaN (padding of a tensor with
    fewer non-zero entries than ``k``) are dropped."""
    if isinstance(top, torch.Tensor):
        top = top.detach().to("cpu", torch.float64).numpy()
    try:
        t = np.abs(np.asarray(top, dtype=np.float64))
    except (TypeError, ValueError):
        raise ValueError(f"top must be a 1-D array of the largest |g| of the tensor, got {type(top).__name__}") from None
    if t.ndim != 1:
        raise ValueError(f"top must be a 1-D array of the largest |g| of the tensor, got shape {t.shape}")
    t = t[~np.isnan(t) & (t > 0)]
    if not np.isfinite(t).all():
        raise ValueError("top holds an infinite value: pass the largest finite |g| (the histogram counts "
                         "finite entries only)")
    return -np.sort(-t)


@dataclass(frozen=True)
class HistogramLaw:
    """The piecewise law of a binade histogram (see the module doc): ``edges`` (``B + 1``
    increasing magnitudes, the last one ``amax``), the probability ``weights`` of the ``B`` binades
    and the log-density ``slopes`` within each; optionally point masses at the tensor's largest
    magnitudes, ``atoms`` (descending), each of probability ``atom_weight``: the binades then hold
    the other entries and end at the smallest atom. ``weights.sum() + atom_weight * len(atoms)``
    is 1 (non-zero entries only).

    Example:
        >>> h = HistogramLaw.from_counts([0, 3, 1], min_exp=-2, amax=1.5, shape="flat")
        >>> h.edges.tolist(), h.weights.tolist(), h.slopes.tolist()
        ([0.5, 1.0, 1.5], [0.75, 0.25], [0.0, 0.0])
        >>> h = HistogramLaw.from_counts([0, 3, 1], min_exp=-2, top=[1.5, 0.875], shape="flat")
        >>> h.edges.tolist(), h.weights.tolist(), h.atoms.tolist(), h.atom_weight
        ([0.5, 0.875], [0.5], [1.5, 0.875], 0.25)
    """

    edges: np.ndarray
    weights: np.ndarray
    slopes: np.ndarray
    atoms: np.ndarray = field(default_factory=lambda: np.zeros(0))
    atom_weight: float = 0.0

    @property
    def amax(self) -> float:
        """The largest magnitude of the law."""
        return float(self.atoms[0]) if self.atoms.size else float(self.edges[-1])

    @classmethod
    def from_counts(cls, counts: Sequence[int], *, min_exp: int = HIST_MIN_EXP, amax: float | None = None,
                    shape: str = "slope", top: Any = None) -> "HistogramLaw":
        """From binade counts (``counts[i]`` entries with ``floor(log2|g|) == min_exp + i``), the
        largest magnitude (default: the top of its binade) and the within-binade ``shape``
        (``"slope"`` or ``"flat"``). ``top``: the ``k`` largest magnitudes of the same entries (any
        order; zeros and NaN ignored), kept exactly as point masses; the binades keep the counts of
        the other entries, the highest of them ending at ``min(top)``. ``top`` empty or ``None``: the
        histogram alone."""
        if shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
        c = np.asarray(counts, dtype=np.float64).reshape(-1)
        nz = np.flatnonzero(c > 0)
        if nz.size == 0:
            raise ValueError("the histogram has no non-zero entries: there is no distribution to analyse")
        t = np.zeros(0) if top is None else _check_top(top)
        if t.size == 0:
            return cls._continuous(c, c.sum(), min_exp, amax, shape)
        n = c.sum()
        if amax is not None and not math.isclose(float(amax), t[0], rel_tol=1e-6):
            raise ValueError(f"top[0]={t[0]} is not amax={amax}: pass the largest |g| of the same tensor in both")
        rest, _ = split_top(c, t, min_exp=min_exp)       # top must be the k largest entries
        atoms, w_atom = t, 1.0 / float(n)
        if rest.sum() == 0:
            return cls(np.zeros(1), np.zeros(0), np.zeros(0), atoms, w_atom)
        low = cls._continuous(rest, n, min_exp, None, shape, upper=float(t[-1]))
        return cls(low.edges, low.weights, low.slopes, atoms, w_atom)

    @classmethod
    def _continuous(cls, c: np.ndarray, n: float, min_exp: int, amax: float | None, shape: str,
                    upper: float | None = None) -> "HistogramLaw":
        """The binades of counts ``c`` (of ``n`` entries in all), the top one ending at ``amax``
        (which must lie in it) or at ``min(upper, its end)``."""
        nz = np.flatnonzero(c > 0)
        lo, hi = int(nz[0]), int(nz[-1])
        w = c[lo:hi + 1] / n
        edges = np.exp2(np.arange(lo, hi + 2, dtype=np.float64) + min_exp)
        if amax is not None:
            a = float(amax)
            if not (edges[-2] <= a <= edges[-1]):
                raise ValueError(f"amax={a} is not in the top binade of the histogram "
                                 f"[{edges[-2]}, {edges[-1]}); pass the largest |g| of the same tensor")
            upper = a
        if upper is not None:
            # a top binade reduced to its lower edge holds its mass there (a point mass, as a sliver)
            edges[-1] = max(min(upper, edges[-1]), edges[-2] * (1 + 2.0 ** -30))
        slopes = np.zeros_like(w)
        if shape == "slope" and w.size > 1:
            width = np.log(edges[1:] / edges[:-1])
            centre = np.log(edges[:-1]) + width / 2
            log_density = np.log(np.maximum(w, 1e-12) / width)
            slopes = np.clip(np.gradient(log_density, centre), -MAX_SLOPE, MAX_SLOPE)
        return cls(edges, w, slopes)

    @classmethod
    def from_stats(cls, stats: StatsRow | Mapping[str, Any], *, shape: str = "slope", top: Any = None) -> "HistogramLaw":
        """From a statistics row (``hist`` and ``max_abs``; :func:`gradstats.stats.tensor_stats`).
        ``top``: the tensor's largest magnitudes (see :meth:`from_counts`); ``None`` reads them from
        the row's :data:`TOP_FIELD` if it has one; ``()`` uses the histogram alone."""
        if "hist" not in stats:
            raise ValueError("the statistics have no 'hist' (binade counts): pass a row of a run's "
                             "stats() or gradstats.stats.tensor_stats(x)")
        amax = stats.get("max_abs")
        amax = None if amax is None or not math.isfinite(float(amax)) else float(amax)
        if top is None:
            top = stats.get(TOP_FIELD)
        return cls.from_counts(stats["hist"], amax=amax, shape=shape, top=top)

    def partial_moments(self, y: np.ndarray, k: Union[int, Sequence[int]], log_scale: np.ndarray) -> np.ndarray:
        """``E[Y**k 1{Y < y}]`` of the law scaled by ``exp(log_scale)``: ``(S, len(y))`` for ``S`` scales;
        for a sequence of orders ``k``, ``(len(k), S, len(y))`` (the cuts located once for all of them).

        Within a binade ``[a, b)`` of slope ``beta``: ``E[Y**k 1{a <= Y < y}] = w a**k
        r(k + beta, ln(y/a)) / r(beta, ln(b/a))`` with ``r(c, t) = (exp(c t) - 1) / c``; an atom at
        ``a`` adds ``atom_weight * a**k`` where ``a < y``.

        Example:
            >>> h = HistogramLaw.from_counts([0, 3, 1], min_exp=-2, amax=1.5, shape="flat")
            >>> m = h.partial_moments(np.array([1.0, np.inf]), (0, 1), np.zeros(1))
            >>> m.shape, m[0, 0].tolist()
            ((2, 1, 2), [0.75, 1.0])
        """
        many = not isinstance(k, (int, np.integer))
        ks = tuple(int(q) for q in k) if many else (int(k),)
        s = np.exp(np.asarray(log_scale, dtype=np.float64))[:, None]
        y = np.asarray(y, dtype=np.float64)
        out = self._binade_moments(y, ks, s)
        if self.atoms.size:
            ya = self.atoms[None, :] * s                                # (S, K)
            below = ya[:, None, :] < y[None, :, None]
            for i, q in enumerate(ks):
                with np.errstate(over="ignore", under="ignore"):
                    out[i] += self.atom_weight * np.sum(np.where(below, ya[:, None, :] ** q, 0.0), axis=2)
        return out if many else out[0]

    @functools.cached_property
    def _terms(self) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """What :meth:`_binade_moments` reads of the law alone, computed once per law (a law is read at many
        scales and cuts): the binades' log-widths and normalisers, and per moment ``k`` (filled as asked)
        their growth."""
        width = np.log(self.edges[1:] / self.edges[:-1])
        return width, expm1_ratio(self.slopes, width), {}

    def _binade_terms(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(norm, grow)``: the binades' normalisers and their moment ``k`` over ``w a**k``."""
        width, norm, grows = self._terms
        grow = grows.get(k)
        if grow is None:
            grow = grows[k] = expm1_ratio(k + self.slopes, width) / norm
        return norm, grow

    def _binade_moments(self, y: np.ndarray, ks: tuple[int, ...], s: np.ndarray) -> np.ndarray:
        """The binades' part of :meth:`partial_moments` for each order of ``ks`` (``s``: the scales, ``(S, 1)``):
        ``(len(ks), S, len(y))``, each cut's binade and its log-offset found once."""
        out = np.zeros((len(ks), s.shape[0], y.size))
        if self.weights.size == 0:
            return out
        e = self.edges[None, :] * s                                    # (S, B+1)
        terms = [self._binade_terms(k) for k in ks]
        cums = []
        for k, (norm, grow) in zip(ks, terms):
            with np.errstate(over="ignore", under="ignore"):
                full = self.weights[None, :] * e[:, :-1] ** k * grow[None, :]
            cums.append(np.concatenate([np.zeros((s.shape[0], 1)), np.cumsum(full, axis=1)], axis=1))
        for i in range(s.shape[0]):
            ei = e[i]
            j = np.clip(np.searchsorted(ei, y, side="right") - 1, 0, len(ei) - 2)
            below, above = y <= ei[0], y >= ei[-1]
            with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
                t = np.log(np.clip(y, ei[j], ei[j + 1]) / ei[j])
                for q, (k, (norm, _)) in enumerate(zip(ks, terms)):
                    inside = cums[q][i, j] + self.weights[j] * ei[j] ** k * expm1_ratio(k + self.slopes[j], t) / norm[j]
                    out[q, i] = np.where(below, 0.0, np.where(above, cums[q][i, -1], inside))
        return out


#: within-binade shapes of :class:`HistogramLaw`
SHAPES = ("slope", "flat")


def flushed_fraction(row: StatsRow | Mapping[str, Any], fmt: Union[FPFormat, str], *, rounding: str = "nearest",
                     scale: Union[str, float] = "amax") -> float:
    """The fraction of a row's non-zero entries that quantising with ``fmt`` sets to zero, from the row's
    histogram law: ``scale`` ``"amax"`` (the largest power of two that keeps the maximum representable, as
    ``apply`` does) or a multiplier; ``rounding`` ``"nearest"`` (below half the smallest positive value, ties to
    the even zero) or ``"stochastic"`` (``1 - s|g| / v1`` below the smallest positive value ``v1``). The
    ``underflow`` of :func:`gradstats.what_if` (per-tensor scales) and of the tracer's watched formats.

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> row = tensor_stats(torch.tensor([2.0 ** -30, 1.0]))
        >>> flushed_fraction(row, "e4m3fn"), flushed_fraction(row, "e5m2")   # scaled by 2^8 and 2^15
        (0.5, 0.0)
    """
    f = parse(fmt)
    if rounding not in PREDICTED_ROUNDINGS:
        raise ValueError(f"rounding must be one of {PREDICTED_ROUNDINGS} (the flushed fraction is predicted for "
                         f"these), got {rounding!r}")
    n, nz = int(row.get("n", 0)), int(row.get("n", 0)) - int(row.get("n_zero", 0))
    if nz <= 0 or n <= 0 or not np.asarray(row.get("hist", [])).sum():
        return 0.0
    return law_flushed(HistogramLaw.from_stats(row), f, tensor_scale(f, scale, float(row["max_abs"])), rounding)


def tensor_scale(fmt: FPFormat, scale: Union[str, float], amax: float) -> float:
    """The per-tensor multiplier ``scale`` names: ``"amax"``, the largest power of two that keeps ``amax``
    representable in ``fmt`` (as ``apply`` does), or a positive number itself.

    Example:
        >>> tensor_scale(parse("e4m3fn"), "amax", 1.0), tensor_scale(parse("e4m3fn"), 0.5, 1.0)
        (256.0, 0.5)
    """
    if isinstance(scale, str):
        if scale != "amax":
            raise ValueError(f"scale must be 'amax' or a positive number (the multiplier), got {scale!r}")
        return amax_scale(fmt, amax)
    s = float(scale)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"scale must be 'amax' or a positive number, got {scale!r}")
    return s


def law_flushed(law: "HistogramLaw", fmt: FPFormat, scale: float, rounding: str) -> float:
    """:func:`flushed_fraction` of a law already made, at the multiplier ``scale``."""
    f, s = fmt, float(scale)
    v1 = float(f.min_subnormal)
    ls = np.array([math.log(s)])
    if rounding == "nearest":
        cut = v1 / 2
        out = float(law.partial_moments(np.array([cut]), 0, ls)[0, 0])
        if law.atoms.size:                       # a value on the midpoint rounds to the even neighbour: zero
            out += law.atom_weight * float(np.sum(law.atoms * s == cut))
        return out
    p = law.partial_moments(np.array([v1]), 0, ls)[0, 0]
    m1 = law.partial_moments(np.array([v1]), 1, ls)[0, 0]
    return float(p - m1 / v1)
