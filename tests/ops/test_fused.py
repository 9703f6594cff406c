"""The fused prune + quantise operator against the composed reference operators."""
from __future__ import annotations

import math

import pytest
import torch

import gradstats.ops.fused as compress
from gradstats.formats import FPFormat
from gradstats.ops.fused import prune_quantize
from gradstats.ops.quantization import quantize

FORMATS = ["e4m3fn", "e5m2", "e3m2fn", "e2m3fn", "e2m1fn", "e4m3", "e6m1", "e3m3", "e4m3fnuz",
           "e5m2_nosub", "e3m2_nosub", "e8m3", "e2m2"]


@pytest.fixture(params=["native", "composed"])
def path(request, monkeypatch):
    if request.param == "composed":
        monkeypatch.setattr(compress, "_native", lambda: None)
    elif compress._native() is None:
        pytest.skip("no C compiler here: the composed path is tested instead")
    return request.param


def lognormal(n, sigma=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * sigma)
    x[:12] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 448, 464, 480, 1e30, -3e-39, 57344])
    return x


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("rounding", ["nearest", "toward_zero"])
def test_quantise_only_is_bit_exact(path, name, rounding):
    x = lognormal(50_000)
    fmt = FPFormat.parse(name)
    for scale in (1.0, 2.0 ** 12, 2.0 ** -7):
        ref = quantize(x, fmt, scale=scale, rounding=rounding)
        got, c = prune_quantize(x, 0.0, fmt, scale=scale, rounding=rounding)
        same = (ref.view(torch.int32) == got.view(torch.int32)) | (ref.isnan() & got.isnan())
        assert bool(same.all()), (name, scale, x[~same][:3], ref[~same][:3], got[~same][:3])
        assert c.saturated == int(((x.abs() * scale) > fmt.max).sum())
        assert c.zeros == int((got == 0).sum())
        assert c.underflow == int(((x != 0) & (got == 0)).sum())


@pytest.mark.parametrize("name", ["e3m2fn", "e2m1fn", "e4m3fn", "e3m2_nosub"])
def test_stochastic_rounding_neighbours_and_unbiased(path, name):
    fmt = FPFormat.parse(name)
    vals = torch.tensor([0.3, -1.1, 2.7, fmt.min_normal * 0.37])
    x = vals.repeat_interleave(40_000)
    g = torch.Generator().manual_seed(1)
    got, _ = prune_quantize(x, 0.0, fmt, rounding="stochastic", generator=g)
    lo = quantize(x, fmt, rounding="toward_zero")
    grid = sorted(set(fmt.values().tolist()))
    for v, chunk, low in zip(vals.tolist(), got.split(40_000), lo.split(40_000)):
        lo_v = low[0].item()
        # the neighbour on the far side of v from zero
        hi_v = min(u for u in grid if u > lo_v) if v > 0 else max(u for u in grid if u < lo_v)
        assert set(chunk.unique().tolist()) <= {lo_v, hi_v}, (name, v)
        mean = chunk.double().mean().item()
        spread = chunk.double().std().item() / math.sqrt(chunk.numel())
        assert abs(mean - v) < 5 * spread + 1e-12, (name, v, mean)


@pytest.mark.parametrize("sigma, target_a", [(1.0, 0.5), (2.5, 0.05)])
def test_pruning_statistics(path, sigma, target_a):
    x = lognormal(400_000, sigma=sigma)[12:]
    g = torch.Generator().manual_seed(2)
    got, c = prune_quantize(x, target_a, None, generator=g)
    small = x.abs() < target_a
    assert torch.equal(got[~small], x[~small])                        # large values kept
    assert set(got[small].abs().unique().tolist()) <= {0.0, target_a} | {float(torch.tensor(target_a))}
    expected_zeros = (1 - x[small].abs() / target_a).sum().item()
    sd = math.sqrt(((x[small].abs() / target_a) * (1 - x[small].abs() / target_a)).sum().item())
    assert abs(c.pruned - expected_zeros) < 5 * sd
    assert abs((got - x).sum().item()) < 5 * math.sqrt((target_a * x[small].abs() - x[small] ** 2).sum().item())


def test_reproducible_with_generator(path):
    x = lognormal(50_000)
    a, _ = prune_quantize(x, 0.01, "e3m2fn", rounding="stochastic", generator=torch.Generator().manual_seed(5))
    b, _ = prune_quantize(x, 0.01, "e3m2fn", rounding="stochastic", generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_out_and_shape(path):
    x = lognormal(6_000).reshape(60, 100).t()                          # non-contiguous
    out = torch.empty(100, 60)
    y, _ = prune_quantize(x, 0.0, "e4m3fn", out=out)
    assert y is out
    torch.testing.assert_close(y, quantize(x, "e4m3fn"), rtol=0, atol=0, equal_nan=True)


def test_bad_input():
    with pytest.raises(ValueError, match="threshold"):
        prune_quantize(torch.ones(3), -1.0, None)
    with pytest.raises(ValueError, match="rounding"):
        prune_quantize(torch.ones(3), 0.0, "e4m3fn", rounding="up")
    with pytest.raises(ValueError, match="scale"):
        prune_quantize(torch.ones(3), 0.0, "e4m3fn", scale=0.0)
    with pytest.raises(ValueError, match="floating-point"):
        prune_quantize(torch.ones(3, dtype=torch.int32), 0.0, None)


def test_gain_error_and_bias_sums_agree_between_the_kernel_and_the_composed_path(monkeypatch):
    """The fused pass measures the call's gain <out, g>/<g, g>, error and magnitude bias (float64 sums
    over the finite entries) and counts non-finite inputs; the reference path gives the same numbers
    (summed in another order: to 1e-9 relative)."""
    from gradstats.ops import fused as _fused

    if _fused._native() is None:
        pytest.skip("no C compiler here")
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(4)) * 1e-3
    x[[3, 7]] = torch.tensor([float("nan"), float("inf")])
    for rounding in ("nearest", "stochastic"):
        y, c = prune_quantize(x, 1e-3, "e3m2fn", scale=2.0 ** 10, rounding=rounding, seed=9)
        with monkeypatch.context() as m:
            m.setattr(_fused, "_native", lambda: None)
            y2, c2 = prune_quantize(x, 1e-3, "e3m2fn", scale=2.0 ** 10, rounding=rounding, seed=9)
        assert c == c2 and c.nonfinite == 2
        for k in ("dot", "norm2", "err2", "noise2", "abs_out", "abs_in"):
            assert getattr(c, k) == pytest.approx(getattr(c2, k), rel=1e-9), k
        fin = torch.isfinite(x)
        xd, od = x[fin].double(), y[fin].double()
        assert c.gain == pytest.approx(float(xd @ od / (xd @ xd)), rel=1e-9)
        assert c.error == pytest.approx(float(((od - xd) ** 2).sum() / (xd @ xd)), rel=1e-9)
        if rounding == "stochastic":                               # pruning and stochastic rounding: unbiased
            assert abs(c.gain - 1) < 5 * c.gain_se
        else:                   # the pruned values rounded up to a = 1.024 / 2**10 round to nearest 1.0: a shrinkage
            assert c.gain < 1 - 5 * c.gain_se


@pytest.mark.parametrize("preset", ["nvfp4", "mxfp8_e4m3", "mxfp4", "mxfp6_e3m2:rounding=stochastic",
                                    "mxfp8_e5m2:scale_rounding=rceil"])
def test_a_scheme_in_place_of_the_format_equals_its_spelled_out_keywords(preset):
    """prune_quantize takes a scheme or a preset name where it takes a format, as quantize does: bit
    for bit the call with the scheme built from its fields spelled out, pruning and counts included."""
    from gradstats.scheme import Scheme

    x = lognormal(8_192, sigma=2.0).reshape(64, 128)
    s = Scheme.parse(preset)
    spelled = Scheme(str(s.element), block_size=s.block_size, scale_format=s.scale_format_name,
                     scale_rounding=s.scale_rounding, rounding=s.rounding)
    ref, c_ref = prune_quantize(x, 0.05, spelled, seed=7)
    by_kw, _ = prune_quantize(x, 0.05, spelled.replace(rounding="nearest"), rounding=s.rounding, seed=7)
    assert bool(((ref.view(torch.int32) == by_kw.view(torch.int32)) | (ref.isnan() & by_kw.isnan())).all())
    for fmt in (preset, s):
        got, c = prune_quantize(x, 0.05, fmt, seed=7)
        same = (ref.view(torch.int32) == got.view(torch.int32)) | (ref.isnan() & got.isnan())
        assert bool(same.all()), preset
        assert c == c_ref
    # a keyword given replaces the scheme's field, as in quantize
    a, _ = prune_quantize(x, 0.0, "nvfp4", rounding="stochastic", seed=3)
    b, _ = prune_quantize(x, 0.0, "e2m1fn:block=16:scale=e4m3", rounding="stochastic", seed=3)
    assert torch.equal(a.nan_to_num(), b.nan_to_num())
    with pytest.raises(ValueError, match="block_size"):
        prune_quantize(x, 0.0, "nvfp4", block_size=0)
