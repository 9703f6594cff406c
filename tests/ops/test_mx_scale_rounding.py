"""MX block-scale rounding modes (floor, ceil, even, rceil) bit for bit against torchao's to_mx, the
reference implementation of the OCP MX recipes torchao trains with."""
from __future__ import annotations

import pytest
import torch

from gradstats.ops.quantization import SCALE_ROUNDINGS, block_scales, mx_shared_exponent, quantize
from gradstats.scheme import Scheme

mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402

ELEMENTS = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m3fn": "fp6_e2m3", "e3m2fn": "fp6_e3m2",
            "e2m1fn": torch.float4_e2m1fn_x2}


def _data(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over 40 binades, exact powers of two and values just below them included
    x = torch.exp2(torch.randint(-30, 10, (64, 128), generator=g).float()) * (1 + torch.rand(64, 128, generator=g))
    x[0, :32] = 2.0 ** torch.arange(-16, 16).float()
    x[1, :32] = 2.0 ** torch.arange(-16, 16).float() * (1 - 2.0 ** -20)
    x[2, :32] = 448.0 * (1 + torch.arange(32).float() / 64)
    return x * torch.where(torch.rand(64, 128, generator=g) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("mode", SCALE_ROUNDINGS)
@pytest.mark.parametrize("fmt", list(ELEMENTS))
def test_block_exponents_match_torchao(fmt, mode):
    x = _data()
    scale, _ = mx.to_mx(x, ELEMENTS[fmt], 32, scaling_mode=ScaleCalculationMode(mode))
    theirs = scale.view(torch.uint8).to(torch.int32).reshape(64, 4) - 127
    amax = x.reshape(64, 4, 32).abs().amax(-1)
    ours = mx_shared_exponent(amax, fmt, mode)
    assert torch.equal(ours, theirs)
    assert torch.equal(block_scales(x, Scheme.of(fmt, block_size=32, scale_rounding=mode)), torch.exp2(ours.float()))


@pytest.mark.parametrize("mode", SCALE_ROUNDINGS)
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_quantised_values_match_torchao(fmt, mode):
    x = _data(1)
    scale, data = mx.to_mx(x, ELEMENTS[fmt], 32, scaling_mode=ScaleCalculationMode(mode))
    theirs = data.float().reshape(64, 4, 32) * torch.exp2(scale.view(torch.uint8).float() - 127).reshape(64, 4, 1)
    ours = quantize(x, fmt, block_size=32, scale_rounding=mode).reshape(64, 4, 32)
    assert torch.equal(ours, theirs)


def test_rceil_never_saturates_and_floor_may():
    x = torch.tensor([[500.0] + [1.0] * 31])
    assert quantize(x, "e4m3fn", block_size=32)[0, 0] == 448.0                        # floor: saturated
    assert quantize(x, "e4m3fn", block_size=32, scale_rounding="rceil")[0, 0] == 512.0  # rceil: 2 * 256
    with pytest.raises(ValueError, match="scale_rounding must be one of"):
        quantize(x, "e4m3fn", block_size=32, scale_rounding="up")


@pytest.mark.parametrize("rule, kw", [
    ({"format": "e2m1fn", "block_size": 16, "scale_format": "e4m3"}, {"block_size": 16, "scale_format": "e4m3"}),
    ({"format": "e4m3fn", "block_size": 32, "scale_rounding": "rceil"}, {"block_size": 32, "scale_rounding": "rceil"}),
    ({"format": "e2m1fn", "block_size": 32}, {"block_size": 32}),
])
def test_apply_enforces_the_block_scales_the_plan_names(rule, kw):
    import gradstats

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64))
    seen = {}

    def keep(module, inputs, output):
        def grab(g):
            seen["g"] = g.clone()
        output.register_hook(grab)               # registered before apply's: sees the gradient first

    net[0].register_forward_hook(keep)
    plan = gradstats.Plan([gradstats.PlanEntry("0", scale="amax", rounding="nearest", **rule)])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 64, generator=gen)
    upstream = torch.randn(8, 64, generator=gen) * torch.exp(2 * torch.randn(8, 64, generator=gen))   # a spread gradient
    with gradstats.apply(net, plan):
        (net(x) * upstream).sum().backward()
    want = quantize(seen["g"], rule["format"], **kw)           # what apply passed on to the weight gradient
    torch.testing.assert_close(net[0].weight.grad, want.t() @ x, rtol=1e-5, atol=1e-6)


def test_plans_carry_the_scale_rounding():
    import gradstats

    plan = gradstats.Plan.uniform(format="e4m3fn:block=32:scale_rounding=rceil")
    again = gradstats.Plan.from_dict(plan.to_dict())
    assert again == plan and again.defaults.scale_rounding == "rceil"
    assert gradstats.Plan.uniform(format="e2m1fn:block=32").defaults.scheme.scale_rounding == "floor"
    with pytest.raises(ValueError, match="rounds MX \\(e8m0\\) block scales"):
        gradstats.plan.Rule(format="e2m1fn", scale="amax", block_size=16, scale_format="e4m3", scale_rounding="rceil")
    with pytest.raises(ValueError, match="scale_rounding"):
        gradstats.plan.Rule(format="e4m3fn", scale="amax", block_size=32, scale_rounding="up")
