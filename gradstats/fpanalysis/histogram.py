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

from gradstats.formats import FPFormat, parse
from gradstats.fpanalysis import _params as P
from gradstats.fpanalysis._pieces import _N_ERR, PARTS, build, coef_matrices
from gradstats.stats import HIST_MIN_EXP, StatsRow  # noqa: F401 - HIST_MIN_EXP for callers
from gradstats.stats.law import MAX_SLOPE, SHAPES, TOP_FIELD, HistogramLaw  # noqa: F401 - re-exported here

__all__ = ["HistogramLaw", "expected_error_from_stats", "best_format_from_stats", "HistogramChoice", "SHAPES",
           "TOP_FIELD"]


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
        moments = h._binade_moments(pc.bounds, tuple(mats), s)      # (orders, S, P+1): the cuts located once
        for g, cm in zip(moments, mats.values()):
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
    P.check_choice("rounding", rounding, P.PREDICTED_ROUNDINGS)
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
    P.check_choice("rounding", rounding, P.PREDICTED_ROUNDINGS)
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
