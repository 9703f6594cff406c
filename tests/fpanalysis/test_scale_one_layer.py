"""optimal_scale on one layer's floats: its anchor and range check in floats, the search on arrays of
one entry, bit for bit what the same layer gets as an array of one."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from gradstats.fpanalysis import optimal_scale

MU = [-20.0, -12.0, -9.0, -3.0, 0.0]
SIGMA = [0.2, 1.0, 1.5, 2.0, 4.0]


@pytest.mark.parametrize("fmt,rounding,criterion,power_of_two", list(itertools.product(
    ["e4m3fn", "e5m2", "e2m1fn", "e3m2fn"], ["nearest", "stochastic"], ["mse", "elementwise"], [True, False])))
def test_one_layer_floats_are_its_array_of_one(fmt, rounding, criterion, power_of_two):
    for mu, sigma in zip(MU, SIGMA):
        kw = dict(rounding=rounding, criterion=criterion, power_of_two=power_of_two)
        one = optimal_scale(fmt, mu=mu, sigma=sigma, **kw)
        arr = optimal_scale(fmt, mu=np.array([mu]), sigma=np.array([sigma]), **kw)
        for k in ("scale", "log2_scale", "error", "mu", "sigma"):
            v = getattr(one, k)
            assert type(v) is float and v == float(getattr(arr, k)[0]), (k, mu, sigma)


def test_one_layer_inputs_outside_the_floats_path_check_as_before():
    with pytest.raises(ValueError, match="sigma"):
        optimal_scale("e4m3fn", mu=-9.0, sigma=0.0)
    with pytest.raises(ValueError, match="p0"):
        optimal_scale("e4m3fn", mu=-9.0, sigma=1.0, p0=1.0)
    with pytest.raises(ValueError, match="numel"):
        optimal_scale("e4m3fn", mu=-9.0, sigma=1.0, numel=0)
    with pytest.raises(ValueError, match="outside 2\\*\\*-126"):
        optimal_scale("e4m3fn", mu=-300.0, sigma=1.0)
    a = optimal_scale("e4m3fn", mu=np.float64(-9.0), sigma=1, p0=0)   # numpy scalars and ints: the array path
    b = optimal_scale("e4m3fn", mu=-9.0, sigma=1.0)
    assert (a.scale, a.log2_scale, a.error) == (b.scale, b.log2_scale, b.error)
