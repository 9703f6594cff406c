"""Pruning to a target sparsity: estimate-and-prune (:func:`prune`) and the exact (sort/selection
based) thresholds the analytic rules are compared against. The operators themselves
(:func:`stochastic_prune`, :func:`hard_prune`) live in :mod:`gradstats.ops.prune`.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Any

import numpy as np
import torch

from gradstats.ops import cpu as _cpu
from gradstats.ops.prune import check_generator, check_out, check_tensor, hard_prune, stochastic_prune
from gradstats.pruning.rules import THRESHOLD_RULES, LayerStats, check_target, exact_threshold
from gradstats.pruning.thresholds import DEFAULT_RULE
from gradstats.pruning.thresholds import threshold as _threshold
from gradstats.stats import SCALAR_FIELDS, has_native_kernel, tensor_stats, tensor_stats_vector

log = logging.getLogger(__name__)

#: bins per binade of the histogram rule in :func:`prune` (``2**HIST_MBITS``)
HIST_MBITS = 2


@functools.lru_cache(maxsize=1)
def _native_log2_hist():
    from gradstats.ops.native import function

    return function("stats", "gs_log2_hist_f32",
                    [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int])


def _histogram(x: torch.Tensor):
    """The LogHistogram of ``x`` at ``2**HIST_MBITS`` bins per binade, in one sweep."""
    from gradstats.pruning.histogram import LogHistogram

    fn = _native_log2_hist() if x.device.type == "cpu" and x.dtype == torch.float32 else None
    if fn is not None:   # the C counting kernel (one sweep, threads as torch's)
        xc = x.detach().contiguous().reshape(-1)
        counts = np.zeros(256 << HIST_MBITS, dtype=np.int64)
        if fn(xc.data_ptr(), xc.numel(), HIST_MBITS, counts.ctypes.data, torch.get_num_threads()) == 0:
            return LogHistogram.from_counts(counts, mbits=HIST_MBITS, float64=False, n=x.numel())
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        counts = _cpu.log2_histogram(x.detach().contiguous().reshape(-1).numpy(), HIST_MBITS)
        return LogHistogram.from_counts(counts, mbits=HIST_MBITS, float64=x.dtype == torch.float64,
                                        n=x.numel())
    bits = x.detach().reshape(-1).float().view(torch.int32) & 0x7FFFFFFF
    counts = torch.bincount(bits >> (23 - HIST_MBITS), minlength=256 << HIST_MBITS)
    return LogHistogram.from_counts(counts.cpu().numpy(), mbits=HIST_MBITS, float64=False,
                                    n=x.numel())


def _estimate(x: torch.Tensor, method: str) -> dict[str, Any]:
    """Statistics of ``x`` needed by ``method`` (n, n_zero, sums), in one sweep."""
    logs = method in ("lognormal", "naive_lognormal")
    if x.device.type == "cpu" and x.dtype == torch.float32 and has_native_kernel():
        # the fused one-pass C kernel: every sum, the zero count and the maximum at once
        st = dict(zip(SCALAR_FIELDS, tensor_stats_vector(x.detach()).tolist()))
        if st["n_nonfinite"] == 0:
            for k in ("n", "n_zero", "n_nonfinite"):
                st[k] = int(st[k])
            return st
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        st = _cpu.moments(x.detach().contiguous().reshape(-1).numpy(), logs=logs, sums=not logs)
        if st.pop("finite"):
            return st
    elif x.device.type != "cpu":
        xf = x.detach().reshape(-1).double()  # float64 sums: cheap on a GPU, no precision worries
        ax = xf.abs()
        nz = ax > 0
        fin = torch.isfinite(ax)
        if bool(fin.all()):
            lg = torch.log(torch.where(nz, ax, 1.0))
            v = torch.stack([nz.sum(), ax.sum(), torch.dot(ax, ax), lg.sum(),
                             torch.dot(lg, lg)]).double().cpu()
            n = xf.numel()
            return {"n": n, "n_zero": n - int(v[0]), "n_nonfinite": 0, "sum_abs": float(v[1]),
                    "sum_sq": float(v[2]), "sum_ln_abs": float(v[3]), "sum_ln_abs_sq": float(v[4])}
    return dict(tensor_stats(x))


def prune(x: torch.Tensor, target: float, *, threshold_rule: str = DEFAULT_RULE, stochastic: bool = True,
          generator: torch.Generator | None = None, out: torch.Tensor | None = None,
          return_threshold: bool = False) -> Any:
    """Estimate the threshold for ``target`` sparsity from ``x`` itself and apply it.

    ``threshold_rule``: ``"histogram"`` (the default, model-free: one sweep counting ``|x|`` in
    quarter-binade bins, see :mod:`gradstats.pruning.histogram`; the most accurate sort-free
    rule on real gradients, within about 1e-4 of the target on average), a model rule of
    :func:`gradstats.pruning.threshold` (``"lognormal"``, the study's closed form,
    ``"naive_lognormal"``, ``"normal"``, ``"laplace"``; the parameters come from one sweep
    over ``x``: zero count and the sums of ``ln|x|``, ``ln^2|x|``, ``|x|``, ``x^2``),
    or ``"exact"`` (``torch.kthvalue`` for the hard operator, the sort-based oracle of
    :func:`exact_threshold` for the stochastic one). ``stochastic=True`` applies
    :func:`stochastic_prune` with the threshold solved for that operator;
    ``stochastic=False`` hard-thresholds at the rule's quantile. Returns the pruned tensor, or
    ``(tensor, threshold)`` with ``return_threshold=True``.

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(200_000, generator=g).mul(2).exp() * torch.randn(200_000, generator=g).sign()
        >>> y = prune(x, 0.9, generator=g)
        >>> abs((y == 0).float().mean().item() - 0.9) < 0.005
        True
    """
    check_tensor(x)
    s = check_target(target)
    method = threshold_rule
    if method not in THRESHOLD_RULES:
        raise ValueError(f"threshold_rule must be one of {tuple(THRESHOLD_RULES)}, got {method!r}")
    check_out(out, x)
    check_generator(generator)
    if method == "exact":
        a = exact_threshold(x, s, stochastic=stochastic)
    elif method == "histogram":
        a = THRESHOLD_RULES["histogram"].threshold(s, LayerStats(hist=_histogram(x)), stochastic=stochastic)
        a = min(a, float(torch.finfo(x.dtype).max))
    else:
        st = _estimate(x, method)
        if int(st["n"]) - int(st["n_zero"]) - int(st.get("n_nonfinite", 0)) <= 0:
            a = 0.0  # all zero (or non-finite): nothing to prune
        else:
            model = "lognormal" if method == "naive_lognormal" else method
            sto = stochastic and method != "naive_lognormal"
            a = float(_threshold(s, st, threshold_rule=model, stochastic=sto))
    if stochastic:
        y = stochastic_prune(x, a, generator=generator, out=out)
    else:
        y = hard_prune(x, a, out=out)
    return (y, a) if return_threshold else y
