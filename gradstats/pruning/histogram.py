"""The model-free threshold rule: the operator's sparsity read off a histogram of log2|g|.

The stochastic operator's expected zero fraction is a functional of the empirical distribution,

    S(a) = (1/n) sum_{|g| < a} (1 - |g|/a)  =  (1/a) * integral_0^a F(x) dx,

so it needs no distribution family at all: the counts of ``|g|`` per log2 bin are enough. The
cumulative fraction ``F`` is known exactly at the bin edges; between them it is interpolated in
``l = ln|g|`` by a monotone cubic (PCHIP), and ``integral F(x) dx = integral F(e^l) e^l dl`` is
taken in closed form on each cubic piece. One bin per binade -- the histogram every statistics
row of :mod:`gradstats.stats` carries, so a traced run needs no raw samples -- lands within
about 5e-4 of the target on average on real gradients; :func:`gradstats.pruning.prune` bins a
tensor at four bins per binade (about 4e-5).

Exact zeros are a separate count (and from tensors, subnormals join them: they are pruned as
zeros); inf and NaN count in ``n`` and are never pruned.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..stats import HIST_MIN_EXP


@dataclass(frozen=True, eq=False)
class LogHistogram:
    """Counts of the non-zero finite ``|g|`` in contiguous bins ``[lower, upper)``, plus the
    zero count and the total number of entries.

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> h = LogHistogram.from_stats(tensor_stats(torch.tensor([0.0, 1.0, 1.5, 3.0])))
        >>> h.n, h.n_zero, float(h.counts.sum())
        (4, 1, 3.0)
        >>> round(h.threshold(0.5), 6) > 1.0
        True
    """

    counts: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    n: int
    n_zero: int

    @classmethod
    def from_stats(cls, row: Mapping[str, Any]) -> "LogHistogram":
        """From a statistics row (one bin per binade, its ``hist`` field)."""
        if "hist" not in row:
            raise ValueError("the histogram rule needs the statistics row's 'hist' field (binade "
                             "counts of log2|g|); this row has none")
        h = np.asarray(row["hist"], dtype=np.float64)
        e = np.arange(h.size) + HIST_MIN_EXP
        keep = h > 0
        if keep.any():  # trim empty ends (keeps the bins contiguous)
            i, j = np.flatnonzero(keep)[[0, -1]]
            h, e = h[i:j + 1], e[i:j + 1]
        return cls(h, np.exp2(e.astype(np.float64)), np.exp2(e + 1.0), int(row["n"]),
                   int(row["n_zero"]))

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
        """Log edges ``l``, cumulative fractions ``F`` there (zeros included), the PCHIP
        coefficients (4, m) in ``t = l - l_k``, and ``J_k = integral_0^{x_k} F(x) dx``."""
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

    def _at(self, la: float, stochastic: bool) -> float:
        """Sparsity at ``a = e^la``."""
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
            if not ai > 0 or self.counts.size == 0:
                out[i] = self.n_zero / self.n
            elif math.isinf(ai):
                out[i] = (self.n_zero + self.counts.sum()) / self.n
            else:
                out[i] = self._at(math.log(ai), stochastic)
        return out

    def threshold(self, target: float, *, stochastic: bool = True) -> float:
        """The threshold whose expected sparsity is ``target`` (0 when the zeros reach it,
        ``inf`` when non-finite entries make it unreachable)."""
        if target * self.n <= self.n_zero or self.counts.size == 0:
            return 0.0
        l, F, c, J = self._pieces()
        if target >= F[-1]:
            return math.inf
        s_edges = J / np.exp(l) if stochastic else F
        if s_edges[-1] <= target:  # beyond the last edge (stochastic only): closed form
            x_m = math.exp(l[-1])
            return float((J[-1] - F[-1] * x_m) / (target - F[-1]))
        k = max(int(np.searchsorted(s_edges, target, side="left")), 1)
        lo, hi = float(l[k - 1]), float(l[k])
        for _ in range(200):  # bisection in ln a: the sparsity is increasing
            mid = 0.5 * (lo + hi)
            if self._at(mid, stochastic) < target:
                lo = mid
            else:
                hi = mid
            if hi - lo < 4e-16 * max(1.0, abs(mid)):
                break
        return float(math.exp(hi))


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
