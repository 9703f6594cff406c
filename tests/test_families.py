"""gradstats.families: the registry by name, and each family's one-layer twin in floats equal to
its array methods (to about 1e-13 relative) over a grid of parameters and thresholds."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy import special

from gradstats import families as F


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b != 0 else abs(a)


def test_normal_law_helpers():
    xs = np.concatenate([np.linspace(-45.0, 10.0, 221), [-37.0001, -36.999, -1.0, -0.9999, 0.0]])
    for x in xs:
        ref = float(special.ndtr(x))     # far in the lower tail erfc and scipy differ by ~1e-14
        assert rel(F.ndtr1(float(x)), ref) <= 1e-13 or ref < 1e-300
        assert rel(F.log_ndtr1(float(x)), float(special.log_ndtr(x))) <= 1e-14
    qs = np.concatenate([np.logspace(-15, -1, 29), np.linspace(0.02, 0.98, 25), 1 - np.logspace(-10, -2, 9)])
    for q in qs:
        assert rel(F._erfinv1(float(q)), float(special.erfinv(q))) <= 1e-13
        assert rel(F._ndtri1(float(q)), float(special.ndtri(q))) <= 1e-13 or abs(special.ndtri(q)) < 1e-3
    assert F._ndtri1(0.0) == -math.inf and F._ndtri1(1.0) == math.inf and F._erfinv1(0.0) == 0.0


@pytest.mark.parametrize("name", F.FAMILIES)
def test_one_layer_twin_equals_the_array_family(name):
    cls = F.family(name)
    for mu, sigma, x in itertools.product([-9.0, 0.0], [0.4, 1.5, 3.5], np.linspace(-6.0, 4.0, 21)):
        arr = cls(np.array([mu]), np.array([sigma])) if name == "lognormal" else cls(np.array([math.exp(mu)]))
        one = F.one_family(name, mu=mu, sigma=sigma, scale=math.exp(mu))
        for m in ("hard", "up"):
            assert rel(getattr(one, m)(float(x)), float(getattr(arr, m)(np.array([x]))[0])) <= 1e-13, (m, mu, sigma, x)
        # S = H - U: to 1e-13 of its terms (far below the mean they cancel to ~1e-53)
        s1, sa = one.stochastic(float(x)), float(arr.stochastic(np.array([x]))[0])
        assert abs(s1 - sa) <= 1e-13 * one.hard(float(x)), (mu, sigma, x)
        assert rel(one.from_x(float(x)), float(arr.from_x(np.array([x]))[0])) <= 1e-15
    for q in (1e-6, 0.05, 0.5, 0.9, 0.999):       # the solver, at the last parameters
        x1 = F.solve_sparsity_one(one, q)
        xa = float(F.solve_sparsity(arr, np.array([q]))[0])
        assert abs(x1 - xa) <= 1e-12 * max(1.0, abs(xa)), (name, q)
        assert rel(F.solve_sparsity_one(one, q, stochastic=False), float(arr.hard_quantile(np.array([q]))[0])) <= 1e-13


def test_the_registry_names_the_families():
    assert tuple(F.FAMILY_REGISTRY) == F.FAMILIES
    assert F.family("normal") is F.HalfNormal and F.family("lognormal").one is F.OneLognormal
    with pytest.raises(ValueError, match="family must be one of"):
        F.family("gamma")
    with pytest.raises(ValueError, match="positive finite sigma"):
        F.one_family("lognormal", mu=0.0, sigma=0.0)
    with pytest.raises(ValueError, match="scale of the laplace family"):
        F.one_family("laplace", scale=math.nan)
    assert not hasattr(F, "solve_sparsity_scalar")
