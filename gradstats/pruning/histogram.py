"""The model-free threshold rule: the operator's sparsity read off a histogram of log2|g|.

The stochastic operator's expected zero fraction is a functional of the empirical distribution,

    S(a) = (1/n) sum_{|g| < a} (1 - |g|/a)  =  (1/a) * integral_0^a F(x) dx,

so it needs no distribution family at all: the counts of ``|g|`` per log2 bin are enough. The
cumulative fraction ``F`` is known exactly at the bin edges; between them it is interpolated in
``l = ln|g|`` by a monotone cubic (PCHIP), and ``integral F(x) dx = integral F(e^l) e^l dl`` is
taken in closed form on each cubic piece. Values known one by one (``atoms``: a statistics
row's 64 largest magnitudes, ``top_abs``) enter exactly, each a step of ``1/n`` in ``F``.

Two sources, one rule (the default of :func:`gradstats.pruning.threshold` and
:func:`gradstats.pruning.prune`):

- a statistics row of :mod:`gradstats.stats` (:meth:`LogHistogram.from_stats`): its binade
  counts (``hist``, one bin per binade), less its ``top_abs`` values, which become atoms; the
  highest remaining bin ends at the smallest of them (or at ``max_abs``) and the lowest starts
  at ``min_abs``. What a traced run stores, so no raw samples are needed;
- a tensor at hand (:func:`gradstats.pruning.prune`): four bins per binade counted in one
  sweep (:meth:`LogHistogram.from_counts`).

On the real gradients of ``experiments/pruning_real.py`` (``docs/pruning.md``) the first lands
within about 6e-4 of the target on average and the second within about 1e-4, where the
lognormal rule misses by 3e-2. (:class:`gradstats.fpanalysis.histogram.HistogramLaw` reads the
same row for the format analysis as log-linear densities within binades; as a threshold rule it
is less accurate than the monotone cubic of ``F`` here, so the two stay separate.)

Exact zeros are a separate count (and from tensors, subnormals join them: they are pruned as
zeros); inf and NaN count in ``n`` and are never pruned.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import numpy as np

from gradstats.stats import HIST_MIN_EXP, StatsRow, split_top


@dataclass(frozen=True, eq=False)
class LogHistogram:
    """Counts of the non-zero finite ``|g|`` in contiguous bins ``[lower, upper)``, plus the
    zero count, the total number of entries and ``atoms``: non-zero finite magnitudes known
    exactly (ascending, one entry each; they are not in ``counts``).

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> h = LogHistogram.from_stats(tensor_stats(torch.tensor([0.0, 1.0, 1.5, 3.0])), top=())
        >>> h.n, h.n_zero, float(h.counts.sum()), h.atoms.size
        (4, 1, 3.0, 0)
        >>> round(h.threshold(0.5), 6) > 1.0
        True
    """

    counts: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    n: int
    n_zero: int
    atoms: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @classmethod
    def from_stats(cls, row: StatsRow | Mapping[str, Any], *, top: Any = None) -> "LogHistogram":
        """From a statistics row: its binade counts (``hist``), with the row's largest
        magnitudes (``top``; ``None`` reads ``top_abs``, ``()`` uses none) as exact atoms taken
        out of their binades, and the end bins cut to the data's range: the highest remaining
        bin ends at the smallest atom (without atoms at ``max_abs``), the lowest starts at
        ``min_abs``. NaN padding in ``top`` (a tensor with fewer non-zero entries, or
        statistics reduced over ranks) is ignored.

        Example:
            >>> import torch
            >>> from gradstats.stats import tensor_stats
            >>> h = LogHistogram.from_stats(tensor_stats(torch.tensor([0.0, 1.0, 1.5, 3.0])))
            >>> h.atoms.tolist(), h.counts.size     # three values: all of them known exactly
            ([1.0, 1.5, 3.0], 0)
            >>> round(h.threshold(0.5), 12)         # (1 + (1 - 1/a) + (1 - 1.5/a)) / 4 = 0.5
            2.5
        """
        if "hist" not in row:
            raise ValueError("the histogram rule needs the statistics row's 'hist' field (binade "
                             "counts of log2|g|); this row has none")
        n, n_zero = int(row["n"]), int(row["n_zero"])
        t = np.zeros(0)
        if top is None:
            top = row["top_abs"] if "top_abs" in row else ()
        if top is not None and not (isinstance(top, float) and math.isnan(top)):
            t = np.abs(np.asarray(top, dtype=np.float64).reshape(-1))
            t = t[np.isfinite(t) & (t > 0)]
        h, t = split_top(row["hist"], t)
        e = np.arange(h.size) + HIST_MIN_EXP
        keep = h > 0
        if not keep.any():
            return cls(np.zeros(0), np.zeros(0), np.zeros(0), n, n_zero, t)
        i, j = np.flatnonzero(keep)[[0, -1]]   # trim empty ends (keeps the bins contiguous)
        h, e = h[i:j + 1], e[i:j + 1]
        lower, upper = np.exp2(e.astype(np.float64)), np.exp2(e + 1.0)
        top_edge = float(t[0]) if t.size else float(row.get("max_abs", math.nan))
        if top_edge > 0 and math.isfinite(top_edge):   # a sliver, where the bin is one value
            upper[-1] = max(min(upper[-1], top_edge), lower[-1] * (1 + 2.0 ** -30))
        low_edge = float(row.get("min_abs", math.nan))
        if low_edge > 0 and math.isfinite(low_edge):
            lower[0] = min(max(lower[0], low_edge), upper[0] * (1 - 2.0 ** -30))
        return cls(h, lower, upper, n, n_zero, t)

    @classmethod
    def from_counts(cls, counts: np.ndarray, *, mbits: int, float64: bool, n: int) -> "LogHistogram":
        """From counts of the key ``(bits of |x|) >> (mantissa bits - mbits)``: ``2**mbits``
        bins per binade; the exponent-field-0 keys (zeros, subnormals) form the zero count and
        the all-ones exponent (inf, NaN) is left out."""
        bias, top = (1023, 2047) if float64 else (127, 255)
        per = 1 << mbits
        c = np.asarray(counts, dtype=np.float64)
        n_zero = int(c[:per].sum())
        k = np.arange(per, top * per)
        h = c[per:top * per]
        keep = h > 0
        if keep.any():
            i, j = np.flatnonzero(keep)[[0, -1]]
            h, k = h[i:j + 1], k[i:j + 1]
        e = (k >> mbits) - bias
        f = (k & (per - 1)).astype(np.float64)
        lower = np.exp2(e.astype(np.float64)) * (1.0 + f / per)
        upper = np.exp2(e.astype(np.float64)) * (1.0 + (f + 1.0) / per)
        return cls(h, lower, upper, int(n), n_zero)

    # -- the interpolated distribution
    def _pieces(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Log edges ``l``, cumulative fractions ``F`` there (zeros included, atoms not), the
        PCHIP coefficients (4, m) in ``t = l - l_k``, and ``J_k = integral_0^{x_k} F(x) dx``."""
        cached = self.__dict__.get("_cache")
        if cached is not None:
            return cached
        from scipy.interpolate import PchipInterpolator

        x = np.concatenate([self.lower[:1], self.upper])
        l = np.log(x)
        F = np.concatenate([[self.n_zero], self.n_zero + np.cumsum(self.counts)]) / self.n
        if l.size >= 3:
            c = PchipInterpolator(l, F).c
        else:  # a single bin: linear
            c = np.array([[0.0], [0.0], [(F[1] - F[0]) / (l[1] - l[0])], [F[0]]])
        J = np.empty_like(l)
        J[0] = F[0] * x[0]
        J[1:] = J[0] + np.cumsum(_piece_integral(c, l, np.arange(l.size - 1), np.diff(l)))
        self.__dict__["_cache"] = (l, F, c, J)
        return l, F, c, J

    def _atom_sums(self) -> tuple[np.ndarray, np.ndarray]:
        """The atoms (ascending) and their prefix sums (length ``len(atoms) + 1``)."""
        cached = self.__dict__.get("_atom_cache")
        if cached is None:
            t = np.sort(np.asarray(self.atoms, dtype=np.float64).reshape(-1))
            cached = (t, np.concatenate([[0.0], np.cumsum(t)]))
            self.__dict__["_atom_cache"] = cached
        return cached

    def _atoms_at(self, a: np.ndarray, stochastic: bool) -> np.ndarray:
        """The atoms' part of the sparsity at thresholds ``a > 0``: ``#{t < a} / n`` (hard) or
        ``sum_{t<a} (1 - t/a) / n``."""
        t, cs = self._atom_sums()
        a = np.asarray(a, dtype=np.float64)
        if t.size == 0:
            return np.zeros(a.shape)
        k = np.searchsorted(t, a, side="left")
        return (k if not stochastic else k - cs[k] / a) / self.n

    def _continuous_at(self, la: float, stochastic: bool) -> float:
        """The binned part's sparsity at ``a = e^la`` (zeros included)."""
        if self.counts.size == 0:
            return self.n_zero / self.n
        l, F, c, J = self._pieces()
        if la <= l[0]:
            return float(F[0])
        if la >= l[-1]:
            if not stochastic:
                return float(F[-1])
            a = math.exp(la)
            return float((J[-1] + F[-1] * (a - math.exp(l[-1]))) / a)
        k = int(np.searchsorted(l, la, side="right")) - 1
        t = la - l[k]
        if not stochastic:
            c0, c1, c2, c3 = c[:, k]
            return float(((c0 * t + c1) * t + c2) * t + c3)
        part = _piece_integral(c, l, np.array([k]), np.array([t]))[0]
        return float((J[k] + part) / math.exp(la))

    def _at(self, la: float, stochastic: bool) -> float:
        """Sparsity at ``a = e^la``."""
        s = self._continuous_at(la, stochastic)
        if self.atoms.size:
            s += float(self._atoms_at(np.array([math.exp(la)]), stochastic)[0])
        return s

    @property
    def finite_fraction(self) -> float:
        """Fraction of entries that are zero or finite: the sparsity of an infinite threshold."""
        return (self.n_zero + float(self.counts.sum()) + self.atoms.size) / self.n

    # -- the sparsity and its inverse
    def expected_sparsity(self, a: Any, *, stochastic: bool = True) -> np.ndarray:
        """Expected zero fraction at threshold(s) ``a`` (hard fraction with ``stochastic=False``).

        Example:
            >>> h = LogHistogram(np.array([10.0]), np.array([1.0]), np.array([2.0]), 20, 10)
            >>> h.expected_sparsity([1.0, 2.0], stochastic=False).tolist()
            [0.5, 1.0]
        """
        a = np.atleast_1d(np.asarray(a, dtype=np.float64))
        out = np.empty_like(a)
        for i, ai in enumerate(a):
            if not ai > 0 or (self.counts.size == 0 and self.atoms.size == 0):
                out[i] = self.n_zero / self.n
            elif math.isinf(ai):
                out[i] = self.finite_fraction
            else:
                out[i] = self._at(math.log(ai), stochastic)
        return out

    def threshold(self, target: float, *, stochastic: bool = True) -> float:
        """The threshold whose expected sparsity is ``target`` (0 when the zeros reach it,
        ``inf`` when non-finite entries make it unreachable)."""
        if target * self.n <= self.n_zero or (self.counts.size == 0 and self.atoms.size == 0):
            return 0.0
        if target >= self.finite_fraction:
            return math.inf
        # the sparsity at the breakpoints: the bin edges, then the atoms
        t, cs = self._atom_sums()
        if self.counts.size:
            l, F, c, J = self._pieces()
            x = np.exp(l)
            s_edges = (J / x if stochastic else F) + self._atoms_at(x, stochastic)
        else:
            l, x, s_edges = np.zeros(0), np.zeros(0), np.zeros(0)
        if t.size:
            s_atoms = np.array([self._continuous_at(math.log(v), stochastic) for v in t])
            s_atoms += self._atoms_at(t, stochastic)
            b = np.concatenate([x, t])
            order = np.argsort(b, kind="stable")
            b, s_b = b[order], np.concatenate([s_edges, s_atoms])[order]
        else:
            b, s_b = x, s_edges
        if s_b[-1] < target:   # beyond every breakpoint
            if not stochastic:  # just above the largest value (a margin the dtype's rounding keeps)
                return float(b[-1] * (1 + 2.0 ** -20))
            f = self.finite_fraction           # S = f - M/a exactly
            m = float(cs[-1]) / self.n
            if self.counts.size:
                m += float(x[-1] * F[-1] - J[-1])   # the binned entries' sum |g| / n
            return float(m / (f - target))
        k = max(int(np.searchsorted(s_b, target, side="left")), 1)
        if not stochastic and (x.size == 0 or b[k - 1] >= x[-1]):
            # between two atoms the hard fraction is a step: every a in (b[k-1], b[k]] gives it;
            # the larger value, as exact_threshold does (no rounding moves it onto b[k-1])
            return float(b[k])
        # safeguarded Newton in ln a within the bracket (the sparsity is increasing and smooth
        # between breakpoints): dS/d(ln a) = F(a) - S(a) for the stochastic operator, F'(a) hard
        lo, hi = math.log(b[k - 1]), math.log(b[k])
        x = 0.5 * (lo + hi)
        for _ in range(200):
            sx = self._at(x, stochastic)
            f = sx - target
            if f < 0:
                lo = x
            else:
                hi = x
            if abs(f) <= 1e-15 or hi - lo < 4e-16 * max(1.0, abs(x)):
                break
            d = self._at(x, False) - sx if stochastic else self._hard_slope(x)
            nx = x - f / d if d > 0 else math.nan
            x = nx if lo < nx < hi else 0.5 * (lo + hi)
        return float(math.exp(x))

    def _hard_slope(self, la: float) -> float:
        """``dF/d(ln a)`` of the binned part at ``a = e^la`` (the atoms are steps: 0 between)."""
        if self.counts.size == 0:
            return 0.0
        l, F, c, J = self._pieces()
        if not l[0] < la < l[-1]:
            return 0.0
        k = int(np.searchsorted(l, la, side="right")) - 1
        t = la - l[k]
        return float((3 * c[0, k] * t + 2 * c[1, k]) * t + c[2, k])


def _piece_integral(c: np.ndarray, l: np.ndarray, k: np.ndarray, T: np.ndarray) -> np.ndarray:
    """``integral_0^T F(l_k + t) e^(l_k + t) dt`` on the cubic pieces ``k`` (closed form:
    the antiderivative of ``p(t) e^t`` is ``e^t (p - p' + p'' - p''')``)."""
    c0, c1, c2, c3 = c[:, k]

    def G(t: np.ndarray) -> np.ndarray:
        p = ((c0 * t + c1) * t + c2) * t + c3
        d1 = (3 * c0 * t + 2 * c1) * t + c2
        d2 = 6 * c0 * t + 2 * c1
        return np.exp(t) * (p - d1 + d2 - 6 * c0)

    return np.exp(l[k]) * (G(T) - G(np.zeros_like(T)))


# ----------------------------------------------------------------------------- one layer, in floats
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


def _piece_g(c0: float, c1: float, c2: float, c3: float, t: float) -> float:
    """The antiderivative of :func:`_piece_integral1` (``G``) at ``t``, as written there."""
    p = ((c0 * t + c1) * t + c2) * t + c3
    d1 = (3 * c0 * t + 2 * c1) * t + c2
    d2 = 6 * c0 * t + 2 * c1
    return math.exp(t) * (p - d1 + d2 - 6 * c0)


def _piece_integral1(c: tuple[float, float, float, float], lk: float, T: float) -> float:
    """``integral_0^T F(l_k + t) e^(l_k + t) dt`` on one cubic piece (as the reference)."""
    c0, c1, c2, c3 = c

    def G(t: float) -> float:
        p = ((c0 * t + c1) * t + c2) * t + c3
        d1 = (3 * c0 * t + 2 * c1) * t + c2
        d2 = 6 * c0 * t + 2 * c1
        return math.exp(t) * (p - d1 + d2 - 6 * c0)

    return math.exp(lk) * (G(T) - G(0.0))


class OneLogHistogram:
    """:class:`LogHistogram` for one layer in Python floats (what apply's refresh solves every
    step; no scipy, no arrays): counts of the non-zero finite ``|g|`` in contiguous bins ``[lower, upper)``,
    the zero count, the number of entries, and ``atoms``: magnitudes known exactly (not in the
    counts), each a step of ``1/n``.

    Example:
        >>> h = OneLogHistogram([10.0], [1.0], [2.0], 20, 10)
        >>> h.expected_sparsity(2.0, stochastic=False)
        1.0
    """

    __slots__ = ("n", "n_zero", "binned", "l", "x", "F", "c", "J", "atoms", "cs", "finite_fraction", "_b", "_g0")

    def __init__(self, counts: Sequence[float], lower: Sequence[float], upper: Sequence[float],
                 n: int, n_zero: int, atoms: Sequence[float] = ()) -> None:
        self.n, self.n_zero = int(n), int(n_zero)
        if self.n <= 0:
            raise ValueError("the histogram describes an empty tensor (n = 0): no threshold can be derived from it")
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
        for i, (c0, c1, c2, c3) in enumerate(c):    # _piece_integral1 over whole pieces, inlined
            T = l[i + 1] - l[i]
            p = ((c0 * T + c1) * T + c2) * T + c3
            d1 = (3 * c0 * T + 2 * c1) * T + c2
            d2 = 6 * c0 * T + 2 * c1
            acc += math.exp(l[i]) * (math.exp(T) * (p - d1 + d2 - 6 * c0) - (c3 - c2 + 2 * c1 - 6 * c0))
            J.append(J[0] + acc)
        self.l, self.F, self.c, self.J = l, F, c, J
        self._g0: list[float | None] = [None] * len(c)
        self.x = [math.exp(v) for v in l]           # the edges as the reference evaluates them

    @classmethod
    def from_stats(cls, hist: Sequence[float], min_exp: int, n: int, n_zero: int, top: Sequence[float] = (),
                   min_abs: float = math.nan, max_abs: float = math.nan) -> "OneLogHistogram":
        """As :meth:`LogHistogram.from_stats`: the counts of ``floor(log2|g|)`` from binade
        ``min_exp`` on (a statistics row's ``hist``), less the largest magnitudes ``top`` (NaN
        padding ignored), which become atoms; the empty bins at both ends trimmed, the highest
        bin ending at the smallest atom (without atoms at ``max_abs``), the lowest starting at
        ``min_abs``. Raises ``ValueError`` where the reference raises (``top`` not the
        largest values the counts hold)."""
        h = [float(v) for v in hist]
        t = sorted(abs(float(v)) for v in top if math.isfinite(v) and v != 0)
        for v in t:
            j = math.frexp(v)[1] - 1 - min_exp
            if not 0 <= j < len(h):
                raise ValueError("top_abs holds a magnitude outside the binades of hist: pass the row's own top_abs, or none")
            h[j] -= 1.0
        if t:
            j0 = math.frexp(t[0])[1] - 1 - min_exp
            if min(h) < 0 or any(h[j0 + 1:]):
                raise ValueError("top_abs is not the largest magnitudes the counts hold: pass the row's own top_abs, or none")
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
        c0, c1, c2, c3 = self.c[k]
        if not stochastic:
            return ((c0 * t + c1) * t + c2) * t + c3
        # _piece_integral1(c[k], l[k], t), its float operations as written there: exp(l[k]) is x[k],
        # G(0) depends on the piece alone (kept once computed)
        g0 = self._g0[k]
        if g0 is None:
            g0 = self._g0[k] = _piece_g(c0, c1, c2, c3, 0.0)
        return (J[k] + self.x[k] * (_piece_g(c0, c1, c2, c3, t) - g0)) / math.exp(la)

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
            pts.sort(key=itemgetter(0))
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
            raise ValueError(f"target sparsity must lie in [0, 1), got {target!r}")
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
