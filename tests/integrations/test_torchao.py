"""torchao: a plan converts a model with torchao's own API, trains, and torchao then does to the
gradient what gradstats says: dX = quantize(g) @ quantize(W) with gradstats' formats and amax scales
(torchao's emulated float8 GEMMs, on the CPU)."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("torchao.float8")
import gradstats  # noqa: E402
from gradstats.formats import amax_scale, parse  # noqa: E402
from gradstats.integrations.torchao import convert  # noqa: E402
from gradstats.ops.quantization import quantize  # noqa: E402


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 16))


def _grads_at(model: torch.nn.Module, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients at ``model[layer]``'s input and output after a backward pass from ``x``."""
    seen = {}

    def keep(module, inputs, output):
        inputs[0].retain_grad()
        output.retain_grad()
        seen["x"], seen["y"] = inputs[0], output

    handle = model[layer].register_forward_hook(keep)
    model(x).square().mean().backward()
    handle.remove()
    return seen["x"].grad, seen["y"].grad


def _q(x: torch.Tensor, fmt: str) -> torch.Tensor:
    s = amax_scale(parse(fmt), float(x.abs().max()))
    return quantize(x * s, fmt) / s


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3fn"])
def test_the_input_gradient_is_quantize_g_times_quantize_w(fmt):
    model = convert(_mlp(), gradstats.Plan.uniform(format=fmt, scale="amax"), emulate=True)
    assert [type(m).__name__ for m in model] == ["Float8Linear", "ReLU", "Float8Linear", "ReLU", "Linear"]
    dx, g = _grads_at(model, 2, torch.randn(8, 32, generator=torch.Generator().manual_seed(1)))
    w = model[2].weight.detach()
    expected = _q(g, fmt) @ _q(w, "e4m3fn")            # torchao casts the weight for grad_input to e4m3fn
    torch.testing.assert_close(dx, expected, rtol=1e-5, atol=1e-9)
    # and not the unquantised product: the cast is really there
    assert not torch.allclose(dx, g @ w, rtol=1e-4, atol=0)


def test_a_recommended_8_bit_plan_converts_and_trains(tmp_path):
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(torch.randn(32, 32, generator=torch.Generator().manual_seed(i)),
             torch.randint(0, 16, (32,), generator=torch.Generator().manual_seed(i))) for i in range(4)]
    with gradstats.trace(model, tmp_path / "run", optimizer=opt):
        for x, y in data[:2]:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    plan = gradstats.recommend(tmp_path / "run", bits=8)
    assert {str(e.format) for e in plan.entries} <= {"e4m3fn", "e5m2"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)        # what torchao cannot express is listed, not lost
        pairs = plan.to_torchao(model, emulate=True)
        convert(model, plan, emulate=True)
    assert pairs and {type(m).__name__ for m in model} >= {"Float8Linear"}
    before = model[0].weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = data[2]
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    assert torch.isfinite(loss) and not torch.equal(before, model[0].weight.detach())


def test_what_torchao_cannot_express_is_listed():
    plan = gradstats.Plan.uniform(format="e4m3fn", sparsity=0.5, rounding="stochastic", scale="amax")
    with pytest.warns(UserWarning, match="does not prune"):
        plan.to_torchao(_mlp())
    with pytest.raises(ValueError, match="not expressible"):
        plan.to_torchao(_mlp(), strict=True)
    # a format torchao has no dtype for: the layer is skipped, nothing converted
    with pytest.warns(UserWarning, match="no torchao.float8 counterpart"):
        assert gradstats.Plan.uniform(format="e3m2fn").to_torchao(_mlp()) == []


@pytest.mark.parametrize("mode", ["floor", "rceil", "even"])
def test_an_mx_plan_is_torchaos_mxfp8_training_bit_for_bit(mode):
    """An MX plan (e4m3fn, blocks of 32, E8M0 scales) becomes torchao's MXFP8TrainingOpConfig with
    the plan's scale rounding; after convert, the input gradient torchao computes (emulated) is
    quantize(g, block_size=32, scale_rounding=mode) @ quantize(W along its output dimension)."""
    pytest.importorskip("torchao.prototype.moe_training")
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig

    plan = gradstats.Plan.uniform(format="e4m3fn", block_size=32, scale_rounding=mode)
    with pytest.warns(UserWarning, match="also casts the forward"):
        pairs = plan.to_torchao(_mlp(), emulate=True)
    assert len(pairs) == 1 and isinstance(pairs[0][0], MXFP8TrainingOpConfig)
    assert pairs[0][0].scale_calculation_mode.name == mode.upper()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = convert(_mlp(), plan, emulate=True)
    assert type(model[2].weight).__name__ == "MXFP8TrainingWeightWrapperTensor"
    assert type(model[4].weight).__name__ == "Parameter"          # the output layer stays as it was
    w = model[2].weight.detach().clone()
    dx, g = _grads_at(model, 2, torch.randn(32, 32, generator=torch.Generator().manual_seed(2)))
    wq = quantize(w.t().contiguous(), "e4m3fn", block_size=32, scale_rounding=mode).t()
    expected = quantize(g, "e4m3fn", block_size=32, scale_rounding=mode) @ wq
    torch.testing.assert_close(dx, expected, rtol=1e-6, atol=0)
    assert not torch.allclose(dx, g @ w, rtol=1e-4, atol=0)


def test_a_recommended_mx_plan_converts_and_nvfp4_is_listed(tmp_path):
    """A recommended MX plan for the CNN converts its hidden linear layer and trains a step under
    torchao; a layer whose features are not multiples of 32 and NVFP4 blocks (no torchao training
    config) are skipped with the reason."""
    pytest.importorskip("torchao.prototype.moe_training")
    from gradstats.zoo.models import build_model
    from gradstats.zoo.training import prepare

    task = prepare("cnn", source="subset", subset=128, test_subset=64)
    with gradstats.trace(task.model, tmp_path / "run", every=1) as tracer:
        task.run(3, progress=False, callback=lambda s, loss: tracer.step())
    plan = gradstats.recommend(tmp_path / "run", bits=8, granularity="mx", rounding="nearest")
    model = build_model("cnn", seed=0)
    with pytest.warns(UserWarning, match="converts nn.Linear modules only"):
        pairs = plan.to_torchao(model, emulate=True)
    assert [type(c).__name__ for c, _ in pairs] == ["MXFP8TrainingOpConfig"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        convert(model, plan, emulate=True)
    assert type(model.fc1.weight).__name__ == "MXFP8TrainingWeightWrapperTensor"
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss0 = torch.nn.functional.cross_entropy(model(x), y)
    loss0.backward()
    opt.step()
    assert torch.isfinite(loss0)
    with pytest.warns(UserWarning, match="NVFP4 blocks"):
        assert gradstats.Plan.uniform(format="e2m1fn", block_size=16, scale_format="e4m3").to_torchao(_mlp()) == []
    with pytest.warns(UserWarning, match="MXFP8"):
        assert gradstats.Plan.uniform(format="e5m2", block_size=32).to_torchao(_mlp()) == []
    mlp = build_model("mlp", seed=0)                                  # 784 inputs: not a multiple of 32
    with pytest.warns(UserWarning, match="multiples of 32"):
        assert gradstats.Plan.uniform(format="e4m3fn", block_size=32).to_torchao(mlp) == []
