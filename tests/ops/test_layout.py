"""The block layout (gradstats.ops.layout): blocks run where the GEMM reads them, and every consumer
(quantize, apply, the tracer's samples, the replay of a plan) forms the same blocks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import gradstats
from gradstats.ops.block_scales import _scales_of_blocks
from gradstats.ops.layout import ORIENTATIONS, channel_dim, from_blocks, gemm_matrix, n_blocks, to_blocks
from gradstats.ops.quantization import _quantize_eager
from gradstats.scheme import E4M3


@pytest.mark.parametrize("shape, cd", [((4, 6, 5, 3), 1), ((2, 7, 33), -1), ((37,), -1), ((3, 5, 7), 1)])
@pytest.mark.parametrize("orientation", ORIENTATIONS)
@pytest.mark.parametrize("b", [1, 4, 16])
def test_blocks_round_trip_and_count(shape, cd, orientation, b):
    x = torch.randn(shape)
    xb, ctx = to_blocks(x, b, orientation, cd)
    m = gemm_matrix(x, cd)
    assert xb.shape == (n_blocks(*m.shape, b, orientation), b * b if orientation == "2d" else b)
    assert torch.equal(from_blocks(xb, ctx), x)
    assert float(xb.abs().sum()) == pytest.approx(float(x.abs().sum()), rel=1e-6)   # padding is zeros


def test_a_conv_gradient_is_blocked_along_its_channels_never_its_width():
    """(N, C, H, W) with W = 4: blocks of 16 hold 16 channels of one pixel (as the data-gradient GEMM
    reads it), not a row of 4 pixels padded to 16."""
    x = torch.arange(2 * 32 * 3 * 4, dtype=torch.float32).reshape(2, 32, 3, 4)
    xb, _ = to_blocks(x, 16, "rows", channel_dim(("Conv2d",), 4))
    assert xb.shape == (2 * 3 * 4 * 2, 16)
    assert torch.equal(xb[0], x[0, :16, 0, 0]) and torch.equal(xb[1], x[0, 16:, 0, 0])
    cols, _ = to_blocks(x, 16, "columns", 1)         # the weight-gradient GEMM: 16 tokens of one channel
    assert torch.equal(cols[0], gemm_matrix(x, 1)[:16, 0])
    assert torch.equal(cols[0][:12], x[0, 0].reshape(-1)) and torch.equal(cols[0][12:], x[1, 0, 0])


@pytest.mark.parametrize("scheme", ["nvfp4", "mxfp4", "mxfp8_e4m3"])
def test_quantize_blocks_a_conv_output_as_its_channels_last_matrix(scheme):
    g = torch.randn(4, 24, 7, 7) * torch.exp2(torch.randn(1, 24, 1, 1) * 3)   # channels of different scales
    y = gradstats.quantize(g, scheme, block_dim=1)
    m = gradstats.quantize(gemm_matrix(g, 1), scheme)
    assert torch.equal(gemm_matrix(y, 1), m)
    assert not torch.equal(y, gradstats.quantize(g, scheme))      # blocks along the width are other blocks


def test_nvfp4_part_of_a_tensor_is_quantised_as_within_the_whole():
    """tensor_amax: a part quantised with the whole tensor's maximum gives the whole's values."""
    g = torch.randn(64, 32) * torch.exp2(torch.randn(64, 1) * 2)
    whole = gradstats.quantize(g, "nvfp4")
    part = gradstats.quantize(g[16:48], "nvfp4", tensor_amax=float(g.abs().max()))
    assert torch.equal(part, whole[16:48])
    with pytest.raises(ValueError, match="tensor_amax"):
        gradstats.quantize(g, "nvfp4", tensor_amax=-1.0)


def test_e4m3_block_scales_round_as_quantize_does():
    """The block scale's e4m3fn rounding (torch's cast) equals gradstats' own nearest-even rounding,
    ties and subnormals included."""
    grid = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].sort().values
    v = torch.cat([torch.exp2(torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * 30 - 20),
                   (grid[1:] + grid[:-1]) / 2, grid, torch.tensor([500.0, 1e30])])
    xb = v[:, None] * 6.0                          # one-entry blocks: scale = e4m3(amax / (6 * t)) * t, t = 1
    X = _scales_of_blocks(xb, gradstats.Scheme("e2m1fn", block_size=1, scale_format="e4m3"), tensor_amax=6.0 * 448.0)
    assert torch.equal(X[:, 0], _quantize_eager(v, E4M3, None, "nearest", "saturate", None))


def test_apply_and_the_tracer_use_the_layers_channels(tmp_path):
    """On a convolution whose output is 4 wide, apply's NVFP4 operator equals quantize with blocks
    along the channels, and the tracer's sample is the gradient's channels-last matrix: the replay
    of a plan quantises exactly what apply does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.Flatten(), nn.Linear(32 * 4 * 4, 5))
    x = torch.randn(8, 3, 4, 4)
    seen = {}

    def probe(key):
        def hook(m, i, o):
            o.register_hook(lambda g: seen.__setitem__(key, g.clone()))
        return hook

    h_in = model[0].register_forward_hook(probe("in"))
    plan = gradstats.Plan.uniform(format="nvfp4", rounding="nearest", output_layer=False, layers=["0"])
    applied = gradstats.apply(model, plan)
    h_out = model[0].register_forward_hook(probe("out"))
    model(x).square().sum().backward()
    applied.remove()
    h_in.remove()
    h_out.remove()
    assert torch.equal(seen["out"], gradstats.quantize(seen["in"], "nvfp4", block_dim=1))
    with gradstats.trace(model, tmp_path, sample_every=1, samples=None) as t:
        model(x).square().sum().backward()
        t.step()
    m = gradstats.open_run(tmp_path).sample_matrix("0", 0)
    assert m.shape == (8 * 4 * 4, 32)
