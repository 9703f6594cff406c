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
from operator import itemgetter
from typing import Any

import numpy as np

from gradstats.stats import HIST_MIN_EXP, StatsRow


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
    """``G(t)`` with ``e^(l_k) (G(T) - G(0)) = integral_0^T F(l_k + t) e^(l_k + t) dt`` on the cubic piece
    ``F(l_k + t) = ((c0 t + c1) t + c2) t + c3`` (the antiderivative of ``p(t) e^t`` is
    ``e^t (p - p1 + p2 - p3)``, ``pk`` the k-th derivative)."""
    p = ((c0 * t + c1) * t + c2) * t + c3
    d1 = (3 * c0 * t + 2 * c1) * t + c2
    d2 = 6 * c0 * t + 2 * c1
    return math.exp(t) * (p - d1 + d2 - 6 * c0)


#: from_binades' two errors (the C kernel's codes -2 and -3)
_TOP_ERRORS = {-2: "top_abs holds a magnitude outside the binades of hist: pass the row's own top_abs "
                   "(the largest |g| of the same tensor), or none",
               -3: "top_abs is not the largest magnitudes the counts hold: pass the row's own top_abs, or none"}


def _native() -> Any:
    """The C kernel's functions (:func:`gradstats.ops.native.histogram`), or None without a compiler."""
    from gradstats.ops.native import histogram

    return histogram()


def _native_table(counts: Sequence[float], lower: Sequence[float], upper: Sequence[float], n: int, n_zero: int,
                  atoms: Sequence[float]) -> Any:
    """The C kernel's table of the distribution (a float64 array), or None where the kernel is not at hand
    or leaves the bins to the Python path (edges not positive and increasing: the Python class raises)."""
    fns = _native()
    if fns is None:
        return None
    table_len, build = fns[0], fns[1]
    nb, na = len(counts), len(atoms)
    if nb and (len(lower) != nb or len(upper) != nb):
        return None
    inputs = np.array([*counts, *lower, *upper, *atoms], dtype=np.float64)
    tab = np.empty(table_len(nb, na), dtype=np.float64)
    p, step = inputs.ctypes.data, 8 * nb
    if build(p, p + step, p + 2 * step, nb, n, n_zero, p + 3 * step, na, tab.ctypes.data) != 0:
        return None
    return tab


def _table_given(tab: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The bins as given (counts, lower, upper) and the atoms of a C table (where the kernel says they are)."""
    nb, na = int(tab[0]), int(tab[1])
    offset = _native()[5]
    atoms_at, given = offset(tab.ctypes.data, 0), offset(tab.ctypes.data, 1)
    return tab[given:given + nb], tab[given + nb:given + 2 * nb], tab[given + 2 * nb:given + 3 * nb], \
        tab[atoms_at:atoms_at + na]


class LogHistogram:
    """Counts of the non-zero finite ``|g|`` in contiguous bins ``[lower, upper)``, plus the zero
    count, the total number of entries and ``atoms``: non-zero finite magnitudes known exactly
    (each a step of ``1/n``; they are not in ``counts``). The tables (the cubic pieces and their
    integrals) and the thresholds are computed by a small C kernel (``gradstats/ops/native/histogram.c``)
    with this class's float operations, the same doubles bit for bit, in a few microseconds, which is
    what apply's refresh solves on every call; where no C compiler is found, in Python floats here (no
    scipy, no arrays). ``counts``, ``lower``, ``upper`` and ``atoms`` read back as arrays.

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> h = LogHistogram.from_stats(tensor_stats(torch.tensor([0.0, 1.0, 1.5, 3.0])), top=())
        >>> h.n, h.n_zero, float(h.counts.sum()), h.atoms.size
        (4, 1, 3.0, 0)
        >>> round(h.threshold(0.5), 6) > 1.0
        True
        >>> LogHistogram([10.0], [1.0], [2.0], 20, 10).expected_sparsity(2.0, stochastic=False)
        1.0
    """

    __slots__ = ("n", "n_zero", "binned", "l", "x", "F", "c", "J", "_atoms", "cs", "finite_fraction", "_b",
                 "_g0", "_bins", "_tab")

    def __init__(self, counts: Sequence[float], lower: Sequence[float], upper: Sequence[float],
                 n: int, n_zero: int, atoms: Sequence[float] = ()) -> None:
        self.n, self.n_zero = int(n), int(n_zero)
        if self.n <= 0:
            raise ValueError("the histogram describes an empty tensor (n = 0): no threshold can be derived from it")
        counts, lower, upper, atoms = (v.tolist() if isinstance(v, np.ndarray) else v
                                       for v in (counts, lower, upper, atoms))
        self._bins = (counts, lower, upper)
        self._atoms = sorted(float(t) for t in atoms)
        self.binned = len(counts) > 0
        self._b = None
        total = 0.0
        for v in counts:
            total += float(v)
        self.finite_fraction = (self.n_zero + total + len(self._atoms)) / self.n
        self._tab = _native_table(counts, lower, upper, self.n, self.n_zero, self._atoms)
        if self._tab is None:
            self._tables()

    def _tables(self) -> None:
        """The Python path's tables (where the C kernel is not at hand, or cannot take the bins)."""
        cs = [0.0]
        for t in self._atoms:
            cs.append(cs[-1] + t)
        self.cs = cs
        if not self.binned:
            return
        counts, lower, upper = self._bins
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
        J = [F[0] * x[0]]              # J_k = integral_0^{x_k} F(x) dx, whole pieces of _piece_g
        acc = 0.0
        for i, (c0, c1, c2, c3) in enumerate(c):
            acc += math.exp(l[i]) * (_piece_g(c0, c1, c2, c3, l[i + 1] - l[i]) - (c3 - c2 + 2 * c1 - 6 * c0))
            J.append(J[0] + acc)
        self.l, self.F, self.c, self.J = l, F, c, J
        self._g0: list[float | None] = [None] * len(c)
        self.x = [math.exp(v) for v in l]           # the edges as the breakpoints evaluate them

    def _given(self) -> tuple[Any, Any, Any, Any]:
        """``(counts, lower, upper, atoms)`` as given (read back from the C table where it built them)."""
        if self._bins is None:
            return _table_given(self._tab)
        return (*self._bins, self._atoms)

    @property
    def counts(self) -> np.ndarray:
        return np.array(self._given()[0], dtype=np.float64)

    @property
    def lower(self) -> np.ndarray:
        return np.array(self._given()[1], dtype=np.float64)

    @property
    def upper(self) -> np.ndarray:
        return np.array(self._given()[2], dtype=np.float64)

    @property
    def atoms(self) -> np.ndarray:
        return np.array(self._given()[3], dtype=np.float64)

    @classmethod
    def from_stats(cls, row: StatsRow | Mapping[str, Any], *, top: Any = None) -> "LogHistogram":
        """From a statistics row: its binade counts (``hist``), with the row's largest
        magnitudes (``top``; ``None`` reads ``top_abs``, ``()`` uses none) as exact atoms taken
        out of their binades, and the end bins cut to the data's range (:meth:`from_binades`).
        NaN padding in ``top`` (a tensor with fewer non-zero entries, or statistics reduced over
        ranks) is ignored.

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
        if top is None:
            top = row["top_abs"] if "top_abs" in row else ()
        if top is None or (isinstance(top, float) and math.isnan(top)):
            top = ()
        h = np.asarray(row["hist"], dtype=np.float64).reshape(-1)
        nz = np.flatnonzero(h > 0)
        i, j = (int(nz[0]), int(nz[-1]) + 1) if nz.size else (0, 0)
        return cls.from_binades(h[i:j].tolist(), HIST_MIN_EXP + i, int(row["n"]), int(row["n_zero"]),
                                np.asarray(top, dtype=np.float64).reshape(-1).tolist(),
                                float(row.get("min_abs", math.nan)), float(row.get("max_abs", math.nan)))

    @classmethod
    def from_binades(cls, hist: Sequence[float], min_exp: int, n: int, n_zero: int, top: Sequence[float] = (),
                     min_abs: float = math.nan, max_abs: float = math.nan) -> "LogHistogram":
        """The counts of ``floor(log2|g|)`` from binade ``min_exp`` on (a statistics row's ``hist``,
        or a slice of it), less the largest magnitudes ``top`` (NaN padding ignored), which become
        atoms; the empty bins at both ends trimmed, the highest bin ending at the smallest atom
        (without atoms at ``max_abs``), the lowest starting at ``min_abs``. ``ValueError`` where
        ``top`` is not the largest values the counts hold (as :func:`gradstats.stats.split_top`).

        Example:
            >>> LogHistogram.from_binades([2.0, 1.0], 0, 4, 1, top=[3.0]).atoms.tolist()
            [3.0]
        """
        if _native() is not None and int(n) > 0:
            h_arr = np.ascontiguousarray(hist, dtype=np.float64).reshape(-1)
            t_arr = np.ascontiguousarray(top, dtype=np.float64).reshape(-1)
            made = cls.from_binades_at(h_arr.ctypes.data, h_arr.size, min_exp, int(n), int(n_zero), t_arr.ctypes.data,
                                       t_arr.size, float(min_abs), float(max_abs))
            if made is not None:
                return made
        h = [float(v) for v in hist]
        t = sorted(abs(float(v)) for v in top if math.isfinite(v) and v != 0)
        for v in t:
            j = math.frexp(v)[1] - 1 - min_exp
            if not 0 <= j < len(h):
                raise ValueError(_TOP_ERRORS[-2])
            h[j] -= 1.0
        if t:
            j0 = math.frexp(t[0])[1] - 1 - min_exp
            if min(h) < 0 or any(h[j0 + 1:]):
                raise ValueError(_TOP_ERRORS[-3])
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

    @classmethod
    def from_binades_at(cls, hist: int, nh: int, min_exp: int, n: int, n_zero: int, top: int, nt: int,
                        min_abs: float, max_abs: float) -> "LogHistogram | None":
        """:meth:`from_binades` of ``nh`` float64 counts and ``nt`` float64 top magnitudes at the addresses
        ``hist`` and ``top`` (a statistics vector's own memory: no array is made of them), on the C kernel:
        the same distribution, in one call. None where the kernel is not at hand or leaves the row to the
        Python path; the same ``ValueError`` as :meth:`from_binades` where ``top`` does not fit the counts.

        Example:
            >>> import numpy as np
            >>> h, t = np.array([2.0, 1.0]), np.array([3.0])
            >>> made = LogHistogram.from_binades_at(h.ctypes.data, 2, 0, 4, 1, t.ctypes.data, 1, np.nan, np.nan)
            >>> made is None or made.atoms.tolist() == [3.0]
            True
        """
        fns = _native()
        if fns is None or n <= 0:
            return None
        tab = np.empty(fns[0](nh, nt), dtype=np.float64)
        rc = fns[4](hist, nh, min_exp, n, n_zero, top, nt, min_abs, max_abs, tab.ctypes.data)
        if rc in (-2, -3):
            raise ValueError(_TOP_ERRORS[rc])
        if rc != 0:
            return None
        used = fns[0](int(tab[0]), int(tab[1]))       # the bins the row holds (nh: all it could)
        return cls._of_table(tab[:used].copy() if used < tab.size else tab)

    @classmethod
    def _of_table(cls, tab: np.ndarray) -> "LogHistogram":
        """The distribution of a table the C kernel built (its bins and atoms read back when asked for)."""
        h = cls.__new__(cls)
        h.n, h.n_zero, h.finite_fraction = int(tab[2]), int(tab[3]), float(tab[4])
        h.binned, h._b, h._tab, h._bins, h._atoms = bool(tab[5]), None, tab, None, None
        return h

    @classmethod
    def from_counts(cls, counts: np.ndarray, *, mbits: int, float64: bool, n: int) -> "LogHistogram":
        """From counts of the key ``(bits of |x|) >> (mantissa bits - mbits)``: ``2**mbits``
        bins per binade; the exponent-field-0 keys (zeros, subnormals) form the zero count and
        the all-ones exponent (inf, NaN) is left out.

        Example:
            >>> c = np.zeros(256 << 2)
            >>> c[127 << 2] = 3.0                     # three values in [1, 1.25)
            >>> LogHistogram.from_counts(c, mbits=2, float64=False, n=4).upper.tolist()
            [1.25]
        """
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

    # -- the sparsity
    def _atoms_at(self, a: float, stochastic: bool) -> float:
        if not self._atoms:
            return 0.0
        k = bisect.bisect_left(self._atoms, a)
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

    def _at(self, la: float, stochastic: bool, a: float | None = None) -> float:
        """The sparsity at ``a = e^la`` (``a``, where given, for the atoms: an atom equal to ``a``
        is not below it, however ``exp(ln a)`` rounds)."""
        s = self._continuous_at(la, stochastic)
        if self._atoms:
            s += self._atoms_at(math.exp(la) if a is None else a, stochastic)
        return s

    def expected_sparsity(self, a: Any, *, stochastic: bool = True) -> Any:
        """Expected zero fraction at threshold ``a`` (hard fraction with ``stochastic=False``): a
        float for a number, an array for an array (or list) of thresholds.

        Example:
            >>> h = LogHistogram([10.0], [1.0], [2.0], 20, 10)
            >>> h.expected_sparsity([1.0, 2.0], stochastic=False).tolist()
            [0.5, 1.0]
        """
        if not isinstance(a, (float, int)):
            v = np.asarray(a, dtype=np.float64)
            return np.array([self.expected_sparsity(float(ai), stochastic=stochastic) for ai in v.reshape(-1)],
                            dtype=np.float64).reshape(v.shape)
        if self._tab is not None:
            return _native()[2](self._tab.ctypes.data, float(a), int(stochastic))
        if not a > 0 or (not self.binned and not self._atoms):
            return self.n_zero / self.n
        if math.isinf(a):
            return self.finite_fraction
        return self._at(math.log(a), stochastic, a)

    def _breakpoints(self) -> list[tuple[float, int]]:
        """The bin edges and the atoms, ascending (edges first among equals, as the reference's
        stable sort): ``(value, index)`` with the index of an edge (``>= 0``) or ``-1`` for an atom."""
        if self._b is None:
            pts = [(v, i) for i, v in enumerate(self.x)] if self.binned else []
            pts += [(v, -1) for v in self._atoms]
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
        if self._tab is not None:
            return _native()[3](self._tab.ctypes.data, float(target), int(stochastic))
        if target * self.n <= self.n_zero or (not self.binned and not self._atoms):
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
        # S - target at the bracket's ends (the breakpoints' values): where a Newton step leaves the
        # bracket (from the concave side, near the root, it overshoots an end just past the root), the
        # secant of the bracket takes its place (bisection only where that fails too): superlinear to the
        # end, where bisection would halve the last interval some forty times
        f_lo = self._s_at_breakpoint(b[k - 1], True) - target
        f_hi = self._s_at_breakpoint(b[k], True) - target
        x = 0.5 * (lo + hi)
        for _ in range(100):
            sx = self._at(x, True)
            f = sx - target
            if f == 0.0:
                break
            if f < 0:
                lo, f_lo = x, f
            else:
                hi, f_hi = x, f
            d = self._at(x, False) - sx
            step = f / d if d > 0 else math.nan
            if abs(step) <= 4e-16 * max(1.0, abs(x)):   # converged: the step is below the resolution of x
                x -= step
                break
            nx = x - step
            if not lo < nx < hi:
                nx = lo - f_lo * (hi - lo) / (f_hi - f_lo) if f_hi > f_lo else math.nan
                if not lo < nx < hi:
                    nx = 0.5 * (lo + hi)
            done = abs(nx - x) <= 4e-16 * max(1.0, abs(x)) or hi - lo <= 4e-16 * max(1.0, abs(x))
            x = nx
            if done:
                break
        return math.exp(x)
