"""The libraries of gradstats._special picked once per formula: each library's functions agree with
the module's per-call functions (bit for bit), the pick follows the arguments' types, quiet() silences
numpy once for a loop, and the pruning verbs' one path through the rules gives what the rules give."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from gradstats import _special as X
from gradstats import families as F
from gradstats.pruning import expected_sparsity, threshold
from gradstats.pruning.rules import THRESHOLD_RULES, LayerStats

NAMES = ("exp", "log", "expm1", "log1p", "erf", "erfinv", "ndtr", "log_ndtr", "ndtri", "isfinite")
FLOATS = [-800.0, -40.0, -1.5, -1.0, -0.3, 0.0, 0.3, 0.999, 1.0, 2.0, 709.0, 710.0, math.inf, -math.inf, math.nan]


def same(a, b) -> bool:
    return a == b or (a != a and b != b)


@pytest.mark.parametrize("name", NAMES)
def test_each_library_is_the_module_function_on_its_kind(name):
    module = getattr(X, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for v in FLOATS:
            try:
                want = module(v)
            except (ValueError, OverflowError) as e:      # math's own domain errors stay the same
                with pytest.raises(type(e)):
                    getattr(X.MATH, name)(v)
                continue
            assert same(getattr(X.MATH, name)(v), want), (name, v)
        arr = np.array([v for v in FLOATS if name not in ("erfinv", "ndtri") or abs(v) <= 1.0])
        np.testing.assert_array_equal(getattr(X.NUMPY, name)(arr), module(arr))
        ten = torch.tensor(arr, dtype=torch.float64)
        torch.testing.assert_close(getattr(X.TORCH, name)(ten), module(ten), rtol=0, atol=0, equal_nan=True)


def test_backend_and_join_follow_the_arguments():
    assert X.backend(1.0, 2, np.float64(3.0), None) is X.MATH
    assert X.backend(1.0, np.zeros(2)) is X.NUMPY and X.backend([1.0]) is X.NUMPY
    assert X.backend(np.zeros(2), torch.zeros(2)) is X.TORCH
    assert X.join(X.MATH, 1.0) is X.MATH and X.join(X.MATH, np.zeros(1)) is X.NUMPY
    assert X.join(X.NUMPY, 1.0) is X.NUMPY and X.join(X.NUMPY, torch.zeros(1)) is X.TORCH
    # a family's methods: the parameters' library joined with the argument's
    one = F.Lognormal(-3.0, 1.5)
    assert type(one.up(0.5)) is float and isinstance(one.up(np.array([0.5])), np.ndarray)
    assert isinstance(one.cdf(torch.tensor([0.5], dtype=torch.float64)), torch.Tensor)
    many = F.Lognormal(np.array([-3.0, -4.0]), np.array([1.5, 2.0]))
    np.testing.assert_array_equal(many.up(0.5), [F.Lognormal(-3.0, 1.5).up(np.array(0.5)),
                                                   F.Lognormal(-4.0, 2.0).up(np.array(0.5))])


def test_quiet_silences_numpy_once_and_the_library_stays_quiet_outside():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert X.NUMPY.exp(np.array([800.0]))[0] == math.inf          # quiet on its own
        assert X.NUMPY.log(np.array([0.0]))[0] == -math.inf
        assert not X.quiet.active()
        with X.quiet():
            assert X.quiet.active()
            assert np.isnan(np.array([0.0]) / np.array([0.0]))[0]   # everything, inside
            assert X.NUMPY.exp(np.array([800.0]))[0] == math.inf
        assert not X.quiet.active()
        with pytest.raises(RuntimeWarning):
            np.array([1.0]) / np.array([0.0])


@pytest.mark.parametrize("rule", ["lognormal", "naive_lognormal", "normal", "laplace"])
def test_the_pruning_verbs_give_what_the_rules_give(rule):
    """threshold() and expected_sparsity() go straight to the rule's checked solve: the same numbers as
    the rule's public methods on the same LayerStats, and (one layer) as its floats within 1e-12."""
    mu, sigma = np.array([-12.0, -9.0, -6.0]), np.array([0.7, 2.0, 3.5])
    p0, scale = np.array([0.0, 0.2, 0.5]), np.array([1e-5, 1e-3, 0.2])
    target = np.array([0.1, 0.9, 0.6])
    kw = dict(mu=mu, sigma=sigma) if "lognormal" in rule else dict(scale=scale)
    st = LayerStats(mu=mu, sigma=sigma, p0=p0, scale_normal=scale, scale_laplace=scale)
    a = threshold(target, p0=p0, threshold_rule=rule, **kw)
    np.testing.assert_array_equal(a, THRESHOLD_RULES[rule].threshold(target, st))
    if rule != "naive_lognormal":
        s = expected_sparsity(a, p0=p0, threshold_rule=rule, **kw)
        np.testing.assert_array_equal(s, THRESHOLD_RULES[rule].expected_sparsity(a, st))
    for i in range(3):
        one = THRESHOLD_RULES[rule].threshold(float(target[i]), LayerStats(
            mu=float(mu[i]), sigma=float(sigma[i]), p0=float(p0[i]), scale_normal=float(scale[i]),
            scale_laplace=float(scale[i])))
        assert abs(one - a[i]) <= 1e-12 * a[i]
