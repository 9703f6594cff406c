"""A statistics row: computing it from a tensor (the C kernel where it applies, else the torch
reference), turning a vector into a row, merging rows, and what the lognormal model reads from one.

Example:
    >>> import torch
    >>> merge_stats([tensor_stats(torch.ones(2)), tensor_stats(torch.zeros(1))])["n"]
    3
"""
from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any, Iterable, Mapping, TypedDict

import numpy as np

from gradstats.stats.fields import HIST_MIN_EXP, LAYOUT, MERGES, SCALAR_FIELDS, STATISTICS, VECTOR_LEN
from gradstats.stats.kernel import kernel_applies, write_stats

if TYPE_CHECKING:
    import torch


class StatsRow(TypedDict, total=False):
    """The statistics row of one tensor (or of several, merged with :func:`merge_stats`): what
    :func:`tensor_stats` returns, what a run stores per (step, layer, kind, call, rank) and what
    every analysis reads (thresholds, format choice, what-if, fits from statistics). A plain ``dict``
    at run time; rows read from a run carry their key columns too. ``top_abs`` is absent from rows
    of runs written before it existed."""

    n: int
    n_zero: int
    n_nonfinite: int
    sum: float
    sum_abs: float
    sum_sq: float
    sum_ln_abs: float
    sum_ln_abs_sq: float
    min_abs: float
    max_abs: float
    hist: np.ndarray
    top_abs: np.ndarray



def tensor_stats_vector(g: torch.Tensor, *, full: bool = True) -> torch.Tensor:
    """Statistics of ``g`` as one float64 vector on ``g``'s device (no host synchronisation
    on CUDA): on the Triton engine one pass of its statistics kernel
    (:mod:`gradstats.ops.triton.stats`), on the CPU the C kernel, else the torch reference. Layout: :data:`gradstats.stats.fields.LAYOUT` (``SCALAR_FIELDS``, the ``HIST_BINS``
    histogram counts, then the ``TOP_K`` largest magnitudes). ``full=False``: the scalar statistics only (the histogram and top parts
    are NaN), which the CPU kernel computes faster (what a refresh of the lognormal and bell
    models needs: :func:`gradstats.apply`).

    Use :func:`vector_to_stats` to turn it into a dict. The tracer keeps the vectors of device
    tensors on the device and converts them in one batch when it flushes; those of CPU tensors
    the kernel writes in place into rows (:func:`write_stats`, :class:`VectorRows`).

    Example:
        >>> import torch
        >>> v = tensor_stats_vector(torch.ones(3))
        >>> v.shape[0] == VECTOR_LEN, float(v[0])
        (True, 3.0)
        >>> bool(tensor_stats_vector(torch.ones(3), full=False)[len(SCALAR_FIELDS):].isnan().all())
        True
    """
    import torch

    from gradstats.ops.engine import use_triton

    x = g.detach()
    if use_triton(x.device.type) and x.numel() > 0:      # one Triton pass, half inputs read as they are
        from gradstats.ops.triton import stats as kstats

        flat = x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)
        if kstats.supports(flat):
            v = kstats.stats_vector(flat)
            if not full:
                v[len(SCALAR_FIELDS):] = math.nan
            return v
    if x.dtype != torch.float32:
        x = x.float()
    x = x.reshape(-1)
    x = x.contiguous() if x.is_cpu else x
    if kernel_applies(x):
        out = torch.empty(VECTOR_LEN, dtype=torch.float64)
        write_stats(x, out.data_ptr(), full=full)
        if not full:
            out[len(SCALAR_FIELDS):] = math.nan
        return out
    from gradstats.stats.reference import reduce

    v = reduce(x)
    if not full:
        v[len(SCALAR_FIELDS):] = math.nan
    return v


def vector_to_stats(v: torch.Tensor | np.ndarray) -> StatsRow:
    """Turn a vector from :func:`tensor_stats_vector` into a :class:`StatsRow` (on the host)."""
    torch = sys.modules.get("torch")             # a tensor exists only once torch is imported
    arr = v.detach().cpu().numpy() if torch is not None and isinstance(v, torch.Tensor) else np.asarray(v)
    out = {s.name: s.from_vector(arr[LAYOUT[s.name]]) for s in STATISTICS}
    return StatsRow(**out)  # type: ignore[typeddict-item]


def tensor_stats(g: torch.Tensor) -> StatsRow:
    """Statistics of one tensor as a :class:`StatsRow` (see the module docstring for the fields).

    Example:
        >>> import torch
        >>> s = tensor_stats(torch.tensor([0.5, -0.5, 0.0]))
        >>> s["n_zero"], round(s["sum_ln_abs"], 6)
        (1, -1.386294)
    """
    import torch

    if not isinstance(g, torch.Tensor):
        raise ValueError(f"tensor_stats expects a torch.Tensor, got {type(g).__name__}")
    if not (g.is_floating_point()):
        raise ValueError(f"tensor_stats expects a floating-point tensor, got dtype {g.dtype}")
    return vector_to_stats(tensor_stats_vector(g))


def n_nonzero(stats: StatsRow | Mapping[str, Any]) -> int:
    """Number of non-zero finite entries (the support of the lognormal fit)."""
    return int(stats["n"]) - int(stats["n_zero"]) - int(stats["n_nonfinite"])


def merge_stats(rows: Iterable[StatsRow | Mapping[str, Any]]) -> StatsRow:
    """Combine statistics of disjoint pieces of data (batches, calls, ranks) exactly:
    each statistic by its declared rule (:data:`gradstats.stats.fields.MERGES`): counts and sums add,
    minima and maxima combine, histograms add, and the largest magnitudes are the ``TOP_K`` largest
    of all rows' (rows without ``top_abs``, from runs written before it existed, make the merged
    row go without it too).

    Example:
        >>> import torch
        >>> a, b = torch.tensor([1.0, 2.0]), torch.tensor([0.0, 4.0])
        >>> m = merge_stats([tensor_stats(a), tensor_stats(b)])
        >>> m["n"], m["n_zero"], m["sum_abs"], m["max_abs"]
        (4, 1, 7.0, 4.0)
    """
    rows = list(rows)
    if not rows:
        raise ValueError("merge_stats needs at least one statistics row")
    out = {s.name: MERGES[s.merge]([r[s.name] for r in rows]) for s in STATISTICS
           if not s.optional or all(s.present(r) for r in rows)}
    return StatsRow(**out)  # type: ignore[typeddict-item]


def lognormal_moments(stats: StatsRow | Mapping[str, Any]) -> tuple[float, float]:
    """``(mu, sigma)`` of ``ln|g|`` (the MLE) from the sums; NaN when there are no non-zero
    finite entries.

    Example:
        >>> import torch
        >>> lognormal_moments(tensor_stats(torch.tensor([1.0, math.e ** 2])))
        (1.0, 1.0)
    """
    m = n_nonzero(stats)
    if m <= 0:
        return math.nan, math.nan
    mu = float(stats["sum_ln_abs"]) / m
    var = max(float(stats["sum_ln_abs_sq"]) / m - mu * mu, 0.0)
    return mu, math.sqrt(var)


def split_top(counts: Any, top: Any, *, min_exp: int = HIST_MIN_EXP) -> tuple[np.ndarray, np.ndarray]:
    """Take a row's largest magnitudes ``top`` (positive, finite) out of its binade counts: returns
    ``(rest, top_sorted)``, the counts of the other entries and ``top`` ascending. The one reading of
    ``hist`` with ``top_abs`` that the histogram rule (:class:`gradstats.pruning.LogHistogram`) and the
    format analysis (:class:`gradstats.fpanalysis.HistogramLaw`) share. ``ValueError`` when ``top`` is
    not the largest entries of the tensor the counts describe.

    Example:
        >>> import torch
        >>> row = tensor_stats(torch.tensor([0.5, 1.0, 1.5, 3.0]))
        >>> rest, top = split_top(row["hist"], [3.0, 1.5])
        >>> int(rest.sum()), top.tolist()
        (2, [1.5, 3.0])
    """
    h = np.asarray(counts, dtype=np.float64).reshape(-1).copy()
    t = np.sort(np.asarray(top, dtype=np.float64).reshape(-1))
    if t.size == 0:
        return h, t
    _, ex = np.frexp(t)                                  # exact floor(log2 t) + 1, even at powers of two
    j = ex.astype(np.int64) - 1 - min_exp
    if j.min() < 0 or j.max() >= h.size:
        raise ValueError(f"top values {t[-3:].tolist()} lie outside the histogram's binades "
                         f"[2^{min_exp}, 2^{min_exp + h.size}): pass the largest |g| of the same tensor")
    np.subtract.at(h, j, 1.0)
    if (h < 0).any() or h[j.min() + 1:].any():
        raise ValueError(f"top ({t.size} values) is not the {t.size} largest |g| of the tensor the histogram "
                         "counts (more values in a binade than it holds, or a larger value missing)")
    return h, t
