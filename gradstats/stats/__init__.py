"""Streaming statistics of one gradient tensor: the one home of the sufficient statistics.

For a tensor ``g`` the statistics are (all in float32 arithmetic on ``g``'s own device,
whatever its dtype):

========================  =================================================================
``n``                     number of elements
``n_zero``                exact zeros (a point mass, never put into the logs)
``n_nonfinite``           inf and NaN (counted, excluded from everything else)
``sum``                   sum of ``g`` over finite entries
``sum_abs``               sum of ``|g|`` over finite entries
``sum_sq``                sum of ``g**2`` over finite entries
``sum_ln_abs``            sum of ``ln|g|`` over non-zero finite entries
``sum_ln_abs_sq``         sum of ``ln(|g|)**2`` over non-zero finite entries
``min_abs``, ``max_abs``  smallest and largest non-zero finite ``|g|`` (NaN when there is none)
``hist``                  counts of ``floor(log2|g|)`` over non-zero finite entries, one bin per
                          float32 binade from ``HIST_MIN_EXP`` (-149, subnormals) to
                          ``HIST_MAX_EXP`` (127): ``hist[i]`` counts values in
                          ``[2**(HIST_MIN_EXP + i), 2**(HIST_MIN_EXP + i + 1))``
``top_abs``               the ``TOP_K`` (64) largest non-zero finite ``|g|``, descending, NaN where
                          the tensor has fewer (``top_abs[0] == max_abs``): the few entries that
                          decide saturation and the error of a low-precision format
========================  =================================================================

On the CPU a fused C kernel (:mod:`gradstats.ops.native`, ``stats.c``: hand-vectorised for AVX-512,
portable C elsewhere; timings in ``bench/RESULTS.md``) computes them when a C compiler is
available; elsewhere, and as the reference, a sequence of torch reductions. The counts,
extremes, binade counts and top magnitudes are exact on every path; the sums agree to float32
rounding.

Each statistic is declared once in :mod:`gradstats.stats.fields` (name, kind, computation, merge
rule); the vector layout, :func:`merge_stats` and a run's columns follow from that declaration.
The torch reference lives in :mod:`gradstats.stats.reference`, the C kernel's use in
:mod:`gradstats.stats.kernel`, rows in :mod:`gradstats.stats.row`; this package re-exports them.

The sums are sufficient for the lognormal MLE (``mu = sum_ln_abs / n_nz``) and mergeable:
statistics of several batches, calls, steps or ranks combine with :func:`merge_stats`.

Example:
    >>> import torch
    >>> from gradstats.stats import tensor_stats
    >>> s = tensor_stats(torch.tensor([0.0, 1.0, -2.0, float("inf")]))
    >>> s["n"], s["n_zero"], s["n_nonfinite"], s["sum_abs"], s["max_abs"]
    (4, 1, 1, 3.0, 2.0)
    >>> int(s["hist"][0 - HIST_MIN_EXP]), int(s["hist"][1 - HIST_MIN_EXP])  # binades of 1.0 and 2.0
    (1, 1)
"""
from __future__ import annotations

from gradstats.stats.fields import (
    COUNT_FIELDS,
    HIST_BINS,
    HIST_MAX_EXP,
    HIST_MIN_EXP,
    LAYOUT,
    SCALAR_FIELDS,
    STATISTICS,
    SUM_FIELDS,
    TOP_K,
    VECTOR_LEN,
    Statistic,
    merge_top,
)
from gradstats.stats.kernel import VectorRows, has_native_kernel, kernel_applies, write_stats
from gradstats.stats.row import (
    StatsRow,
    lognormal_moments,
    merge_stats,
    n_nonzero,
    split_top,
    tensor_stats,
    tensor_stats_vector,
    vector_to_stats,
)

__all__ = ["COUNT_FIELDS", "HIST_BINS", "HIST_MAX_EXP", "HIST_MIN_EXP", "LAYOUT", "SCALAR_FIELDS", "STATISTICS",
           "SUM_FIELDS", "TOP_K", "VECTOR_LEN", "Statistic", "StatsRow", "VectorRows", "has_native_kernel",
           "kernel_applies", "lognormal_moments", "merge_stats", "merge_top", "n_nonzero", "split_top",
           "tensor_stats", "tensor_stats_vector", "vector_to_stats", "write_stats"]
