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
from gradstats.integrations.torchao import convert, to_torchao  # noqa: E402
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

    plan = gradstats.Plan.uniform(format=f"e4m3fn:block=32:scale_rounding={mode}")
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
    torchao; a layer whose features are not multiples of 32 (MXFP8) or 128 (torchao's NVFP4 GEMMs)
    is skipped with the reason."""
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
    with pytest.warns(UserWarning, match="multiples of 128 for torchao's NVFP4 GEMMs"):
        assert gradstats.Plan.uniform(format="nvfp4").to_torchao(_mlp()) == []
    with pytest.warns(UserWarning, match="MXFP8"):
        assert gradstats.Plan.uniform(format="mxfp8_e5m2").to_torchao(_mlp()) == []
    mlp = build_model("mlp", seed=0)                                  # 784 inputs: not a multiple of 32
    with pytest.warns(UserWarning, match="multiples of 32"):
        assert gradstats.Plan.uniform(format="mxfp8_e4m3").to_torchao(mlp) == []


# -- torchao's named float8 recipes -------------------------------------------------------------------

def test_what_recipes_says_of_each_float8_recipe_is_what_the_installed_torchao_builds():
    """RECIPES' claims about the gradient (granularity, dtype, power-of-two scales, the grad_weight
    GEMM) against Float8LinearConfig.from_recipe_name; only the recipes gradstats maps to are read,
    so a torchao release that adds recipes passes."""
    from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName, ScalingType

    from gradstats.integrations.torchao import FLOAT8_RECIPES, RECIPES

    assert set(FLOAT8_RECIPES) <= {r.value for r in Float8LinearRecipeName}
    for name in FLOAT8_RECIPES:
        c, claim = Float8LinearConfig.from_recipe_name(name), RECIPES[name]
        assert c.cast_config_grad_output.scaling_granularity.value == claim["granularity"], name
        assert str(c.cast_config_grad_output.target_dtype) == f"torch.{claim['dtype']}", name
        assert c.round_scales_to_power_of_2 is claim["power_of_2"], name
        hp = c.cast_config_grad_output_for_grad_weight.scaling_type is ScalingType.DISABLED
        assert hp is (claim["grad_weight"] == "high precision"), name
    assert {"keeps", "cannot"} <= set(RECIPES["mxfp8"]) and "hadamard 16" in RECIPES["nvfp4"]["keeps"]


@pytest.mark.parametrize("fmt, differs", [("e5m2", set()), ("e4m3fn", {"cast_config_grad_output",
                                                                      "cast_config_grad_output_for_grad_weight"})])
def test_a_per_tensor_plan_is_the_tensorwise_recipe_with_power_of_two_scales(fmt, differs):
    """A per-tensor e5m2 plan with amax scales is torchao's tensorwise recipe with only
    round_scales_to_power_of_2 set (gradstats' amax rule); an e4m3fn plan also sets the two
    grad_output casts' dtype, nothing else of them."""
    import dataclasses

    from torchao.float8.config import Float8LinearConfig

    from gradstats.integrations.torchao import recipe_table

    plan = gradstats.Plan.uniform(format=fmt, scale="amax")
    with warnings.catch_warnings():
        warnings.simplefilter("error")                          # nothing of the plan is lost
        (config, keep), = plan.to_torchao(_mlp(), emulate=True)
    base = Float8LinearConfig.from_recipe_name("tensorwise")
    other = {f.name for f in dataclasses.fields(base) if getattr(config, f.name) != getattr(base, f.name)}
    assert other == differs | {"round_scales_to_power_of_2", "emulate"}
    assert config.round_scales_to_power_of_2 and base.round_scales_to_power_of_2 is False
    for name in differs:
        a, b = getattr(config, name), getattr(base, name)
        assert str(a.target_dtype) == f"torch.float8_{fmt}"
        assert (a.scaling_type, a.scaling_granularity) == (b.scaling_type, b.scaling_granularity)
    table = recipe_table(plan, _mlp())
    assert table["layer"].tolist() == ["0", "2"] and set(table["recipe"]) == {"tensorwise"} and table["exact"].all()


def test_the_rowwise_recipes_are_torchaos_and_say_what_of_the_plan_they_change():
    """recipe="rowwise" (or "rowwise_with_gw_hp") is torchao's recipe as it is, with what it
    changes of the plan listed; converted (emulated), the model trains a step."""
    import dataclasses

    from torchao.float8.config import Float8LinearConfig

    plan = gradstats.Plan.uniform(format="e4m3fn", scale="amax")
    for recipe in ("rowwise", "rowwise_with_gw_hp"):
        with pytest.warns(UserWarning, match="scales each row of g"):
            (config, _), = to_torchao(plan, _mlp(), emulate=True, recipe=recipe)
        assert config == dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
        with pytest.raises(ValueError, match=f"torchao's {recipe} recipe: not expressible"):
            to_torchao(plan, _mlp(), recipe=recipe, strict=True)
    with pytest.warns(UserWarning, match="high precision for the grad_weight GEMM"):
        to_torchao(plan, _mlp(), recipe="rowwise_with_gw_hp")
    with pytest.warns(UserWarning, match="casts g to e4m3fn"):
        to_torchao(gradstats.Plan.uniform(format="e5m2", scale="amax"), _mlp(), recipe="rowwise")
    with pytest.raises(ValueError, match="recipe must be one of"):
        to_torchao(plan, _mlp(), recipe="blockwise")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = convert(_mlp(), plan, emulate=True, recipe="rowwise")
    model(torch.randn(8, 32)).square().mean().backward()
    assert type(model[2]).__name__ == "Float8Linear" and torch.isfinite(model[2].weight.grad).all()


def test_the_recipe_table_names_mx_and_nvfp4_and_what_nvfp4_changes():
    pytest.importorskip("torchao.prototype.moe_training")
    from gradstats.integrations.torchao import recipe_table

    mx = recipe_table(gradstats.Plan.uniform(format="mxfp8_e4m3:scale_rounding=rceil"), _mlp())
    assert set(mx["recipe"]) == {"mxfp8"} and mx["exact"].all()       # the forward casts are not the gradient's
    nv = recipe_table(gradstats.Plan.uniform(format="nvfp4", rounding="nearest"), _mlp())
    assert set(nv["recipe"]) == {"nvfp4"} and not nv["exact"].any()
    assert all(any("no Hadamard transform" in x for x in n) and any("rounding 'nearest'" in x for x in n)
               for n in nv["notes"])
    tr = recipe_table(gradstats.Plan.uniform(format="nvfp4_training"), _mlp())
    assert set(tr["recipe"]) == {"nvfp4"} and not tr["exact"].any()       # torchao's grad_input GEMM differs
    assert all(not any("Hadamard" in x or "rounding '" in x for x in n) for n in tr["notes"])
    assert all(any("grad_input GEMM" in x for x in n) for n in tr["notes"])
    stochastic = recipe_table(gradstats.Plan.uniform(format="e5m2", scale="amax", rounding="stochastic"), _mlp())
    assert set(stochastic["recipe"]) == {"tensorwise"} and not stochastic["exact"].any()


# -- NVFP4 training ------------------------------------------------------------------------------------

def _nvfp4_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def test_an_nvfp4_training_plan_is_torchaos_nvfp4_training_config_with_the_same_rotation():
    """The "nvfp4_training" plan becomes torchao's NVFP4TrainingConfig (its recipe: NVFP4 blocks,
    stochastic rounding, 16-point RHT for grad_weight) with gradstats' sign vector; torchao's RHT
    matrix, which multiplies token vectors from the right, is then the transpose of the rotation
    gradstats applies from the left, and convert swaps in torchao's NVFP4Linear (on the CPU; its
    GEMMs run on CUDA SM100 only, so no step is taken here). What torchao does otherwise is listed."""
    pytest.importorskip("torchao.prototype.moe_training.nvfp4_training")
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear, NVFP4TrainingConfig
    from torchao.quantization.quantize_.common import KernelPreference

    from gradstats.ops.hadamard import rht_matrix, signs

    plan = gradstats.Plan.uniform(format="nvfp4_training")
    with pytest.warns(UserWarning) as caught:
        doc = plan.export("torchao", _nvfp4_mlp())
    assert doc["configs"] == {n: {"recipe": "nvfp4", "kernel_preference": "triton",
                                  "rht_sign_vector": list(signs(16))} for n in ("0", "2")}
    text = str(caught[0].message)
    assert "grad_input GEMM: torchao quantises g along the channels without the rotation" in text
    assert "bfloat16" in text and "also casts the forward input" in text
    assert "rounds g stochastically" not in text and "no Hadamard" not in text      # the recipe's own choices
    with pytest.warns(UserWarning):
        (config, keep), = plan.to_torchao(_nvfp4_mlp())
    assert isinstance(config, NVFP4TrainingConfig) and config.kernel_preference is KernelPreference.TRITON
    assert config.rht_sign_vector == signs(16) and keep(None, "0") and not keep(None, "4")
    theirs = get_rht_matrix(tuple(signs(16)), "cpu", torch.float32, 16)
    assert torch.equal(theirs.t(), rht_matrix(16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        model = convert(_nvfp4_mlp(), plan)
    assert [type(m).__name__ for m in model] == ["NVFP4Linear", "ReLU", "NVFP4Linear", "ReLU", "Linear"]
    assert isinstance(model[0], NVFP4Linear) and model[0].rht_sign_vector == signs(16)


def test_what_torchaos_nvfp4_training_cannot_express_is_listed_per_layer():
    pytest.importorskip("torchao.prototype.moe_training.nvfp4_training")
    plan = gradstats.Plan.uniform(format="nvfp4", rounding="nearest", sparsity=0.5)
    with pytest.warns(UserWarning) as caught:
        doc = plan.export("torchao", _nvfp4_mlp())
    notes = doc["dropped"]["0"]
    assert any("rounding 'nearest'" in n for n in notes) and any("no Hadamard transform" in n for n in notes)
    assert any("does not prune" in n for n in notes) and "0: " in str(caught[0].message)
    with pytest.raises(ValueError, match="not expressible"):
        plan.to_torchao(_nvfp4_mlp(), strict=True)
    with pytest.warns(UserWarning, match="no emulated GEMMs"):          # torchao cannot emulate NVFP4 training
        assert gradstats.Plan.uniform(format="nvfp4_training").to_torchao(_nvfp4_mlp(), emulate=True) == []
    with pytest.warns(UserWarning, match="rotates the gradient in its NVFP4 training recipe only"):
        doc = gradstats.Plan.uniform(format="mxfp4:hadamard=32").export("torchao", _nvfp4_mlp())
    assert doc["configs"] == {} and set(doc["skipped"]) == {"0", "2"}
