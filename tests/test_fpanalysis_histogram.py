"""The format analysis from a binade histogram (gradstats.fpanalysis.histogram)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gradstats
from gradstats import fpanalysis as fa
from gradstats.fpanalysis.histogram import HistogramLaw
from gradstats.stats import tensor_stats


def _log_uniform(n: int, lo: float, hi: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(lo + (hi - lo) * torch.rand(n, generator=g, dtype=torch.float64)).float()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2", "e2m5fn", "e3m2fn", "e2m1fn", "e4m3fnuz", "e3m4"])
@pytest.mark.parametrize("log2_scale", [6, 12, 18])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_flat_shape_is_exact_on_log_uniform_data(fmt, log2_scale, rounding):
    """Log-uniform data over whole binades is the flat law itself: the prediction equals the
    measured error of quantize (Monte Carlo noise of 1e6 entries only)."""
    x = _log_uniform(1_000_000, -25, -5)
    s = 2.0 ** log2_scale
    p = fa.expected_error_from_stats(fmt, tensor_stats(x), scale=s, rounding=rounding, shape="flat")
    m = float(fa.measured_error(x, fmt, scale=[s], rounding=rounding,
                                generator=torch.Generator().manual_seed(2))[0])
    assert p["total"] == pytest.approx(m, rel=0.02)
    parts = sum(p[k] for k in fa.PARTS)
    assert parts == pytest.approx(p["total"], rel=1e-12)


@pytest.mark.parametrize("shape", ["flat", "slope"])
def test_partial_moments_integrate_the_law(shape):
    """Mass 1, and the moments equal a numerical integral of the piecewise density; the slopes
    are finite and bounded."""
    x = torch.exp(-8 + 1.7 * torch.randn(200_000, generator=torch.Generator().manual_seed(3)))
    h = HistogramLaw.from_stats(tensor_stats(x), shape=shape)
    assert np.all(np.abs(h.slopes) <= 6) and h.weights.sum() == pytest.approx(1.0)
    ln_s = np.array([0.0, 3.0])
    assert np.allclose(h.partial_moments(np.array([np.inf]), 0, ln_s), 1.0)
    # numerical integration over u = ln y of the piecewise log-linear density
    u = np.linspace(np.log(h.edges[0]), np.log(h.edges[-1]), 400_001)[:-1]
    j = np.clip(np.searchsorted(h.edges, np.exp(u), side="right") - 1, 0, len(h.weights) - 1)
    width = np.log(h.edges[1:] / h.edges[:-1])
    beta = h.slopes[j]
    norm = np.where(np.abs(h.slopes) < 1e-12, width, np.expm1(h.slopes * width) / np.where(h.slopes == 0, 1, h.slopes))
    dens = h.weights[j] * np.exp(beta * (u - np.log(h.edges[j]))) / norm[j]
    du = u[1] - u[0]
    for k in (1, 2):
        num = np.sum(dens * np.exp(k * u)) * du
        got = h.partial_moments(np.array([np.inf]), k, np.array([0.0]))[0, 0]
        assert got == pytest.approx(num, rel=2e-3)
    # a partial moment at a point inside the range
    y = float(np.exp(np.median(u)))
    num = np.sum((dens * np.exp(2 * u))[u < np.log(y)]) * du
    assert h.partial_moments(np.array([y]), 2, np.array([0.0]))[0, 0] == pytest.approx(num, rel=2e-3)


def test_slope_shape_predicts_lognormal_samples():
    """On lognormal data the sloped binades follow the curvature: predicted within a few percent of
    the measured error at the best scale, and the same choice as a brute-force search."""
    x = torch.exp(-9 + 1.2 * torch.randn(1 << 18, generator=torch.Generator().manual_seed(4)))
    st = tensor_stats(x)
    for bits in (4, 6, 8):
        c = fa.best_format_from_stats(bits, st)
        m = float(fa.measured_error(x, c.format, scale=[c.scale])[0])
        assert c.error == pytest.approx(m, rel=0.08)
        chk = fa.check_prediction(x, bits, fit="histogram", window=4)
        assert chk.match or chk.tie or chk.excess < 0.02


def test_choice_object():
    x = torch.exp(-6 + torch.randn(10_000, generator=torch.Generator().manual_seed(5)))
    c = fa.best_format_from_stats(6, tensor_stats(x), rounding="stochastic")
    d = c.to_dict()
    assert d["format"] == str(c.format) and set(d["candidates"]) == {str(f) for f in c.candidates}
    assert c.scale == 2.0 ** c.log2_scale and c.error == min(c.errors)
    assert all(len(g) == len(e) for g, e in c.scan.values())


def test_bad_input():
    with pytest.raises(ValueError, match="no non-zero"):
        HistogramLaw.from_counts([0, 0, 0])
    with pytest.raises(ValueError, match="top binade"):
        HistogramLaw.from_counts([0, 3, 1], min_exp=-2, amax=0.75)
    with pytest.raises(ValueError, match="hist"):
        fa.best_format_from_stats(8, {"n": 3})
    with pytest.raises(ValueError, match="shape"):
        HistogramLaw.from_counts([1, 2], shape="curvy")
    st = tensor_stats(torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="scale"):
        fa.expected_error_from_stats("e4m3fn", st, scale=-1.0)
    with pytest.raises(ValueError, match="8 bits"):
        fa.best_format_from_stats(8, st, candidates=["e2m1fn"])
