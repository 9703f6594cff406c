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
    h = HistogramLaw.from_stats(tensor_stats(x), shape=shape, top=())
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


def test_partial_moments_of_several_orders_are_each_order_s():
    """Several orders in one call (the cuts located once) give each order's own call, bit for bit, atoms and
    several scales included."""
    x = torch.exp(-8 + 1.7 * torch.randn(50_000, generator=torch.Generator().manual_seed(5)))
    h = HistogramLaw.from_stats(tensor_stats(x))
    assert h.atoms.size
    y = np.concatenate([[0.0, np.inf], np.sort(x[:200].double().numpy()), h.atoms[:3]])
    ln_s = np.array([0.0, 1.5, -2.0])
    many = h.partial_moments(y, (0, 1, 2), ln_s)
    assert many.shape == (3, 3, y.size)
    for i, k in enumerate((0, 1, 2)):
        assert np.array_equal(many[i], h.partial_moments(y, k, ln_s))


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


# --- the largest magnitudes as point masses (top=) ---------------------------------------------

#: a tiny tensor with values on rounding ties of e2m1fn at scale 1 (0.25: between 0 and 0.5, to
#: even 0; 1.25: between 1 and 1.5, to even 1.0; 0.75: to 1.0) and values that saturate it
_TINY = torch.tensor([0.25, -1.25, 0.75, 3e-3, -0.1, 7.5, 0.0, -13.0, 2.2, 1e-5])


@pytest.mark.parametrize("fmt", ["e2m1fn", "e3m2fn", "e2m3fn", "e4m3fn", "e5m2", "e4m3fnuz"])
@pytest.mark.parametrize("log2_scale", [-3, 0, 2, 6])
def test_top_covering_the_tensor_is_exact(fmt, log2_scale):
    """With every non-zero entry given as a point mass the law is the tensor itself: the predicted
    relative MSE equals quantize's measured one (float32 rounding of the squares only), and the
    fraction flushed to zero follows quantize's ties-to-even."""
    x = _TINY
    s = 2.0 ** log2_scale
    st = tensor_stats(x)
    for crit in ("mse", "elementwise"):
        p = fa.expected_error_from_stats(fmt, st, scale=s, criterion=crit, top=x.abs())
        m = fa.measured_error(x, fmt, scale=s, criterion=crit)
        assert p["total"] == pytest.approx(m, rel=1e-6, abs=1e-12)
        assert sum(p[k] for k in fa.PARTS) == pytest.approx(p["total"], rel=1e-12)
    q = gradstats.quantize(x * s, fmt)
    nz = x != 0
    assert p["flushed"] == pytest.approx(float((q[nz] == 0).double().mean()), abs=1e-12)
    assert p["saturated"] == pytest.approx(float(((x * s).abs()[nz] > fa_max(fmt)).double().mean()), abs=1e-12)


def fa_max(fmt: str) -> float:
    return gradstats.FPFormat.parse(fmt).max


def test_top_covering_the_tensor_is_exact_with_stochastic_rounding():
    """Stochastic rounding of point masses: the expected error (each entry's variance
    ``(y - q0)(q1 - y)``) and the expected fraction flushed, against quantize averaged over many
    independent roundings of the same entries."""
    x = _TINY
    reps = 20_000
    xr = x.repeat(reps)
    gen = torch.Generator().manual_seed(7)
    for fmt, j in [("e2m1fn", 0), ("e3m2fn", 2), ("e4m3fn", 4)]:
        s = 2.0 ** j
        p = fa.expected_error_from_stats(fmt, tensor_stats(x), scale=s, rounding="stochastic", top=x.abs())
        m = fa.measured_error(xr, fmt, scale=s, rounding="stochastic", generator=gen)
        assert p["total"] == pytest.approx(m, rel=0.03)
        q = gradstats.quantize(xr * s, fmt, rounding="stochastic", generator=gen)
        nz = xr != 0
        flushed = float((q[nz] == 0).double().mean())
        assert p["flushed"] == pytest.approx(flushed, abs=4 * math.sqrt(0.25 / nz.sum().item()) + 1e-12)


def test_check_prediction_with_top_k_covering_the_tensor():
    """A tensor of fewer entries than top_k is known exactly: the predicted error is the measured
    one and the choice is the brute-force best."""
    x = torch.exp(-7 + 2.0 * torch.randn(24, generator=torch.Generator().manual_seed(8)))
    for bits in (4, 6, 8):
        c = fa.check_prediction(x, bits, fit="histogram", top_k=32, window=4)
        assert c.predicted_error == pytest.approx(c.measured_at_predicted, rel=1e-6)
        assert c.match or c.tie


def _spiked(seed: int = 0) -> torch.Tensor:
    """Log-uniform over whole binades [2**-25, 2**-5) and five large entries four binades above
    (a sixth of the energy): the histogram alone spreads those five over their binade, the top
    values place them."""
    spikes = torch.tensor([1.1, -1.3, 1.45, 1.7, -1.9]) * 2.0 ** -1
    return torch.cat([_log_uniform(200_000, -25, -5, seed), spikes])


@pytest.mark.parametrize("k", [5, 40])
def test_top_with_binades_predicts_measured(k):
    """Point masses and binades together: with the five spikes (and some of the log-uniform top)
    given exactly the flat law is the data up to Monte Carlo noise, at scales where the spikes
    saturate or decide the rounding; the histogram alone misses by 8-40% there."""
    x = _spiked()
    st = tensor_stats(x)
    top = torch.topk(x.abs(), k).values
    for fmt, j in [("e4m3fn", 9), ("e4m3fn", 10), ("e3m2fn", 6), ("e2m1fn", 6), ("e2m1fn", 8)]:
        s = 2.0 ** j
        m = fa.measured_error(x, fmt, scale=s)
        p = fa.expected_error_from_stats(fmt, st, scale=s, top=top, shape="flat")
        p0 = fa.expected_error_from_stats(fmt, st, scale=s, shape="flat", top=())
        assert p["total"] == pytest.approx(m, rel=0.01)
        assert abs(p0["total"] / m - 1) > 0.05


def test_top_law_is_normalised():
    """Binades and atoms together have mass 1, and their second moment is the data's when the
    atoms hold the largest entries (the binades carry little energy on the log-uniform part)."""
    x = _spiked(1)
    a = x.abs().double()
    h = HistogramLaw.from_stats(tensor_stats(x), top=torch.topk(a, 40).values, shape="flat")
    assert h.weights.sum() + h.atom_weight * h.atoms.size == pytest.approx(1.0, rel=1e-12)
    assert h.amax == float(a.max()) and h.edges[-1] <= h.atoms[-1]
    ln_s = np.array([0.0, 5.0])
    assert np.allclose(h.partial_moments(np.array([np.inf]), 0, ln_s), 1.0)
    e2 = h.partial_moments(np.array([np.inf]), 2, np.array([0.0]))[0, 0]
    assert e2 == pytest.approx(float((a * a).mean()), rel=0.01)
    # a point between the atoms counts the atoms below it
    y = float(h.atoms[2])
    below = h.partial_moments(np.array([y]), 0, np.array([0.0]))[0, 0]
    assert below == pytest.approx(1.0 - 3 * h.atom_weight, rel=1e-12)


def test_no_top_is_the_histogram_alone():
    """``top=None`` without a top field, ``top=()``, and a row whose top field is empty (or only
    zero/NaN padding) all give the histogram-only law, bit for bit; a row's top field is read."""
    x = torch.exp(-9 + 2.0 * torch.randn(20_000, generator=torch.Generator().manual_seed(9)))
    st = tensor_stats(x)
    bare = {k: v for k, v in st.items() if k != "top_abs"}
    ref = fa.best_format_from_stats(8, st, top=())
    for kw, row in [({}, bare), ({"top": ()}, st), ({}, {**st, "top_abs": np.array([])}),
                    ({}, {**st, "top_abs": np.full(64, np.nan)}), ({"top": [0.0, float("nan")]}, st)]:
        c = fa.best_format_from_stats(8, row, **kw)
        assert np.array_equal(c.errors, ref.errors) and np.array_equal(c.log2_scales, ref.log2_scales)
        assert all(np.array_equal(c.scan[f][1], ref.scan[f][1]) for f in c.scan)
    top = torch.topk(x, 16).values
    a = fa.expected_error_from_stats("e3m4fn", {**st, "top_abs": top.numpy()}, scale=2.0 ** 10)
    b = fa.expected_error_from_stats("e3m4fn", st, scale=2.0 ** 10, top=top)
    assert a == b and a != fa.expected_error_from_stats("e3m4fn", st, scale=2.0 ** 10, top=())
    # the statistics carry their own top (gradstats.stats.TOP_K of them), read by default
    own = fa.expected_error_from_stats("e3m4fn", st, scale=2.0 ** 10)
    assert own == fa.expected_error_from_stats("e3m4fn", st, scale=2.0 ** 10, top=torch.topk(x, 64).values)


def test_top_bad_input():
    st = tensor_stats(torch.tensor([0.5, 1.0, 3.0, -2.5]))
    with pytest.raises(ValueError, match="largest"):              # 2.5 is missing
        HistogramLaw.from_stats(st, top=[3.0, 1.0])
    with pytest.raises(ValueError, match="largest"):              # more in a binade than counted
        HistogramLaw.from_stats(st, top=[3.0, 2.5, 2.1])
    with pytest.raises(ValueError, match="amax"):
        HistogramLaw.from_stats(st, top=[2.9, 2.5])
    with pytest.raises(ValueError, match="outside"):
        HistogramLaw.from_counts([1, 1], min_exp=0, top=[4.5])
    with pytest.raises(ValueError, match="1-D"):
        fa.best_format_from_stats(8, st, top=[[3.0]])
    with pytest.raises(ValueError, match="infinite"):
        fa.expected_error_from_stats("e4m3fn", st, top=[float("inf")])
    with pytest.raises(ValueError, match="top"):
        fa.expected_error_from_stats("e4m3fn", st, top="big")
    x = torch.exp(torch.randn(100, generator=torch.Generator().manual_seed(0)))
    with pytest.raises(ValueError, match="top_k"):
        fa.check_prediction(x, 8, fit="mle", top_k=8)
    with pytest.raises(ValueError, match="top_k"):
        fa.check_prediction(x, 8, fit="histogram", top_k=-1)


def test_composed_prediction_reads_the_law_s_mass_itself():
    """composed_from_moments takes a law's partial moments as they are: the same prediction, bit for bit, for
    the law scaled by any mass (its mass is read at inf with the other points), and a law without mass refused."""
    from gradstats.fpanalysis.composed import composed_from_moments

    x = torch.exp(-8 + 1.7 * torch.randn(50_000, generator=torch.Generator().manual_seed(6)))
    h = HistogramLaw.from_stats(tensor_stats(x))
    zero = np.zeros(1)

    def pm(t, k, c=1.0):
        return c * h.partial_moments(np.asarray(t, dtype=np.float64), k, zero)[0]
    for fmt, rounding in (("e4m3fn", "nearest"), ("e2m1fn", "stochastic"), (None, "nearest")):
        a = composed_from_moments(pm, fmt, threshold=float(x.median()), scale=2.0 ** 12, rounding=rounding)
        b = composed_from_moments(lambda t, k: pm(t, k, 0.25), fmt, threshold=float(x.median()), scale=2.0 ** 12,
                                  rounding=rounding)
        assert a.to_dict() == b.to_dict()          # (a power of two: the quotients are exact)
        assert 0 < a.error < 1 and a.pruned > 0.3
    with pytest.raises(ValueError, match="no mass"):
        composed_from_moments(lambda t, k: pm(t, k, 0.0), "e4m3fn", threshold=0.0, scale=1.0)
