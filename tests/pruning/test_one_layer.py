"""The paths that apply's refresh calls: the threshold rules (gradstats.pruning.rules) against
scipy.stats references (the operator's sparsity by scipy's distributions and quadrature, solved by
brentq; the conditioning on amax by its definition), one layer in floats and many in arrays through
the same rule; the histogram rule (LogHistogram) against scipy's PCHIP and quadrature, the scale search (gradstats.fpanalysis.optimal_scale
for one layer) and the prediction (composed.predict_one)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import integrate, interpolate, optimize, stats

from gradstats import fpanalysis, pruning
from gradstats.formats import FPFormat
from gradstats.fpanalysis._pieces import build
from gradstats.fpanalysis._pieces import integrate as pieces_integrate
from gradstats.fpanalysis.composed import predict_one
from gradstats.pruning.histogram import LogHistogram
from gradstats.pruning.rules import THRESHOLD_RULES, LayerStats
from gradstats.stats import HIST_MIN_EXP, tensor_stats

RTOL = 1e-12

MUS = [-14.0, -9.0, -3.0, 0.0, 1.5]
SIGMAS = [0.2, 0.7, 1.2, 2.0, 3.0, 4.5]
P0S = [0.0, 0.3, 0.7]
TARGETS = [0.05, 0.3, 0.5, 0.85, 0.95, 0.99]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else abs(a)


def _params(model: str, mu: float, sigma: float) -> dict:
    return {"mu": mu, "sigma": sigma} if "lognormal" in model else {"scale": math.exp(mu + sigma)}


def _stats(p0=0.0, mu=math.nan, sigma=math.nan, scale=math.nan, amax=None, mean_abs=None):
    return LayerStats(mu=mu, sigma=sigma, p0=p0, scale_normal=scale, scale_laplace=scale, amax=amax, mean_abs=mean_abs)


def _ref(f, x, **kw):
    """The vectorised reference (arrays of one layer: not the one-layer path)."""
    return float(f(np.array([x]), **{k: np.array([v]) if isinstance(v, float) else v for k, v in kw.items()})[0])


class S:
    """The one-layer paths under the names the grid checks use."""

    @staticmethod
    def threshold(t, model="lognormal", *, p0=0.0, **kw):
        return THRESHOLD_RULES[model].threshold(t, _stats(p0, **kw))

    @staticmethod
    def expected_sparsity(a, model="lognormal", *, p0=0.0, stochastic=True, **kw):
        return THRESHOLD_RULES[model].expected_sparsity(a, _stats(p0, **kw), stochastic=stochastic)


def _dist(model: str, mu: float, sigma: float):
    if "lognormal" in model:
        return stats.lognorm(s=sigma, scale=math.exp(mu))
    return (stats.halfnorm if model == "normal" else stats.expon)(scale=math.exp(mu + sigma))


def _ref_sparsity(d, a: float, p0: float, stochastic: bool = True) -> float:
    """p0 + (1 - p0) (P(|g| < a) - E[|g| 1{|g| < a}] / a), from scipy.stats and quadrature in ln|g|."""
    if not stochastic:
        return p0 + (1 - p0) * float(d.cdf(a))
    la = math.log(a)
    m1 = integrate.quad(lambda l: math.exp(2 * l) * d.pdf(math.exp(l)), la - 80, la, epsabs=0, epsrel=1e-13,
                        limit=400)[0]
    return p0 + (1 - p0) * (float(d.cdf(a)) - m1 / a)


def _ref_threshold(model: str, t: float, p0: float, mu: float, sigma: float) -> float:
    """The threshold by its definition: brentq on the reference sparsity (the quantile for the naive rule)."""
    d = _dist(model, mu, sigma)
    q = (t - p0) / (1 - p0)
    if q <= 0:
        return 0.0
    lq = math.log(d.ppf(q))
    if model == "naive_lognormal":
        return math.exp(lq)
    return math.exp(optimize.brentq(lambda la: _ref_sparsity(d, math.exp(la), p0) - t, lq, lq + 40,
                                    xtol=1e-15, rtol=1e-15))


def _ref_conditioned(model: str, t: float, a: float, amax: float, mean_abs: float) -> float:
    """``a`` capped at amax, or mean_abs / (1 - t) where the target lies above 1 - mean_abs / amax."""
    if model != "naive_lognormal" and t >= 1 - mean_abs / amax:
        return mean_abs / (1 - t)
    return min(a, amax)


@pytest.mark.parametrize("model", ["lognormal", "naive_lognormal", "normal", "laplace"])
def test_threshold_and_expected_sparsity_against_scipy(model):
    """The rule's threshold and expected sparsity, one layer in floats and many in arrays, against
    the references above, without and with the conditioning on amax."""
    for mu, sigma, p0, t in itertools.product([-9.0, 0.0], [0.7, 4.5], [0.0, 0.3], [0.05, 0.5, 0.95]):
        kw = _params(model, mu, sigma)
        ref = _ref_threshold(model, t, p0, mu, sigma)
        a = S.threshold(t, model, p0=p0, **kw)
        assert (a == 0) == (ref == 0) and rel(a, ref) <= 1e-9, (mu, sigma, p0, t)
        if ref == 0:
            continue
        d = _dist(model, mu, sigma)
        em = "lognormal" if model == "naive_lognormal" else model
        for x in (ref, 0.37 * ref, 4.1 * ref):
            for sto in (True, False):
                assert abs(S.expected_sparsity(x, em, p0=p0, stochastic=sto, **kw) - _ref_sparsity(d, x, p0, sto)) <= 1e-9
        for am, frac in ((0.5 * ref, 0.2), (0.5 * ref, 0.02), (3.0 * ref, 0.1)):
            cond = {"amax": am, "mean_abs": frac * am}
            assert rel(S.threshold(t, model, p0=p0, **kw, **cond), _ref_conditioned(model, t, ref, **cond)) <= 1e-9


@pytest.mark.parametrize("model", ["lognormal", "naive_lognormal", "normal", "laplace"])
def test_one_layer_and_many_layers_agree(model):
    """The same rule on one layer's floats (math) and on arrays (numpy, through pruning.threshold),
    over a grid of mu, sigma, p0 and targets, without and with the conditioning on amax."""
    worst = 0.0
    for mu, sigma, p0, t in itertools.product(MUS, SIGMAS, P0S, TARGETS):
        kw = _params(model, mu, sigma)
        a, b = S.threshold(t, model, p0=p0, **kw), _ref(pruning.threshold, t, threshold_rule=model, p0=p0, **kw)
        assert (a == 0) == (b == 0), (mu, sigma, p0, t)
        if b == 0:
            continue
        worst = max(worst, rel(a, b))
        em = "lognormal" if model == "naive_lognormal" else model
        for x in (b, 0.37 * b, 4.1 * b):
            assert rel(S.expected_sparsity(x, em, p0=p0, **kw),
                       _ref(pruning.expected_sparsity, x, threshold_rule=em, p0=p0, **kw)) <= RTOL
            assert rel(S.expected_sparsity(x, em, p0=p0, stochastic=False, **kw),
                       _ref(pruning.expected_sparsity, x, threshold_rule=em, p0=p0, stochastic=False, **kw)) <= RTOL
        # a tensor whose largest |g| lies below or above the model's threshold
        for am, frac in ((0.5 * b, 0.2), (0.5 * b, 0.02), (3.0 * b, 0.1)):
            cond = {"amax": am, "mean_abs": frac * am}
            ac = S.threshold(t, model, p0=p0, **kw, **cond)
            bc = _ref(pruning.threshold, t, threshold_rule=model, p0=p0, **kw, **cond)
            assert rel(ac, bc) <= RTOL, (mu, sigma, p0, t, cond)
    assert worst <= RTOL
    assert S.expected_sparsity(0.0, "lognormal", mu=0.0, sigma=1.0, p0=0.25) == 0.25
    assert S.expected_sparsity(math.inf, "lognormal", mu=0.0, sigma=1.0) == 1.0


def test_the_brief_check_values_and_outside_inputs():
    assert round(S.expected_sparsity(1.0, mu=0.0, sigma=1.0), 6) == 0.238422
    assert round(S.expected_sparsity(1.0, mu=0.0, sigma=2.0), 6) == 0.331898
    assert S.threshold(0.2, mu=-10.0, sigma=2.0, p0=0.3) == 0.0
    for bad in ({"mu": math.nan, "sigma": 1.0}, {"mu": 0.0, "sigma": 0.0}):
        with pytest.raises(ValueError, match="mu and a positive finite sigma"):
            S.threshold(0.5, **bad)
    with pytest.raises(ValueError, match="target sparsity must lie in"):
        S.threshold(1.0, mu=0.0, sigma=1.0)
    with pytest.raises(ValueError, match="scale of the normal family"):
        S.threshold(0.5, "normal", scale=-1.0)
    with pytest.raises(ValueError, match="needs mean_abs"):     # amax without mean_abs: the reference's error
        S.threshold(0.5, mu=0.0, sigma=1.0, amax=2.0)
    with pytest.raises(ValueError, match="the histogram rule needs"):
        THRESHOLD_RULES["histogram"].threshold(0.5, LayerStats())
    assert sorted(THRESHOLD_RULES) == sorted(pruning.RULES + ("exact",))


def test_exact_rule_on_the_tensor():
    g = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    rule, stats = THRESHOLD_RULES["exact"], LayerStats(tensor=g)
    a = rule.threshold(0.8, stats)
    assert a == float(pruning.exact_threshold(g, 0.8, stochastic=True))
    assert abs(rule.expected_sparsity(a, stats) - 0.8) < 2e-3 and rule.predicted_sparsity(0.8, a, stats) == 0.8


def _rows():
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, (n, sigma) in enumerate(itertools.product([60, 2000, 200_000], [0.6, 1.5, 3.0])):
        x = torch.exp(torch.randn(n, generator=g) * sigma - 8.0)
        if i % 2:                                          # zeros (ReLU) and a second mode
            x = x * (torch.rand(n, generator=g) > 0.4)
            x[: n // 5] *= 300.0
        rows.append(tensor_stats(x))
    rows.append(tensor_stats(torch.ones(50)))              # one bin
    rows.append(tensor_stats(torch.tensor([0.0, 0.0, 1e-3])))
    return rows


class _RefHistogram:
    """The histogram rule's distribution by its definition, from scipy: F in ln|g| by scipy's
    PchipInterpolator through the cumulative fractions at the bin edges (constant outside them),
    each atom a step of 1/n; S(a) = (1/a) integral_0^a F(x) dx by quadrature in ln x."""

    def __init__(self, h: LogHistogram) -> None:
        self.n, self.n_zero, self.atoms = h.n, h.n_zero, h.atoms
        self.binned = h.counts.size > 0
        if self.binned:
            x = np.concatenate([h.lower[:1], h.upper])
            self.l = np.log(x)
            self.F = np.concatenate([[h.n_zero], h.n_zero + np.cumsum(h.counts)]) / h.n
            self.P = (interpolate.PchipInterpolator(self.l, self.F) if self.l.size >= 3 else
                      interpolate.interp1d(self.l, self.F))

    def _cont(self, la: float) -> float:
        if not self.binned:
            return self.n_zero / self.n
        return float(self.F[0] if la <= self.l[0] else self.F[-1] if la >= self.l[-1] else self.P(la))

    def sparsity(self, a: float, stochastic: bool) -> float:
        below = self.atoms[self.atoms < a]
        if not stochastic:
            return self._cont(math.log(a)) + below.size / self.n
        integral = self.n_zero / self.n * a
        if self.binned:
            lo, hi = self.l[0], min(math.log(a), self.l[-1])
            integral = self.F[0] * math.exp(lo) if a > math.exp(lo) else self.F[0] * a
            if hi > lo:
                pts = [v for v in self.l if lo < v < hi]
                integral += integrate.quad(lambda t: self._cont(t) * math.exp(t), lo, hi, points=pts[:100] or None,
                                           epsabs=0, epsrel=1e-13, limit=2000)[0]
                integral += self.F[-1] * max(a - math.exp(self.l[-1]), 0.0)
        return (integral + float(np.sum(a - below)) / self.n) / a


def _check_histogram(h: LogHistogram, targets) -> None:
    ref = _RefHistogram(h)
    for t, stochastic in itertools.product(targets, [True, False]):
        a = h.threshold(t, stochastic=stochastic)
        if a == 0 or math.isinf(a):
            continue
        s = ref.sparsity(a, stochastic)
        if stochastic or not h.atoms.size:       # (the hard fraction is a step at an atom)
            assert abs(s - t) <= 1e-11, (t, stochastic, a, s)
        for x in (a, 0.3 * a, 7.0 * a, 1e6 * a):
            assert abs(h.expected_sparsity(x, stochastic=stochastic) - ref.sparsity(x, stochastic)) <= 1e-11


@pytest.mark.parametrize("row", _rows(), ids=lambda r: f"n{r['n']}")
def test_histogram_rule_against_its_definition(row):
    h = LogHistogram.from_stats(row)
    _check_histogram(h, [0.0, 0.1, 0.3, 0.5, 0.7, 0.85, 0.95, 0.99])
    # the same rule through the public verbs and the registry (what apply's refresh runs)
    a = THRESHOLD_RULES["histogram"].threshold(0.85, LayerStats(hist=h))
    assert a == pruning.threshold(0.85, row, threshold_rule="histogram")
    assert abs(h.expected_sparsity(a) - pruning.expected_sparsity(a, row, threshold_rule="histogram")) == 0.0
    # the refresh's reading of the binades (a slice of hist, from its lowest non-empty binade)
    nz = np.flatnonzero(np.asarray(row["hist"]) > 0)
    if nz.size:
        h2 = LogHistogram.from_binades(row["hist"][nz[0]:].tolist(), HIST_MIN_EXP + int(nz[0]), row["n"], row["n_zero"],
                                       row["top_abs"].tolist(), row["min_abs"], row["max_abs"])
        assert h2.threshold(0.85) == a


def test_histogram_from_quarter_binade_counts():
    """Bins that are not binades (the counts of LogHistogram.from_counts, four per binade)."""
    g = torch.Generator().manual_seed(3)
    x = torch.exp(torch.randn(50_000, generator=g) * 2.0 - 6.0).numpy().astype(np.float32)
    key = (x.view(np.uint32) & 0x7FFFFFFF) >> (23 - 2)
    counts = np.bincount(key, minlength=256 << 2)
    h = LogHistogram.from_counts(counts, mbits=2, float64=False, n=x.size)
    _check_histogram(h, (0.2, 0.5, 0.85, 0.97))


FORMATS = ["e3m2fn", "e2m3fn", "e2m1fn", "e4m3fn", "e5m2", "e4m3fnuz"]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_optimal_scale_matches_the_reference(fmt, rounding):
    f = FPFormat.parse(fmt)
    for mu, sigma in itertools.product(MUS, SIGMAS):
        r = fpanalysis.optimal_scale(f, mu=[mu], sigma=[sigma], rounding=rounding)      # the vectorised search
        one = fpanalysis.optimal_scale(f, mu=mu, sigma=sigma, rounding=rounding)      # one layer, in floats
        assert one.log2_scale == r.log2_scale[0] and one.scale == r.scale[0], (mu, sigma)   # ties included
        assert rel(one.error, float(r.error[0])) <= RTOL


def test_optimal_scale_walks_and_ties_as_the_reference():
    f = FPFormat.parse("e4m3fn")
    for mu, sigma in [(-60.0, 0.05), (40.0, 0.05), (0.0, 0.01), (-2.0, 11.5)]:
        try:
            r = fpanalysis.optimal_scale(f, mu=[mu], sigma=[sigma])
        except ValueError as exc:
            with pytest.raises(ValueError, match="lies outside"):
                fpanalysis.optimal_scale(f, mu=mu, sigma=sigma)
            assert "lies outside" in str(exc)
            continue
        assert fpanalysis.optimal_scale(f, mu=mu, sigma=sigma).log2_scale == r.log2_scale[0]
    with pytest.raises(ValueError, match="lies outside"):
        fpanalysis.optimal_scale(f, mu=-150.0, sigma=1.0)
    with pytest.raises(ValueError, match="sigma"):
        fpanalysis.optimal_scale(f, mu=0.0, sigma=13.0)      # sigma above the range: the reference's error


@pytest.mark.parametrize("fmt", ["e3m2fn", "e4m3fn", "e2m1fn", "e5m2"])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_predict_without_pruning_is_expected_error(fmt, rounding):
    for mu, sigma, p0, log2s in itertools.product([-10.0, -3.0], [0.7, 2.0], [0.0, 0.4], [-4, 3, 9, 14]):
        r = fpanalysis.expected_error(fmt, mu=mu, sigma=sigma, p0=p0, scale=2.0 ** log2s, rounding=rounding)
        uf, sat, err = predict_one(FPFormat.parse(fmt), rounding, mu, sigma, p0, 0.0, 2.0 ** log2s)
        assert rel(err, r.total) <= 1e-12
        assert abs(uf - r.flushed) <= 1e-14 + 1e-12 * r.flushed and abs(sat - r.saturated) <= 1e-14 + 1e-12 * r.saturated


def _lognormal_quad(f, m, s, lo, hi):
    """E[f(y) 1{lo <= y < hi}] for ln y ~ N(m, s^2), by quadrature in ln y."""
    def g(l):
        return f(math.exp(l)) * math.exp(-0.5 * ((l - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))
    a = max(math.log(lo) if lo > 0 else m - 12 * s, m - 12 * s)
    b = min(math.log(hi) if math.isfinite(hi) else m + 12 * s, m + 12 * s)
    return integrate.quad(g, a, b, limit=400, epsabs=0, epsrel=1e-11)[0] if b > a else 0.0


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_predict_with_pruning(rounding):
    """Kept values over the format's cells from the threshold up (the reference engine, cut from
    below as the difference of two cut from above), and the values rounded up to the threshold as
    a point mass there; checked against quadrature of the operator's exact outcome."""
    fmt = FPFormat.parse("e3m2fn")
    values = fmt.values().numpy()
    values = np.unique(np.abs(values[np.isfinite(values)]))
    pc = build(fmt, rounding, "saturate")

    def q_moments(y):           # E[Q(y)], E[Q(y)^2], P(Q(y) = 0) of one scaled magnitude
        if y >= fmt.max:
            return fmt.max, fmt.max ** 2, 0.0
        i = np.searchsorted(values, y, side="right") - 1
        q0, q1 = values[i], values[min(i + 1, values.size - 1)]
        if rounding == "nearest":
            q = q0 if (y - q0 < q1 - y or (y - q0 == q1 - y and int(np.argmax(values == q0)) % 2 == 0)) else q1
            return q, q * q, float(q == 0)
        p = (y - q0) / (q1 - q0) if q1 > q0 else 0.0
        return y, q0 * q0 * (1 - p) + q1 * q1 * p, (1 - p) if q0 == 0 else 0.0

    for mu, sigma, a_over, log2s in [(-9.0, 1.5, 0.2, 13), (-9.0, 1.5, 3.0, 9), (-4.0, 2.2, 1.0, 5)]:
        s = 2.0 ** log2s
        a = a_over * math.exp(mu)
        uf, sat, err = predict_one(fmt, rounding, mu, sigma, 0.0, a, s)
        m = mu + math.log(s)
        A = a * s
        e2 = math.exp(2 * m + 2 * sigma ** 2)
        # kept: the reference engine, everything minus the part below A
        full = pieces_integrate(pc, np.array([mu]), np.array([sigma]), np.array([math.log(s)]))[0]
        below = pieces_integrate(pc, np.array([mu]), np.array([sigma]), np.array([math.log(s)]),
                                 upper=np.array([A]))[0]
        kept = full - below
        eq, eq2, p_zero = q_moments(A)
        m1 = _lognormal_quad(lambda y: y, m, sigma, 0.0, A)
        m2 = _lognormal_quad(lambda y: y * y, m, sigma, 0.0, A)
        err_ref = kept[:4].sum() + (eq2 * m1 / A - 2 * eq * m2 / A + m2) / e2
        uf_ref = kept[4] + m1 / A * p_zero
        assert rel(err, err_ref) <= 1e-9 and abs(uf - uf_ref) <= 1e-10
        assert sat == pytest.approx(kept[5], abs=1e-14)
        # the pruning's own error, no format: E[(T(g) - g)^2] / E[g^2] = added_variance(relative)
        _, _, e0 = predict_one(None, rounding, mu, sigma, 0.0, a, 1.0)
        assert rel(e0, pruning.added_variance(a, mu=mu, sigma=sigma, relative=True)) <= 1e-10
    with pytest.raises(ValueError, match="sigma > 0"):
        predict_one(fmt, "nearest", 0.0, -1.0, 0.0, 0.0, 1.0)
