"""Tests of the floating-point format analysis (gradstats.fpanalysis)."""
from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradstats
from gradstats import fpanalysis as fa
from gradstats.formats import FPFormat
from gradstats.ops.quantization import quantize

LN2 = math.log(2.0)


# ----------------------------------------------------------------------------- Monte Carlo oracle
def mc_error(fmt, mu, sigma, *, scale=1.0, rounding="nearest", overflow="saturate", criterion="mse",
             n=2 ** 19, seed=0):
    """Monte Carlo estimate of what expected_error predicts, with its standard error.

    ``"mse"`` (MSE / E[x^2]) is estimated by stratified importance sampling with bounded summands:
    values the format sees in its normal range or above come from the x^2-tilted lognormal
    LN(mu + 2 sigma^2, sigma) (density x^2 f / E[x^2]), whose summand is the bounded relative error
    ((Q(x) - x)/x)^2; subnormal values from the x-tilted LN(mu + sigma^2, sigma) (density
    x f / E[x]), summand (Q(x) - x)^2 / x * E[x] / E[x^2]; values in the cell that rounds to zero
    (nearest: below half the smallest subnormal; stochastic: below it) from the x-tilted one as well
    for nearest rounding (summand x E[x]/E[x^2]) and from LN(mu, sigma) for stochastic rounding,
    whose rare round-ups to the smallest subnormal would make any tilted summand unbounded. The plain
    ratio sum(err)/sum(x^2) rests on a handful of samples at large sigma; this estimator keeps every
    summand bounded, so its standard error is honest. ``"elementwise"`` samples LN(mu, sigma)."""
    fmt = FPFormat.parse(fmt)
    g = torch.Generator().manual_seed(seed)

    def draw(loc, m):
        x = torch.exp(loc + sigma * torch.randn(m, generator=g, dtype=torch.float64)).float()
        x = torch.where(torch.rand(m, generator=g) < 0.5, -x, x)
        q = quantize(x, fmt, scale=scale, rounding=rounding, overflow=overflow, generator=g)
        e = torch.where(torch.isfinite(q), (q.double() - x.double()) ** 2, 0.0)
        return x.double().abs(), e

    if criterion == "elementwise":
        x, e = draw(mu, n)
        r = e / x ** 2
        return float(r.mean()), float(r.std() / math.sqrt(n))
    low = fmt.min_normal / scale
    zero = fmt.min_subnormal / scale  # stochastic rounding's flush cell [0, min_subnormal)
    x, e = draw(mu + 2 * sigma * sigma, n // 2)
    hi = torch.where(x >= low, e / x ** 2, 0.0)
    x, e = draw(mu + sigma * sigma, n // 4)
    sub = x < low if rounding == "nearest" else (x < low) & (x >= zero)
    mid = torch.where(sub, e / x, 0.0) * math.exp(-mu - 1.5 * sigma * sigma)
    if rounding == "nearest":
        return float(hi.mean() + mid.mean()), math.sqrt(float(hi.var()) / (n // 2) + float(mid.var()) / (n // 4))
    x, e = draw(mu, n // 4)
    lo = torch.where(x < zero, e, 0.0) * math.exp(-2 * mu - 2 * sigma * sigma)
    se = math.sqrt(float(hi.var()) / (n // 2) + float(mid.var() + lo.var()) / (n // 4))
    return float(hi.mean() + mid.mean() + lo.mean()), se


def agrees(analytic, mc, se, rel=0.03, z=3.0):
    """Within 3% relative, or within 3 Monte Carlo standard errors where the error is tiny."""
    return abs(analytic - mc) <= max(rel * analytic, z * se)


SUBSET = ["e2m1fn", "e3m2fn", "e2m3fn", "e4m3fn", "e5m2", "e4m3fnuz", "e3m4", "e5m2fnuz", "e4m3fn_nosub", "e1m6fn"]


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name", SUBSET)
def test_matches_monte_carlo_subset(name, rounding):
    fmt = FPFormat.parse(name)
    # (mu, sigma of log2|g|, binades off the best scale): best, underflow-heavy, clipping-heavy
    for k, (mu, s2, off) in enumerate([(-9.0, 1.5, 0), (-3.0, 3.5, 0), (-9.0, 1.5, -3), (-3.0, 3.5, 2)]):
        sigma = s2 * LN2
        j = fa.optimal_scale(fmt, mu=mu, sigma=sigma, rounding=rounding).log2_scale
        scale = 2.0 ** (j + off)
        a = fa.expected_error(fmt, mu=mu, sigma=sigma, scale=scale, rounding=rounding).total
        m, se = mc_error(fmt, mu, sigma, scale=scale, rounding=rounding, seed=k, n=2 ** 17)
        assert agrees(a, m, se), (name, rounding, mu, s2, off, a, m, se)


def grid_formats():
    """FP4 to FP8, every split, the three conventions (ieee needs E >= 2)."""
    return [f for bits in range(4, 9) for sp in ("ieee", "fn", "fnuz") for f in fa.candidate_formats(bits, sp)
            if not (sp == "ieee" and f.exp_bits < 2)]


@pytest.mark.slow
def test_matches_monte_carlo_full_grid():
    """The full grid of the issue: 1e6 samples per check; prints the agreement summary. With 1320
    checks, 3 standard errors would fail about 4 checks by chance alone: the Monte Carlo side uses 4
    (Bonferroni: a family-wise false-alarm rate near 8%); the number beyond 3 is printed."""
    rows = []
    for fmt in grid_formats():
        for rounding in ("nearest", "stochastic"):
            for s2 in (1.0, 2.0, 3.0, 4.5):
                mu, sigma = -9.0, s2 * LN2
                j = fa.optimal_scale(fmt, mu=mu, sigma=sigma, rounding=rounding).log2_scale
                for off in (0, -3, 2):
                    scale = 2.0 ** (j + off)
                    a = fa.expected_error(fmt, mu=mu, sigma=sigma, scale=scale, rounding=rounding).total
                    m, se = mc_error(fmt, mu, sigma, scale=scale, rounding=rounding, n=10 ** 6,
                                     seed=len(rows))
                    rows.append((str(fmt), rounding, s2, off, a, m, se, abs(m - a) / a,
                                 agrees(a, m, se, z=4.0), abs(m - a) <= 0.03 * a))
    dev = np.array([r[7] for r in rows])
    z = np.array([abs(r[5] - r[4]) / r[6] for r in rows])
    by_se = sum(1 for r in rows if r[8] and not r[9])
    precise = np.array([3 * r[6] < 0.03 * r[4] for r in rows])
    print(f"\nanalytic vs Monte Carlo (1e6 samples): {len(rows)} checks, {len(grid_formats())} formats; "
          f"max relative deviation {dev.max():.4f} (median {np.median(dev):.5f}); among the {precise.sum()} "
          f"checks whose 3 standard errors are below 3%: max {dev[precise].max():.4f}; max |z| {z.max():.2f}, "
          f"{int((z > 3).sum())} beyond 3; {by_se} checks within 4 standard errors but beyond 3%")
    worst = sorted(rows, key=lambda r: -r[7])[:5]
    for r in worst:
        print("  ", r[:4], f"analytic {r[4]:.4g} mc {r[5]:.4g} +- {r[6]:.2g}")
    assert all(r[8] for r in rows)


def test_plain_ratio_estimator_agrees_at_small_sigma():
    # without importance sampling: sum((Q(x)-x)^2) / sum(x^2) on plain lognormal samples
    g = torch.Generator().manual_seed(3)
    x = torch.exp(-5.0 + 0.6 * torch.randn(10 ** 6, generator=g, dtype=torch.float64)).float()
    for name in ("e4m3fn", "e2m1fn", "e3m2fn"):
        s = fa.optimal_scale(name, mu=-5.0, sigma=0.6).scale
        q = quantize(x, name, scale=s).double()
        e, x2 = (q - x.double()) ** 2, x.double() ** 2
        ratio = float(e.sum() / x2.sum())
        # delta-method standard error of a ratio of means
        se = float((e - ratio * x2).std() / (x2.mean() * math.sqrt(x.numel())))
        a = fa.expected_error(name, mu=-5.0, sigma=0.6, scale=s).total
        assert agrees(a, ratio, se), (name, a, ratio, se)


@pytest.mark.parametrize("criterion", ["mse", "elementwise"])
def test_fractions_and_nonfinite_match_monte_carlo(criterion):
    fmt = FPFormat.parse("e4m3fn")
    mu, sigma, scale = -2.0, 2.0, 2.0 ** 3
    r = fa.expected_error(fmt, mu=mu, sigma=sigma, scale=scale, overflow="nonfinite", criterion=criterion)
    g = torch.Generator().manual_seed(5)
    x = torch.exp(mu + sigma * torch.randn(10 ** 6, generator=g, dtype=torch.float64)).float()
    q = quantize(x, fmt, scale=scale, overflow="nonfinite")
    n = x.numel()
    for frac, emp in ((r.flushed, (q == 0).double().mean()), (r.nonfinite, torch.isnan(q).double().mean())):
        se = math.sqrt(max(frac * (1 - frac), 1e-12) / n)
        assert abs(frac - float(emp)) <= 4 * se + 1e-9, (frac, float(emp))
    qs = quantize(x, fmt, scale=scale)
    sat = fa.expected_error(fmt, mu=mu, sigma=sigma, scale=scale).saturated
    assert abs(sat - float((x * scale > fmt.max).double().mean())) <= 4 * math.sqrt(sat / n)
    assert float((qs.abs() == fmt.max / scale).double().mean()) >= float((x * scale > fmt.max).double().mean())
    # entries that turn into NaN are excluded from the total: it is below the saturating total
    assert r.total < fa.expected_error(fmt, mu=mu, sigma=sigma, scale=scale, criterion=criterion).total
    m, se = mc_error(fmt, mu, sigma, scale=scale, overflow="nonfinite", criterion=criterion, n=10 ** 6, seed=9)
    assert agrees(r.total, m, se)


@pytest.mark.parametrize("scale_format,block", [("e8m0", 32), ("e4m3", 16)])
@pytest.mark.parametrize("name", ["e2m1fn", "e4m3fn", "e3m2fn"])
def test_block_scaling_matches_monte_carlo(name, scale_format, block):
    """Blocks: importance sampling with one x^2-tilted entry per block and B-1 plain ones."""
    mu, sigma, nb = -6.0, 1.2, 2 ** 14
    g = torch.Generator().manual_seed(11)
    z = torch.randn(nb, block, generator=g, dtype=torch.float64)
    x = torch.exp(mu + sigma * z)
    x[:, 0] = torch.exp(mu + 2 * sigma ** 2 + sigma * z[:, 0])
    x = x.float()
    q = quantize(x, name, block_size=block, scale_format=scale_format)
    r = ((q[:, 0] - x[:, 0]) / x[:, 0]).double() ** 2
    a = fa.expected_error(gradstats.Scheme.of(name, block_size=block, scale_format=scale_format), mu=mu, sigma=sigma,
                          scale=None, tensor_amax=float(x.abs().max())).total
    assert agrees(a, float(r.mean()), float(r.std()) / math.sqrt(nb)), (a, float(r.mean()))


def test_block_scaling_with_zeros_and_elementwise():
    mu, sigma, B, p0 = -4.0, 1.5, 32, 0.4
    g = torch.Generator().manual_seed(2)
    x = torch.exp(mu + sigma * torch.randn(2 ** 20, generator=g, dtype=torch.float64)).float()
    x[torch.rand(x.numel(), generator=g) < p0] = 0
    q = quantize(x, "e2m1fn", block_size=B)
    nz = x != 0
    r = ((q[nz] - x[nz]) / x[nz]).double() ** 2
    a = fa.expected_error("e2m1fn", mu=mu, sigma=sigma, p0=p0, granularity=B, scale=None, criterion="elementwise")
    assert agrees(a.total, float(r.mean()), float(r.std()) / math.sqrt(r.numel()))
    flushed = float(((q == 0) & nz).double().mean())
    assert abs(a.flushed - flushed) <= 4 * math.sqrt(flushed / x.numel()) + 1e-6


# ----------------------------------------------------------------------------- exact identities
def test_tilt_identity_is_exact():
    # MSE/E[x^2] under LN(mu, s) == mean relative squared error under LN(mu + 2 s^2, s)
    for name in ("e4m3fn", "e2m1fn", "e5m2", "e3m2fn_nosub"):
        for rounding in ("nearest", "stochastic"):
            mu, s = np.array([-7.0, -1.0, 2.0]), np.array([0.4, 1.3, 2.2])
            a = fa.expected_error(name, mu=mu, sigma=s, scale=4.0, rounding=rounding).total
            b = fa.expected_error(name, mu=mu + 2 * s * s, sigma=s, scale=4.0, rounding=rounding,
                                  criterion="elementwise").total
            np.testing.assert_allclose(a, b, rtol=1e-9)


def test_criteria_share_the_minimum_and_differ_by_two_sigma_squared():
    for s in (0.5, 1.5, 2.5):
        m = fa.optimal_scale("e4m3fn", mu=-8.0, sigma=s, power_of_two=False)
        e = fa.optimal_scale("e4m3fn", mu=-8.0, sigma=s, power_of_two=False, criterion="elementwise")
        assert m.error == pytest.approx(e.error, rel=1e-6)
        # the elementwise error curve is the MSE curve shifted by 2 sigma^2 nats (on flat stretches
        # the search may settle a whole binade apart, at equal error)
        shifted = fa.expected_error("e4m3fn", mu=-8.0, sigma=s, criterion="elementwise",
                                    scale=2.0 ** (m.log2_scale + 2 * s * s / LN2)).total
        assert shifted == pytest.approx(e.error, rel=1e-6)


def test_scale_is_a_shift_of_mu_and_bias_is_a_scale():
    j = np.arange(-4, 5)
    a = fa.expected_error("e3m2fn", mu=-2.0, sigma=1.1, scale=2.0 ** j).total
    b = fa.expected_error("e3m2fn", mu=-2.0 + j * LN2, sigma=1.1).total
    np.testing.assert_allclose(a, b, rtol=1e-12)
    # a bias larger by 3 divides every value by 8: the scale 1/8 undoes it
    c = fa.expected_error(FPFormat(4, 3, bias=10, special="fn"), mu=-2.0, sigma=1.1, scale=0.125).total
    d = fa.expected_error(FPFormat(4, 3, special="fn"), mu=-2.0, sigma=1.1).total
    assert c == pytest.approx(d, rel=1e-12)


def test_parts_sum_and_zero_fraction():
    r = fa.expected_error("e3m2fn", mu=[-4.0, 0.0], sigma=[2.0, 1.0], scale=[1.0, 0.25], p0=[0.0, 0.3])
    np.testing.assert_allclose(r.total, r.overflow + r.normal + r.subnormal + r.underflow, rtol=1e-12)
    assert r.total.shape == (2,) and all(v >= 0 for v in (*r.flushed, *r.saturated))
    # p0: relative MSE unchanged, absolute MSE and fractions scale with 1 - p0
    kw = dict(mu=-4.0, sigma=1.5, scale=64.0)
    r0, r3 = fa.expected_error("e3m2fn", **kw), fa.expected_error("e3m2fn", p0=0.3, **kw)
    assert r3.total == pytest.approx(r0.total, rel=1e-12)
    assert r3.flushed == pytest.approx(0.7 * r0.flushed, rel=1e-12)
    a0 = fa.expected_error("e3m2fn", relative=False, **kw).total
    assert fa.expected_error("e3m2fn", relative=False, p0=0.3, **kw).total == pytest.approx(0.7 * a0, rel=1e-12)
    assert a0 == pytest.approx(r0.total * math.exp(2 * -4.0 + 2 * 1.5 ** 2), rel=1e-9)


def test_16_bit_formats_stay_accurate():
    # many narrow cells: the partial-moment sums must not lose the result to cancellation
    for name, eps in (("float16", 2.0 ** -10), ("bfloat16", 2.0 ** -7)):
        mu, s = -3.0, 1.0
        a = fa.expected_error(name, mu=mu, sigma=s, scale=2.0 ** 6).total
        m, se = mc_error(name, mu, s, scale=2.0 ** 6, n=10 ** 6, seed=4)
        assert agrees(a, m, se)
        # uniform rounding noise of spacing eps * 2**e on values in [2**e, 2**(e+1)): about eps^2/24
        assert 0.03 * eps ** 2 < a < 0.06 * eps ** 2


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["e2m1fn", "e3m2fn", "e4m3fn", "e5m2", "e2m3fn_nosub"]),
       mu=st.floats(-12, 4), sigma=st.floats(0.05, 4.0), j=st.integers(-8, 8))
def test_stochastic_rounding_never_beats_nearest(name, mu, sigma, j):
    # per value, the SR variance (x-q0)(q1-x) >= min distance^2
    near = fa.expected_error(name, mu=mu, sigma=sigma, scale=2.0 ** j)
    sr = fa.expected_error(name, mu=mu, sigma=sigma, scale=2.0 ** j, rounding="stochastic")
    assert sr.total >= near.total * (1 - 1e-9)
    assert 0 <= near.total and math.isfinite(near.total) and 0 <= near.flushed <= 1


def test_amax_conditioning():
    x = torch.exp(-9 + 2.0 * torch.randn(65536, generator=torch.Generator().manual_seed(0)))
    st_ = gradstats.tensor_stats(x)
    mu, sigma = gradstats.stats.lognormal_moments(st_)
    amax = float(st_["max_abs"])
    for j in range(2, 10):
        meas = fa.measured_error(x, "e3m4fn", scale=2.0 ** j)
        cond = fa.expected_error("e3m4fn", mu=mu, sigma=sigma, scale=2.0 ** j, amax=amax, numel=x.numel()).total
        trunc = fa.expected_error("e3m4fn", mu=mu, sigma=sigma, scale=2.0 ** j, amax=amax).total
        pop = fa.expected_error("e3m4fn", mu=mu, sigma=sigma, scale=2.0 ** j).total
        # a handful of entries carry most of sum(x^2); given the maximum the model follows them
        assert abs(cond / meas - 1) < 0.1, (j, cond, meas)
        if j in (3, 4, 5):  # near the best scale the population is dominated by values beyond this max
            assert pop > 5 * meas, (j, pop, meas)
        if j in (5, 6):  # the maximum itself clips: the atom at amax matters
            assert abs(cond / meas - 1) < abs(trunc / meas - 1)
    # without numel: the truncated lognormal alone; with numel -> inf it converges to that
    t = fa.expected_error("e3m4fn", mu=mu, sigma=sigma, scale=32.0, amax=amax).total
    t_big = fa.expected_error("e3m4fn", mu=mu, sigma=sigma, scale=32.0, amax=amax, numel=1e15).total
    assert t == pytest.approx(t_big, rel=1e-6)


# ----------------------------------------------------------------------------- scales and formats
@pytest.mark.parametrize("name", ["e4m3fn", "e5m2", "e2m1fn", "e3m2fn", "e2m3fn"])
def test_optimal_scale_is_the_grid_minimum(name):
    mus, sig = np.array([-9.0, -3.0, 0.0, -15.0]), np.array([1.5, 0.3, 2.5, 3.4])
    r = fa.optimal_scale(name, mu=mus, sigma=sig)
    js = np.arange(-60.0, 80.0)
    for i in range(mus.size):
        e = fa.expected_error(name, mu=mus[i], sigma=sig[i], scale=2.0 ** js).total
        assert r.error[i] <= e.min() * (1 + fa.scale.TIE_RTOL)
        assert float(r.log2_scale[i]).is_integer()
        c = fa.optimal_scale(name, mu=mus[i], sigma=sig[i], power_of_two=False)
        fine = np.linspace(r.log2_scale[i] - 1.5, r.log2_scale[i] + 1.5, 1201)
        ef = fa.expected_error(name, mu=mus[i], sigma=sig[i], scale=2.0 ** fine).total
        # small sigma: the curve has ripples finer than the search grid; near-ties are fine
        assert c.error <= ef.min() * (1 + 1e-4) and c.error <= r.error[i] * (1 + 1e-12)


def test_best_format_ranks_and_matches_optimal_scale():
    b = fa.best_format(8, mu=[-9.0, -9.0, -9.0], sigma=np.array([1.0, 2.5, 5.0]) * LN2, names=["a", "b", "c"])
    assert [str(f) for f in b.format] == ["e3m4fn", "e4m3fn", "e5m2fn"]
    for i in range(3):
        ch = b.choices(i)
        assert [c.rank for c in ch] == list(range(6))
        assert all(ch[k].error <= ch[k + 1].error for k in range(5))
        r = fa.optimal_scale(ch[0].format, mu=-9.0, sigma=b.sigma[i])
        assert r.scale == ch[0].scale and r.error == pytest.approx(ch[0].error, rel=1e-12)
    df = b.to_dataframe()
    assert len(df) == 18 and set(df.layer) == {"a", "b", "c"}
    assert b.to_dict()["layers"][1]["choices"][0]["format"] == "e4m3fn"
    one = fa.best_format(6, mu=-3.0, sigma=1.0)
    assert isinstance(one.format, FPFormat) and isinstance(one.scale, float) and one.single


def test_best_format_candidates_and_blocks():
    hw = fa.best_format(8, mu=-9.0, sigma=4.5 * LN2, candidates="hardware")
    assert "e5m2" in [str(c) for c in hw.candidates]
    mine = fa.best_format(8, mu=-9.0, sigma=1.0, candidates=["e4m3fn", "e5m2"])
    assert len(mine.candidates) == 2
    mx = fa.best_format(4, mu=-9.0, sigma=1.5, granularity=32)
    direct = [fa.expected_error(f, mu=-9.0, sigma=1.5, granularity=32, scale=None).total for f in mx.candidates]
    assert mx.format == mx.candidates[int(np.argmin(direct))] and math.isnan(mx.scale)
    assert mx.error == pytest.approx(min(direct), rel=1e-12)
    assert fa.candidate_formats(8, "ieee")[0] == FPFormat(2, 5)


# ----------------------------------------------------------------------------- candidate presets
def _names(fmts):
    return sorted(str(f) for f in fmts)


def test_candidate_presets_hold_the_formats_that_exist():
    """The presets name what users target: the OCP formats, torchao's and Transformer Engine's
    gradient recipes (per tensor, MX blocks, NVFP4 blocks); 'any' is every split (research)."""
    assert set(fa.CANDIDATE_PRESETS) == {"ocp", "torchao", "te"}
    ocp = fa.preset_formats("ocp")
    assert _names(ocp) == ["e2m1fn", "e2m3fn", "e3m2fn", "e4m3fn", "e5m2"]
    # e5m2 is the ieee convention with inf (torch.float8_e5m2, OCP); the others are finite (fn)
    e5m2 = [f for f in ocp if f.exp_bits == 5][0]
    assert e5m2.special == "ieee" and e5m2.has_inf and e5m2.max == 57344.0
    assert {f.special for f in ocp if f.exp_bits != 5} == {"fn"}
    assert [f.max for f in fa.preset_formats("ocp", 8) if f.exp_bits == 4] == [448.0]
    assert {str(f): f.max for f in fa.preset_formats("ocp", 6)} == {"e2m3fn": 7.5, "e3m2fn": 28.0}
    assert [(str(f), f.max) for f in fa.preset_formats("ocp", 4)] == [("e2m1fn", 6.0)]
    for g in ("tensor", "mx", "nvfp4", None, 64):   # the OCP formats, whatever the scaling
        assert _names(fa.preset_formats("ocp", granularity=g)) == _names(ocp)
    # every preset's format has a torch dtype or is an OCP MX element type of ml_dtypes
    for name in fa.CANDIDATE_PRESETS:
        assert all(f.standard_name for f in fa.preset_formats(name)), name
    # torchao: float8 per tensor; MX (MXFP8, MXFP6, MXFP4); NVFP4
    assert _names(fa.preset_formats("torchao", granularity="tensor")) == ["e4m3fn", "e5m2"]
    assert _names(fa.preset_formats("torchao", granularity="mx")) == _names(ocp)
    assert _names(fa.preset_formats("torchao", granularity="nvfp4")) == ["e2m1fn"]
    assert _names(fa.preset_formats("torchao")) == _names(ocp)            # every granularity
    assert _names(fa.preset_formats("torchao", 6, granularity="mx")) == ["e2m3fn", "e3m2fn"]
    # Transformer Engine: FP8 e4m3 (fn, max 448) and e5m2 per tensor, MXFP8, NVFP4
    assert _names(fa.preset_formats("te", granularity="tensor")) == ["e4m3fn", "e5m2"]
    assert _names(fa.preset_formats("te", granularity="mx")) == ["e4m3fn", "e5m2"]
    assert _names(fa.preset_formats("te", granularity="nvfp4")) == ["e2m1fn"]
    assert _names(fa.preset_formats("te")) == ["e2m1fn", "e4m3fn", "e5m2"]
    # 'any' and the conventions: every split, as candidate_formats
    assert fa.preset_formats("any", 8) == fa.candidate_formats(8, "fn")
    for conv in ("fn", "ieee", "fnuz", "hardware"):
        assert fa.preset_formats(conv, 6) == fa.candidate_formats(6, conv)
    assert fa.DEFAULT_CANDIDATES == "ocp"
    assert set(fa.CANDIDATE_NAMES) == {"ocp", "torchao", "te", "any", "hardware", "fn", "ieee", "fnuz"}


@pytest.mark.parametrize("call, match", [
    (lambda: fa.preset_formats("ocp", 5), r"candidates='ocp' has no 5-bit format.*4, 6, 8.*candidates='any'"),
    (lambda: fa.preset_formats("ocp", 7), r"no 7-bit format.*candidates='any'"),
    (lambda: fa.preset_formats("torchao", 6, granularity="tensor"), r"no 6-bit format per tensor.*granularity='mx'"),
    (lambda: fa.preset_formats("te", 4, granularity="mx"), r"no 4-bit format in MX blocks.*granularity='nvfp4'"),
    (lambda: fa.preset_formats("nvidia", 8), r"unknown candidates 'nvidia'.*'ocp', 'torchao', 'te', 'any'"),
    (lambda: fa.preset_formats("any"), "needs bits"),
    (lambda: fa.preset_formats("ocp", 8, granularity="channel"), "granularity"),
])
def test_candidate_preset_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_best_format_with_presets():
    """best_format's own default stays every split (the analysis primitive: the crossover figures);
    a preset restricts the ranking to real formats, at the granularity of the block rule."""
    sig = np.array([0.6, 1.0, 2.5, 5.0]) * LN2
    every = fa.best_format(8, mu=-9.0, sigma=sig)
    assert len(every.candidates) == 6 and str(every.format[0]) == "e2m5fn"
    ocp = fa.best_format(8, mu=-9.0, sigma=sig, candidates="ocp")
    assert _names(ocp.candidates) == ["e4m3fn", "e5m2"]
    assert [str(f) for f in ocp.format] == ["e4m3fn", "e4m3fn", "e4m3fn", "e5m2"]
    assert _names(fa.best_format(6, mu=-9.0, sigma=sig, candidates="ocp").candidates) == ["e2m3fn", "e3m2fn"]
    assert str(fa.best_format(4, mu=-9.0, sigma=1.0, candidates="ocp").format) == "e2m1fn"
    # the block rule picks the granularity: torchao's FP6 is MX only
    with pytest.raises(ValueError, match="granularity='mx'"):
        fa.best_format(6, mu=-9.0, sigma=1.0, candidates="torchao")
    mx = fa.best_format(6, mu=-9.0, sigma=1.0, candidates="torchao", granularity=32)
    assert _names(mx.candidates) == ["e2m3fn", "e3m2fn"]
    nv = fa.best_format(4, mu=-9.0, sigma=1.0, candidates="te", granularity="nvfp4")
    assert _names(nv.candidates) == ["e2m1fn"]
    with pytest.raises(ValueError, match="candidates='any'"):
        fa.best_format(5, mu=-9.0, sigma=1.0, candidates="ocp")
    assert len(fa.best_format(5, mu=-9.0, sigma=1.0, candidates="any").candidates) == 3


def test_best_format_from_stats_with_presets():
    from gradstats.stats import tensor_stats

    g = torch.exp(-9 + 0.4 * torch.randn(50_000, generator=torch.Generator().manual_seed(0)))
    st = tensor_stats(g)
    assert str(fa.best_format_from_stats(8, st).format) == "e2m5fn"      # default: every split
    c = fa.best_format_from_stats(8, st, candidates="ocp")
    assert _names(c.candidates) == ["e4m3fn", "e5m2"] and str(c.format) == "e4m3fn"
    assert _names(fa.best_format_from_stats(8, st, candidates="torchao").candidates) == ["e4m3fn", "e5m2"]
    with pytest.raises(ValueError, match="per tensor"):   # per-tensor scales only: torchao's FP4 is blocks
        fa.best_format_from_stats(4, st, candidates="torchao")
    with pytest.raises(ValueError, match="candidates='any'"):
        fa.best_format_from_stats(7, st, candidates="ocp")


def test_best_format_is_fast_for_a_plan():
    rng = np.random.default_rng(0)
    mu, sig = rng.uniform(-20, -5, 100), rng.uniform(0.7, 3.5, 100)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        for bits in range(4, 9):
            fa.best_format(bits, mu=mu, sigma=sig)
        times.append(time.perf_counter() - t)
    assert min(times) < 1.0, times


def test_crossover_table_is_consistent_with_best_format():
    t = fa.crossover_table(bits=[6, 8], sigma_max=7.0, step=0.1)
    assert t.assumptions["convention"] == "fn" and "std of log2|g|" in t.assumptions["sigma"]
    for r in t.ranges:
        mid = 0.5 * (r["sigma_lo"] + r["sigma_hi"])
        b = fa.best_format(r["bits"], mu=-9.0, sigma=mid * LN2, power_of_two=False)
        assert b.exp_bits == r["exp_bits"], r
        assert t.best_exp_bits(r["bits"], mid) == r["exp_bits"]
    for c in t.crossovers:
        fa_, fb_ = (FPFormat(e, c["bits"] - 1 - e, special="fn") for e in (c["exp_bits"], c["to_exp_bits"]))
        ea, eb = (fa.optimal_scale(f, mu=0.0, sigma=c["sigma"] * LN2, power_of_two=False).error for f in (fa_, fb_))
        assert eb == pytest.approx(ea, rel=1e-3), c
    cmp = t.compare_authors()
    assert list(cmp.bits) == [8, 8, 6, 6] and cmp["ours_lo"].notna().all()
    assert set(t.to_dataframe().columns) >= {"bits", "exp_bits", "sigma_lo", "sigma_hi"}


def test_crossover_table_criterion_invariance_and_assumptions():
    a = fa.crossover_table(bits=[6], sigma_max=3.0, step=0.1)
    b = fa.crossover_table(bits=[6], sigma_max=3.0, step=0.1, criterion="elementwise")
    for x, y in zip(a.crossovers, b.crossovers):
        assert x["sigma"] == pytest.approx(y["sigma"], abs=2e-3)
    # reserving the top binade for inf/NaN or dropping subnormals moves crossovers down
    ieee = fa.crossover_table(bits=[6], sigma_max=3.0, step=0.1, special="ieee")
    nosub = fa.crossover_table(bits=[6], sigma_max=3.0, step=0.1, subnormals=False)
    last = [c["sigma"] for c in a.crossovers if c["exp_bits"] == 3][0]
    assert [c["sigma"] for c in ieee.crossovers if c["exp_bits"] == 3][0] < last
    assert [c["sigma"] for c in nosub.crossovers if c["exp_bits"] == 3][0] < last
    assert nosub.assumptions["subnormals"] is False


def test_results_to_dict_and_dataframe():
    r = fa.expected_error("e4m3fn", mu=[-3.0, -4.0], sigma=1.0)
    assert r.to_dataframe().shape[0] == 2 and r.to_dict()["format"] == "e4m3fn"
    assert set(r.parts) == set(fa.PARTS)
    s = fa.optimal_scale("e4m3fn", mu=[-3.0, -4.0], sigma=1.0)
    assert s.to_dataframe().shape[0] == 2 and s.to_dict()["power_of_two"] is True
    assert float(fa.optimal_scale("e4m3fn", mu=-3.0, sigma=1.0)) > 0


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("call,match", [
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=0.0), "sigma"),
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=-1.0), "sigma"),
    (lambda: fa.expected_error("e4m3fn", mu=float("nan"), sigma=1.0), "mu"),
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=1.0, scale=0.0), "scale"),
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=1.0, scale=2.0 ** 140), "cannot represent"),
    (lambda: fa.expected_error("e8m0fnu", mu=0.0, sigma=1.0), "unsigned"),
    (lambda: fa.expected_error("float32", mu=0.0, sigma=1.0), "3 to 16 bits"),
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=1.0, p0=1.0), "p0"),
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=1.0, rounding="up"), "rounding"),
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=1.0, scale=2.0, granularity=32), "either scale"),
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=1.0, relative=False, criterion="elementwise"),
     "relative"),
    (lambda: fa.expected_error("e4m3fn", mu=[0.0, 1.0], sigma=[1.0, 1.0, 1.0]), "broadcast"),
    (lambda: fa.expected_error("e4m3fn", mu=0.0, sigma=1.0, amax=-1.0), "amax"),
    (lambda: fa.optimal_scale("e4m3fn", mu=-200.0, sigma=1.0), "cannot represent"),
    (lambda: fa.best_format(2, mu=0.0, sigma=1.0), "bits"),
    (lambda: fa.best_format(17, mu=0.0, sigma=1.0), "bits"),
    (lambda: fa.best_format(8.0, mu=0.0, sigma=1.0), "bits"),
    (lambda: fa.best_format(8, mu=0.0, sigma=1.0, candidates=["e2m1fn"]), "8 bits"),
    (lambda: fa.best_format(3, mu=0.0, sigma=1.0, candidates="ieee"), "no ieee"),
    (lambda: fa.crossover_table(bits=[20]), "bits"),
    (lambda: fa.measured_error(torch.zeros(5), "e4m3fn"), "non-zero"),
])
def test_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------- real gradients (small)
@pytest.fixture(scope="module")
def cnn_gradients(tmp_path_factory):
    """Every layer's whole neural gradient (1,280 to 3.2M entries) of a BatchNorm CNN after 10 steps
    on the committed Fashion-MNIST subset: the three-model experiment (experiments/fpanalysis_real.py)
    in small. Whole tensors, not samples: a brute-force verdict at 8 bits rests on the few largest
    entries, so on a 2**15 sample it depends on which sample it is."""
    from gradstats.zoo.training import prepare

    path = tmp_path_factory.mktemp("fpa") / "run"
    task = prepare("cnn", source="subset", subset=512, test_subset=100)
    with gradstats.trace(task.model, path, every=[9], sample_every=[9], samples=None) as tr:
        task.run(10, progress=False, test=None, callback=lambda step, loss: tr.step())
    run = gradstats.open_run(path)
    return {layer: run.samples(layer, 9) for layer in run.layers}


def test_prediction_matches_brute_force_on_lognormal_twins(cnn_gradients):
    """The issue's criterion where the model holds: for lognormal tensors with each layer's
    (mu, sigma, p0) (2**17 entries: the MSE of a large-sigma tensor rests on its few largest entries,
    so smaller ones make the brute force noisy), the predicted split and power-of-two scale are the
    brute-force best in at least 90% of cases, and otherwise within 10% of it."""
    g = torch.Generator().manual_seed(1)
    checks = []
    for layer, x in cnn_gradients.items():
        st_ = gradstats.tensor_stats(x)
        mu, sigma = gradstats.stats.lognormal_moments(st_)
        n, p0 = 1 << 17, st_["n_zero"] / st_["n"]
        twin = torch.exp(mu + sigma * torch.randn(n, generator=g, dtype=torch.float64)).float()
        twin[torch.rand(n, generator=g) < p0] = 0
        for bits in (4, 8):
            checks.append(fa.check_prediction(twin, bits, window=4))
    assert np.mean([c.match or c.tie for c in checks]) >= 0.9
    assert max(c.excess for c in checks) <= 0.10
    assert all(0.5 < c.predicted_error / c.measured_at_predicted < 2 for c in checks)


def test_real_gradients_small(cnn_gradients):
    """Real gradients deviate from the lognormal (skewed ln|g|), so the agreement is weaker than on
    the twins (the three-model numbers: docs/fpanalysis.md). What holds on this CNN's whole tensors:
    at 4 bits the issue's criterion (the energy-weighted fit, given the tensor's maximum, picks the
    brute-force best split and scale in >= 90% of layers, else within 10%), and the pick is never
    worse than the prediction from (mu, sigma) alone, which is off by orders of magnitude; at 4 and
    8 bits the predicted error is within a factor 10 of the measured one. At 8 bits the lognormal's
    pick can cost several times the best (conv2: 5.5x): the real lower tail is longer than the
    lognormal's, and at 8 bits the format reaches it. The histogram predictor, which sees that
    tail, is never worse than the energy fit and matches the brute force (next test)."""
    four = []
    for layer, x in cnn_gradients.items():
        for bits in (4, 8):
            cache: dict = {}
            e = fa.check_prediction(x, bits, fit="energy", measured=cache, window=4)
            h = fa.check_prediction(x, bits, fit="histogram", measured=cache, window=4)
            assert 0.1 < e.predicted_error / e.measured_at_predicted < 2, (layer, bits, e)
            assert h.measured_at_predicted <= e.measured_at_predicted * (1 + 1e-9), (layer, bits, e, h)
            if bits == 4:
                p = fa.check_prediction(x, bits, use_amax=False, measured=cache, window=2)
                assert e.measured_at_predicted <= p.measured_at_predicted * (1 + 1e-9), (layer, bits, e, p)
                four.append(e)
    assert np.mean([c.match or c.tie for c in four]) >= 0.9 and max(c.excess for c in four) <= 0.10


def test_histogram_prediction_on_real_gradients_small(cnn_gradients):
    """The issue's criterion on real gradients, met by the histogram predictor (the tensor's binade
    counts and maximum, no lognormal): the predicted split and power-of-two scale are the brute-force
    best in at least 90% of the CNN's layers at 4, 6 and 8 bits, the misses within 10%, and the
    predicted error is unbiased (within 25% of the measured one at the predicted choice)."""
    checks = {4: [], 6: [], 8: []}
    for layer, x in cnn_gradients.items():
        for bits in checks:
            c = fa.check_prediction(x, bits, fit="histogram", window=4)
            assert 0.75 < c.predicted_error / c.measured_at_predicted < 1.25, (layer, bits, c)
            checks[bits].append(c)
    for bits, cs in checks.items():
        assert np.mean([c.match or c.tie for c in cs]) >= 0.9, bits
        assert max(c.excess for c in cs) <= 0.10, bits


def test_lognormal_prediction_of_many_layers_matches_quantized_samples():
    """composed.predict_one on arrays (one entry per layer, what apply's refresh computes for one layer
    in floats) against quantising lognormal samples with exact zeros: the fractions of all entries
    flushed and saturated and the relative error, within the Monte Carlo noise of 2**20 entries."""
    from gradstats.formats import FPFormat
    from gradstats.fpanalysis.composed import predict_one

    mu, sigma, p0 = np.array([-9.0, -12.0, -7.0]), np.array([1.0, 0.9, 0.5]), np.array([0.0, 0.2, 0.1])
    scale = np.array([2.0 ** 7, 2.0 ** 13, 2.0 ** 10])          # the last saturates in e2m1fn
    g = torch.Generator().manual_seed(3)
    for name in ("e4m3fn", "e2m1fn"):
        uf, sat, err = predict_one(FPFormat.parse(name), "nearest", mu, sigma, p0, 0.0, scale)
        assert uf.shape == sat.shape == err.shape == (3,)
        for i in range(3):
            n = 1 << 20
            x = torch.exp(mu[i] + sigma[i] * torch.randn(n, generator=g, dtype=torch.float64))
            x[torch.rand(n, generator=g, dtype=torch.float64) < p0[i]] = 0
            q = quantize((x * scale[i]).float(), name, overflow="saturate").double() / scale[i]
            nz = x != 0
            assert abs(uf[i] - float(((q == 0) & nz).double().mean())) < 2e-3, (name, i)
            assert abs(sat[i] - float((nz & (x * scale[i] > FPFormat.parse(name).max)).double().mean())) < 1e-3
            measured = float(((q - x) ** 2).sum() / (x ** 2).sum())
            assert abs(err[i] / measured - 1) < 0.05, (name, i, err[i], measured)
            one = predict_one(FPFormat.parse(name), "nearest", float(mu[i]), float(sigma[i]), float(p0[i]), 0.0,
                              float(scale[i]))
            assert isinstance(one[0], float)


@pytest.mark.parametrize("scheme,mu,sigma,n,seeds,each", [
    ("nvfp4", -7.0, 1.5, 4096, 5, 0.2), ("nvfp4", -7.0, 1.5, 2 ** 20, 3, 0.07), ("nvfp4", -9.0, 1.0, 2 ** 16, 3, 0.07),
    ("mxfp4", -7.0, 1.5, 4096, 5, 0.2), ("mxfp4", 0.0, 2.5, 2 ** 20, 3, 0.1)])
def test_block_error_given_the_tensor_maximum_matches_measurement(scheme, mu, sigma, n, seeds, each):
    """NVFP4 and MX conditioned on the tensor's largest magnitude (``tensor_amax``): predicted over
    measured on iid lognormal tensors of 4k to 1M entries. Unconditioned, NVFP4 counted the lognormal's
    tail above the maximum as saturated blocks (0.164 predicted against 0.0067 measured at 4096 entries),
    and MX at sigma 2.5 strayed 0.83-1.33x at 2**20 entries."""
    ratios = []
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        g = torch.exp(torch.randn(n, dtype=torch.float64, generator=gen) * sigma + mu).float()
        g = g * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
        amax = float(g.abs().max())
        p = fa.expected_error(scheme, mu=mu, sigma=sigma, numel=n, tensor_amax=amax)
        ratios.append(float(p.total) / fa.measured_error(g, scheme, scale=None))
        q = quantize(g, scheme, tensor_amax=amax) if scheme == "nvfp4" else quantize(g, scheme)
        flushed = float((q == 0).double().mean())
        assert abs(float(p.flushed) - flushed) <= 5 * math.sqrt(flushed * (1 - flushed) / n) + 2e-3, (p.flushed, flushed)
    assert all(abs(r - 1) <= each for r in ratios), ratios
    assert abs(float(np.median(ratios)) - 1) <= 0.05, ratios


def test_tensor_amax_is_refused_with_a_per_tensor_scale():
    with pytest.raises(ValueError, match="pass amax"):
        fa.expected_error("e4m3fn", mu=-7.0, sigma=1.0, tensor_amax=1.0)
