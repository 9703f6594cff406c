"""The gain alert of gradstats.apply: a small shrinkage sustained over calls, each call within its
own noise, fires within a few calls; unbiased pruning and stochastic rounding do not."""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

import gradstats
from gradstats.apply.refresh import LayerState
from gradstats.ops.fused import CompressCounts
from gradstats.plan import Plan


def net():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def handle(**kw):
    """An apply handle whose alert checks the tests call directly (stochastic rounding on every layer)."""
    return gradstats.apply(net(), Plan.uniform(format="e4m3fn", rounding="stochastic", scale="amax",
                                               output_layer=False), **kw)


def counts(gain: float, se: float, n: int = 4096) -> CompressCounts:
    """A call of gain ``gain`` whose own draws have standard error ``se`` (``<g, g>`` = 1)."""
    return CompressCounts(n=n, zeros=0, pruned=0, underflow=0, saturated=0, dot=gain, norm2=1.0, err2=0.01,
                          noise2=se * se, abs_out=gain, abs_in=1.0)


def first_alert(h, gains, se) -> int:
    """The call (1-based) at which the gain alert fires on calls of these gains, 0 if none."""
    st = LayerState()
    for k, g in enumerate(gains, 1):
        st.seq = k
        h.checks.check("0", st, counts(g, se))
        if "gain" in st.alerts:
            return k
    return 0


def test_gain_alert_catches_a_sustained_small_shrinkage():
    h = handle(zero_calls=None)
    # gain 0.985 on every call, 0.4% standard error per call (a 4096-entry gradient under 4-bit stochastic
    # rounding): no single call is off 1 beyond the bound and its noise (0.015 < 0.01 + 5 * 0.004), all
    # the calls so far are at the third; before, the cumulative test waited for five standard errors
    # beyond the bound (the 16th call)
    assert abs(0.985 - 1) < h.config.bias_bound + 5 * 0.004
    assert first_alert(h, [0.985] * 50, 0.004) == 3
    assert first_alert(h, [1.015] * 50, 0.004) == 3                        # inflation alike
    # drawn around 0.985 at 0.2% per call (a 32k-entry gradient): mostly the first call or the second,
    # always within a few (before: the fourth, at most the tenth)
    rng = np.random.default_rng(0)
    at = [first_alert(h, rng.normal(0.985, 0.002, 50), 0.002) for _ in range(100)]
    assert 0 not in at and np.median(at) <= 2 and max(at) <= 4, at
    # and a gain within the bound (0.995) does not fire over 200 calls
    assert first_alert(h, [0.995] * 200, 0.004) == 0
    # unbiased operators, gain 1 in expectation: no alert over 200 calls on 300 layers, from tiny
    # standard errors to those of 85% pruning of small tensors
    for se in (0.001, 0.004, 0.02, 0.2):
        fired = [first_alert(h, rng.normal(1.0, se, 200), se) for _ in range(300)]
        assert not any(fired), (se, [f for f in fired if f])


def test_gain_alert_quiet_for_unbiased_stochastic_plans():
    """Real gradients, 50 calls: stochastic rounding to e2m1fn (per-tensor amax scales) and 85% pruning
    with stochastic e3m2fn, gain 1 in expectation: no gain alert on any layer."""
    torch.manual_seed(0)
    for plan in (Plan.uniform(format="e2m1fn", rounding="stochastic", scale="amax", output_layer=False),
                 Plan.uniform(format="e3m2fn", rounding="stochastic", scale="amax", sparsity=0.85,
                              output_layer=False)):
        m = net()
        h = gradstats.apply(m, plan)
        for _ in range(50):
            m(torch.randn(16, 64)).sin().sum().backward()
        gains = [r["gain"] for r in h.history]
        assert len(gains) >= 100 and abs(np.mean(gains) - 1) < 0.01
        assert not any("gain" in a for a in h.alerts.values()), h.alerts
        h.remove()
