"""gradstats.families against independent references: each family's maths (written once for floats
and arrays) against scipy.stats and quadrature, its sparsity against Monte Carlo, the solver against
scipy's brentq; the elementwise functions of gradstats._special against scipy.special; the registry
by name."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import integrate, optimize, special, stats

from gradstats import _special as X
from gradstats import families as F
from gradstats._roots import bracketed_newton


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else abs(a)


def test_normal_law_helpers():
    xs = np.concatenate([np.linspace(-45.0, 10.0, 221), [-37.0001, -36.999, -1.0, -0.9999, 0.0]])
    for x in xs:
        ref = float(special.ndtr(x))     # far in the lower tail erfc and scipy differ by ~1e-14
        assert rel(X.ndtr(float(x)), ref) <= 1e-13 or ref < 1e-300
        assert rel(X.log_ndtr(float(x)), float(special.log_ndtr(x))) <= 1e-14
        assert rel(X.log_ndtr1(float(x)), float(special.log_ndtr(x))) <= 1e-14
    qs = np.concatenate([np.logspace(-15, -1, 29), np.linspace(0.02, 0.98, 25), 1 - np.logspace(-10, -2, 9)])
    for q in qs:
        assert rel(X.erfinv(float(q)), float(special.erfinv(q))) <= 1e-13
        assert rel(X.ndtri(float(q)), float(special.ndtri(q))) <= 1e-13 or abs(special.ndtri(q)) < 1e-3
    assert X.ndtri(0.0) == -math.inf and X.ndtri(1.0) == math.inf and X.erfinv(0.0) == 0.0
    # numpy's conventions where math would raise
    assert X.exp(1e3) == math.inf and X.log(0.0) == -math.inf and math.isnan(X.log(-1.0))


def test_special_functions_pick_the_library_by_argument():
    x = [-3.0, -0.5, 0.0, 2.0]
    for f, ref in [(X.exp, np.exp), (X.expm1, np.expm1), (X.erf, special.erf), (X.ndtr, special.ndtr),
                   (X.log_ndtr, special.log_ndtr)]:
        one = [f(v) for v in x]
        assert all(type(v) is float for v in one)
        arr = f(np.array(x))
        ten = f(torch.tensor(x, dtype=torch.float64))
        assert isinstance(arr, np.ndarray) and isinstance(ten, torch.Tensor)
        np.testing.assert_allclose(one, ref(np.array(x)), rtol=1e-14, atol=1e-300)
        np.testing.assert_allclose(arr, ref(np.array(x)), rtol=0)
        np.testing.assert_allclose(ten.numpy(), ref(np.array(x)), rtol=1e-14)
    assert type(X.exp(np.float64(0.5))) is float and X.where(True, 1.0, 2.0) == 1.0


def _scipy(name: str, mu: float, sigma: float, scale: float):
    """The family's distribution of |g| in scipy.stats."""
    if name == "lognormal":
        return stats.lognorm(s=sigma, scale=math.exp(mu))
    if name == "normal":
        return stats.halfnorm(scale=scale)
    return stats.expon(scale=scale)


def _model(name: str, mu, sigma, scale):
    return F.make_family(name, mu=mu, sigma=sigma, scale=scale)


PARAMS = [(-9.0, 0.4, 3e-4), (0.0, 1.5, 1.0), (-3.0, 3.5, 0.05)]
XS = np.linspace(-4.0, 3.0, 15)


@pytest.mark.parametrize("name", F.FAMILIES)
def test_each_family_against_scipy_stats(name):
    """H, U, S, the CDF, the log-density, the quantiles, E[g^2] and E[T^2] against scipy.stats (the
    partial moment E[|g| 1{|g| < a}] and E[g^2 1{|g| < a}] by quadrature), for floats and arrays."""
    for mu, sigma, scale in PARAMS:
        d = _scipy(name, mu, sigma, scale)
        one = _model(name, mu, sigma, scale)
        arr = _model(name, np.full(XS.size, mu), np.full(XS.size, sigma), np.full(XS.size, scale))
        for i, x in enumerate(XS):
            a = one.from_x(float(x))
            assert rel(one.to_x(a), float(x)) <= 1e-12 or abs(x) < 1e-12
            m1 = integrate.quad(lambda v: v * d.pdf(v), 0.0, a, epsabs=0, epsrel=1e-12, limit=200)[0]
            m2 = integrate.quad(lambda v: v * v * d.pdf(v), 0.0, a, epsabs=0, epsrel=1e-12, limit=200)[0]
            hard, up = d.cdf(a), m1 / a
            assert rel(one.hard(float(x)), hard) <= 1e-12, (name, mu, sigma, x)
            assert rel(one.up(float(x)), up) <= 1e-9, (name, mu, sigma, x)
            assert abs(one.stochastic(float(x)) - (hard - up)) <= 1e-9 * hard
            et2 = (d.moment(2) - m2 + a * m1) / d.moment(2)
            assert rel(one.et2_ratio(float(x)), et2) <= 1e-9
            assert rel(one.added_rel(float(x)), (a * m1 - m2) / d.moment(2)) <= 1e-7
            assert rel(one.cdf(a), hard) <= 1e-12 and rel(one.log_density(a), d.logpdf(a)) <= 1e-12
            # the arrays: the same methods on many layers at once
            assert rel(float(arr.hard(XS)[i]), one.hard(float(x))) <= 1e-14
            assert rel(float(arr.up(XS)[i]), one.up(float(x))) <= 1e-13
        assert rel(one.m2(), d.moment(2)) <= 1e-12
        for q in (1e-6, 0.05, 0.5, 0.9, 0.999):
            aq = one.from_x(one.hard_quantile(q))     # (scipy's halfnorm.ppf loses digits at small q)
            assert rel(d.cdf(aq), q) <= 1e-12 and rel(aq, d.ppf(q)) <= 1e-9
            assert abs(one.ln_quantile(q) - math.log(aq)) <= 1e-14 * max(1.0, abs(math.log(aq)))
        ts = np.array([-20.0, -8.0, -1.0, 2.0])
        a = np.exp2(ts)
        np.testing.assert_allclose(one.log2_density(ts), math.log(2) * a * d.pdf(a), rtol=1e-12)
        p = {"mu": mu, "sigma": sigma} if name == "lognormal" else {"scale": scale}
        assert F.mean_loglik(name, p) == pytest.approx(-d.entropy(), rel=1e-12)   # at the MLE: E log f = -entropy
        t = torch.tensor([0.0, float(d.median()), math.inf], dtype=torch.float64)
        np.testing.assert_allclose(F.cdf64(name, t, p).numpy(), [0.0, 0.5, 1.0], atol=1e-15)


@pytest.mark.parametrize("name", F.FAMILIES)
def test_sparsity_against_monte_carlo(name):
    """S(a) is the stochastic operator's zero fraction: the mean of 1 - |g|/a below a, on samples."""
    mu, sigma, scale = -6.0, 1.8, 2e-3
    d = _scipy(name, mu, sigma, scale)
    g = d.rvs(size=400_000, random_state=np.random.default_rng(7))
    m = _model(name, mu, sigma, scale)
    for q in (0.3, 0.85, 0.97):
        a = m.from_x(F.solve_sparsity(m, q))
        zero = np.where(g < a, 1.0 - g / a, 0.0)
        assert abs(zero.mean() - q) <= 5 * zero.std() / math.sqrt(g.size), (name, q)


@pytest.mark.parametrize("name", F.FAMILIES)
def test_solve_sparsity_against_brentq(name):
    for (mu, sigma, scale), q in itertools.product(PARAMS, (1e-6, 0.05, 0.5, 0.9, 0.999)):
        d = _scipy(name, mu, sigma, scale)

        def s_of(la: float) -> float:     # the operator's zero fraction from scipy.stats and quadrature
            m1 = integrate.quad(lambda l: math.exp(2 * l) * d.pdf(math.exp(l)), la - 80, la, epsabs=0, epsrel=1e-13,
                                limit=400)[0]    # E[|g| 1{|g| < a}], in ln|g|
            return d.cdf(math.exp(la)) - m1 / math.exp(la) - q

        ref = optimize.brentq(s_of, math.log(d.ppf(q)), math.log(d.ppf(q)) + 40, xtol=1e-14, rtol=1e-14)
        one = _model(name, mu, sigma, scale)
        arr = _model(name, np.array([mu, mu]), np.array([sigma, sigma]), np.array([scale, scale]))
        la = math.log(one.from_x(F.solve_sparsity(one, q)))
        assert abs(la - ref) <= 1e-8 * max(1.0, abs(ref)), (name, mu, sigma, q)
        xa = F.solve_sparsity(arr, np.array([q, 0.5]))
        assert abs(float(xa[0]) - F.solve_sparsity(one, q)) <= 1e-12 * max(1.0, abs(float(xa[0])))
        assert rel(d.cdf(one.from_x(F.solve_sparsity(one, q, stochastic=False))), q) <= 1e-12


def test_solve_ratio_inverts_et2_ratio():
    m = F.Lognormal(np.array([-3.0, 0.0]), np.array([0.5, 2.5]))
    r = np.array([1.01, 1.5])
    np.testing.assert_allclose(m.et2_ratio(F.solve_ratio(m, r)), r, rtol=1e-12)
    assert rel(F.HalfNormal(2.0).et2_ratio(F.solve_ratio(F.HalfNormal(2.0), 1.3)), 1.3) <= 1e-12


def test_bracketed_newton_one_root_and_many_against_brentq():
    cs = np.array([0.1, 2.0, 7.5, 100.0])
    many = bracketed_newton(lambda x, i: (x ** 3 - cs[i], 3 * x * x), np.zeros(4), np.full(4, 10.0))
    for c, got in zip(cs, many):
        ref = optimize.brentq(lambda x: x ** 3 - c, 0.0, 10.0, xtol=1e-15, rtol=1e-15)
        one = bracketed_newton(lambda x, _: (x ** 3 - c, 3 * x * x), 0.0, 10.0)
        assert rel(one, ref) <= 1e-13 and rel(float(got), ref) <= 1e-13
        bis = bracketed_newton(lambda x, _: (x ** 3 - c, None), 0.0, 10.0)      # no slope: bisection
        assert rel(bis, ref) <= 1e-13
    # a step that would leave the bracket bisects; best= keeps the point of smallest |f|
    x = bracketed_newton(lambda x, _: (math.atan(x - 1.0), 1.0 / (1.0 + (x - 1.0) ** 2)), -50.0, 60.0, 59.0)
    assert abs(x - 1.0) <= 1e-12
    assert abs(bracketed_newton(lambda x, _: (x - 0.3, 1.0), 0.0, 1.0, best=True) - 0.3) <= 1e-15


def test_the_registry_names_the_families():
    assert tuple(F.FAMILY_REGISTRY) == F.FAMILIES
    assert F.family("normal") is F.HalfNormal and F.N_PARAMS == {"lognormal": 2, "normal": 1, "laplace": 1}
    with pytest.raises(ValueError, match="family must be one of"):
        F.family("gamma")
    with pytest.raises(ValueError, match="positive finite sigma"):
        F.make_family("lognormal", mu=0.0, sigma=0.0)
    with pytest.raises(ValueError, match="positive finite sigma"):
        F.make_family("lognormal", mu=np.zeros(2), sigma=np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match="scale of the laplace family"):
        F.make_family("laplace", scale=math.nan)
    for gone in ("solve_sparsity_scalar", "solve_sparsity_one", "one_family", "OneLognormal", "bracket_solve"):
        assert not hasattr(F, gone)
