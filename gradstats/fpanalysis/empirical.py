"""Measured quantisation error of real tensors, and the brute-force check of the predictions.

:func:`measured_error` quantises with :func:`gradstats.ops.quantization.quantize` and measures the same
criteria the analysis predicts; :func:`check_prediction` fits the lognormal to a tensor's non-zero
values (:func:`gradstats.stats.lognormal_moments`; optionally truncated at its largest magnitude), predicts the best split and power-of-two
scale with :func:`~gradstats.fpanalysis.best_format`, and compares it with an exhaustive search
over every split and every power-of-two scale around it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from gradstats.formats import FPFormat
from gradstats.fpanalysis import _params as P
from gradstats.fpanalysis.choice import best_format
from gradstats.fpanalysis.granularity import analysed_scheme
from gradstats.fpanalysis.scale import TIE_RTOL
from gradstats.ops.quantization import quantize
from gradstats.scheme import Scheme
from gradstats.stats import lognormal_moments, tensor_stats

__all__ = ["measured_error", "check_prediction", "energy_moments", "PredictionCheck"]


def _errors(x: torch.Tensor, q: torch.Tensor, criterion: str) -> torch.Tensor:
    """Criterion per row of ``q`` (rows: scales); sums in float64. ``q - x`` is exact in float32
    whenever ``q`` is within a factor 2 of ``x`` (Sterbenz), and the squares lose nothing that matters."""
    d = q.sub(x)
    if criterion == "mse":
        return d.mul_(d).sum(dim=-1, dtype=torch.float64) / x.double().square().sum()
    nz = x != 0
    d = d.div_(torch.where(nz, x, 1.0))
    return d.mul_(d).mul_(nz).sum(dim=-1, dtype=torch.float64) / nz.sum()


def measured_error(
    x: torch.Tensor,
    fmt: Union[FPFormat, str],
    *,
    scale: Union[float, Sequence[float], np.ndarray, None] = 1.0,
    rounding: str = "nearest",
    criterion: str = "mse",
    granularity: Union[str, int, Scheme, None] = None,
    generator: Optional[torch.Generator] = None,
) -> Any:
    """The error of ``quantize(x * scale, fmt) / scale`` on a real tensor.

    ``criterion="mse"``: ``sum((Q(x) - x)**2) / sum(x**2)`` (the relative MSE of
    :func:`~gradstats.fpanalysis.expected_error`); ``"elementwise"``: the mean of
    ``((Q(x) - x)/x)**2`` over the non-zero entries. ``scale`` may be a list (one error each, one
    vectorised call). With a block-scaled ``fmt`` (``"mxfp4"``, ``"nvfp4"``, a scheme) or ``granularity``
    (``"mx"``, ``"nvfp4"``, a block size: :func:`~gradstats.fpanalysis.granularity.analysed_scheme`) the block
    scales follow the blocks of ``x`` flattened.

    Example:
        >>> import torch
        >>> x = torch.exp(torch.randn(10000, generator=torch.Generator().manual_seed(0)))
        >>> round(measured_error(x, "e4m3fn") * 1e4, 1)
        6.3
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("x must be a floating-point torch.Tensor")
    P.check_choice("criterion", criterion, P.CRITERIA)
    sch = analysed_scheme(fmt, granularity, what="measured_error")
    fmt = P.check_format(sch.element)
    rounding = sch.rounding if rounding == "nearest" else rounding      # a scheme's own rounding, unless told
    x = x.detach().reshape(-1).float()
    x = x[torch.isfinite(x)]
    if x.numel() == 0 or not bool((x != 0).any()):
        raise ValueError("x has no non-zero finite values: its relative error is undefined")
    if sch.block_size is not None:
        if scale not in (None, 1.0):
            raise ValueError("pass either scale or a block-scaled format (its scales follow the blocks), not both")
        q = quantize(x, sch.replace(rounding=rounding), generator=generator)
        return float(_errors(x, q[None, :], criterion)[0])
    scalar = np.ndim(scale) == 0
    s = np.atleast_1d(np.asarray(1.0 if scale is None else scale, dtype=np.float64))
    P.check_scale(s)
    st = torch.as_tensor(s, dtype=torch.float32)[:, None]
    q = quantize(x[None, :].expand(len(s), -1), fmt, scale=st, rounding=rounding, generator=generator)
    e = _errors(x, q, criterion).numpy()
    return float(e[0]) if scalar else e


@dataclass(frozen=True)
class PredictionCheck:
    """Predicted best format and scale of one tensor against the measured brute-force best.

    Attributes:
        mu, sigma, p0, n: the lognormal fit of the tensor's non-zero values (ln|g|; ``fit="energy"``:
            of the ``g**2``-weighted values), zero fraction, size.
        fit, use_amax, criterion: the prediction's setting.
        predicted_format, predicted_log2_scale, predicted_error: the analysis' choice and its
            predicted error; measured_at_predicted: that choice's measured error.
        best_format, best_log2_scale, best_error: the measured minimum over every split and every
            power-of-two scale searched.
        match: the predicted (split, scale) is the measured argmin.
        tie: the predicted choice's measured error is within ``TIE_RTOL`` of the minimum (power-of-two
            scales leave the normal-range values unchanged, so several scales can tie exactly).
        excess: ``measured_at_predicted / best_error - 1``.
        best_per_format: ``{format: (log2 scale, error)}``, the measured best scale of each split.
    """

    mu: float
    sigma: float
    p0: float
    n: int
    predicted_format: str
    predicted_log2_scale: float
    predicted_error: float
    measured_at_predicted: float
    best_format: str
    best_log2_scale: float
    best_error: float
    match: bool
    tie: bool
    excess: float
    best_per_format: dict
    fit: str = "mle"
    use_amax: bool = True
    criterion: str = "mse"

    def to_dict(self) -> dict[str, Any]:
        """Plain dict."""
        return asdict(self)

    def to_dataframe(self) -> Any:
        """pandas view: one row (``best_per_format`` as its own column of dicts)."""
        import pandas as pd

        return pd.DataFrame([self.to_dict()])


def energy_moments(x: torch.Tensor) -> tuple[float, float]:
    """``(mu, sigma)`` of ``ln|g|`` weighted by ``g**2``: the lognormal the relative MSE sees.

    For ``ln|g| ~ N(mu, s**2)`` this is ``(mu + 2 s**2, s)``; the relative MSE of ``g`` equals the
    mean relative squared error under it (see the package doc).

    Example:
        >>> import torch
        >>> x = torch.exp(-3 + 0.5 * torch.randn(200000, generator=torch.Generator().manual_seed(0)))
        >>> [round(v, 2) for v in energy_moments(x)]
        [-2.5, 0.5]
    """
    a = x.detach().reshape(-1).double().abs()
    a = a[torch.isfinite(a) & (a > 0)]
    if a.numel() < 2:
        raise ValueError("x needs at least two non-zero finite values")
    w = a * a
    w = w / w.sum()
    lg = a.log()
    m = float((w * lg).sum())
    return m, float((w * (lg - m) ** 2).sum().sqrt())


class _HistogramPick:
    """A :class:`~gradstats.fpanalysis.histogram.HistogramChoice` seen as a ``BestFormat`` of one
    layer (the attributes :func:`check_prediction` reads)."""

    def __init__(self, c: Any) -> None:
        self.candidates, self.scales = c.candidates, np.exp2(c.log2_scales)
        self.format, self.scale, self.error = c.format, c.scale, c.error


def check_prediction(
    x: torch.Tensor,
    bits: int,
    *,
    candidates: Union[None, str, Sequence[Union[FPFormat, str]]] = None,
    rounding: str = "nearest",
    criterion: str = "mse",
    window: int = 8,
    use_amax: bool = True,
    fit: str = "mle",
    generator: Optional[torch.Generator] = None,
    measured: Optional[dict] = None,
    top_k: Optional[int] = None,
) -> PredictionCheck:
    """Fit, predict, and brute-force one tensor (see the module doc).

    ``fit``: ``"mle"``, the lognormal of the non-zero ``|g|`` (mean and std of ``ln|g|``, as
    everywhere); ``"energy"`` (``criterion="mse"`` only): the lognormal of the ``g**2``-weighted
    distribution (``g**2``-weighted mean and std of ``ln|g|``), the part of the data the MSE sees; by
    the identity MSE/E[g**2] = mean relative squared error under the ``g**2``-weighted distribution,
    it predicts with ``criterion="elementwise"`` on that fit. For exactly lognormal data the two
    fits agree (``mu + 2 sigma**2``, ``sigma``); for near-lognormal gradients with a short upper tail
    the energy fit describes the values that matter.
    ``"histogram"``: no lognormal at all: the tensor's binade histogram and maximum read as a
    piecewise log-uniform law (:func:`~gradstats.fpanalysis.best_format_from_stats`: what a run's
    statistics give without samples; ``use_amax`` does not apply); ``top_k``: the ``top_k``
    largest ``|g|`` of ``x`` as point masses (the ``top`` of
    :func:`~gradstats.fpanalysis.best_format_from_stats`); ``None``: those the statistics carry
    (``top_abs``, :data:`gradstats.stats.TOP_K` of them); ``0``: the histogram alone.
    ``use_amax``: predict the error of this tensor given its largest magnitude (``"mle"``: one entry
    there, the others lognormal truncated there; ``"energy"``: truncated there); ``False``: the
    population optimum from the fitted parameters alone.
    Every split of ``candidates`` (default: the ``fn`` splits of ``bits`` bits) is measured at the
    powers of two within ``window`` binades of its predicted best scale; the window grows until the
    measured minimum is inside it. ``measured``: a dict to reuse measurements between calls on the
    same ``x`` with the same rounding and criterion (filled in place).

    Example:
        >>> import torch
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.exp(-9 + 2.0 * torch.randn(50000, generator=g))
        >>> c = check_prediction(x, 8)
        >>> c.predicted_format, c.match or c.tie, c.excess < 0.1
        ('e4m3fn', True, True)
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("x must be a floating-point torch.Tensor")
    x = x.detach().reshape(-1).float()
    x = x[torch.isfinite(x)]
    P.check_choice("fit", fit, ("mle", "energy", "histogram"))
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0):
        raise ValueError(f"top_k must be None (what the statistics carry) or a non-negative int "
                         f"(0: the histogram alone), got {top_k!r}")
    if top_k and fit != "histogram":
        raise ValueError("top_k applies to fit='histogram' (the largest |g| as point masses of the histogram law)")
    if fit == "energy" and criterion != "mse":
        raise ValueError("fit='energy' (the g**2-weighted lognormal) predicts the MSE; use criterion='mse'")
    st = tensor_stats(x)
    mu, sigma = lognormal_moments(st)
    if not (math.isfinite(mu) and sigma > 0):
        raise ValueError("x needs at least two distinct non-zero finite magnitudes to fit a lognormal")
    p0 = float(st["n_zero"]) / max(int(st["n"]), 1)
    amax = float(st["max_abs"]) if use_amax else None
    if fit == "histogram":
        from gradstats.fpanalysis.histogram import best_format_from_stats

        top = (None if top_k is None else
               torch.topk(x.abs(), min(int(top_k), x.numel())).values if top_k else ())
        bf = _HistogramPick(best_format_from_stats(bits, st, candidates=candidates, rounding=rounding,
                                                   criterion=criterion, top=top))
    elif fit == "energy":
        mu, sigma = energy_moments(x)
        bf = best_format(bits, mu=mu, sigma=sigma, candidates=candidates, rounding=rounding,
                         criterion="elementwise", amax=amax)
    else:
        bf = best_format(bits, mu=mu, sigma=sigma, p0=p0, candidates=candidates, rounding=rounding,
                         criterion=criterion, amax=amax, numel=int(st["n"]) if use_amax else None)
    measured = {} if measured is None else measured
    per_fmt: dict[str, tuple[float, float]] = {}
    for i, f in enumerate(bf.candidates):
        j0 = round(math.log2(bf.scales[i]))
        lo, hi = j0 - window, j0 + window
        while True:
            js = [j for j in range(lo, hi + 1) if (str(f), float(j)) not in measured]
            js = [j for j in js if P.LOG2_SCALE_RANGE[0] <= j <= P.LOG2_SCALE_RANGE[1]]
            if js:
                e = measured_error(x, f, scale=[2.0 ** j for j in js], rounding=rounding, criterion=criterion,
                                   generator=generator)
                measured.update({(str(f), float(j)): float(v) for j, v in zip(js, e)})
            mine = {j: v for (n, j), v in measured.items() if n == str(f)}
            jb = min(mine, key=lambda j: (mine[j], abs(j - j0)))
            if lo < jb < hi or not (P.LOG2_SCALE_RANGE[0] < jb < P.LOG2_SCALE_RANGE[1]):
                break
            lo, hi = (lo - window, hi) if jb <= lo else (lo, hi + window)
        per_fmt[str(f)] = (jb, mine[jb])
    pf, pj = str(bf.format), round(math.log2(bf.scale))
    at_pred = measured[(pf, float(pj))]
    names = {str(f) for f in bf.candidates}
    (bfmt, bj), best = min(((k, v) for k, v in measured.items() if k[0] in names), key=lambda kv: kv[1])
    return PredictionCheck(
        mu=mu, sigma=sigma, p0=p0, n=int(st["n"]), predicted_format=pf, predicted_log2_scale=float(pj),
        predicted_error=float(bf.error), measured_at_predicted=at_pred, best_format=bfmt,
        best_log2_scale=bj, best_error=best, match=(pf, float(pj)) == (bfmt, bj),
        tie=at_pred <= best * (1 + TIE_RTOL), excess=at_pred / best - 1 if best > 0 else 0.0,
        best_per_format=per_fmt, fit=fit, use_amax=bool(use_amax), criterion=criterion)
