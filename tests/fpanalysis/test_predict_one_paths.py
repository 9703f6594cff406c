"""predict_one computes the terms of the maximum and of the threshold only where some layer has them:
layers predicted together give what each gives alone, and one layer's floats what its array of one
gives, within float rounding (the engine's sums of differences of the normal CDF are grouped by the
rows it is given, so they agree to about 1e-12 of their terms, not of the result)."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from gradstats.formats import FPFormat
from gradstats.fpanalysis.composed import predict_one

ROWS = [  # mu, sigma, p0, threshold, scale, amax, numel
    (-9.0, 1.5, 0.0, 0.0, 2.0 ** 7, math.nan, math.nan),
    (-9.0, 1.5, 0.1, 1e-5, 2.0 ** 7, 0.05, 4096.0),
    (-20.0, 2.0, 0.3, 1e-6, 2.0 ** 15, math.nan, math.nan),
    (-5.0, 0.3, 0.0, 0.0, 2.0 ** 3, 0.05, math.nan),
    (-9.0, 1.5, 0.0, 1e-2, 2.0 ** 7, 1e-3, 100.0),       # the maximum below the threshold
    (-12.0, 2.5, 0.2, 0.0, 2.0 ** 9, 1e-3, 50.0),
]


@pytest.mark.parametrize("fmt,rounding", list(itertools.product([None, "e4m3fn", "e2m1fn"], ["nearest", "stochastic"])))
def test_layers_together_are_each_layer_alone(fmt, rounding):
    f = None if fmt is None else FPFormat.parse(fmt)
    cols = [np.array(c) for c in zip(*ROWS)]
    together = predict_one(f, rounding, *cols)
    for i, row in enumerate(ROWS):
        alone = predict_one(f, rounding, *(np.array([v]) for v in row))
        for t, a in zip(together, alone):
            assert abs(np.asarray(t)[i] - np.asarray(a)[0]) <= 1e-9 * abs(np.asarray(a)[0]) + 1e-300, (i, row)
        one = predict_one(f, rounding, *(None if math.isnan(v) else v for v in row))
        assert all(type(v) is float for v in one)
        for o, a in zip(one, alone):
            assert abs(o - float(a[0])) <= 1e-9 * abs(o) + 1e-300, (i, row)
