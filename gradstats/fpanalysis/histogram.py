"""The format analysis from a tensor's binade histogram instead of a lognormal fit.

A run stores, for every captured tensor, the counts of ``floor(log2|g|)`` and the largest
``|g|`` (:mod:`gradstats.stats`). Read as a distribution of ``u = ln|g|``, that is a piecewise
law: each binade ``[2**j, 2**(j+1))`` holds exactly its observed mass, the top one ends at
``amax``, and within a binade the density of ``u`` is log-linear, ``exp(beta_j u)``, with the slope
``beta_j`` of the log-densities of the neighbouring binades (central differences; ``shape="flat"``
takes ``beta = 0``: log-uniform binades). With a power-of-two scale every binade boundary of a float
format falls on a binade boundary of the histogram, so underflow, the subnormal range and the top
binades see the tensor's own masses exactly; only the shape *within* a binade is modelled. Real
gradients are near-lognormal with a longer lower tail than the lognormal (negative skewness of
``ln|g|``) and a top that the lognormal does not follow either; the histogram sees both where the
two-parameter fit cannot, and those decide when exponent bits are traded against mantissa bits
(on the real gradients of ``experiments/fpanalysis_real.py`` the predicted split and scale are the
brute-force best in over 90% of layers at FP4, FP6 and FP8; see ``docs/fpanalysis.md``).

The error integrals use the same exact engine as the lognormal analysis (the format's
quantisation cells as polynomial pieces, :mod:`._pieces`) with the partial moments of the
piecewise law, ``E[y**k 1{a <= y < b}]``, in closed form.

The relative MSE is dominated by the largest entries, and where a tensor's top binade holds few
of them their places decide whether the best scale lets them saturate: the histogram alone then
picks a scale one binade off. ``top=`` (or a statistics row's :data:`TOP_FIELD`) adds the
tensor's ``k`` largest magnitudes as exact point masses, each in its known quantisation cell
(nearest rounding with ties to even, or stochastic rounding's exact variance); the binades keep
the other entries and end at the smallest of them. With every entry given the prediction is
``quantize``'s measured error; on the real (sampled) gradients of ``experiments/fpanalysis_real.py``
the 64 a statistics row carries (``top_abs``, read by default) make every predicted choice the
brute-force best at FP4, FP6 and FP8 (``docs/fpanalysis.md``).

Example:
    >>> import torch
    >>> from gradstats.stats import tensor_stats
    >>> g = torch.Generator().manual_seed(0)
    >>> x = torch.exp(-9 + 1.5 * torch.randn(100_000, generator=g))
    >>> b = best_format_from_stats(8, tensor_stats(x))
    >>> str(b.format), b.log2_scale    # given the sample's maximum, as a brute-force search finds
    ('e3m4fn', 8.0)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

import numpy as np
import torch

from gradstats.formats import FPFormat, parse
from gradstats.fpanalysis import _params as P
from gradstats.fpanalysis._pieces import _N_ERR, PARTS, build, coef_matrices
from gradstats.stats import HIST_MIN_EXP, StatsRow, split_top

__all__ = ["HistogramLaw", "expected_error_from_stats", "best_format_from_stats", "HistogramChoice", "SHAPES",
           "TOP_FIELD"]


def _expm1_ratio(c: np.ndarray, t: np.ndarray) -> np.ndarray:
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
        P.check_choice("shape", shape, SHAPES)
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

    def partial_moments(self, y: np.ndarray, k: int, log_scale: np.ndarray) -> np.ndarray:
        """``E[Y**k 1{Y < y}]`` of the law scaled by ``exp(log_scale)``: ``(S, len(y))`` for ``S`` scales.

        Within a binade ``[a, b)`` of slope ``beta``: ``E[Y**k 1{a <= Y < y}] = w a**k
        r(k + beta, ln(y/a)) / r(beta, ln(b/a))`` with ``r(c, t) = (exp(c t) - 1) / c``; an atom at
        ``a`` adds ``atom_weight * a**k`` where ``a < y``."""
        s = np.exp(np.asarray(log_scale, dtype=np.float64))[:, None]
        y = np.asarray(y, dtype=np.float64)
        out = self._binade_moments(y, k, s)
        if self.atoms.size:
            ya = self.atoms[None, :] * s                                # (S, K)
            with np.errstate(over="ignore", under="ignore"):
                below = ya[:, None, :] < y[None, :, None]
                out += self.atom_weight * np.sum(np.where(below, ya[:, None, :] ** k, 0.0), axis=2)
        return out

    def _binade_moments(self, y: np.ndarray, k: int, s: np.ndarray) -> np.ndarray:
        """The binades' part of :meth:`partial_moments` (``s``: the scales, ``(S, 1)``)."""
        out = np.zeros((s.shape[0], y.size))
        if self.weights.size == 0:
            return out
        e = self.edges[None, :] * s                                    # (S, B+1)
        width = np.log(self.edges[1:] / self.edges[:-1])
        norm = _expm1_ratio(self.slopes, width)
        grow = _expm1_ratio(k + self.slopes, width) / norm             # a binade's moment over w a**k
        with np.errstate(over="ignore", under="ignore"):
            full = self.weights[None, :] * e[:, :-1] ** k * grow[None, :]
        cum = np.concatenate([np.zeros((s.shape[0], 1)), np.cumsum(full, axis=1)], axis=1)
        for i in range(s.shape[0]):
            ei = e[i]
            j = np.clip(np.searchsorted(ei, y, side="right") - 1, 0, len(ei) - 2)
            with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
                t = np.log(np.clip(y, ei[j], ei[j + 1]) / ei[j])
                inside = cum[i, j] + self.weights[j] * ei[j] ** k * _expm1_ratio(k + self.slopes[j], t) / norm[j]
            out[i] = np.where(y <= ei[0], 0.0, np.where(y >= ei[-1], cum[i, -1], inside))
        return out


#: within-binade shapes of :class:`HistogramLaw`
SHAPES = ("slope", "flat")


def _atom_pieces(pc: Any, y: np.ndarray) -> np.ndarray:
    """The piece of each value ``y`` (any shape), as :func:`gradstats.quantize` rounds it where the
    pieces' half-open cells do not say: under nearest rounding a value on a midpoint goes to the
    neighbour with the even code (piece ``i < len(values)`` is the cell of the ``i``-th non-negative
    value, whose code is ``i``), and a value equal to ``max`` is not saturated. The error is the same
    either way; the part it is filed under and the fractions flushed and saturated are not."""
    idx = np.clip(np.searchsorted(pc.bounds, y, side="right") - 1, 0, pc.n_pieces - 1)
    if pc.rounding == "nearest":
        n_values = int((pc.fmt.values().numpy() >= 0).sum())
        tie = (idx >= 1) & (idx < n_values) & (idx % 2 == 1) & (y == pc.bounds[idx])
        idx = np.where(tie, idx - 1, idx)
    return np.where(y == pc.fmt.max, idx - 1, idx)


def _integrals(fmt: FPFormat, h: HistogramLaw, log2_scales: np.ndarray, *, rounding: str,
               mode: str) -> np.ndarray:
    """``(S, 7)``: error parts (normalised by ``mode``) and fractions at each power-of-two scale.
    The binades through their partial moments at the cell boundaries, the atoms each in its cell."""
    pc = build(fmt, rounding, "saturate")
    ln_s = np.asarray(log2_scales, dtype=np.float64) * math.log(2)
    out = np.zeros((ln_s.size, 7))
    mats = coef_matrices(pc, mode)
    if h.weights.size:
        s = np.exp(ln_s)[:, None]
        for kk, cm in mats.items():
            g = h._binade_moments(pc.bounds, kk, s)                   # (S, P+1)
            out += np.diff(g, axis=1) @ cm
    if h.atoms.size:
        y = h.atoms[None, :] * np.exp2(np.asarray(log2_scales, dtype=np.float64))[:, None]   # (S, K), exact
        idx = _atom_pieces(pc, y)
        rows = np.broadcast_to(np.arange(ln_s.size)[:, None], y.shape)
        for kk, cm in mats.items():
            m = np.zeros((ln_s.size, pc.n_pieces))
            with np.errstate(over="ignore", under="ignore"):
                np.add.at(m, (rows, idx), h.atom_weight * y ** kk)
            out += m @ cm
    if mode == "relative":
        energy = h.partial_moments(np.array([np.inf]), 2, ln_s)[:, 0]
        out[:, :_N_ERR] /= energy[:, None]
    return out


@dataclass(frozen=True)
class HistogramChoice:
    """The splits of one width ranked on a tensor's histogram (:func:`best_format_from_stats`).

    Attributes: ``bits``, ``candidates``; ``errors`` and ``log2_scales`` per candidate (each at its
    best power-of-two scale); ``format``, ``scale``, ``log2_scale``, ``error`` of the winner;
    ``scan``: ``{format name: (log2 scales, errors)}`` of every scale evaluated.

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> c = best_format_from_stats(6, tensor_stats(torch.logspace(-8, -2, 1000)))
        >>> len(c.candidates), c.to_dict()["format"] in [str(f) for f in c.candidates]
        (4, True)
    """

    bits: int
    candidates: tuple[FPFormat, ...]
    errors: np.ndarray
    log2_scales: np.ndarray
    rounding: str = "nearest"
    criterion: str = "mse"
    scan: dict = field(default_factory=dict, repr=False)

    @property
    def best(self) -> int:
        return int(np.argmin(self.errors))

    @property
    def format(self) -> FPFormat:
        return self.candidates[self.best]

    @property
    def log2_scale(self) -> float:
        return float(self.log2_scales[self.best])

    @property
    def scale(self) -> float:
        return float(2.0 ** self.log2_scale)

    @property
    def error(self) -> float:
        return float(self.errors[self.best])

    def to_dict(self) -> dict[str, Any]:
        """The winner and every candidate's error and scale."""
        return {"bits": self.bits, "format": str(self.format), "log2_scale": self.log2_scale, "error": self.error,
                "rounding": self.rounding, "criterion": self.criterion,
                "candidates": {str(f): {"error": float(e), "log2_scale": float(j)}
                               for f, e, j in zip(self.candidates, self.errors, self.log2_scales)}}

    def to_dataframe(self) -> Any:
        """pandas view: one row per candidate format, the winner marked ``best``."""
        import pandas as pd

        return pd.DataFrame([{"format": str(f), "error": float(e), "log2_scale": float(j), "best": i == self.best}
                             for i, (f, e, j) in enumerate(zip(self.candidates, self.errors, self.log2_scales))])


def _scan_range(fmt: FPFormat, h: HistogramLaw, window: int) -> np.ndarray:
    """Powers of two from where ``amax`` lands ``window`` binades past the top of the format to
    where it sits ``window`` binades below it (the MSE optimum is always near the top)."""
    j0 = math.floor(math.log2(fmt.max / h.amax))
    lo, hi = max(j0 - window, P.LOG2_SCALE_RANGE[0]), min(j0 + window, P.LOG2_SCALE_RANGE[1])
    return np.arange(lo, hi + 1, dtype=np.float64)


def expected_error_from_stats(fmt: Union[FPFormat, str], stats: StatsRow | Mapping[str, Any], *, scale: float = 1.0,
                              rounding: str = "nearest", criterion: str = "mse",
                              shape: str = "slope", top: Any = None) -> dict[str, float]:
    """Predicted error of ``fmt`` at ``scale`` on the tensor a statistics row describes (its binade
    histogram read as a piecewise log-uniform law, see the module doc): ``total`` and the parts
    (relative MSE, or the mean relative squared error with ``criterion="elementwise"``) and the
    fractions flushed and saturated, per non-zero entry. ``shape``: the within-binade model
    (:data:`SHAPES`; ``"flat"`` is exact for log-uniform data). ``top``: the tensor's largest
    magnitudes as exact point masses (:meth:`HistogramLaw.from_counts`; ``None``: the row's
    :data:`TOP_FIELD` if it has one; ``()``: the histogram alone).

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> st = tensor_stats(torch.tensor([1.0, 1.5, 3.0, 0.0]))
        >>> e = expected_error_from_stats("e4m3fn", st)
        >>> e["total"] < 1e-3, e["saturated"]
        (True, 0.0)
        >>> from gradstats.fpanalysis import measured_error
        >>> x = torch.tensor([1.0, 1.5, 3.0, 0.0, -5.5])
        >>> exact = expected_error_from_stats("e2m1fn", tensor_stats(x), top=x.abs())  # every entry
        >>> round(exact["total"], 6), round(measured_error(x, "e2m1fn"), 6)
        (0.005882, 0.005882)
    """
    f = P.check_format(parse(fmt))
    P.check_choice("rounding", rounding, P.ROUNDINGS)
    P.check_choice("criterion", criterion, P.CRITERIA)
    s = float(scale)
    if not (s > 0 and math.isfinite(s)):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    h = HistogramLaw.from_stats(stats, shape=shape, top=top)
    r = _integrals(f, h, np.array([math.log2(s)]), rounding=rounding,
                   mode="relative" if criterion == "mse" else "elementwise")[0]
    out = {"total": float(r[:_N_ERR].sum())}
    out.update({p: float(v) for p, v in zip(PARTS, r[:_N_ERR])})
    out.update(flushed=float(r[_N_ERR]), saturated=float(r[_N_ERR + 1]))
    return out


def best_format_from_stats(bits: int, stats: StatsRow | Mapping[str, Any], *,
                           candidates: Union[None, str, Sequence[Union[FPFormat, str]]] = None,
                           rounding: str = "nearest", criterion: str = "mse", window: int = 12,
                           shape: str = "slope", top: Any = None) -> HistogramChoice:
    """Rank the splits of ``bits`` bits on one tensor's statistics row (its binade histogram and
    maximum), each at its best power-of-two scale (searched over ``window`` binades either side of
    the scale that puts ``amax`` at the top of the format).

    ``candidates`` as in :func:`gradstats.fpanalysis.best_format` (default: every split; a preset
    such as ``"ocp"`` gives its per-tensor formats). Per-tensor scales only.
    ``top``: the tensor's largest magnitudes, exact point masses that place the entries deciding
    saturation (see :func:`expected_error_from_stats`); by default the row's ``top_abs`` (the 64
    largest, :data:`gradstats.stats.TOP_K`), ``()`` for the histogram alone.

    Example:
        >>> import torch
        >>> from gradstats.stats import tensor_stats
        >>> g = torch.Generator().manual_seed(1)
        >>> x = torch.exp(-10 + 3.0 * torch.randn(100_000, generator=g))
        >>> c = best_format_from_stats(8, tensor_stats(x))
        >>> str(c.format), sorted(c.to_dict()["candidates"])[:2]
        ('e3m4fn', ['e1m6fn', 'e2m5fn'])
        >>> from gradstats.fpanalysis import measured_error
        >>> t = best_format_from_stats(8, tensor_stats(x), top=torch.topk(x.abs(), 32).values)
        >>> str(t.format), t.log2_scale, round(t.error / measured_error(x, t.format, scale=t.scale), 2)
        ('e3m4fn', 1.0, 0.99)
    """
    from gradstats.fpanalysis.choice import preset_formats

    bits = P.check_bits(bits)
    P.check_choice("rounding", rounding, P.ROUNDINGS)
    P.check_choice("criterion", criterion, P.CRITERIA)
    if candidates is None or isinstance(candidates, str):   # a preset: its per-tensor formats
        cands = preset_formats(candidates or "any", bits, granularity="tensor")
    else:
        cands = [P.check_format(parse(c)) for c in candidates]
        wrong = [str(c) for c in cands if c.bits != bits]
        if not cands or wrong:
            raise ValueError(f"candidates must be formats of {bits} bits, got {[str(c) for c in cands]}")
    h = HistogramLaw.from_stats(stats, shape=shape, top=top)
    mode = "relative" if criterion == "mse" else "elementwise"
    errs, js, scan = [], [], {}
    for f in cands:
        grid = _scan_range(f, h, window)
        e = _integrals(f, h, grid, rounding=rounding, mode=mode)[:, :_N_ERR].sum(axis=1)
        i = int(np.argmin(e))
        errs.append(float(e[i]))
        js.append(float(grid[i]))
        scan[str(f)] = (grid, e)
    return HistogramChoice(bits, tuple(cands), np.array(errs), np.array(js), rounding, criterion, scan)
